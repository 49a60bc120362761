"""The CPU cost model (core.plan.cpu_cost), its calibration (core.runtime.calibrate) and what a run records
(core.runtime.fold_back, core.plan.cpu_history): NNLS against a brute-force reference, coefficients recovered
from steps priced by the prediction's own functions, the band carried to the prediction, plans that stay."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from core.plan import cpu_cost, cpu_history, hrm
from core.plan.cpu_cost import CpuCosts
from core.plan.hardware import preset
from core.plan.planner import Workload, plan, predict
from core.plan.presets import preset_spec
from core.plan.tracking import MIN_DECODE_STEPS, Tracker
from core.runtime import calibrate as cal
from core.runtime import fold_back as fb
from core.telemetry import RequestDone, StepDone

CPU_ONLY = dataclasses.replace(preset("t4"), name="cpu-test", gpu_name=None, gpu_count=0)
SPEC = preset_spec("mixtral-8x7b")
TRUE = CpuCosts("float32", flop_s=2e-12, weight_s=1e-10, expert_flop_s=3e-12, expert_weight_s=2e-10,
                expert_call_s=4e-6, kv_s=4e-10, elem_s=1e-9, sdpa_flop_s=5e-12, prefill_tok_s=2e-6, task_s=5e-5,
                step_s=3e-4, wave_s=2e-3)


def brute_nnls(a, b):
    """The least-squares solution over every support whose unconstrained solution is non-negative."""
    A, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    best, best_r = None, float("inf")
    for keep in itertools.product([0, 1], repeat=A.shape[1]):
        idx = [i for i, k in enumerate(keep) if k]
        x = torch.zeros(A.shape[1], dtype=torch.float64)
        if idx:
            x[idx] = torch.linalg.lstsq(A[:, idx], y[:, None]).solution[:, 0]
        if (x >= -1e-12).all() and (r := float(torch.linalg.norm(A @ x - y))) < best_r - 1e-12:
            best, best_r = x, r
    return best.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_nnls_finds_the_best_non_negative_solution(seed):
    rng = random.Random(seed)
    a = [[rng.uniform(-1, 1) for _ in range(5)] for _ in range(12)]
    b = [rng.uniform(-1, 1) for _ in range(12)]
    got, want = cpu_cost.nnls(a, b), brute_nnls(a, b)
    assert min(got) >= 0
    assert got == pytest.approx(want, abs=1e-9)


def synthetic_steps(d, L: int, c: CpuCosts, rng: random.Random) -> list[cal.RunStep]:
    """Steps of a few shapes whose seconds are what the prediction's functions (not step_rows) price them at."""
    steps = []
    for n, mb, mean in ((8, 2, 77), (16, 8, 231), (32, 32, 77), (64, 16, 154)):
        lengths = [max(4, int(rng.lognormvariate(0, 0.6) * mean)) for _ in range(n)]
        groups = [lengths[i:i + mb] for i in range(0, n, mb)]
        pre = sum(cpu_cost.prefill_seconds(d, c, len(g), sum(g) / len(g), sum(x * x for x in g) / len(g))
                  for g in groups) * L
        steps.append(cal.RunStep("prefill", pre + cpu_cost.head_seconds(d, c, n) + c.wave_s, {"prefill": pre}, groups))
        for t in range(1, 6):
            groups = [[x + t for x in g] for g in groups]
            tasks: dict = {}
            for g in groups:
                for k, v in cpu_cost.decode_tasks(d, c, micro_batch=len(g), expert_batch=len(g),
                                                  context=sum(g) / len(g), lengths=g).items():
                    tasks[k] = tasks.get(k, 0.0) + v * L
            steps.append(cal.RunStep("decode", sum(tasks.values()) + cpu_cost.head_seconds(d, c, n), tasks, groups))
    return steps


def test_the_fit_recovers_what_the_steps_were_priced_at():
    d = hrm.dims(SPEC)
    steps = synthetic_steps(d, SPEC.num_layers, TRUE, random.Random(0))
    got = CpuCosts("float32", **dict(zip(cpu_cost.NAMES, cpu_cost.fit(
        [r for s in steps for r in cal.step_rows(d, SPEC.num_layers, s)]))))
    for name in ("flop_s", "expert_weight_s", "kv_s", "sdpa_flop_s", "task_s", "step_s", "wave_s"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=0.02), name
    # and a shape it never saw priced as the truth prices it
    kw = dict(micro_batch=24, expert_batch=48, context=500)
    assert cpu_cost.decode_tasks(d, got, **kw) == pytest.approx(cpu_cost.decode_tasks(d, TRUE, **kw), rel=0.01)
    assert cpu_cost.prefill_seconds(d, got, 12, 400) == pytest.approx(cpu_cost.prefill_seconds(d, TRUE, 12, 400),
                                                                      rel=0.01)


