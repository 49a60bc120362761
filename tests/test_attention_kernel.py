"""The fused C decode attention (core.model.cpu.native) against float64, and its fallbacks.

Each build the engine can make is checked: the usable ISA's (AVX-512 or AVX2 here; under CI's AVX2
lane the AVX2 one), an AVX2 and a baseline build by faking the ISA answer, in every kernel form (G
and D known at compile time, any G/D in vectors, scalar for a head size no multiple of the vector),
over bf16 and fp32 caches, with gaps between rows, a sliding window's ring, and threads. Where no
compiler exists, or the build fails, decode attention runs torch ops with the same numbers.
"""

from __future__ import annotations

import platform as py_platform
import shutil

import pytest
import torch

from core.model import attention
from core.model.cpu import isa, native
from core.model.kvcache import KVStore, Rows

X86 = py_platform.machine().lower() in ("x86_64", "amd64")
needs_cc = pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")


@pytest.fixture
def fresh_build(kernel_cache):
    kernel_cache(native.KERNEL)


@pytest.fixture
def first_build(kernel_cache):
    kernel_cache(native.KERNEL, shared=False)


def _reference(q, store, slots, lengths, scale):
    """float64 attention of each request over its cache row's first `length` positions."""
    B, Hq, D = q.shape
    Hkv = store.k.shape[1]
    out = []
    for b, (row, n) in enumerate(zip(slots, lengths)):
        k, v = store.k[row, :, :n].double(), store.v[row, :, :n].double()
        qq = q[b].double().view(Hkv, Hq // Hkv, D)
        p = torch.softmax(torch.einsum("hgd,htd->hgt", qq, k) * scale, dim=-1)
        out.append(torch.einsum("hgt,htd->hgd", p, v).reshape(-1))
    return torch.stack(out)


def _case(G, D, dtype, q_dtype=None, B=9, slots=None, window=0, cap=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hkv = 2
    nslots = 16
    store = KVStore(nslots, Hkv, D, cap, dtype, window=window)
    store.k.copy_(torch.randn(store.k.shape, generator=g))
    store.v.copy_(torch.randn(store.v.shape, generator=g))
    slots = slots or list(range(B))
    positions = [int(x) for x in torch.randint(0, 2 * cap if window else cap, (len(slots),), generator=g)]
    q = torch.randn(len(slots), Hkv * G, D, generator=g).to(q_dtype or dtype)
    return q, store, Rows(slots, positions)


def _check(q, store, rows, out, bf16_tol=8e-3):
    """bf16: the kernel's only rounding is its output's; torch's bmm path also rounds scores and
    probabilities to bf16 (2e-2, as tests/test_attention_rows.py allows it)."""
    kept = [store.kept(p + 1) for p in rows.positions.tolist()]
    ref = _reference(q, store, rows.slots.tolist(), kept, 0.3)
    tol = 1e-5 if q.dtype == torch.float32 else bf16_tol
    assert out.dtype == q.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@needs_cc
@pytest.mark.parametrize("G,D", [(4, 64), (8, 128), (1, 128), (3, 32), (4, 8), (2, 24)])
@pytest.mark.parametrize("dtype,q_dtype", [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, torch.float32)])
def test_kernel_matches_float64(G, D, dtype, q_dtype):
    """Compile-time (4, 64), (8, 128); vectors of any size (1, 128), (3, 32); scalar (4, 8), (2, 24). A bf16
    cache with fp32 queries is the AVX2 CPU's widened math over a cache kept in bf16."""
    q, store, rows = _case(G, D, dtype, q_dtype)
    assert native.usable(q, store.k, store.v, None), native.status()
    _check(q, store, rows, attention.decode_over_rows(q, store, rows, 0.3))


@needs_cc
@pytest.mark.parametrize("window,openmp", [(0, True), (16, True), (0, False)])
def test_rows_with_gaps_a_window_and_threads(window, openmp, fresh_build, monkeypatch):
    """Requests in scattered, unsorted rows (no gather: each reads its own row), a sliding window's ring
    (its kept length), one call split over two threads bit for bit equal to one thread's: torch's own
    OpenMP threads where torch runs on libgomp, else helper threads of ours (macOS, Windows)."""
    if not openmp:
        monkeypatch.setattr(native, "_torch_uses_gomp", lambda: False)
    assert native.library().openmp == (openmp and native._torch_uses_gomp())
    q, store, rows = _case(4, 64, torch.bfloat16, slots=[11, 2, 7, 0, 15, 5], window=window)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = attention.decode_over_rows(q, store, rows, 0.3)
        torch.set_num_threads(2)
        two = attention.decode_over_rows(q, store, Rows(rows.slots.tolist(), rows.positions.tolist()), 0.3)
    finally:
        torch.set_num_threads(threads)
    _check(q, store, rows, one)
    assert torch.equal(one, two)


def test_cuts_split_by_length():
    assert native.cuts([10, 10, 10, 10], 2) == [0, 2, 4]
    assert native.cuts([100, 1, 1, 1], 2) == [0, 1, 4]
    assert native.cuts([5], 3) == [0, 1, 1, 1]
    assert native.cuts([0, 0], 2) == [0, 2, 2]


@needs_cc
@pytest.mark.skipif(not X86 or not torch.cpu._is_avx2_supported(), reason="an x86 CPU with AVX2")
@pytest.mark.parametrize("usable,vw", [("avx2", 8), ("baseline", 4)])
def test_builds_for_lower_isas(fresh_build, monkeypatch, usable, vw):
    """The AVX2 build (the CPUs most users have) and the baseline one, faked on any x86 machine."""
    fake = isa.CpuIsa(hardware=usable, usable=usable, bf16_native=False, fp16_native=False)
    monkeypatch.setattr(isa, "cpu_isa", lambda: fake)
    lib = native.library()
    assert lib is not None and lib.dll.mlight_decode_attention_vw() == vw
    for G, D in ((4, 64), (2, 128), (4, 8)):
        q, store, rows = _case(G, D, torch.bfloat16, seed=G + D)
        _check(q, store, rows, attention.decode_over_rows(q, store, rows, 0.3))


@pytest.mark.parametrize("why", ["no compiler", "compiler fails", "disabled"])
def test_without_the_kernel_attention_runs_torch_ops(fresh_build, monkeypatch, tmp_path, why):
    if why == "no compiler":
        monkeypatch.setattr(native, "_compiler", lambda: None)
    elif why == "compiler fails":
        false = shutil.which("false")
        if false is None:
            pytest.skip("no `false` program to stand in for a broken compiler")
        monkeypatch.setattr(native, "_compiler", lambda: false)
    else:
        monkeypatch.setenv("MLIGHT_NATIVE", "0")
    q, store, rows = _case(4, 64, torch.bfloat16)
    assert native.library() is None and not native.usable(q, store.k, store.v, None)
    assert native.status().startswith("torch ops (") and {"no compiler": "no C compiler", "compiler fails": "failed",
                                                          "disabled": "MLIGHT_NATIVE=0"}[why] in native.status()
    _check(q, store, rows, attention.decode_over_rows(q, store, rows, 0.3), bf16_tol=2e-2)


@needs_cc
def test_sinks_fp16_and_other_shapes_stay_on_torch_ops():
    q, store, rows = _case(4, 64, torch.bfloat16)
    assert native.usable(q, store.k, store.v, None)
    assert not native.usable(q, store.k, store.v, torch.zeros(8))  # gpt-oss's sinks: torch ops
    assert not native.usable(q.half(), store.k.half(), store.v.half(), None)  # fp16: torch ops
    assert not native.usable(q, store.k, store.v[..., :32].contiguous(), None)  # V narrower than K (MLA-like)


@needs_cc
def test_cpu_mode_decodes_through_the_kernel_equal_to_transformers(tmp_path, monkeypatch):
    """The engine's CPU mode takes the kernel for every decode step's attention, and its greedy tokens
    are transformers' (the family parity tests run the same way wherever a compiler exists). fp32: in
    bf16 a tiny random model's near-flat distributions flip on rounding — transformers' attention rounds
    scores and probabilities to bf16, the kernel keeps them in fp32 (closer to float64, see above)."""
    from checkpoints import make_checkpoint, reference_greedy
    from test_engine_parity import MAX_NEW, PROMPTS

    from core.runtime.engine import Engine, Request

    path = make_checkpoint("mixtral", tmp_path)
    calls = []
    real = native.decode_attention
    monkeypatch.setattr(native, "decode_attention", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k))[1])
    engine = Engine.load(path)
    engine.eos_ids = set()
    reqs = [Request(id=f"r{i}", prompt=p, max_new_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
    results = {r.id: r for r in engine.generate(reqs, batch_size=7, micro_batch_size=4)}
    assert len(calls) >= engine.spec.num_layers * (max(MAX_NEW) - 1)
    for r in reqs:
        assert results[r.id].output_token_ids == reference_greedy(path, engine.prompt_token_ids(r), r.max_new_tokens)


@needs_cc
def test_the_kernel_is_built_while_loading_with_progress_not_in_the_first_decode_step(tmp_path, first_build):
    """A first build takes about a second: a silent pause in the first decode step looked like a hang
    and landed in the step's timing. Engine.load builds it and says so; a second load, from the cache,
    says nothing."""
    from checkpoints import make_checkpoint

    from core.runtime.engine import Engine
    from core.telemetry import Progress

    path = make_checkpoint("mixtral", tmp_path)
    seen = []
    Engine.load(path, progress=seen.append)
    built = [e for e in seen if isinstance(e, Progress) and "decode attention kernel" in e.what]
    assert built and built[-1].done == built[-1].total, seen
    assert len(native.KERNEL.built) == 1  # built and loaded before any step ran
    native.KERNEL.cache_clear()
    again = []
    Engine.load(path, progress=again.append)
    assert not [e for e in again if isinstance(e, Progress) and "decode attention kernel" in e.what]
    assert native.library() is not None
