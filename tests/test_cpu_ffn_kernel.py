"""The fused bf16 expert kernel (core.model.cpu.ffn, core/assets/kernels/moe_ffn.c) against float64, and
its fallbacks.

Where the CPU has AVX-512 BF16 and a compiler exists: a layer's routed experts in one call match a
float64 reference (tighter than torch's bf16 path, which rounds between its ops), for one token and
for many, uneven loads (idle experts, one expert taking every token), bf16 and fp32 routing weights, a
prefill cut into chunks; its scratch is reused; a bf16 engine in CPU mode runs it and its logits stay
as close to float64 transformers as oneDNN's. Everywhere: a CPU answer without AVX-512 BF16 (AVX2,
plain AVX-512: faked), `MLIGHT_NATIVE=0` / `MLIGHT_NATIVE_EXPERTS=0`, no compiler, shapes or experts it
does not take — each leaves the experts on oneDNN's packing (or the caller's fallback).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.model import moe
from core.model.cpu import ffn, isa, native

runs = pytest.mark.skipif(ffn.library() is None, reason=f"the fused expert kernel does not run here: {ffn.status()}")


@pytest.fixture
def fresh_build(kernel_cache):
    kernel_cache(ffn.KERNEL)


def _experts(E=6, D=128, I=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).bfloat16(),
            (torch.randn(E, D, I, generator=g) / I ** 0.5).bfloat16())


def _reference(h, w13, w2, weights, idx):
    """float64 Σ_j w_j · down(silu(gate) · up) over the bf16 values."""
    I = w2.shape[-1]
    out = torch.zeros(h.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(h.shape[0]):
        x = h[t].double()
        for e, wj in zip(idx[t].tolist(), weights[t].double().tolist()):
            gu = w13[e].double() @ x
            out[t] += wj * (w2[e].double() @ (F.silu(gu[:I]) * gu[I:]))
    return out


def _route(T, E, k=2, seed=1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, 128, generator=g).bfloat16()
    w, idx = torch.softmax(torch.randn(T, E, generator=g), -1).topk(k)
    return h, w.to(dtype), idx


def _rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def _engine_error(engine, ref) -> float:
    """The largest relative error of a prefill's and one decode step's logits of three prompts against `ref`
    (float64 transformers over the same weights)."""
    from core.runtime.engine import Request

    prompts = [engine.prompt_token_ids(Request(id=str(i), prompt=p))
               for i, p in enumerate(["Hi there", "Tell me a story about a cat", "x y z"])]
    runner = engine.runner(slots=3, micro_batch_size=3, max_tokens=32)
    logits, _ = runner.prefill(prompts, [0, 1, 2], [[0, 1, 2]])
    nxt = [3, 4, 5]
    step, _ = runner.decode([nxt], [[0, 1, 2]], [[len(p) for p in prompts]])
    err = 0.0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = ref(torch.tensor([p + [nxt[i]]])).logits[0, -2:]
        err = max(err, _rel(logits[i], want[0]), _rel(step[i], want[1]))
    return err


@runs
@pytest.mark.parametrize("T", [1, 7, 37])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_fused_experts_match_float64(T, wdtype):
    """One rounding (the output's) plus the bf16 intermediate: < 6e-3 of the largest output; torch's bf16
    path rounds gate/up, the activation, each expert's output and the running sum too."""
    w13, w2 = _experts()
    h, w, idx = _route(T, 6, dtype=wdtype)
    ref = _reference(h, w13, w2, w, idx)
    got = ffn.NativeExperts(w13, w2)(h, w, idx)
    assert got.dtype == torch.bfloat16 and got.shape == (T, 128)
    torch_path = moe.experts(h, w13, w2, w, idx, grouped=False)
    assert _rel(got, ref) < 6e-3 and _rel(got, ref) <= _rel(torch_path, ref)


@runs
def test_uneven_loads_idle_experts_and_one_taking_every_token():
    w13, w2 = _experts(E=8, D=64, I=64)
    h = torch.randn(13, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    idx = torch.tensor([[3, 1]] * 12 + [[7, 3]])  # expert 3 gets all 13 rows (two tiles and a tail), 0/2/4-6 none
    w = torch.full((13, 2), 0.5, dtype=torch.bfloat16)
    got = ffn.NativeExperts(w13, w2)(h, w, idx)
    assert _rel(got, _reference(h, w13, w2, w, idx)) < 6e-3


@runs
def test_long_k_in_several_blocks_and_every_row_count_of_an_expert():
    """K runs in blocks of 64 pairs with each tile's sums carried between them: D = 320 (160 pairs: 64,
    64, 32) and I = 224 (112: 64, 48); expert 0 gets 1..20 rows across calls, split into balanced tiles
    (13 rows: 5, 4, 4), the other slot spread over experts 1-3. Within the same 6e-3 of float64."""
    g = torch.Generator().manual_seed(5)
    E, D, I = 4, 320, 224
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) / I ** 0.5).bfloat16()
    nat = ffn.NativeExperts(w13, w2)
    for T in (1, 2, 6, 7, 13, 20):
        h = torch.randn(T, D, generator=g).bfloat16()
        idx = torch.stack([torch.zeros(T, dtype=torch.int64), 1 + torch.arange(T) % 3], 1)
        w = torch.rand(T, 2, generator=g).bfloat16()
        ref = _reference(h, w13, w2, w, idx)
        assert _rel(nat(h, w, idx), ref) < 6e-3, T


