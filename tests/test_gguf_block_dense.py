"""A GGUF file's quantized dense projections held and computed as its blocks in the CPU-only mode (issue 47).

The attention (and shared-expert) projections and the LM head of a quantized GGUF used to be expanded to
the compute dtype at load: in RAM at 16 bits, read at 16 bits every decode step. Now they stay the file's
blocks (core.model.quant.block_dense): the weight must equal gguf's own dequantization of the file's rows
(mixed formats, the q/k row interleave undone), the model must stay within issue 44's bound of the
reference reading, the projections must be held at the file's bytes, and neither the load nor a decode
step may expand a whole quantized matrix (only the token embedding, a lookup, is read as floats).
"""

from __future__ import annotations

import statistics

import gguf
import numpy as np
import pytest
import torch

from core.model.cpu import gguf_blocks, gguf_token
from core.model.gguf import load as gguf_load
from core.model.gguf.load import open_gguf
from core.model.quant import expand, experts
from core.model.quant.formats import NATIVE_GGUF_ROWS
from core.runtime.engine import Engine, Request
from gguf_files import decode_logits, first_logits, logit_error, quantize
from test_engine_parity import PROMPTS
from test_gguf_int8 import quantized
from test_gguf_token import reading
from test_gguf_reference import MEDIAN_BOUND, WORST_BOUND, knob, made  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(gguf_blocks.library() is None, reason="no C compiler: GGUF blocks expand")


def _rows(kind: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(w, kind))
    deq = np.array(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float64)
    return torch.from_numpy(raw).view(torch.uint8).reshape(n, -1), torch.from_numpy(deq).reshape(n, k)


@pytest.mark.parametrize("rows", [1, 5, NATIVE_GGUF_ROWS + 3])  # the kernel, and a prefill's expansion
def test_a_block_weight_of_mixed_formats_multiplies_like_its_dequantized_rows(rows):
    from core.model.quant.block_dense import BlockWeight, Segment

    K = 512
    parts = [("Q4_K", 0, 256), ("Q4_K", 256, 320), ("Q6_K", 320, 384), ("Q8_0", 384, 448)]
    made_ = [(kind, r0, r1, *_rows(kind, r1 - r0, K, seed)) for seed, (kind, r0, r1) in enumerate(parts)]
    w = BlockWeight((448, K), torch.float32, [Segment(r0, r1, kind, raw) for kind, r0, r1, raw, _ in made_])
    assert w.kinds == ["Q4_K", "Q6_K", "Q8_0"]  # the two Q4_K runs joined: one call
    assert w.held_bytes == sum(raw.numel() for *_, raw, _ in made_)
    deq = torch.cat([d for *_, d in made_])
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    bias = torch.randn(448, dtype=torch.float64)

    def reference(x):  # each segment's product as the kernel takes it: on the integer paths (bf16 x), x quantized
        def read(kind):
            if x.dtype == torch.bfloat16 and rows <= gguf_token.ROWS:
                return reading(kind, x)  # the few-row kernel's
            g = gguf_blocks.int8_group(kind, x.dtype, rows) if rows <= NATIVE_GGUF_ROWS else None
            return quantized(x, g) if g else x.double()

        return torch.cat([read(kind) @ d.t() for kind, *_, d in made_], -1)

    want = reference(x) + bias
    got = torch.nn.functional.linear(x.float(), w, bias.float())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    xb = x.bfloat16()  # bf16 in and out: the output's rounding (and, expanded, the weights')
    gotb = torch.nn.functional.linear(xb, w)
    torch.testing.assert_close(gotb.double(), reference(xb), rtol=2e-2, atol=0.15)
    torch.testing.assert_close(w.dequantized(torch.float32).double(), deq, rtol=0, atol=0)


def _read_whole(monkeypatch) -> list[str]:
    """Names of the quantized tensors the loader expands whole (read_float on a block format), as it goes."""
    seen = []
    real = gguf_load.read_float

    def spy(ref):
        if ref.kind not in gguf_load.FLOAT_KINDS:
            seen.append(ref.name)
        return real(ref)

    monkeypatch.setattr(gguf_load, "read_float", spy)
    return seen


