"""GGUF blocks computed as the file stores them (issue 47): the C kernel core.model.cpu.gguf_blocks.

Its fp32 path's decoded rows must be `gguf.quants.dequantize`'s weights bit for bit (x = the identity gives
them back: each output is one weight times 1 plus zeros; the int8 path is tests/test_gguf_int8.py); the default
path built on it must stay within issue 44's
bound of the reference reading, per format; the experts must be held at the file's bytes; and a decode
step must never expand a whole quantized matrix (the expander is made to raise during decode).
"""

from __future__ import annotations

import os
import statistics

import gguf
import numpy as np
import pytest
import torch

from core.model.cpu import gguf_blocks
from core.model.gguf.load import open_gguf
from core.model.quant import expand, experts
from core.model.quant.formats import Format
from core.runtime.engine import Engine
from gguf_files import FORMATS, decode_logits, first_logits, logit_error, quantize
from test_engine_parity import PROMPTS
from test_gguf_reference import MEDIAN_BOUND, WORST_BOUND, knob, made  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(gguf_blocks.library() is None, reason="no C compiler: GGUF blocks expand per use")
FAST = ("Q8_0", "Q4_0", "Q4_K")


def _blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw uint8 [n, bytes], gguf's dequantization float32 [n, k]) of random weights in `kind`."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(w, kind))
    deq = np.array(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32)
    return torch.from_numpy(raw).view(torch.uint8).reshape(n, -1), torch.from_numpy(deq).reshape(n, k)


@pytest.mark.parametrize("kind", FORMATS)
def test_decoded_rows_are_gguf_dequantize_bit_for_bit(kind):
    raw, deq = _blocks(kind, 24, 512)
    got = gguf_blocks.linear(kind, torch.eye(512), raw, path="fp32").t()
    assert torch.equal(got, deq)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(gguf_blocks.linear(kind, x, raw, path="fp32"), x @ deq.t(), rtol=1e-5, atol=1e-4)
    xb = x.bfloat16()  # bf16 in and out: only the output's rounding differs from fp32 math
    torch.testing.assert_close(gguf_blocks.linear(kind, xb, raw, path="fp32"), (xb.float() @ deq.t()).bfloat16(),
                               rtol=8e-3, atol=1e-2)


def test_the_reference_reading_keeps_the_kernel_off(knob):
    knob("torch")
    assert not gguf_blocks.runs("Q8_0", torch.float32, 256)
    knob("auto")
    assert gguf_blocks.runs("Q8_0", torch.bfloat16, 256)
    assert not gguf_blocks.runs("Q8_0", torch.bfloat16, 48)  # not whole blocks


@pytest.mark.skipif(os.environ.get("MLIGHT_AVX2_LANE") != "1", reason="the AVX2 lane's own check")
def test_the_avx2_lane_builds_it_without_avx512():
    assert "-mavx2" in gguf_blocks.library().flags and "avx512" not in gguf_blocks.library().flags


def _quant(engine) -> list:
    return [lw.quant for lw in engine.weights.layers if lw.quant is not None]


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in FORMATS])
def test_native_blocks_stay_within_the_bound_of_the_reference(made, knob, kind):
    _, path = made("qwen3_moe", kind)
    knob("torch")
    ref = Engine.load(path)
    # decode at batch 1 too: one fused call a layer (gguf_blocks.moe), not the kernel expert by expert
    want = torch.cat([first_logits(ref, PROMPTS), decode_logits(ref, PROMPTS), decode_logits(ref, PROMPTS[:1])])
    knob("auto")
    engine = Engine.load(path)
    assert _quant(engine) and all(q.blocks for q in _quant(engine))  # the kernel, not the expander
    got = torch.cat([first_logits(engine, PROMPTS), decode_logits(engine, PROMPTS), decode_logits(engine, PROMPTS[:1])])
    rel = [logit_error(got[i:i + 1], want[i:i + 1])[1] for i in range(len(got))]
    assert statistics.median(rel) <= MEDIAN_BOUND and max(rel) <= WORST_BOUND, rel


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_experts_are_held_at_the_files_bytes(made, kind):
    _, path = made("qwen3_moe", kind)
    engine = Engine.load(path)
    held = sum(t.numel() * t.element_size() for q in _quant(engine) for t in q.parts.values())
    g = open_gguf(path)
    file = sum(t.nbytes for t in g.tensors.values() if "_exps." in t.name)
    assert held == file  # the blocks as they are: 1.0x the file's expert tensors


