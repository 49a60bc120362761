"""The fused MoE Triton kernel against a float64 torch reference, in triton's interpreter on the CPU.

Reference: every expert's matrix through `formats.dequantize` (blocks.decode for the block formats), the
pairs' rows multiplied in float64. The kernel rounds each dequantized weight once to the compute dtype, then
accumulates in fp32 and rounds the output: with u the compute dtype's unit roundoff (2^-11 fp16, 2^-8 bf16)
|got − want| ≤ u·(|a|·|W|ᵀ) + u·|want|; the tests allow twice that (plus 1e-6), so a wrong byte, nibble,
scale or zero point fails them. Shapes are tiny: the interpreter runs each program in numpy.
Legend: T = tokens, k = top_k, E = experts, N = outputs, K = inputs, p = pair, BM = block of pairs.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from core.model import fused_moe_triton as fmt_kernel
from core.model.quant.formats import GGUF_BLOCKS, Format, dequantize, quantize

triton = pytest.importorskip("triton")
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
MARK = 777.0  # what rows the launch must not write hold


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """TRITON_INTERPRET for these tests only: the kernel is jitted on its first launch, so this takes effect."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def align(topk_ids: torch.Tensor, E: int, BM: int):
    """moe_align's contract in plain Python: pairs grouped by expert, each run padded to BM with T·k."""
    P = topk_ids.numel()
    flat = topk_ids.flatten().tolist()
    S = math.ceil((P + min(E, P) * (BM - 1)) / BM) * BM
    ids, experts, pos = [P] * S, [-1] * (S // BM), 0
    for e in range(E):
        ps = [p for p in range(P) if flat[p] == e]
        if ps:
            ids[pos:pos + len(ps)] = ps
            blocks = math.ceil(len(ps) / BM)
            experts[pos // BM:pos // BM + blocks] = [e] * blocks
            pos += blocks * BM
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32),
            torch.tensor([pos], dtype=torch.int32))


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], -1)