@pytest.mark.parametrize("family,kind", [("mixtral", "Q4_K"), ("qwen3_moe", "Q8_0")])
def test_quantized_projections_stay_the_files_blocks_within_the_bound(made, knob, monkeypatch, family, kind):
    _, path = made(family, kind)
    knob("torch")
    ref = Engine.load(path)
    want = torch.cat([first_logits(ref, PROMPTS), decode_logits(ref, PROMPTS, steps=2)])
    knob("auto")
    whole = _read_whole(monkeypatch)
    engine = Engine.load(path)
    assert whole == ["token_embd.weight"], whole  # a lookup table; every projection stayed blocks
    from core.model.quant.block_dense import BlockWeight

    layers = engine.weights.layers
    assert all(isinstance(lw.tensors[n], BlockWeight) for lw in layers for n in ("qkv", "o"))
    assert isinstance(engine.weights.globals["lm_head"], BlockWeight)
    g = open_gguf(path)
    file = sum(t.nbytes for t in g.tensors.values() if ".attn_" in t.name and t.kind == kind)
    assert sum(lw.tensors[n].held_bytes for lw in layers for n in ("qkv", "o")) == file  # 1.0x the file's
    got = torch.cat([first_logits(engine, PROMPTS), decode_logits(engine, PROMPTS, steps=2)])
    rel = [logit_error(got[i:i + 1], want[i:i + 1])[1] for i in range(len(got))]
    assert statistics.median(rel) <= MEDIAN_BOUND and max(rel) <= WORST_BOUND, rel


def test_no_load_or_decode_step_expands_a_whole_quantized_matrix(made, monkeypatch):
    """Experts on their kernel, projections on theirs: the loader expands only the embedding, and two decode
    steps (batch 1 and a batch) reach no expander at all."""
    _, path = made("qwen3_moe", "Q4_0")
    whole = _read_whole(monkeypatch)
    engine = Engine.load(path)
    assert whole == ["token_embd.weight"], whole
    from core.model.quant import block_dense

    def refuse(*args, **kwargs):
        raise AssertionError("a decode step expanded a whole quantized matrix")

    for n in (1, len(PROMPTS)):
        ids = [engine.prompt_token_ids(Request(id=str(i), prompt=p)) for i, p in enumerate(PROMPTS[:n])]
        runner = engine.runner(slots=n, micro_batch_size=n, max_tokens=128)
        runner.prefill(ids, list(range(n)), [list(range(n))])
        with monkeypatch.context() as m:
            for mod, name in ((experts, "expand_into"), (expand, "expand_blocks"), (block_dense, "expand_into"),
                              (gguf_load, "read_float")):
                m.setattr(mod, name, refuse)
            pos = [len(x) for x in ids]
            for _ in range(2):
                logits, _ = runner.decode([[7] * n], [list(range(n))], [pos])
                assert torch.isfinite(logits).all()
                pos = [p + 1 for p in pos]


def test_the_planner_prices_gguf_experts_at_the_files_bytes(tmp_path):
    """A Q4_K_M-like mix (Q4_K gate/up, Q6_K down): the spec the planner reads holds the experts at the file's
    own bytes (never at the compute dtype's), within a byte of rounding per expert."""
    from checkpoints import make_checkpoint
    from core.model.gguf.load import load_spec
    from core.plan.hrm import dims
    from gguf_files import uniform, write_gguf
    from test_gguf_reference import SHAPES

    q4 = uniform("Q4_K")
    ckpt = make_checkpoint("mixtral", tmp_path / "ckpt", **SHAPES["mixtral"])
    path = write_gguf("mixtral", ckpt, tmp_path / "mix.gguf", lambda n: "Q6_K" if "ffn_down_exps" in n else q4(n))
    g = open_gguf(path)
    spec = load_spec(g)
    assert spec.expert_format == "Q4_K/Q6_K"
    file = sum(t.nbytes for t in g.tensors.values() if "_exps." in t.name)
    experts = spec.num_layers * spec.num_experts
    assert abs(dims(spec).total_expert_bytes - file) <= experts
    assert dims(spec).total_expert_bytes < 0.4 * spec.num_layers * spec.num_experts * spec.expert_params * 2
