"""mlight's C int4 kernel (core.model.cpu.int4) against float64, every build it can make, and its fallbacks.

The kernel quantizes the activations and keeps the weights integers: fp32 inputs as two int8 digits
per input with a scale per 8 inputs (about 15 bits), bf16 inputs as one digit (8 bits at the lane's
largest input: what bf16 itself holds there; half the integer work). Its only other rounding is fp32
summation (the weights' offset of 8 and their zeros are applied per group from fp32 sums of the
quantized and of the exact inputs) and a bf16 output. So against float64 over the dequantized weights:
fp32 within 5e-5 of the largest output; bf16 within 8e-3 (measured up to 6e-3: twice the output's own
rounding) and, for one token's fused experts (whose activation between the projections is quantized
too), within 1.5e-2 (measured up to 1e-2; torch's int4 path with its bf16 intermediates: 2e-2).
Checked on the usable ISA's build, and by faking the CPU's answer on AVX-512 without VNNI, AVX2 and
portable C; over K with a tail chunk, every group size, 1..17 rows (part tiles of weight and token
rows); one token's fused experts; threads; and where there is no kernel, the torch path with the same
numbers.
"""

from __future__ import annotations

import platform as py_platform
import shutil

import pytest
import torch

from core.model import moe
from core.model.cpu import int4, isa, native
from core.model.quant.experts import ExpertScheme, QuantExperts
from core.model.quant.formats import Format, dequantize, quantize

X86 = py_platform.machine().lower() in ("x86_64", "amd64")
needs_cc = pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")
TOL = {torch.float32: 5e-5, torch.bfloat16: 8e-3}
MOE_TOL = {torch.float32: 5e-5, torch.bfloat16: 1.5e-2}


@pytest.fixture
def fresh_build(kernel_cache):
    kernel_cache(int4.KERNEL)


@pytest.fixture
def first_build(kernel_cache):
    kernel_cache(int4.KERNEL, shared=False)