@runs
def test_a_long_prefill_runs_in_chunks_with_the_same_result(monkeypatch):
    w13, w2 = _experts()
    h, w, idx = _route(29, 6)
    nat = ffn.NativeExperts(w13, w2)
    whole = nat(h, w, idx)
    monkeypatch.setattr(ffn, "CHUNK_TOKENS", 8)  # 8 + 8 + 8 + 5 tokens
    assert torch.equal(nat(h, w, idx), whole)


@runs
def test_the_scratch_is_reused_and_the_result_lands_in_out():
    w13, w2 = _experts()
    h, w, idx = _route(16, 6)
    nat = ffn.NativeExperts(w13, w2)
    out = torch.empty(16, 128, dtype=torch.bfloat16)
    nat(h, w, idx, out)
    buf = native._local.buf
    assert nat(h, w, idx, out) is out and native._local.buf is buf
    assert nat(h[:3], w[:3], idx[:3]).shape == (3, 128) and native._local.buf is buf  # fewer tokens: same buffer


@runs
def test_expert_ids_out_of_range_are_refused():
    w13, w2 = _experts()
    h, w, idx = _route(4, 6)
    idx[2, 1] = 6
    with pytest.raises(ValueError, match="expert ids"):
        ffn.NativeExperts(w13, w2)(h, w, idx)


@runs
def test_experts_dispatch_to_the_kernel_and_refuse_other_activations():
    w13, w2 = _experts()
    h, w, idx = _route(5, 6)
    packed = moe.pack_cpu_experts(w13, w2, fused=True)
    assert isinstance(packed, ffn.NativeExperts) and len(packed) == 6
    scratch = moe.Scratch()
    got = moe.experts(h, None, None, w, idx, packed=packed, scratch=scratch)
    assert torch.equal(got, packed(h, w, idx))
    with pytest.raises(ValueError, match="SwiGLU"):
        moe.experts(h, None, None, w, idx, packed=packed, act=moe.clamped_swiglu(1.7, 7.0))