@pytest.mark.parametrize("batch", [1, len(PROMPTS)])
def test_a_decode_step_never_expands_a_whole_quantized_matrix(made, monkeypatch, batch):
    _, path = made("qwen3_moe", "Q8_0")
    engine = Engine.load(path)
    ids = [engine.prompt_token_ids(r) for r in _requests(PROMPTS[:batch])]
    n = len(ids)
    runner = engine.runner(slots=n, micro_batch_size=n, max_tokens=128)
    runner.prefill(ids, list(range(n)), [list(range(n))])

    def refuse(*args, **kwargs):
        raise AssertionError("a decode step expanded a whole quantized matrix")

    monkeypatch.setattr(experts, "expand_into", refuse)
    monkeypatch.setattr(expand, "expand_blocks", refuse)
    pos = [len(x) for x in ids]
    for _ in range(2):
        logits, _ = runner.decode([[7] * n], [list(range(n))], [pos])
        assert torch.isfinite(logits).all()
        pos = [p + 1 for p in pos]


def _requests(prompts):
    from core.runtime.engine import Request

    return [Request(id=str(i), prompt=p) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("kind", FORMATS)
def test_dequantize_is_ggufs_weights_bit_for_bit(kind):
    """A dense GEMM's many rows take the blocks expanded (core.model.quant.expand) by the C decoder: gguf's
    float32 weights exactly, bf16 rounded to nearest even as torch's cast; an odd block count and a column slice
    of a wider output."""
    raw, deq = _blocks(kind, 9, 3 * 256, seed=4)
    for dtype in (torch.float32, torch.bfloat16):
        wide = torch.zeros(9, 3 * 256 + 5, dtype=dtype)
        got = gguf_blocks.dequantize(kind, raw, wide[:, 2:2 + 3 * 256])
        assert torch.equal(got, deq.to(dtype)) and wide[:, :2].eq(0).all() and wide[:, -3:].eq(0).all()
    ws = expand.Workspace("cpu")
    fmt = Format(kind)
    assert torch.equal(expand.expand_into(ws, fmt, {"raw": raw}, 9, 3 * 256, torch.bfloat16), deq.bfloat16())


@pytest.mark.parametrize("up,down", [("Q8_0", "Q8_0"), ("Q4_K", "Q6_K"), ("MXFP4", "MXFP4")])
def test_one_tokens_experts_in_one_call_equal_the_float32_experts(up, down):
    """The fp32 path (the int8 one, the default: tests/test_gguf_int8.py)."""
    E, D, I, k = 4, 256, 512, 2
    w13 = [_blocks(up, 2 * I, D, seed=e) for e in range(E)]
    w2 = [_blocks(down, D, I, seed=10 + e) for e in range(E)]
    g = torch.Generator().manual_seed(2)
    x, ids, wts = torch.randn(1, D, generator=g), torch.tensor([[3, 1]]), torch.tensor([[0.7, 0.3]])
    got = gguf_blocks.moe(x, ids, wts, (up, torch.stack([r for r, _ in w13])), (down, torch.stack([r for r, _ in w2])),
                          path="fp32")
    want = torch.zeros(1, D)
    for e, w in zip(ids[0].tolist(), wts[0].tolist()):
        gate, u = (x @ w13[e][1].t()).chunk(2, -1)
        want += w * (torch.nn.functional.silu(gate) * u) @ w2[e][1].t()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert got.shape == (1, D) and k == ids.shape[1]