def _matrix(n, k, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    parts = quantize(Format("int4", g), torch.randn(n, k, generator=gen) / k ** 0.5)
    return parts, dequantize(Format("int4", g), parts).double()


def _close(got, ref, dtype, tol=TOL):
    assert got.dtype == dtype and got.shape == ref.shape
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol[dtype], err


def _check_linear(dtype, cases=((1, 48, 96, 32), (3, 40, 1024, 64), (9, 16, 384, 128), (2, 64, 64, 32),
                                (17, 15, 256, 64))):
    """(M, N, K, g): K = 96 and 64 end in a part chunk (AVX-512 reads 128 inputs a chunk), M = 9 and 17 past
    the 8 rows of a tile (a part tile after them), N = 15 a weight row short of the tiles' 2."""
    for M, N, K, g in cases:
        parts, W = _matrix(N, K, g, seed=K + M)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
        _close(int4.linear(x, parts["q"], parts["sz"], g), x.double() @ W.T, dtype)


def _experts(E=6, D=64, I=96, g=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    fmt = Format("int4", g)
    p13 = quantize(fmt, torch.randn(E, 2 * I, D, generator=gen) / D ** 0.5)
    p2 = quantize(fmt, torch.randn(E, D, I, generator=gen) / I ** 0.5)
    return p13, p2, dequantize(fmt, p13).double(), dequantize(fmt, p2).double()


def _moe_ref(x, ids, wts, W13, W2):
    I = W2.shape[-1]
    out = 0
    for e, w in zip(ids, wts):
        gu = x.double() @ W13[e].T
        out = out + float(w) * ((torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ W2[e].T)
    return out


def _check_moe(dtype, D=64, I=96, g=32):
    p13, p2, W13, W2 = _experts(D=D, I=I, g=g)
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    for ids, wts in (([4, 1], [0.625, 0.375]), ([2], [1.0]), ([5, 0, 3], [0.5, 0.25, 0.25])):
        w = torch.tensor([wts], dtype=dtype)
        got = int4.moe(x, torch.tensor([ids]), w, (p13["q"], p13["sz"]), (p2["q"], p2["sz"]), g)
        _close(got, _moe_ref(x, ids, w[0].tolist(), W13, W2), dtype, MOE_TOL)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64(dtype):
    assert int4.library() is not None, int4.status()
    _check_linear(dtype)
    _check_moe(dtype)
    _check_moe(dtype, D=256, I=384, g=128)


@needs_cc
@pytest.mark.skipif(not X86 or not torch.cpu._is_avx2_supported(), reason="an x86 CPU with AVX2")
@pytest.mark.parametrize("usable,vnni,vw", [("avx512", False, 16), ("avx2", False, 8), ("baseline", False, 4)])
def test_builds_for_lower_isas(fresh_build, monkeypatch, usable, vnni, vw):
    """AVX-512 without VNNI (vpmaddubsw), AVX2 (the CPUs most users have) and portable C, faked here."""
    if usable == "avx512" and not torch.cpu._is_avx512_supported():
        pytest.skip("needs an AVX-512 CPU")
    fake = isa.CpuIsa(hardware=usable, usable=usable, bf16_native=False, fp16_native=False)
    monkeypatch.setattr(isa, "cpu_isa", lambda: fake)
    monkeypatch.setattr(int4, "_vnni", lambda: vnni)
    lib = int4.library()
    assert lib is not None and lib.vw == vw and ("-mavx512vnni" in lib.flags) == vnni, int4.status()
    _check_linear(torch.float32, cases=((1, 48, 96, 32), (5, 16, 256, 64), (2, 8, 384, 128), (11, 7, 128, 32)))
    _check_moe(torch.bfloat16)


@needs_cc
def test_threads_split_rows_bit_for_bit():
    """Each output is one thread's whole sum: two threads give one thread's bits."""
    parts, _ = _matrix(256, 512, 64)
    x = torch.randn(2, 512).bfloat16()
    p13, p2, _, _ = _experts()
    xs = torch.randn(1, 64).bfloat16()
    ids, w = torch.tensor([[3, 1]]), torch.tensor([[0.5, 0.5]])
    threads = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out.append((int4.linear(x, parts["q"], parts["sz"], 64),
                        int4.moe(xs, ids, w, (p13["q"], p13["sz"]), (p2["q"], p2["sz"]), 32)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*out))


def _quant_experts(dtype=torch.float32):
    p13, p2, W13, W2 = _experts()
    parts = {**{f"w13.{s}": t for s, t in p13.items()}, **{f"w2.{s}": t for s, t in p2.items()}}
    return QuantExperts(ExpertScheme.uniform(Format("int4", 32), 64, 96), parts, dtype), W13, W2


def _experts_close(q, W13, W2, tol):
    """The layer's experts on one token and on three (the fused call, then the expert-by-expert loop)."""
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    idx = torch.tensor([[4, 1], [0, 4], [2, 5]])
    w = torch.tensor([[0.625, 0.375], [0.5, 0.5], [0.75, 0.25]])
    one = moe.experts(h[:1], None, None, w[:1], idx[:1], quant=q)
    many = moe.experts(h, None, None, w, idx, quant=q)
    for t, got in ((0, one[0]), *((t, many[t]) for t in range(3))):
        ref = _moe_ref(h[t:t + 1], idx[t].tolist(), w[t].tolist(), W13, W2)[0]
        assert ((got.double() - ref).abs().max() / ref.abs().max()) < tol


@needs_cc
def test_the_experts_take_the_kernel_as_stored(monkeypatch):
    """pack_cpu keeps the stored parts (no repacking; they still expand for many tokens), a token's experts
    are one fused call, and a few tokens per expert take the kernel's linear."""
    q, W13, W2 = _quant_experts()
    assert q.pack_cpu() and q.native
    q.detach_parts()
    assert set(q.parts) == {"w13.q", "w13.sz", "w2.q", "w2.sz"}
    calls = []
    for name in ("moe", "linear"):
        real = getattr(int4, name)
        monkeypatch.setattr(int4, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    _experts_close(q, W13, W2, 5e-5)
    assert calls.count("moe") == 1 and calls.count("linear") >= 2


@pytest.mark.parametrize("why", ["no compiler", "compiler fails", "disabled", "threads without OpenMP"])
def test_without_the_kernel_the_experts_run_torch(fresh_build, monkeypatch, why):
    if why == "no compiler":
        monkeypatch.setattr(native, "_compiler", lambda: None)
    elif why == "compiler fails":
        false = shutil.which("false")
        if false is None:
            pytest.skip("no `false` program to stand in for a broken compiler")
        monkeypatch.setattr(native, "_compiler", lambda: false)
    elif why == "disabled":
        monkeypatch.setenv("MLIGHT_NATIVE", "0")
    else:
        if native._compiler() is None:
            pytest.skip("no C compiler on this machine")
        monkeypatch.setattr(native, "_torch_uses_gomp", lambda: False)  # no -fopenmp: one C thread
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # where torch runs two
        assert int4.library() is not None and not int4.library().openmp
    if why != "threads without OpenMP":
        assert int4.library() is None
        assert int4.status().startswith("torch's weight-only kernel (") and {
            "no compiler": "no C compiler", "compiler fails": "failed", "disabled": "MLIGHT_NATIVE=0"}[why] in int4.status()
    assert not int4.runs(torch.bfloat16, 64, group=32)
    q, W13, W2 = _quant_experts()
    assert q.pack_cpu() and not q.native  # torch's kernel, prepacked
    _experts_close(q, W13, W2, 2e-2)  # torch's int4 kernel rounds the activations to bf16


@needs_cc
def test_cpu_mode_runs_int4_through_the_kernel_built_while_loading(tmp_path, first_build, monkeypatch):
    """Engine.load builds the kernel and says so (not silently inside the first step); every decode step's
    experts at batch 1 are one call per layer; greedy tokens are those of transformers running the same
    dequantized experts (fp32: the kernel's ≈ 15-bit activations keep the logits within the int4 parity
    tests' 1e-4)."""
    from checkpoints import make_checkpoint
    from quant_ref import dequantized_hf

    from core.runtime.engine import Engine, Request
    from core.telemetry import Progress

    path = make_checkpoint("mixtral", tmp_path / "m")
    calls = []
    real = int4.moe
    monkeypatch.setattr(int4, "moe", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    seen = []
    engine = Engine.load(path, quantize="int4", group_size=32, progress=seen.append)
    built = [e for e in seen if isinstance(e, Progress) and "int4 kernel" in e.what]
    assert built and built[-1].done == built[-1].total, seen
    engine.eos_ids = set()
    req = Request(id="a", prompt="Hello there, tell me", max_new_tokens=6)
    (result,) = engine.generate([req], batch_size=1)
    engine.close()
    assert len(calls) >= engine.spec.num_layers * 5
    ref = dequantized_hf(path, Format("int4", 32), dtype=torch.float32)
    ids = engine.prompt_token_ids(req)
    with torch.no_grad():
        for _ in range(req.max_new_tokens):
            ids = ids + [int(ref(torch.tensor([ids])).logits[0, -1].argmax())]
    assert result.output_token_ids == ids[-req.max_new_tokens:]


@needs_cc
def test_rows_per_expert_choose_the_kernel_or_expansion(monkeypatch):
    """Up to NATIVE_INT4_ROWS tokens on one expert take the C kernel's tiles (which beat expanding the expert
    into bf16 up to there: bench/quant_cpu.py's per-expert table), more expand it and multiply."""
    from core.model.quant import experts
    from core.model.quant.formats import KERNEL_ROWS, NATIVE_INT4_ROWS

    assert NATIVE_INT4_ROWS > KERNEL_ROWS  # torch's kernels' limit is not the C kernel's
    q, W13, _ = _quant_experts()
    assert q.pack_cpu() and q.native and q.kernel_rows == NATIVE_INT4_ROWS
    seen = []
    real_linear, real_expand = int4.linear, experts.expand_into
    monkeypatch.setattr(int4, "linear", lambda *a, **k: (seen.append("kernel"), real_linear(*a, **k))[1])
    monkeypatch.setattr(experts, "expand_into", lambda *a, **k: (seen.append("expand"), real_expand(*a, **k))[1])
    for rows in (1, KERNEL_ROWS + 1, NATIVE_INT4_ROWS, NATIVE_INT4_ROWS + 1):
        seen.clear()
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        got = q.up(2, x)
        assert seen == ["kernel" if rows <= NATIVE_INT4_ROWS else "expand"], rows
        assert ((got.double() - x.double() @ W13[2].T).abs().max() / (x.double() @ W13[2].T).abs().max()) < 5e-5


@needs_cc
def test_the_probe_times_one_tokens_fused_call(monkeypatch):
    """The planner's one-row int4 rate ("int4@1") is the engine's call at one token on the C kernel: the
    fused experts (one call a layer), not one small matrix's linear, whose fixed cost per call read as a
    kernel at half the fused call's rate (the HRM then predicted int4 / bf16 1.66x where 2.2x ran)."""
    from core.model.quant import experts

    calls = []
    for name in ("moe", "linear"):
        real = getattr(int4, name)
        monkeypatch.setattr(int4, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    run, flops = experts.kernel_probe("int4", rows=1, n=256, k=128)
    out = run()
    assert calls == ["moe"] and out.shape == (1, 128)
    assert flops == 2 * 2 * 3 * 128 * 128  # two routed experts, gate/up/down of hidden 128, width 128
    calls.clear()
    run, flops = experts.kernel_probe("int4", rows=4, n=256, k=128)
    assert run().shape == (4, 256) and calls == ["linear"] and flops == 2 * 4 * 256 * 128