def test_pack_layout_puts_gate_and_up_columns_of_a_panel_side_by_side():
    """Panel p of w13 holds gate columns 32p..32p+31 then up columns 32p..32p+31; each column's K values
    come in pairs (what vdpbf16ps multiplies). Pure layout: runs on every CPU."""
    D, I = 64, 64
    w13 = torch.arange(2 * I * D, dtype=torch.float32).view(2 * I, D)
    p = ffn.pack_gate_up(w13)  # [I/32, D/2, 4, 16, 2]
    assert p.shape == (2, 32, 4, 16, 2)
    # panel 1, K pair 5, vector 2 (up, columns 32..47 of that panel's up half), lane 3, second of the pair
    assert p[1, 5, 2, 3, 1] == w13[I + 32 + 3, 11]
    assert p[1, 5, 1, 3, 0] == w13[32 + 16 + 3, 10]  # vector 1: gate columns 48..63
    w2 = torch.arange(D * I, dtype=torch.float32).view(D, I)
    assert ffn.pack_rows(w2)[0, 7, 3, 15, 0] == w2[63, 14]


def test_a_cpu_without_avx512_bf16_keeps_onednn(monkeypatch, fresh_build):
    """The answer the kernel acts on is faked: AVX2 (also the AVX2 limits) and plain AVX-512 build nothing."""
    for level in ("avx2", "avx512", "baseline"):
        assert ffn.KERNEL.at(level) is None
        assert "AVX-512 BF16" in ffn.KERNEL.reason
    monkeypatch.setattr(ffn, "library", lambda: None)
    w13, w2 = _experts()
    sentinel = object()
    monkeypatch.setattr(moe, "pack_experts", lambda a, b: sentinel)
    assert moe.pack_cpu_experts(w13, w2, fused=True) is sentinel
    assert not ffn.takes(w13, w2)


@pytest.mark.parametrize("var", ["MLIGHT_NATIVE", "MLIGHT_NATIVE_EXPERTS"])
def test_switched_off_or_no_compiler_builds_nothing(monkeypatch, fresh_build, var):
    monkeypatch.setenv(var, "0")
    assert ffn.KERNEL.at("avx512_bf16") is None and ffn.KERNEL.reason == f"{var}=0"
    monkeypatch.delenv(var)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    ffn.KERNEL.cache_clear()
    assert ffn.KERNEL.at("avx512_bf16") is None and "no C compiler" in ffn.KERNEL.reason
    assert ffn.status().startswith("oneDNN's packed GEMMs (")


def test_shapes_and_experts_it_does_not_take(monkeypatch):
    monkeypatch.setattr(ffn, "library", lambda: type("L", (), {"openmp": True})())
    w13, w2 = _experts(D=128, I=96)
    assert ffn.takes(w13, w2)
    assert not ffn.takes(w13.float(), w2.float())  # fp32 experts: torch's path
    assert not ffn.takes(*_experts(D=96, I=96))  # hidden not a multiple of 64
    assert not ffn.takes(*_experts(D=128, I=80))  # intermediate not a multiple of 32
    sentinel = object()
    monkeypatch.setattr(moe, "pack_experts", lambda a, b: sentinel)
    assert moe.pack_cpu_experts(w13, w2, fused=False) is sentinel  # biases or gpt-oss's clamped activation
    monkeypatch.setattr(ffn, "library", lambda: type("L", (), {"openmp": False})())
    torch_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not ffn.takes(w13, w2)  # one C thread would lose to oneDNN's two
    finally:
        torch.set_num_threads(torch_threads)


@runs
def test_bf16_engine_runs_the_kernel_as_close_to_float64_as_onednn(tmp_path, monkeypatch):
    """Prefill and one decode step of a bf16 Mixtral in CPU mode: the kernel's logits against float64
    transformers over the same bf16 weights, beside the same engine on oneDNN's packing."""
    from checkpoints import hf_model, make_checkpoint
    from core.runtime.engine import Engine

    path = make_checkpoint("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    ref = hf_model(path, dtype=torch.float64)
    errors = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(ffn, "takes", lambda *a: False)
        engine = Engine.load(path)
        kinds = {type(lw.packed).__name__ for lw in engine.weights.layers}
        assert kinds == ({"NativeExperts"} if fused else {"list"})
        errors[fused] = _engine_error(engine, ref)
    assert errors[True] < 3e-2 and errors[True] <= 1.25 * errors[False], errors
