"""Expanding quantized experts into reused buffers (the device's decode hot path): equal to the float
reference bit for bit, and no allocation once every shape has been seen — counted by torch's profiler."""

from __future__ import annotations

import pytest
import torch

from core.model.quant.expand import Workspace, expand_into
from core.model.quant.experts import ExpertScheme, QuantExperts
from core.model.quant.formats import Format, dequantize, quantize

E, D, I = 3, 64, 128


def _experts(fmt: Format, dtype, chunk_elems: int | None = None, seed: int = 0) -> QuantExperts:
    g = torch.Generator().manual_seed(seed)
    parts = {}
    for name, (n, k) in (("w13", (2 * I, D)), ("w2", (D, I))):
        w = torch.randn(E, n, k, generator=g)
        w[:, 5] *= 30  # an outlier row
        parts.update({f"{name}.{s}": t for s, t in quantize(fmt, w).items()})
    scratch = {("workspace", "cpu"): Workspace("cpu", chunk_elems)} if chunk_elems else None
    return QuantExperts(ExpertScheme.uniform(fmt, D, I), parts, dtype, scratch)


FORMATS = [Format("int8"), Format("int4", 32), Format("int4", 64)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
@pytest.mark.parametrize("dtype,chunk", [(torch.bfloat16, None), (torch.bfloat16, 7 * 64), (torch.float32, 7 * 64)],
                         ids=["bf16-whole", "bf16-chunks-of-7-rows", "fp32-chunks-of-7-rows"])
def test_expansion_is_the_reference_bit_for_bit(fmt, dtype, chunk):
    q = _experts(fmt, dtype, chunk)
    for m in q.scheme.matrices:
        for e in range(E):
            want = dequantize(m.fmt, q.matrix_parts(m, e)).to(dtype)
            assert torch.equal(q.expand(m, e), want), (m.name, e)


def _allocations(fn) -> list[str]:
    """Ops that allocated memory while `fn` ran (torch's own allocator events; the in-process profiler,
    which starts in milliseconds where Kineto's takes seconds)."""
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as prof:
        fn()
    return [ev.name for ev in prof.function_events if ev.cpu_memory_usage > 0]


def test_the_allocation_counter_sees_hidden_allocations():
    """What the next test relies on: a wrapped Python scalar and a promoted-dtype copy are counted."""
    x, y = torch.zeros(8, dtype=torch.bfloat16), torch.ones(8)
    assert _allocations(lambda: x.sub_(1)) and _allocations(lambda: x.mul_(y))
    assert _allocations(lambda: y.mul_(y)) == []


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_expansion_allocates_nothing_after_the_first_call(fmt):
    """Every layer's experts share one Workspace: the second layer's first expansion already finds every
    buffer, and the hot path makes no tensor at all (no temporaries, no wrapped scalars)."""
    scratch = {("workspace", "cpu"): Workspace("cpu", 64 * 64)}  # several chunks per matrix
    layers = []
    for seed in range(2):
        q = _experts(fmt, torch.bfloat16, seed=seed)
        layers.append(QuantExperts(q.scheme, q.parts, torch.bfloat16, scratch))
    first = {m.name: layers[0].expand(m, 0) for m in layers[0].scheme.matrices}

    def hot():
        for q in layers:
            for m in q.scheme.matrices:
                for e in range(E):
                    assert q.expand(m, e) is first[m.name]  # the same buffer, every layer and expert

    assert _allocations(hot) == []
    ws = layers[0].workspace
    made = ws.allocations
    hot()
    assert layers[1].workspace is ws and ws.allocations == made


def _block_parts(kind: str, rows: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A [rows, k] matrix in a block format: real quantized rows and arbitrary bytes (finite scales), for
    GGUF (through gguf's quantizer where it has one) and gpt-oss's MXFP4 (blocks + exponents)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "mxfp4":
        blocks = torch.from_numpy(rng.integers(0, 256, (rows, k // 32, 16), dtype=np.uint8))
        scales = torch.from_numpy(rng.integers(100, 140, (rows, k // 32), dtype=np.uint8))
        scales[0, 0], scales[1, 1] = 0, 255  # extreme exponents too
        return {"blocks": blocks, "scales": scales}
    from gguf_files import quantize as gquant
    from test_quant_gguf import _random_blocks

    x = (rng.standard_normal((rows // 2, k)) * np.linspace(1e-3, 30, rows // 2)[:, None]).astype(np.float32)
    real = gquant(x, kind)
    return {"raw": torch.from_numpy(np.concatenate([real, _random_blocks(kind, rng, real.shape)]))}


BLOCK_KINDS = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "mxfp4"]


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_block_formats_expand_bit_for_bit_and_allocate_nothing_after_the_first_call(kind):
    """GGUF blocks and gpt-oss MXFP4 expand, a few rows a chunk, to exactly blocks.decode's values (the
    float reference bit-equal to gguf's own dequantization, tests/test_quant_gguf.py), in bf16 and fp32;
    once every buffer has been made, a second layer's expansion makes no tensor at all — before, each
    chunk's decode allocated its intermediates (a fresh lookup table among them: on a GPU a copy from
    the host per expert)."""
    pytest.importorskip("gguf")
    from core.model.quant.blocks import decode

    fmt = Format(kind)
    rows, k = 12, 512
    layers = [_block_parts(kind, rows, k, seed) for seed in (0, 1)]
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        ws = Workspace("cpu", chunk_elems=5 * k)  # chunks of 5, 5 and 2 rows
        want = [decode(fmt, p).to(dtype).view(bits) for p in layers]  # bits: NaN-proof and -0.0-aware
        first = expand_into(ws, fmt, layers[0], rows, k, dtype)
        assert torch.equal(first.view(bits), want[0])
        assert _allocations(lambda: expand_into(ws, fmt, layers[1], rows, k, dtype)) == []
        again = expand_into(ws, fmt, layers[1], rows, k, dtype)
        assert again is first and torch.equal(again.view(bits), want[1])


def test_gguf_blocks_expand_in_bounded_chunks():
    """Block formats decode a chunk of rows at a time into the same reused output (their decoders'
    temporaries scale with the chunk, not the matrix)."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType, quantize as gquant

    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    raw = torch.from_numpy(gquant(w.numpy(), GGMLQuantizationType.Q8_0))
    fmt = Format("Q8_0")
    ws = Workspace("cpu", chunk_elems=8 * 256)
    got = expand_into(ws, fmt, {"raw": raw}, 40, 256, torch.float32)
    again = expand_into(ws, fmt, {"raw": raw}, 40, 256, torch.float32)
    assert again is got
    torch.testing.assert_close(got, dequantize(fmt, {"raw": raw}), rtol=0, atol=0)


def test_block_decoders_build_their_lookup_tables_once_per_device():
    """blocks.decode (the reference, and what loading converts with) keeps its MXFP4 tables: a table made
    per call is a host-to-device copy per expert on a GPU (torch.tensor from a Python tuple: lift_fresh)."""
    from core.model.quant.blocks import decode

    for kind in ("mxfp4", "MXFP4"):
        parts = _block_parts(kind, 4, 64)
        decode(Format(kind), parts)
        with torch.autograd.profiler.profile(use_kineto=False) as prof:
            decode(Format(kind), parts)
        assert not [ev.name for ev in prof.function_events if ev.name == "aten::lift_fresh"], kind