def test_the_band_is_the_largest_error_either_way_and_never_below_the_noise():
    assert cpu_cost.band_of([0.01, -0.02]) == cpu_cost.MIN_BAND
    assert cpu_cost.band_of([0.03, -0.14, 0.09]) == pytest.approx(0.14)


def calibrated(band: float = 0.12) -> tuple:
    """CPU_ONLY with TRUE stored as this machine's calibration of SPEC (the test's own cache folder)."""
    costs = dataclasses.replace(TRUE, band=band, model=cpu_cost.model_key(hrm.dims(SPEC)),
                                model_bytes=hrm.dims(SPEC).total_bytes, threads=2)
    cpu_cost.save(CPU_ONLY, costs, runs=[])
    return dataclasses.replace(CPU_ONLY, cpu_costs=cpu_cost.load(CPU_ONLY)), costs


def test_a_prediction_carries_the_calibrations_band_and_shows_it():
    hw, costs = calibrated(0.12)
    work = Workload(prompt_len=77, gen_len=32, num_requests=64)
    policy, p = plan(SPEC, hw, work)
    assert policy.ffn_on == "cpu" and p.band == 0.12
    assert p.quote() == f"≈ {p.tokens_per_s:,.0f} tok/s ± 12 %"
    assert "band" in p.to_dict() and p.to_dict()["tokens_per_s"] == p.tokens_per_s  # a key added, none renamed
    assert plan(SPEC, preset("t4"), work)[1].band == 0.0  # a GPU plan quotes no CPU band
    assert cpu_cost.load(CPU_ONLY)[costs.math][costs.model]["band"] == 0.12


def test_an_uncalibrated_machine_quotes_the_wide_default_band():
    p = plan(SPEC, CPU_ONLY, Workload(prompt_len=77, gen_len=32, num_requests=64))[1]
    assert p.band == cpu_cost.DEFAULT_BAND


@pytest.mark.parametrize("fmt, bits", [("Q8_0", 8.5), ("Q4_K/Q6_K", 5.0)])
def test_an_uncalibrated_gguf_expert_step_reads_the_files_bytes(fmt, bits):
    """The GGUF block kernels read an expert where it lies, at the file's bits: at one token, where the expert
    task is its weights' read, it costs the bf16 checkpoint's (native bf16 math) by the bytes' ratio, give or take the
    task's other work (its FLOPs, elementwise and dispatch: ≈ 3 % of the bf16 task)."""
    gguf = dataclasses.replace(SPEC, expert_format=fmt, expert_bits=bits)
    hw = dataclasses.replace(CPU_ONLY, cpu_isa="avx512_bf16")

    def ffn(spec):
        r = hrm.effective_rates(hw, spec.dtype, spec)
        assert r.cpu_costs.math == "bfloat16" and not r.cpu_costs.measured
        return hrm.decode_tasks(spec, r, batch=1, micro_batch=1, expert_batch=1, attention_on="cpu", ffn_on="cpu",
                                gpu_weight_fraction=0.0, gpu_kv_fraction=0.0, context=77)["ffn"].seconds

    assert ffn(gguf) / ffn(SPEC) == pytest.approx(bits / 16, abs=0.035)


def test_one_cache_record_per_machine_torch_and_kernels(monkeypatch):
    hw, costs = calibrated()
    path = cpu_cost.cache_path(hw)
    assert path.name.startswith(f"v{cpu_cost.VERSION}-") and cpu_cost.code_fingerprint() in path.name
    assert cpu_cost.pick(cpu_cost.load(hw)[costs.math], hrm.dims(SPEC)) == costs
    monkeypatch.setattr(cpu_cost, "code_fingerprint", lambda: "other-kernels")  # new kernels: not this record
    assert cpu_cost.load(hw) == {}
    monkeypatch.undo()
    path.write_text("{not json", encoding="utf-8")  # damaged: as never calibrated
    assert cpu_cost.load(hw) == {}


