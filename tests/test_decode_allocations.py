"""The decode step reuses its big buffers (brief: the hot path does not allocate what it need not; a
fresh 134 MB buffer page-faults at 2 GB/s where copy_ into a kept one runs at 6.8 GB/s).

Counted with torch's profiler memory events (as tests/test_quant_expand.py does): after a warm-up step,
- no op allocates as much as one micro-batch's fp32 logits (they were computed per micro-batch, widened
  and concatenated: 2 × 39 MB a step at B = 64 on a 152k vocabulary), and the logits come back in the
  same buffer step after step, equal to a float64 reference of the final norm and head;
- the routed experts' gathered tokens and their sum come from reused buffers, equal to a float64
  reference of the experts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.model import moe
from core.runtime.engine import Engine


def _allocations(fn) -> list[tuple[str, int]]:
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as prof:
        fn()
    return [(ev.name, ev.cpu_memory_usage) for ev in prof.function_events if ev.cpu_memory_usage > 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_logits_land_in_one_reused_buffer(tmp_path, dtype):
    """...and two micro-batches meeting at the experts (expert_group 2) put their tokens side by side in
    reused buffers: they allocate nothing that the same step with each micro-batch alone does not."""
    from checkpoints import make_checkpoint

    path = make_checkpoint("mixtral", tmp_path, dtype=dtype, num_hidden_layers=2, vocab_size=4096)  # logits stand out
    cats = {}
    for group in (1, 2):
        engine = Engine.load(path, expert_group=group)
        runner = engine.runner(slots=8, micro_batch_size=4, max_tokens=16)
        V = engine.spec.vocab_size
        tokens, slots = [[3, 4, 5, 6], [7, 8, 9, 10]], [[0, 1, 2, 3], [4, 5, 6, 7]]
        first, _ = runner.decode(tokens, slots, [[0] * 4, [0] * 4])
        made = _allocations(lambda: runner.decode(tokens, slots, [[1] * 4, [1] * 4]))
        big = [(n, b) for n, b in made if b >= 4 * V * 4]  # one micro-batch's fp32 logits
        assert big == [], big
        cats[group] = sorted(b for n, b in made if n == "aten::cat")
        logits, _ = runner.decode(tokens, slots, [[2] * 4, [2] * 4])
        assert logits.data_ptr() == first.data_ptr() and logits.shape == (8, V) and logits.dtype == torch.float32
    assert cats[2] == cats[1]


@pytest.mark.parametrize("dtype,packed", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_logits_into_a_buffer_match_float64(dtype, packed, monkeypatch):
    """Straight into the buffer (a plain head of the buffer's dtype) or a few rows at a time (bf16, or a
    prepacked head, whose linear has no out= form)."""
    from types import SimpleNamespace

    from core.model import layers
    from core.model.cpu.kernels import PackedWeight
    from core.model.moe import packing_supported

    if packed and not packing_supported():
        pytest.skip("oneDNN cannot prepack bf16 on this CPU (the AVX2 lane): the plain head is tested")
    monkeypatch.setattr(layers, "LOGIT_CHUNK_BYTES", 3 * 96 * 2)  # three rows a chunk: the loop runs
    spec = SimpleNamespace(norm="rms", norm_eps=1e-6)
    g = torch.Generator().manual_seed(0)
    x, norm_w = torch.randn(8, 64, generator=g).to(dtype), (1 + torch.randn(64, generator=g) / 4).to(dtype)
    head = (torch.randn(96, 64, generator=g) / 8).to(dtype)
    out = torch.full((8, 96), float("nan"))
    layers.final_logits(spec, norm_w, PackedWeight(head) if packed else head, x, out=out)
    x64 = x.double()
    normed = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).double() * norm_w.double()
    ref = normed @ head.double().t()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_routed_experts_reuse_their_gather_and_scatter_buffers():
    g = torch.Generator().manual_seed(0)
    T, D, I, E, k = 16, 64, 32, 4, 2
    h = torch.randn(T, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / 8, torch.randn(E, D, I, generator=g) / 8
    logits = torch.randn(T, E, generator=g)
    weights, idx = torch.softmax(logits, -1).topk(k, -1)
    scratch = moe.Scratch()
    moe.experts(h, w13, w2, weights, idx, grouped=False, scratch=scratch)  # grows the buffers once
    out = None

    def call():
        nonlocal out
        out = moe.experts(h, w13, w2, weights, idx, grouped=False, scratch=scratch)

    made = _allocations(call)
    assert [(n, b) for n, b in made if b >= T * D * 4] == []  # neither the gathered tokens nor the sum
    assert out.data_ptr() == scratch.get("out", (T, D), h.dtype).data_ptr()
    ref = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            gu = h[t].double() @ w13[e].double().t()
            y = (F.silu(gu[:I]) * gu[I:]) @ w2[e].double().t()
            ref[t] += weights[t, j].double() * y
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # without a scratch the experts give the same numbers in fresh tensors
    torch.testing.assert_close(moe.experts(h, w13, w2, weights, idx, grouped=False), out, rtol=0, atol=0)
