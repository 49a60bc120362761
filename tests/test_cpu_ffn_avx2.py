"""The fp32-math expert kernel for AVX2 CPUs (core/assets/kernels/moe_ffn_avx2.c through core.model.cpu.ffn):
bf16 experts in the packed layout, fp32 activations, against float64; the engine takes it where the CPU
computes bf16 checkpoints in fp32, and its fallbacks.

On this box it runs under the AVX2 limits (tests/test_cpu_avx2_lane.py) and on AVX-512 machines alike (they
have AVX2); the engine's path is forced there with cpu_math="float32", what an AVX2 CPU picks by itself.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_ffn_kernel import _engine_error, _experts, _reference, _rel  # the bf16 kernel's own helpers

from core.model import moe
from core.model.cpu import ffn, native

runs = pytest.mark.skipif(ffn.library_avx2() is None, reason=f"the fp32 expert kernel does not run here: {ffn.status('float32')}")
TOL = 2e-5  # fp32 sums in another order than float64's: measured 2-3e-6 of the largest output


@runs
@pytest.mark.parametrize("T", [1, 5, 37])
def test_fp32_experts_match_float64(T):
    w13, w2 = _experts()
    g = torch.Generator().manual_seed(T)
    h = torch.randn(T, 128, generator=g)
    w, idx = torch.softmax(torch.randn(T, 6, generator=g), -1).topk(2)
    got = ffn.NativeExperts(w13, w2)(h, w, idx)
    assert got.dtype == torch.float32 and got.shape == (T, 128)
    ref = _reference(h, w13, w2, w, idx)
    assert _rel(got, ref) < TOL
    assert _rel(moe.experts(h, w13.float(), w2.float(), w, idx, grouped=False), ref) < TOL  # torch's fp32: the same class


@runs
def test_long_k_uneven_loads_and_every_row_count():
    """D = 320 (160 K pairs: blocks of 64, 64, 32), I = 224; expert 0 takes 1..40 rows (below 16: tiles of at
    most 4 over weights widened in registers; from 16: tiles of at most 6 over each block widened once),
    experts 4-5 none; bf16 routing weights are taken too."""
    g = torch.Generator().manual_seed(5)
    E, D, I = 6, 320, 224
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) / I ** 0.5).bfloat16()
    nat = ffn.NativeExperts(w13, w2)
    for T in (1, 2, 3, 5, 7, 13, 15, 16, 17, 21, 40):
        h = torch.randn(T, D, generator=g)
        idx = torch.stack([torch.zeros(T, dtype=torch.int64), 1 + torch.arange(T) % 3], 1)
        w = torch.rand(T, 2, generator=g).bfloat16()
        assert _rel(nat(h, w, idx), _reference(h, w13, w2, w, idx)) < TOL, T


@runs
def test_chunks_threads_out_and_bad_ids(monkeypatch):
    w13, w2 = _experts()
    g = torch.Generator().manual_seed(9)
    h, (w, idx) = torch.randn(29, 128, generator=g), torch.softmax(torch.randn(29, 6, generator=g), -1).topk(2)
    nat = ffn.NativeExperts(w13, w2)
    whole = nat(h, w, idx)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = nat(h, w, idx)
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(one, whole, rtol=0, atol=1e-6)  # panels split over threads: the same sums
    monkeypatch.setattr(ffn, "CHUNK_TOKENS", 8)
    out = torch.empty(29, 128)
    assert nat(h, w, idx, out) is out and torch.equal(out, whole)
    idx[3, 0] = 6
    with pytest.raises(ValueError, match="expert ids"):
        nat(h, w, idx)


@runs
def test_it_asks_for_its_own_scratch(monkeypatch):
    """The fp32-math kernel's scratch is sized by its own formula (T, k, E, I, threads): ctypes passes extra
    arguments through unchecked, and once the bf16 kernel's (T, k, E, D, I, threads) was handed to it — D read as
    I, I as the thread count: a 1.5 GB scratch for a 512-token chunk of the 784M, and an intermediate sized by D."""
    w13, w2 = _experts(E=6, D=128, I=96)
    g = torch.Generator().manual_seed(4)
    h, (w, idx) = torch.randn(11, 128, generator=g), torch.softmax(torch.randn(11, 6, generator=g), -1).topk(2)
    asked, real = [], native.scratch
    monkeypatch.setattr(native, "scratch", lambda nbytes: asked.append(nbytes) or real(nbytes))
    ffn.NativeExperts(w13, w2)(h, w, idx)
    lib = ffn.library_avx2()
    assert asked == [lib.scratch(11, 2, 6, 96, torch.get_num_threads() if lib.openmp else 1)]


@runs
def test_a_kernel_called_with_a_wrong_count_fails_in_the_tests(monkeypatch):
    """The tests bind every C kernel strictly (conftest: MLIGHT_STRICT_KERNEL_CALLS=1), so the defect above raises;
    elsewhere the bare ctypes function runs, with nothing added to a call."""
    import ctypes

    lib = ffn.library_avx2()
    with pytest.raises(TypeError, match="mlight_moe_avx2_scratch takes 5 arguments, got 6"):
        lib.scratch(11, 2, 6, 128, 96, 1)
    assert lib.scratch(11, 2, 6, 96, 1) > 0
    monkeypatch.delenv(native.STRICT_ENV)
    bare = native.bind(lib.dll, "mlight_moe_avx2_scratch", [ctypes.c_int64] * 5, ctypes.c_int64)
    assert isinstance(bare, ctypes._CFuncPtr) and bare(11, 2, 6, 96, 1) == lib.scratch(11, 2, 6, 96, 1)


def test_what_it_takes_and_when_it_is_not_built(monkeypatch, tmp_path):
    monkeypatch.setattr(ffn, "library_avx2", lambda: type("L", (), {"openmp": True})())
    w13, w2 = _experts()
    assert ffn.takes_widened(w13, w2)
    assert not ffn.takes_widened(w13.float(), w2.float())  # fp32 experts need no widening
    assert not ffn.takes_widened(*_experts(D=96))  # hidden not a multiple of 64
    monkeypatch.undo()
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    ffn.KERNEL_AVX2.cache_clear()
    try:
        assert ffn.KERNEL_AVX2.at("baseline") is None and "no AVX2" in ffn.KERNEL_AVX2.reason
        monkeypatch.setenv("MLIGHT_NATIVE_EXPERTS", "0")
        assert ffn.KERNEL_AVX2.at("avx2") is None and ffn.KERNEL_AVX2.reason == "MLIGHT_NATIVE_EXPERTS=0"
        monkeypatch.delenv("MLIGHT_NATIVE_EXPERTS")
        monkeypatch.setattr(native, "_compiler", lambda: None)
        ffn.KERNEL_AVX2.cache_clear()
        assert ffn.KERNEL_AVX2.at("avx2") is None and "no C compiler" in ffn.KERNEL_AVX2.reason
    finally:
        ffn.KERNEL_AVX2.cache_clear()


@runs
def test_engine_in_fp32_math_runs_it_as_close_to_float64_as_the_widened_tiles(tmp_path, monkeypatch):
    """A bf16 Mixtral in CPU mode computing in fp32 (what an AVX2 CPU picks): the experts packed for the kernel,
    the dense part widened; prefill and a decode step's logits against float64 transformers, beside the same
    engine on torch's widened tiles."""
    from checkpoints import hf_model, make_checkpoint
    from core.runtime.engine import Engine

    path = make_checkpoint("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    ref = hf_model(path, dtype=torch.float64)
    errors = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(ffn, "takes_widened", lambda *a: False)
        engine = Engine.load(path, cpu_math="float32")
        assert engine.cpu.fused == fused and engine.cpu.math == "float32"
        kinds = {type(lw.packed).__name__ for lw in engine.weights.layers}
        assert kinds == ({"NativeExperts"} if fused else {"NoneType"})
        assert "in registers" in engine.cpu.describe() if fused else "tile by tile" in engine.cpu.describe()
        errors[fused] = _engine_error(engine, ref)
    # both within what the bf16 KV cache leaves (2-4e-3 here); the kernel no further from float64 than torch's tiles
    assert errors[True] < 1e-2 and errors[True] <= 1.25 * errors[False] + 1e-6, errors