def make_stack(name: str | None, E: int, N: int, K: int, dtype, seed: int):
    """(fmt, parts [E, ...] as the engine holds them, dequantized float64 [E, N, K]) for random weights of O(1)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    if name is None:
        w = torch.randn(E, N, K, generator=g).to(dtype)
        return None, {"w": w}, w.double()
    fmt = Format("int4", int(name[5:])) if name.startswith("int4") else Format(name)
    if fmt.name in ("int8", "int4"):
        parts = quantize(fmt, torch.randn(E, N, K, generator=g))
    elif fmt.name == "mxfp4":
        parts = {"blocks": torch.from_numpy(rng.integers(0, 256, (E, N, K // 32, 16), dtype=np.uint8)),
                 "scales": torch.from_numpy(rng.integers(124, 130, (E, N, K // 32), dtype=np.uint8))}
    else:  # arbitrary bytes (every bit pattern of the quants and packed scales), finite scales of O(1) weights
        bs, ts = GGUF_BLOCKS[fmt.name]
        raw = rng.integers(0, 256, (E, N, K // bs, ts), dtype=np.uint8)
        d_at, size = {"Q8_0": (0, 1 / 64), "Q4_0": (0, 1 / 8), "Q4_K": (0, 1 / 512), "Q5_K": (0, 1 / 1024),
                      "Q6_K": (ts - 2, 1 / 1024), "MXFP4": (None, 0)}[fmt.name]
        if d_at is None:
            raw[..., 0] = rng.integers(124, 130, raw.shape[:-1])  # e: 2^(e-128) x doubled e2m1
        else:
            raw[..., d_at:d_at + 2] = _f16_bytes(rng.uniform(-size, size, (*raw.shape[:-1], 1)))
            if fmt.name in ("Q4_K", "Q5_K"):
                raw[..., 2:4] = _f16_bytes(rng.uniform(-size, size, (*raw.shape[:-1], 1)) * 4)
        parts = {"raw": torch.from_numpy(raw.reshape(E, N, -1))}
    return fmt, parts, dequantize(fmt, parts).double()


def run_case(name, dtype, E, k, T, *, N=48, K=64, base=0, n=None, second=False, seed=0, BM=None):
    """One launch over the part [base, base + n) of E experts; returns (got, want, touched rows)."""
    g = torch.Generator().manual_seed(seed + 1)
    fmt, parts, w64 = make_stack(name, E, N, K, dtype, seed)
    n = E - base if n is None else n
    topk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # distinct experts a token
    BM = BM or fmt_kernel.pick_block_m(T * k, E)
    sorted_ids, block_expert, n_padded = align(topk, E, BM)
    a = torch.randn(T * k if second else T, K, generator=g).to(dtype)
    route = torch.rand(T * k, generator=g) if second else None
    out = torch.full((T * k, N), MARK, dtype=dtype)
    part = {s: v[base:base + n] for s, v in parts.items()}
    fmt_kernel.moe_gemm(a, part, fmt, out, sorted_ids, block_expert, n_padded, top_k=1 if second else k,
                        block_m=BM, expert_base=base, route_w=route)
    e = topk.flatten()
    rows = a.double()[torch.arange(T * k) // (1 if second else k)]
    w = w64[e]  # [T·k, N, K]
    want = torch.einsum("pk,pnk->pn", rows, w)
    bound = torch.einsum("pk,pnk->pn", rows.abs(), w.abs())
    if second:
        want, bound = want * route.double()[:, None], bound * route.double()[:, None]
    touched = (e >= base) & (e < base + n)
    u = UNIT[dtype]
    tol = 2 * u * (bound + want.abs()) + 1e-6
    return out.double(), want, tol, touched


def check(got, want, tol, touched):
    assert torch.all(got[~touched] == MARK), "rows of other experts were written"
    err = (got[touched] - want[touched]).abs()
    bad = err > tol[touched]
    worst = float((err / tol[touched]).max())
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs off; worst {worst:.1f}x the tolerance"


FORMATS = [None, "int8", "int4-32", "int4-64", "int4-128", "mxfp4", "Q8_0", "Q4_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_both_projections(name):
    K = 256 if name in ("Q4_K", "Q5_K", "Q6_K") else 128
    for second in (False, True):
        check(*run_case(name, torch.float16, E=8, k=2, T=5, K=K, second=second, seed=len(name or "")))


@pytest.mark.parametrize("name", [None, "int4-64", "Q4_K"])
def test_bf16_compute(name):
    check(*run_case(name, torch.bfloat16, E=8, k=2, T=3, K=256 if name == "Q4_K" else 64))


# E = 8, 64, 128 by k = 1, 2, 8: T·k never a multiple of BM, both projections, formats in turn
@pytest.mark.parametrize("E,k,T,name,second", [
    (8, 1, 7, "int4-32", False), (8, 2, 11, "int8", True), (8, 8, 5, None, False),
    (64, 1, 9, "Q8_0", True), (64, 2, 13, "int4-128", False), (64, 8, 3, "mxfp4", True),
    (128, 1, 15, None, True), (128, 2, 6, "int4-64", True), (128, 8, 16, "int8", False)])
def test_experts_and_top_k(E, k, T, name, second):
    check(*run_case(name, torch.float16, E=E, k=k, T=T, N=40, K=128, second=second, seed=E + k))


def test_larger_blocks_pad_runs():
    """BM = 32 with runs shorter than a block: the sentinel rows of a block are masked, not written."""
    check(*run_case("int4-32", torch.float16, E=8, k=2, T=16, BM=32))


@pytest.mark.parametrize("name", [None, "int4-64", "Q4_0"])
def test_two_parts_fill_disjoint_rows(name):
    """A layer in two parts (resident 0..3, streamed 4..7): each launch writes only its experts' rows,
    and the two together give the whole projection."""
    got1, want, tol, t1 = run_case(name, torch.float16, E=8, k=2, T=7, base=4, seed=3)
    check(got1, want, tol, t1)
    got0, _, _, t0 = run_case(name, torch.float16, E=8, k=2, T=7, base=0, n=4, seed=3)
    check(got0, want, tol, t0)
    assert torch.all(t0 ^ t1)
    check(torch.where(t1[:, None], got1, got0), want, tol, t0 | t1)


def test_unsupported_follows_triton_on_turing(monkeypatch):
    fp16, bf16 = torch.float16, torch.bfloat16
    for name in (None, "int8", "Q6_K", "mxfp4"):
        fmt = None if name is None else Format(name)
        assert fmt_kernel.unsupported(fmt, fp16, (7, 5)) is None
        assert fmt_kernel.unsupported(fmt, bf16, (8, 0)) is None
        assert "SM80" in fmt_kernel.unsupported(fmt, bf16, (7, 5))
    assert fmt_kernel.unsupported(Format("int4", 32), fp16, (9, 0)) is None
    assert fmt_kernel.unsupported(None, torch.float32, (9, 0))
    assert fmt_kernel.unsupported(None, fp16, (7, 0))


def test_imports_without_triton():
    """A CPU-only install without triton imports the module; `unsupported` says why for everything."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "from core.model import fused_moe_triton as m\n"
            "print(m.unsupported(None, None, (9, 0)), m.pick_block_m(4, 128))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    assert out.split() == ["triton", "is", "not", "installed", "16"]