class FakeEngine:
    """What fold_back reads of an engine: a CPU-only, unquantized run of SPEC."""

    spec = SPEC
    config = type("C", (), {"device": "cpu", "ffn_on": "cpu", "attention_on": "cpu", "expert_group": 1})()


def a_run(tokens_per_s: float, batch: int = 32, steps: int = 12) -> fb.RunSums:
    meter = fb.RunSums()
    for _ in range(steps):
        meter(StepDone("decode", batch, batch / tokens_per_s, {"gpu": 0.5 * batch / tokens_per_s}, active=batch))
    for _ in range(batch):
        meter(RequestDone("x", prompt_tokens=77, output_tokens=steps + 1, seconds=1.0, finish_reason="length"))
    return meter


def test_a_plan_is_the_same_before_and_after_runs_are_recorded():
    hw, costs = calibrated(0.10)
    work, micro = Workload(prompt_len=77, gen_len=13, num_requests=32), 32
    first = plan(SPEC, hw, work)
    want = predict(fb.cpu_policy(32, micro), SPEC, hw, work).decode_tokens_per_s
    out = fb.fold_back(FakeEngine(), a_run(want * 0.7), micro, hw=hw)  # 30 % slow: outside the band of 10 %
    assert out["error"] == pytest.approx(-0.3, abs=0.02) and out["runs"] == 1
    hw2 = dataclasses.replace(CPU_ONLY, cpu_costs=cpu_cost.load(CPU_ONLY))
    again = plan(SPEC, hw2, work)
    assert again[0] == first[0]  # the same policy ...
    assert again[1].tokens_per_s == first[1].tokens_per_s  # ... and the same prediction: no coefficient moved
    assert again[1].band == pytest.approx(0.3, abs=0.02)  # only the band widened to the run it missed
    assert fb.fold_back(FakeEngine(), a_run(want, steps=MIN_DECODE_STEPS - 1), micro, hw=hw2) is None  # too short
    assert cpu_history.behind(hw2, SPEC)["runs"] == 1
    assert "1 run here read -30% to -30% of predicted" == cpu_history.spread_words(cpu_history.behind(hw2, SPEC))


def test_plans_are_a_pure_function_of_their_inputs():
    hw, _ = calibrated()
    work = Workload(prompt_len=100, gen_len=64, num_requests=200)
    assert plan(SPEC, hw, work) == plan(SPEC, hw, work)
    assert plan(SPEC, preset("t4"), work) == plan(SPEC, preset("t4"), work)


def test_the_tracker_parts_outside_the_predictions_band():
    hw, _ = calibrated(0.10)
    p = plan(SPEC, hw, Workload(prompt_len=77, gen_len=32, num_requests=32))[1]
    inside, outside = Tracker(p, SPEC.num_layers), Tracker(p, SPEC.num_layers)
    for t, rate in ((inside, 0.95), (outside, 0.8)):
        for _ in range(MIN_DECODE_STEPS):
            t(StepDone("decode", 32, 32 / (p.decode_tokens_per_s * rate), active=32))
    assert inside.comparison().error == pytest.approx(-0.05) and not inside.comparison().parted
    assert outside.comparison().parted and "mlight bench --calibrate" in outside.comparison().message


def test_calibration_fits_a_real_engine_and_its_band_covers_its_shapes(checkpoint_factory):
    """A tiny checkpoint's calibration: every coefficient non-negative, each shape's run within the band."""
    from core.io.workloads import build_prompts, target_lengths
    from core.runtime.engine import Engine

    engine = Engine.load(checkpoint_factory("mixtral"), device="cpu", threads=1)
    notes: dict = {}
    prompts = lambda n, mean: build_prompts(engine.tokenizer, target_lengths(n, mean=mean, max_len=2 * mean))  # noqa
    costs = cal.calibrate(engine, prompts, shapes=((4, 2, 12), (8, 8, 30)), notes=notes)
    assert costs.measured and min(costs.coefficients) >= 0 and costs.task_s > 0
    assert [s["requests"] for s in notes["shapes"]] == [4, 8, 8]  # the second shape again: the noise
    assert all(abs(s["error"]) <= costs.band for s in notes["shapes"]) and abs(notes["noise"]) <= costs.band
    assert costs.model == cpu_cost.model_key(hrm.dims(engine.spec))
