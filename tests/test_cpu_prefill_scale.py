"""Predictions at the planner's own batch (issue 11 item 6): a CPU-only run's micro-batches are 16-100x the
calibration's, and its prefill calls tens of thousands of tokens.

The cost model: the fused expert kernel takes 512 tokens a call and reads every routed expert again in
each (per-expert GEMMs amortise their weights over any rows), and a prefill chunk whose activations pass the
allocator's threshold (only a prompt longer than a chunk) pays per fresh token. The calibration: it times the
expert kernel the engine runs (the fused one where it runs, not oneDNN's packed GEMMs), and it fits the
fresh term from calls past the threshold where it has any, recovering a synthetic slowdown.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from core.model.cpu import ffn
from core.plan import cpu_cost, cpu_speed, hrm
from core.plan.cpu_cost import CpuCosts
from core.plan.presets import resolve_spec
from core.runtime import calibrate as cal
from core.runtime import calibrate_pieces as pieces

TRUTH = CpuCosts(math="bfloat16", flop_s=1e-12, weight_s=3e-11, call_s=2e-5, expert_flop_s=1e-12,
                 expert_weight_s=3e-11, expert_call_s=1e-5, elem_s=1.7e-10, sdpa_flop_s=1.5e-10, task_s=8e-5,
                 prompt_s=2e-3, prefill_act_s=5e-8, cache_bytes=32 << 20, expert_chunk=512)


def _dims():
    return hrm.dims(resolve_spec("mixtral-8x7b"))


def test_the_fused_kernels_experts_cost_the_same_per_token_past_its_chunk():
    d = _dims()
    per = lambda c, t: cpu_cost.experts_seconds(d, c, t) / t  # noqa: E731
    assert per(TRUTH, 4096) == pytest.approx(per(TRUTH, 512), rel=1e-9)  # 8 calls, each reading the weights
    assert cpu_cost.experts_seconds(d, TRUTH, 1100) == pytest.approx(
        2 * cpu_cost.experts_seconds(d, TRUTH, 512) + cpu_cost.experts_seconds(d, TRUTH, 76), rel=1e-9)
    # in a call, the slower of the weights (few tokens) and the arithmetic (many): a roofline, not their sum
    per_expert = 3 * d.I * d.D
    e16, _ = cpu_cost._experts(d, 16)
    assert cpu_cost.experts_seconds(d, TRUTH, 16) == pytest.approx(
        TRUTH.expert_weight_s * e16 * per_expert + TRUTH.expert_call_s * e16, rel=1e-9)
    e512, _ = cpu_cost._experts(d, 512)
    assert cpu_cost.experts_seconds(d, TRUTH, 512) == pytest.approx(
        TRUTH.expert_flop_s * 2 * 512 * d.k * per_expert + TRUTH.expert_call_s * e512, rel=1e-9)
    # per-expert GEMMs (oneDNN's) read each expert once whatever the rows: the weights' share falls with tokens
    gemms = dataclasses.replace(TRUTH, expert_chunk=0)
    assert per(gemms, 4096) < 0.97 * per(gemms, 512)
    # ... and their SwiGLU and gathers are elementwise work beside the GEMMs, inside the fused kernel
    assert cpu_cost.experts_seconds(d, gemms, 64) > cpu_cost.experts_seconds(d, TRUTH, 64)


def test_a_prefill_call_pays_for_activations_too_large_to_reuse():
    d = _dims()
    hi = cpu_cost.FRESH_BYTES / (d.D * 2)  # bf16 activations: from here every one is mapped fresh
    fresh = lambda c, t, n: cpu_cost.fresh_tokens(d, c, t, n)  # noqa: E731
    assert cpu_cost.prefill_chunk(d) <= hi / 2  # the engine's chunk stays under the threshold
    # one prompt alone spans what it spans: past the threshold, every token fresh; under half of it, none
    assert fresh(TRUTH, hi / 2, hi / 2) == 0.0 and fresh(TRUTH, hi, hi) == hi
    assert fresh(TRUTH, 0.75 * hi, 0.75 * hi) == pytest.approx(0.75 * hi / 2)  # the ramp between
    assert fresh(dataclasses.replace(TRUTH, math="float32"), hi / 2, hi / 2) == hi / 2  # fp32: twice the bytes
    # many short prompts run a chunk at a time: a call's size alone maps nothing fresh (it did, as one piece)
    assert fresh(TRUTH, 4 * hi, 77) == 0.0 and fresh(TRUTH, 4 * hi, hi) == 4 * hi
    without = dataclasses.replace(TRUTH, prefill_act_s=0.0)
    for prompts, n in ((2, 64), (64, 77), (452, 77), (1, int(hi)), (3, int(hi))):
        t = prompts * n
        extra = cpu_cost.prefill_seconds(d, TRUTH, prompts, n) - cpu_cost.prefill_seconds(d, without, prompts, n)
        assert extra == pytest.approx(TRUTH.prefill_act_s * d.D * fresh(TRUTH, t, n), rel=1e-9, abs=1e-15)
    # neither the calibration's micro-batch of 4 prompts nor a planner's of 452 pays for it; a prompt past it does
    ratio = lambda p, n: cpu_cost.prefill_seconds(d, TRUTH, p, n) / cpu_cost.prefill_seconds(d, without, p, n)  # noqa: E731
    assert ratio(4, 77) == 1.0 and ratio(452, 77) == 1.0 and ratio(1, 2 * hi) > 1.01


def test_calibration_fits_a_per_call_size_slowdown_of_prefill():
    """Prefill steps timed as a machine with the fresh-activation term would run them. The calibration's large
    calls of many short prompts run in chunks and map nothing fresh: the fit recovers attention's and the
    per-prompt terms from them and leaves the fresh term as it was. Calls of prompts past the threshold
    (which only a prompt longer than a chunk reaches) would tell it apart."""
    spec = resolve_spec("mixtral-8x7b")
    d, L = hrm.dims(spec), spec.num_layers
    truth = dataclasses.replace(TRUTH, **{f.name: getattr(TRUTH, f.name) / 1000 for f in dataclasses.fields(CpuCosts)
                                          if f.type == "float" and f.name not in cpu_cost.EFFICIENCIES})
    base = dataclasses.replace(truth, sdpa_flop_s=0.0, prompt_s=0.0, prefill_act_s=0.0)
    big = pieces.fresh_prefills(d, "bfloat16", 1e-5, spec.max_position - 2)
    (p0, n0), (p, n) = big
    assert p * n > cpu_cost.fresh_from(d, "bfloat16") and n0 == n and p0 >= 8  # a call as large as a planner's
    assert cpu_cost.fresh_tokens(d, base, p * n, n) == 0 == cpu_cost.fresh_tokens(d, base, p0 * n0, n0)

    def observed(c, shapes):
        took = lambda p, n: L * cpu_cost.prefill_seconds(d, c.for_step(p * n * d.kv_tok), p, n)  # noqa: E731
        return [pieces.Obs("prefill", p, n, {"gpu": took(p, n)}, 0.0) for p, n in shapes]

    got = pieces.fit_engine_terms(SimpleNamespace(spec=spec), base, observed(truth, pieces.PREFILLS + tuple(big)))
    for name in ("sdpa_flop_s", "prompt_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert got.prefill_act_s == 0.0
    # prompts of the threshold's length, on a machine where mapping them costs a seventh of their prefill
    hi = int(cpu_cost.fresh_from(d, "bfloat16"))
    slow = dataclasses.replace(truth, prefill_act_s=4 * truth.prefill_act_s)
    shapes = pieces.PREFILLS + tuple(big) + ((4, hi),)
    got = pieces.fit_engine_terms(SimpleNamespace(spec=spec), base, observed(slow, shapes))
    for name in ("sdpa_flop_s", "prompt_s", "prefill_act_s"):
        assert getattr(got, name) == pytest.approx(getattr(slow, name), rel=1e-3), name
    # a machine on which those prefills would take too long: no such points
    assert pieces.fresh_prefills(d, "bfloat16", 1e-2, spec.max_position - 2) == []


def test_calibration_tells_a_per_token_prefill_cost_from_attentions():
    """A machine whose prefill costs more a token than its GEMMs and elementwise terms say (the demo's routing
    over a whole call: 2.2x them), whatever the prompts' lengths. The fit must price it per token, not as
    attention (which grows with the square of a prompt): fitted as attention, the same tokens in prompts 4x
    longer were priced 1.5-2x what they took."""
    spec = resolve_spec("mixtral-8x7b")
    d, L = hrm.dims(spec), spec.num_layers
    truth = dataclasses.replace(TRUTH, **{f.name: getattr(TRUTH, f.name) / 1000 for f in dataclasses.fields(CpuCosts)
                                          if f.type == "float" and f.name not in cpu_cost.EFFICIENCIES})
    base = dataclasses.replace(truth, sdpa_flop_s=0.0, prompt_s=0.0, prefill_act_s=0.0)
    per_token = 0.5 * cpu_cost.prefill_seconds(d, base, 16, 64) / (16 * 64)  # a third of a token's whole cost

    def took(c, p, n):  # seconds of a layer: the cost model's, plus the per-token work it has no other term for
        return cpu_cost.prefill_seconds(d, c.for_step(p * n * d.kv_tok), p, n) + per_token * p * n

    obs = [pieces.Obs("prefill", p, n, {"gpu": L * took(truth, p, n)}, 0.0) for p, n in pieces.PREFILLS]
    got = pieces.fit_engine_terms(SimpleNamespace(spec=spec), base, obs)
    # unseen shapes: MT-Bench's prompts and 4x them, the same tokens a call, and prompts longer than any timed
    for p, n in ((16, 77), (4, 308), (2, 1000)):  # (none of their activations mapped fresh)
        assert cpu_cost.prefill_seconds(d, got.for_step(p * n * d.kv_tok), p, n) == pytest.approx(took(truth, p, n),
                                                                                               rel=0.03), (p, n)
    assert got.sdpa_flop_s == pytest.approx(truth.sdpa_flop_s, rel=0.05)


class _Clock:
    """A clock the fake kernel advances by what the cost model says: the fit must give the coefficients back."""
    resolution = 1e-9

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_fused_kernels_terms_fit_whole_layer_calls():
    d = _dims()
    clock = _Clock()

    class Layer:
        fused_swiglu, E, D, I, held_bytes = True, d.E, d.D, d.I, 1

        def __call__(self, h, w, idx, out):
            assert idx.shape == (h.shape[0], d.k) and len(set(idx[0].tolist())) == d.k  # distinct experts a token
            clock.now += clock.cost(h.shape[0])

    # a whole-layer call: the slower of its arithmetic and its weights (its call's overhead is its task's)
    truth = dataclasses.replace(TRUTH, expert_call_s=0.0)
    clock.cost = lambda t: cpu_cost.experts_seconds(d, truth, t)
    got = pieces.fused_terms([Layer()], d, 0, tokens=(1, 2, 4, 8, 16, 64, 256, 512), clock=clock)
    assert got == pytest.approx((truth.expert_flop_s, truth.expert_weight_s, 0.0), rel=1e-6)


@pytest.mark.parametrize("fused", [
    pytest.param(True, marks=pytest.mark.skipif(ffn.library() is None,
                                                reason=f"the fused expert kernel does not run here: {ffn.status()}")),
    False])
def test_calibration_times_the_expert_kernel_the_engine_runs(tmp_path, monkeypatch, fused):
    """A bf16 engine on a CPU with AVX-512 BF16 runs its experts in the fused kernel: the calibration times that
    kernel, whole layers a call (not oneDNN's packed GEMMs on the experts' shapes), and prices its chunks;
    with the kernel switched off (MLIGHT_NATIVE_EXPERTS=0), or on a CPU without it, it times the GEMMs the engine
    then runs (oneDNN's packed ones, or the widened ones under AVX2)."""
    from checkpoints import make_checkpoint
    from core.runtime.engine import Engine

    path = make_checkpoint("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    if not fused:
        monkeypatch.setenv("MLIGHT_NATIVE_EXPERTS", "0")
    # both kernels' builds: under the AVX2 limits the fp32-math one, built by an earlier test, would outlive the switch
    ffn._build.cache_clear()
    ffn._build_avx2.cache_clear()
    try:
        engine = Engine.load(path, threads=1)
        assert bool(pieces.fused_layers(engine)) is fused
        monkeypatch.setattr(cal, "llc_bytes", lambda: 64 << 10)  # a tiny cache: the GEMM stage cycles few copies
        timed, layers, terms = [], [], []
        real_gemm, real_fused = pieces.gemm_terms, pieces.fused_terms
        def gemms(kernel, math, shapes, *a, **kw):
            timed.append(list(shapes))
            terms.append(real_gemm(kernel, math, shapes, *a, **kw))
            return terms[-1]

        def fused_layers(ls, *a, **kw):
            layers.append(ls)
            terms.append(real_fused(ls, *a, **kw))
            return terms[-1]

        monkeypatch.setattr(cal, "gemm_terms", gemms)
        monkeypatch.setattr(cal, "fused_terms", fused_layers)
        monkeypatch.setattr(cpu_speed, "measure", lambda *a, **kw: 1e11)  # one speed: the terms reach the fit as timed

        class Stop(Exception):
            pass

        def stop(engine, base, obs, bounds=None):
            raise Stop(base)

        monkeypatch.setattr(cal, "fit_engine_terms", stop)
        with pytest.raises(Stop) as got:
            cal.calibrate(engine, quick=True, clock=time.perf_counter, batch=2, micro_batch=1, windows=1)
        base = got.value.args[0]
        expert_shapes = pieces.model_shapes(engine.spec)[1]
        assert (expert_shapes in timed) is not fused
        assert bool(layers) is fused and base.expert_chunk == (ffn.CHUNK_TOKENS if fused else 0)
        # the experts' terms are that kernel's, as it was timed (the second timing: the first is the dense GEMMs')
        assert (base.expert_flop_s, base.expert_weight_s, base.expert_call_s) == terms[1][:3]
        assert base.expert_call_s + base.expert_flop_s + base.expert_weight_s > 0
        engine.close()
    finally:
        ffn._build.cache_clear()
        ffn._build_avx2.cache_clear()
