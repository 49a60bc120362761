"""The decode payload of grouped-query attention: q and k rotated in one RoPE over both (gqa.pre; in bf16 on
the CPU, whole-head halves, by core.model.cpu.row_ops' C join) is bit for bit the per-tensor projection
(gqa.project), for whole and partial rotary, paired rotation, LongRoPE's two tables, a qkv bias and an
output gate."""

from __future__ import annotations

import pytest
import torch

from core.model import gqa
from core.model.cpu import row_ops
from core.model.rope import for_spec
from core.model.spec import ModelSpec, RopeSpec


def _spec(rope: RopeSpec, bias: bool, gate: bool) -> ModelSpec:
    return ModelSpec(architecture="MixtralForCausalLM", family="mixtral", num_layers=1, hidden_size=64,
                     num_heads=4, num_kv_heads=2, head_dim=16, expert_intermediate=32, num_experts=4, top_k=2,
                     vocab_size=64, max_position=256, rope=rope, qkv_bias=bias, attn_gate=gate)


@pytest.mark.parametrize("rope,bias,gate", [
    (RopeSpec(), False, False),
    (RopeSpec(dim=8), True, False),
    (RopeSpec(pairs=True), False, True),
    (RopeSpec(kind="longrope", factor=4.0, original_max=8, short_factor=(1.0,) * 8, long_factor=(2.0,) * 8,
              short_mscale=1.1, long_mscale=1.3), False, False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rope_over_q_and_k_is_the_projection_bit_for_bit(rope, bias, gate, dtype):
    spec = _spec(rope, bias, gate)
    g = torch.Generator().manual_seed(0)
    rows = spec.q_size * (2 if gate else 1) + 2 * spec.kv_size
    w = {"qkv": torch.randn(rows, 64, generator=g).to(dtype)}
    if bias:
        w["qkv_bias"] = torch.randn(rows, generator=g).to(dtype)
    h = torch.randn(3, 64, generator=g).to(dtype)
    positions, lengths = torch.tensor([0, 7, 40]), torch.tensor([1, 8, 41])
    r = for_spec(spec, 64, dtype)
    calls, apply = [], r.apply
    r.apply = lambda x, *a: calls.append(x.shape) or apply(x, *a)
    payload, kept = gqa.pre(spec, w, h, positions, r, lengths)
    joined = r.joins_in_c(h) and rope.dim in (0, 16) and row_ops.library() is not None
    # one RoPE over q's and k's heads (a decode step's ops cost more than their math), or none: the C join's
    assert calls == ([] if joined else [(3, 6, 16)])
    q, k, v, want_gate = gqa.project(spec, w, h, positions, r, lengths)
    want = torch.cat((q.reshape(3, -1), k.reshape(3, -1), v.reshape(3, -1)), dim=-1)
    assert torch.equal(payload, want)
    assert (kept is None) == (not gate)
    if gate:
        assert torch.equal(kept, want_gate)