def test_block_m_follows_pairs_per_expert():
    assert fmt_kernel.pick_block_m(4, 128) == 16  # decode
    assert fmt_kernel.pick_block_m(8 * 16, 8) == 16
    assert fmt_kernel.pick_block_m(8 * 512, 128) == 32
    assert fmt_kernel.pick_block_m(8 * 4096, 128) == 64


def _ptx(capability: int, dtype: str, name: str | None) -> str:
    """The kernel compiled (not run) for a GPU of `capability` with triton's bundled ptxas: no GPU needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    code, block_bytes, block_vals = fmt_kernel._CODES[name]
    ptr = {0: "*" + dtype, 1: "*i8"}.get(code, "*u8")
    sig = dict(a_ptr="*" + dtype, w_ptr=ptr, s_ptr={1: "*fp32", 2: "*bf16", 3: "*u8"}.get(code, ptr),
               out_ptr="*" + dtype, sorted_ptr="*i32", block_expert_ptr="*i32", n_padded_ptr="*i32",
               route_ptr="*fp32", **{a: "i32" for a in ("N", "K", "pairs", "expert_base", "n_experts", "stride_am",
                                                          "stride_we", "stride_wn", "stride_se", "stride_sn",
                                                          "stride_om")})
    const = dict(TOP_K=2, FMT=code, GROUP=64, BLOCK_BYTES=block_bytes, BLOCK_VALS=block_vals, HAS_ROUTE=True,
                 DOT_F32=False, BM=16, BN=64, BK=32 if code >= 3 else 64)
    sig.update({c: "constexpr" for c in const})
    try:
        return triton.compile(ASTSource(JITFunction(fmt_kernel._moe_gemm), sig, const),
                              target=GPUTarget("cuda", capability, 32),
                              options={"enable_fp_fusion": True}).asm["ptx"]  # as fused_moe_triton launches it
    except (FileNotFoundError, RuntimeError) as e:  # no bundled ptxas / LLVM backend in this install
        pytest.skip(f"triton cannot compile for CUDA here: {e}")


def test_turing_compiles_to_fma_and_ampere_to_mma(monkeypatch, tmp_path):
    """The facts `unsupported` and the module docstring rest on: triton 3.9 compiles the kernel for SM75 but
    lowers its dot to FMA (no mma); from SM80 the dot is mma.sync. A triton that brings Turing's MMA back
    fails the first assertion: then T4 is worth re-measuring."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # not the user's ~/.triton
    sm75 = _ptx(75, "fp16", "int4")
    assert "fma.rn.f32" in sm75 and "mma.sync" not in sm75
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in _ptx(80, "bf16", "int4")
