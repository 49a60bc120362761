"""The grouped_mm expert backend against the per-expert loop, over many shapes and routings."""

from __future__ import annotations

import pytest
import torch

from core.model.moe import HAS_GROUPED_MM, can_pack, experts, pack_experts


def reference(h, w13, w2, weights, idx):
    """Token by token, slot by slot, in float64: the obviously correct MoE."""
    out = torch.zeros(h.shape, dtype=torch.float64)
    I = w13.shape[1] // 2
    for t in range(h.shape[0]):
        for s in range(idx.shape[1]):
            e = int(idx[t, s])
            x = h[t].double()
            a = torch.nn.functional.silu(w13[e, :I].double() @ x) * (w13[e, I:].double() @ x)
            out[t] += weights[t, s].double() * (w2[e].double() @ a)
    return out


@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAS_GROUPED_MM, reason="this torch has no grouped_mm"))])
@pytest.mark.parametrize("T,E,k,D,I", [(1, 4, 2, 16, 32), (7, 8, 2, 32, 48), (33, 8, 1, 64, 16), (64, 16, 4, 32, 64)])
def test_experts_match_reference(grouped, T, E, k, D, I):
    g = torch.Generator().manual_seed(T * 100 + E)
    h = torch.randn(T, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T > 8:
        idx[: T // 2] = idx[0]  # skewed routing: several experts get no tokens at all
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    got = experts(h, w13, w2, weights, idx, grouped=grouped)
    torch.testing.assert_close(got.double(), reference(h, w13, w2, weights, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no grouped_mm")
def test_grouped_and_loop_agree_in_bfloat16():
    g = torch.Generator().manual_seed(1)
    T, E, k, D, I = 40, 8, 2, 64, 128
    h = torch.randn(T, D, generator=g).bfloat16()
    w13, w2 = (torch.randn(E, 2 * I, D, generator=g) / 8).bfloat16(), (torch.randn(E, D, I, generator=g) / 11).bfloat16()
    idx = torch.randint(0, E, (T, k), generator=g)
    weights = torch.rand(T, k, generator=g).bfloat16()
    a = experts(h, w13, w2, weights, idx, grouped=True).float()
    b = experts(h, w13, w2, weights, idx, grouped=False).float()
    ref = reference(h, w13, w2, weights, idx).float()
    assert (a - ref).abs().max() <= 2 * (b - ref).abs().max() + 1e-2


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="this CPU or torch cannot prepack bf16 weights (oneDNN wants AVX-512 BF16 or AVX-NE-CONVERT)")
def test_packed_experts_match_the_loop_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    T, E, k, D, I = 37, 8, 2, 64, 96
    h = torch.randn(T, D, generator=g).bfloat16()
    w13, w2 = (torch.randn(E, 2 * I, D, generator=g) / 8).bfloat16(), (torch.randn(E, D, I, generator=g) / 10).bfloat16()
    idx = torch.randint(0, E, (T, k), generator=g)
    weights = torch.rand(T, k, generator=g).bfloat16()
    loop = experts(h, w13, w2, weights, idx, grouped=False)
    packed = experts(h, None, None, weights, idx, packed=pack_experts(w13, w2))
    assert torch.equal(loop, packed)


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="this CPU or torch cannot prepack bf16 weights (oneDNN wants AVX-512 BF16 or AVX-NE-CONVERT)")
def test_bf16_engine_with_packed_experts_gives_the_unpacked_tokens(tmp_path):
    from checkpoints import make_checkpoint
    from core.runtime.engine import Engine, Request

    path = make_checkpoint("qwen2_moe", tmp_path / "bf16", dtype=torch.bfloat16)
    packed, plain = Engine.load(path), Engine.load(path, executor="threaded")
    assert packed.weights.packed and not plain.weights.packed
    packed.eos_ids = plain.eos_ids = set()
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=6) for i, p in enumerate(["Hi", "Tell me a story", "x y"])]
    try:
        a = {r.id: r.output_token_ids for r in packed.generate(reqs, batch_size=2)}
        b = {r.id: r.output_token_ids for r in plain.generate(reqs, batch_size=2)}
    finally:
        plain.close()
    assert a == b


def test_a_cpu_that_refuses_packing_is_detected():
    from core.model.moe import try_pack

    def refuse(w, rows):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
                           "avx512bw, avx512vl and avx512dq")

    assert try_pack(refuse) is False
    assert try_pack(lambda w, rows: w) is True


def test_bf16_engine_runs_unpacked_where_the_cpu_cannot_pack(tmp_path, monkeypatch):
    """An AVX2-only CPU: no prepacking, the plain loop instead, the same tokens as the threaded runtime."""
    import core.model.moe
    from checkpoints import make_checkpoint
    from core.runtime.engine import Engine, Request

    monkeypatch.setattr(core.model.moe, "packing_supported", lambda: False)
    path = make_checkpoint("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    # bf16 math on both sides (on an AVX2 CPU the engine would widen to fp32: tests/test_cpu_compute.py)
    cpu, plain = Engine.load(path, cpu_math="bfloat16"), Engine.load(path, executor="threaded", cpu_math="bfloat16")
    assert not cpu.weights.packed
    cpu.eos_ids = plain.eos_ids = set()
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=5) for i, p in enumerate(["Hi", "Tell me a story", "x y"])]
    try:
        a = {r.id: r.output_token_ids for r in cpu.generate(reqs, batch_size=2)}
        b = {r.id: r.output_token_ids for r in plain.generate(reqs, batch_size=2)}
    finally:
        plain.close()
    assert a == b


def test_kernel_choice_is_measured_once_per_shape_and_picks_the_faster():
    from core.model import expert_choice

    ticks = iter(range(10_000))
    calls = {"slow": 0, "fast": 0}

    def clock():  # every call of "slow" takes 5 ticks, of "fast" 1
        return next(ticks)

    def slow():
        calls["slow"] += 1
        for _ in range(4):
            clock()

    def fast():
        calls["fast"] += 1

    key = ("test", 64)
    assert expert_choice.choose(key, {"slow": slow, "fast": fast}, clock=clock) == "fast"
    measured = dict(calls)
    assert measured["slow"] == measured["fast"] == 1 + expert_choice.TRIALS  # a warm-up, then the trials
    assert expert_choice.choose(key, {"slow": slow, "fast": fast}, clock=clock) == "fast"
    assert calls == measured  # remembered: no second measurement
    assert expert_choice.bucket(1) == 1 and expert_choice.bucket(33) == 64 and expert_choice.bucket(64) == 64


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no grouped_mm")
def test_unspecified_kernel_is_chosen_and_still_correct():
    from core.model import expert_choice

    g = torch.Generator().manual_seed(3)
    T, E, k, D, I = 24, 64, 8, 32, 16  # many small experts
    h = torch.randn(T, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    got = experts(h, w13, w2, weights, idx)
    assert any(key[2:3] == (E,) and choice in ("grouped", "loop") for key, choice in expert_choice.chosen().items())
    torch.testing.assert_close(got.double(), reference(h, w13, w2, weights, idx), rtol=1e-5, atol=1e-5)
