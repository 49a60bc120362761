"""The fused expert path (core.model.fused_moe) against a float64 reference: every weight format, E = 8, 64, 128,
k = 1, 2, 8, one part or two (resident + streamed), biases and gpt-oss's activation; its ops as the dispatcher
and a launch counter see them (one per projection, whatever E); and the Triton kernel, where this tree has
it, equal to the torch form under TRITON_INTERPRET=1.

Tolerance: the relative norm of the error against the reference over the dequantized weights in float64 —
1e-5 in fp32, 4e-3 in fp16, 2e-2 in bf16 (the compute dtype's rounding of the weights, the inputs, gate/up and
each expert's output: a few ulps at most).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from core.model import fused_moe
from core.model.moe import clamped_swiglu, device_experts
from core.model.quant.experts import ExpertScheme, QuantExperts
from core.model.quant.formats import Format, dequantize, quantize

D, I, T = 64, 64, 5
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _swiglu(gu):
    gate, up = gu.chunk(2, -1)
    return F.silu(gate) * up


def _encode(fmt: Format, w: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    """w [E, N, K] in `fmt`'s parts (block formats: bytes of the right layout, finite values)."""
    if fmt.name in ("int8", "int4"):
        return quantize(fmt, w)
    E, N, K = w.shape
    if fmt.name == "mxfp4":
        return {"blocks": torch.randint(0, 256, (E, N, K // 32, 16), generator=g, dtype=torch.uint8),
                "scales": torch.randint(118, 126, (E, N, K // 32), generator=g, dtype=torch.uint8)}
    from gguf_files import quantize as gquant

    return {"raw": torch.from_numpy(gquant(w.numpy(), fmt.name))}


def _layer(E: int, fmt: Format | None, dtype, bias: bool, seed: int):
    """(parts builder, float64 w13 [E, 2I, D], w2 [E, D, I], b13, b2) of one layer's experts."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5, torch.randn(E, D, I, generator=g) / I ** 0.5
    b13 = torch.randn(E, 2 * I, generator=g) * 0.1 if bias else None
    b2 = torch.randn(E, D, generator=g) * 0.1 if bias else None
    if fmt is None:
        w13, w2 = w13.to(dtype), w2.to(dtype)
        ref13, ref2 = w13.double(), w2.double()
        stacks = {"w13": w13, "w2": w2}
    else:
        p13, p2 = _encode(fmt, w13, g), _encode(fmt, w2, g)
        ref13, ref2 = dequantize(fmt, p13).to(dtype).double(), dequantize(fmt, p2).to(dtype).double()
        stacks = {**{f"w13.{s}": t for s, t in p13.items()}, **{f"w2.{s}": t for s, t in p2.items()}}
    b13 = None if b13 is None else b13.to(dtype)
    b2 = None if b2 is None else b2.to(dtype)

    def parts(split: int | None):
        cuts = [(0, E)] if split is None else [(0, split), (split, E)]
        out = []
        for a, b in cuts:
            if fmt is None:
                p = {"w13": stacks["w13"][a:b], "w2": stacks["w2"][a:b]}
            else:
                p = {"quant": QuantExperts(ExpertScheme.uniform(fmt, D, I), {n: t[a:b] for n, t in stacks.items()},
                                           dtype)}
            if bias:
                p.update(b13=b13[a:b], b2=b2[a:b])
            out.append(p)
        return out

    return parts, ref13, ref2, (None if b13 is None else b13.double()), (None if b2 is None else b2.double())


def _routing(E: int, k: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    h = torch.randn(T, D, generator=g).to(dtype)
    idx = torch.rand(T, E, generator=g).topk(k, -1).indices
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(dtype)
    return h, w, idx


def reference(h, w, idx, w13, w2, b13=None, b2=None, act=_swiglu) -> torch.Tensor:
    """float64: each token's k experts, weighed and summed."""
    gu = torch.einsum("td,tknd->tkn", h.double(), w13[idx])
    if b13 is not None:
        gu = gu + b13[idx]
    y = torch.einsum("tki,tkni->tkn", act(gu), w2[idx])
    if b2 is not None:
        y = y + b2[idx]
    return (y * w.double()[..., None]).sum(1)


def _err(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


FORMATS = [(None, torch.float32), (None, torch.float16), (None, torch.bfloat16), (Format("int8"), torch.bfloat16),
           (Format("int4", 32), torch.bfloat16), (Format("int4", 64), torch.float32), (Format("mxfp4"), torch.bfloat16),
           (Format("Q8_0"), torch.bfloat16)]


@pytest.mark.parametrize("fmt,dtype", FORMATS, ids=lambda x: getattr(x, "label", str(x).replace("torch.", "")))
@pytest.mark.parametrize("E", [8, 64, 128])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_the_fused_path_equals_the_float64_reference(fmt, dtype, E, k):
    parts, w13, w2, _, _ = _layer(E, fmt, dtype, bias=False, seed=E + k)
    h, w, idx = _routing(E, k, dtype, seed=E * k)
    want = reference(h, w, idx, w13, w2)
    for split in ((None, E // 4) if k == 2 else (E // 4,)):  # resident + streamed, and (k = 2) one part
        got = device_experts(h, parts(split), w, idx, grouped=False)
        assert got.dtype == dtype and got.shape == (T, D)
        assert _err(got, want) < TOL[dtype], split


@pytest.mark.parametrize("fmt", [None, Format("int4", 32), Format("mxfp4")], ids=lambda f: getattr(f, "label", "dense"))
def test_biases_and_the_clamped_activation_over_two_parts(fmt):
    E, k, dtype = 64, 8, torch.float32
    parts, w13, w2, b13, b2 = _layer(E, fmt, dtype, bias=True, seed=3)
    h, w, idx = _routing(E, k, dtype, seed=4)
    act = clamped_swiglu(1.702, 7.0)
    want = reference(h, w, idx, w13, w2, b13, b2, act=act)
    assert _err(device_experts(h, parts(E // 4), w, idx, grouped=False, act=act), want) < TOL[dtype]


def test_a_chunk_of_blocks_at_a_time_gives_the_same_result(monkeypatch):
    """The torch form's byte budget cut to a block or two: the same numbers (memory bounded, launches by T)."""
    E, k = 64, 2
    parts, *_ = _layer(E, Format("int8"), torch.float32, bias=False, seed=5)
    h, w, idx = _routing(E, k, torch.float32, seed=6)
    whole = device_experts(h, parts(E // 4), w, idx, grouped=False)
    monkeypatch.setattr(fused_moe, "FUSED_CHUNK_BYTES", 1)
    torch.testing.assert_close(device_experts(h, parts(E // 4), w, idx, grouped=False), whole, rtol=0, atol=0)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fmt", [None, Format("int4", 64)], ids=["dense", "int4"])
def test_one_op_a_projection_whatever_the_number_of_experts(fmt):
    """As the dispatcher sees it: align, up, the activation's two, down, the sum — at E = 8 and E = 128."""
    seen = []
    for E in (8, 128):
        parts, *_ = _layer(E, fmt, torch.bfloat16, bias=False, seed=7)
        h, w, idx = _routing(E, 8, torch.bfloat16, seed=8)
        with _Ops() as ops:
            device_experts(h, parts(E // 4), w, idx, grouped=False)
        seen.append(ops.names)
    assert seen[0] == seen[1]
    assert seen[0].count("moe_gemm.default") == 2 and seen[0].count("moe_align.default") == 1, seen[0]
    assert len(seen[0]) == 6, seen[0]


def test_meta_tensors_know_their_shapes():
    E, k = 128, 8
    h = torch.empty(T, D, dtype=torch.bfloat16, device="meta")
    w, idx = torch.empty(T, k, dtype=torch.bfloat16, device="meta"), torch.empty(T, k, dtype=torch.long, device="meta")
    parts = [dict(w13=torch.empty(E, 2 * I, D, dtype=torch.bfloat16, device="meta"),
                  w2=torch.empty(E, D, I, dtype=torch.bfloat16, device="meta"))]
    out = device_experts(h, parts, w, idx, grouped=False)
    assert out.shape == (T, D) and out.device.type == "meta"


def test_long_dense_calls_take_grouped_mm_where_it_runs():
    assert fused_moe.expert_path(False, 4, grouped_mm=True) == "fused"
    assert fused_moe.expert_path(False, 1000, grouped_mm=True) == "grouped"
    assert fused_moe.expert_path(False, 1000, grouped_mm=False) == "fused"  # a T4: no grouped_mm kernel
    assert fused_moe.expert_path(True, 1000, grouped_mm=True) == "fused"  # quantized: never grouped_mm
    assert fused_moe.expert_path(False, 4, grouped_mm=True, forced=True) == "grouped"
    assert fused_moe.expert_path(False, 1000, grouped_mm=True, forced=False) == "fused"


_TRITON = importlib.util.find_spec("core.model.fused_moe_triton") is not None


@pytest.mark.skipif(not _TRITON, reason="triton is not installed")
def test_the_triton_path_equals_the_torch_path_under_the_interpreter(monkeypatch):
    """device_experts end to end with the kernel (TRITON_INTERPRET=1: the kernel is jitted on its first launch
    under it, core.model.fused_moe_triton._kernel) against the torch form and the reference: fp16, dense and
    int4, two parts."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for fmt in (None, Format("int4", 32)):
        parts, w13, w2, _, _ = _layer(8, fmt, torch.float16, bias=False, seed=9)
        h, w, idx = _routing(8, 2, torch.float16, seed=10)
        kern = device_experts(h, parts(2), w, idx, grouped=False, backend="triton")
        torch_form = device_experts(h, parts(2), w, idx, grouped=False, backend="torch")
        want = reference(h, w, idx, w13, w2)
        errs = (_err(kern, want), _err(torch_form, want), _err(kern, torch_form.double()))
        assert max(errs) < 4e-3, (fmt, errs)
