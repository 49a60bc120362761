"""The calibrated CPU cost model: fitted from the engine's own kernels and steps, cached per machine,
used by the planner for CPU-only plans, and predicted-vs-measured exposed for the app (Tracker)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from core.plan import cpu_cost, hrm
from core.plan.cpu_cost import CpuCosts
from core.plan.tracking import Tracker
from core.runtime import calibrate as cal
from core.runtime import calibrate_pieces as pieces
from core.telemetry import RequestDone, StepDone
from test_plan_cli import no_gpu  # noqa: F401 - the fixture: no NVML, an isolated cache dir

COSTS = CpuCosts(math="float32", flop_s=1e-11, weight_s=2e-10, call_s=3e-6, expert_flop_s=2e-11,
                 expert_weight_s=4e-10, expert_call_s=5e-6, elem_s=1e-9, kv_s=3e-11, kv_copy_s=7e-11, attn_row_s=1e-7,
                 sdpa_flop_s=2e-11, task_s=5e-5, prompt_s=2e-5, step_s=3e-4, seq_s=1e-6)


def test_fit_recovers_coefficients_and_keeps_them_non_negative():
    truth = [2.0, 0.5, 3.0]
    rows = [[x, x * x % 7 + 1, 1.0] for x in range(1, 12)]
    y = [sum(c * f for c, f in zip(truth, r)) for r in rows]
    assert pieces.fit(rows, y) == pytest.approx(truth, rel=1e-6)
    # data that a negative coefficient would fit better: it is dropped, the others refit
    y2 = [r[0] * 2.0 for r in rows]
    got = pieces.fit([[r[0], r[1], -r[1]] for r in rows], y2)
    assert min(got) >= 0 and got[0] == pytest.approx(2.0, rel=1e-6)


def test_a_coefficients_feature_is_the_cost_function_at_one():
    """The fit's features and the prediction are the same functions: cost = Σ coefficient × feature."""
    from core.plan.presets import resolve_spec

    d = hrm.dims(resolve_spec("mixtral-8x7b"))
    fn = lambda c: sum(cpu_cost.decode_tasks(d, c, micro_batch=24, expert_batch=48, context=300).values())  # noqa: E731
    names = [f.name for f in dataclasses.fields(CpuCosts) if f.type == "float" and f.name not in cpu_cost.EFFICIENCIES]
    assert fn(COSTS) == pytest.approx(sum(getattr(COSTS, n) * pieces._feature(fn, COSTS, n) for n in names), rel=1e-9)


def test_gemm_cost_is_affine_in_rows_and_gemv_experts_follow_the_routing_odds():
    from core.plan.presets import resolve_spec

    c = dataclasses.replace(COSTS, direct_rows=2, gemv_s=1e-10)
    assert c.gemm(64, 100, 10) - c.gemm(32, 100, 10) == pytest.approx(c.flop_s * 2 * 32 * 100 * 10)
    assert c.gemv(100, 10, 2) == pytest.approx(2 * (c.gemv_s * 1000 + c.expert_call_s))
    d = hrm.dims(resolve_spec("mixtral-8x7b"))  # 8 experts, top-2: p = 1/4 per token and expert
    few_e, few_rows = cpu_cost._direct(d, 4, 2)
    assert few_e == pytest.approx(8 * (4 * 0.25 * 0.75 ** 3 + 6 * 0.25 ** 2 * 0.75 ** 2))  # 1 or 2 of 4 tokens
    assert few_rows == pytest.approx(8 * (4 * 0.25 * 0.75 ** 3 + 2 * 6 * 0.25 ** 2 * 0.75 ** 2))
    assert cpu_cost._direct(d, 4, 0) == (0.0, 0.0)
    # one token: every touched expert is a GEMV
    assert cpu_cost.experts_seconds(d, c, 1) == pytest.approx(
        c.gemv(2 * d.I, d.D, 2) + c.gemv(d.D, d.I, 2) + c.elem_s * 2 * (3 * d.D + 3 * d.I))


def test_calibrations_are_cached_per_machine_and_picked_per_model(no_gpu, monkeypatch):
    from core.plan import hardware
    from core.plan.presets import resolve_spec

    monkeypatch.setattr(hardware, "_measure", lambda hw, s: {"cpu_flops": 1e11, "cpu_bw": 2e10, "cpu_isa": "avx2",
                                                            "cpu_matmul": {"float32": 1e11, "bfloat16": 1e10}})
    small, big = resolve_spec("olmoe-1b-7b"), resolve_spec("mixtral-8x7b")
    hw = hardware.probe()
    assert not hrm.effective_rates(hw, "bfloat16", big).cpu_costs.measured  # never calibrated: the defaults
    for spec, flop_s in ((small, 1e-11), (big, 2e-11)):
        d = hrm.dims(spec)
        cpu_cost.save(hw, dataclasses.replace(COSTS, flop_s=flop_s, model=cpu_cost.model_key(d),
                                              model_bytes=spec.total_bytes))
    hw = hardware.probe()  # the cache answers, with the calibration attached
    assert set(hw.cpu_costs["float32"]) == {cpu_cost.model_key(hrm.dims(small)), cpu_cost.model_key(hrm.dims(big))}
    # bf16 weights on an AVX2 machine compute in fp32: the fp32 calibration of that model, or the nearest
    assert hrm.effective_rates(hw, "bfloat16", big).cpu_costs.flop_s == 2e-11
    assert hrm.effective_rates(hw, "bfloat16", small).cpu_costs.flop_s == 1e-11
    qwen = resolve_spec("qwen3-30b-a3b")  # ≈ 61 GB: nearer Mixtral's 93 GB than OLMoE's 14 GB
    assert hrm.effective_rates(hw, "bfloat16", qwen).cpu_costs.flop_s == 2e-11
    assert HardwareSpecRoundTrip(hw)


def HardwareSpecRoundTrip(hw) -> bool:
    from core.plan.hardware import HardwareSpec

    return HardwareSpec.from_json(hw.to_json()) == hw


def test_cpu_only_predictions_use_the_calibrated_costs(no_gpu, monkeypatch):
    from core.plan import hardware, planner
    from core.plan.policy import Policy
    from core.plan.presets import resolve_spec

    monkeypatch.setattr(hardware, "_measure", lambda hw, s: {"cpu_flops": 1e11, "cpu_bw": 2e10, "cpu_isa": "avx2"})
    spec = resolve_spec("olmoe-1b-7b")
    d = hrm.dims(spec)
    hw = hardware.probe()
    cpu_cost.save(hw, dataclasses.replace(COSTS, model=cpu_cost.model_key(d), model_bytes=spec.total_bytes))
    hw = hardware.probe()
    policy = Policy(batch_size=32, micro_batch_size=8, expert_batch_size=16, attention_on="cpu", ffn_on="cpu")
    work = planner.Workload(prompt_len=77, gen_len=32)
    pred = planner.predict(policy, spec, hw, work)
    # attention reads each cache row whole: longest prompt + generation
    tasks = cpu_cost.decode_tasks(d, COSTS, micro_batch=8, expert_batch=16, context=work.decode_context,
                                  row_tokens=work.longest_prompt + work.gen_len)
    layer = 4 * (tasks["pre_attn"] + tasks["cpu_attn"] + tasks["post_attn"]) + 2 * tasks["ffn"]
    step = spec.num_layers * layer + cpu_cost.head_seconds(d, COSTS, 32)
    assert pred.step_seconds == pytest.approx(step, rel=1e-9)
    assert pred.layer_seconds["cpu_attn"] == pytest.approx(4 * tasks["cpu_attn"], rel=1e-9)
    best, _ = planner.plan(spec, hw, work, planner.Budget(0, 200 * 10**9))
    assert best.ffn_on == "cpu" and best.batch_size > 1  # the planner picks the CPU batch from these costs


def test_an_uncalibrated_cpu_prediction_counts_the_engines_overheads(no_gpu, monkeypatch, demo_model):
    """Never calibrated, a CPU-only prediction is the probe's rates through the same cost model with the
    default shares and overheads (cpu_cost.defaults), not a bare roofline: the demo model's steps are
    mostly Python and dispatch, which the roofline plus 30 µs a task put at ~7x too fast."""
    from core.model.families import load_spec
    from core.plan import hardware, planner
    from core.plan.policy import Policy

    monkeypatch.setattr(hardware, "_measure", lambda hw, s: {"cpu_flops": 2e11, "cpu_bw": 7e10, "cpu_isa": "avx512_bf16",
                                                            "cpu_matmul": {"float32": 2e11, "bfloat16": 9e11}})
    spec = load_spec(demo_model)
    d = hrm.dims(spec)
    hw = hardware.probe()
    policy = Policy(batch_size=16, micro_batch_size=4, expert_batch_size=4, attention_on="cpu", ffn_on="cpu")
    work = planner.Workload(prompt_len=77, gen_len=32)
    pred = planner.predict(policy, spec, hw, work)
    costs = hrm.effective_rates(hw, spec.dtype, spec).cpu_costs
    assert costs == cpu_cost.defaults("float32", 2e11, 7e10, 4, 4)
    tasks = cpu_cost.decode_tasks(d, costs, micro_batch=4, expert_batch=4, context=work.decode_context,
                                  row_tokens=work.longest_prompt + work.gen_len)
    step = spec.num_layers * 4 * sum(tasks.values()) + cpu_cost.head_seconds(d, costs, 16)
    assert pred.step_seconds == pytest.approx(step, rel=1e-9)
    overhead = spec.num_layers * 16 * cpu_cost.DEFAULT_TASK + cpu_cost.DEFAULT_STEP
    assert pred.step_seconds > overhead > 0.5 * pred.step_seconds  # the demo's step is mostly overhead


def test_a_quick_calibration_cycles_through_little_memory_whatever_the_cache(demo_model, monkeypatch):
    """A full calibration's weights cycle through up to 8x the last-level cache so they come from RAM; a quick one
    (the tests') keeps to QUICK_COLD_BYTES: on a VM reporting a 480 MB L3 it made ~290,000 copies of the demo's
    router and took 49 s, most of CI's calibration tests' time."""
    from core.runtime.engine import Engine

    monkeypatch.setattr(cal, "llc_bytes", lambda: 480 << 20)
    seen = []
    monkeypatch.setattr(cal, "gemm_terms", lambda kernel, math, shapes, resident, *a: seen.append(resident)
                        or (1e-11, 1e-10, 1e-6, 0.0))
    monkeypatch.setattr(cal, "prefill_attention_terms", lambda *a: (1e-11, 0.0))
    engine = Engine.load(demo_model, threads=1)
    try:
        cal.kernel_costs(engine, quick=True)
        assert seen and max(seen) <= pieces.QUICK_COLD_BYTES
        seen.clear()
        monkeypatch.setattr(cal, "effective_cache_bytes", lambda reported: 64 << 20)  # as measured on that VM
        cal.kernel_costs(engine)
        assert max(seen) == 2 * (64 << 20)  # the demo is small: twice the cache a run can count on
    finally:
        engine.close()


def test_calibrate_on_the_demo_model_measures_every_term(demo_model):
    from core.runtime.engine import Engine

    engine = Engine.load(demo_model, threads=1)
    costs = cal.calibrate(engine, quick=True, clock=time.process_time, batch=4, micro_batch=2)
    assert costs.math == "float32" and costs.threads == 1 and costs.model == cpu_cost.model_key(hrm.dims(engine.spec))
    assert costs.flop_s > 0 and costs.expert_flop_s > 0 and costs.task_s > 0 and costs.step_s > 0
    # the fitted model explains fresh steps of the same shapes to within a factor of two (CPU time on a
    # shared machine still varies with what the neighbours do to the caches)
    obs = pieces.runner_observations(engine, batches=(4, 16), contexts=(32,), prefills=(), steps=3, clock=time.process_time)
    d, L = hrm.dims(engine.spec), engine.spec.num_layers
    predicted = sum(sum(pieces._layer_decode(d, costs, o)) * L for o in obs)
    assert 0.5 < predicted / sum(o.busy["gpu"] + o.busy["cpu_attn"] for o in obs) < 2.0, obs


def test_tracker_compares_predicted_and_measured_and_says_when_they_part():
    from core.plan.policy import Prediction

    pred = Prediction(tokens_per_s=90.0, decode_tokens_per_s=100.0, prefill_tokens_per_s=1e3, bottleneck="gpu",
                      gpu_bytes=0, cpu_bytes=1, layer_seconds={"gpu": 0.01, "cpu_attn": 0.002, "h2d": 0, "d2h": 0})
    t = Tracker(pred, num_layers=2)
    t(StepDone("prefill", 40, 0.5, {"gpu": 0.4}))
    assert t.comparison().error is None and "measuring" in t.comparison().message
    for _ in range(5):
        t(StepDone("decode", 10, 0.125, {"gpu": 0.1, "cpu_attn": 0.02}))  # 80 tokens/s: −20 %
    c = t.comparison()
    assert c.measured_decode_tokens_per_s == pytest.approx(80.0) and c.error == pytest.approx(-0.2)
    assert not c.parted and c.layer_seconds["gpu"] == (0.01, pytest.approx(0.05))  # 0.1 s over 2 layers
    for _ in range(10):
        t(StepDone("decode", 10, 0.5, {"gpu": 0.45}))  # now far slower
    t(RequestDone("r", 5, 16, 1.0, "length"))
    c = t.comparison()
    assert c.parted and c.error < -0.25 and "calibrate" in c.message
    assert c.measured_tokens_per_s == pytest.approx((150 + 1) / (0.5 + 5 * 0.125 + 10 * 0.5))


def test_mlight_bench_calibrate_caches_the_model_and_reports_the_error(no_gpu, monkeypatch, capsys, demo_model):
    from app.cli import main

    real = cal.calibrate
    monkeypatch.setattr(cal, "calibrate", lambda engine, **kw: real(engine, **{**kw, "quick": True}))
    assert main(["bench", "--model", str(demo_model), "--calibrate", "--requests", "4", "--gen-len", "6", "--batch",
                 "2", "--micro-batch", "1", "--threads", "1", "--clock", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads((no_gpu / "calibration").glob("*.json").__next__().read_text())["cpu"]["float32"]
    (run,) = report["runs"]
    assert run["schedule"] == "cpu" and run["predicted"]["calibrated"] and run["clock"] == "cpu"
    assert set(run["error"]) == {"tokens_per_s", "decode_tokens_per_s"} and report["calibration"]["costs"]["task_s"] > 0
    # its last stage ran the engine at the bench's batch and folded the run back
    ran = report["calibration"]["run"]
    assert report["calibration"]["costs"]["run_batch"] == [2, 1] and ran["steps"] > 2
    assert set(ran["factors"]) == set(cpu_cost.EFFICIENCIES) and all(v > 0 for v in ran["factors"].values())
    # its windows joined this machine's history; the factors are the history's median, the calibration's own beside
    hist = report["calibration"]["history"]
    assert hist["entries"] == hist["calibration_windows"] == (len(ran["windows"]) + len(ran["large"]["windows"])
                                                              + len(ran["mid"]["windows"]))
    assert hist["runs"] == 0 and ran["large"]["batch"] == [4, 4]  # and at a large micro-batch (quick: 4x the bench's)
    assert report["calibration"]["costs"]["large_rows"] == 4
    # and between the two: the large run's requests at their geometric middle
    assert ran["mid"]["batch"] == [4, 2] and report["calibration"]["costs"]["mid_rows"] == 2
    assert set(ran["mid"]["factors"]) == set(cpu_cost.MID.values()) and all(v > 0 for v in ran["mid"]["factors"].values())
    assert {"low", "high", "spread", "since"} <= set(hist) and report["calibration"]["this_calibration"]["task_s"] > 0
    assert run["predicted"]["history"]["entries"] == hist["entries"]
    assert run["predicted"]["tokens_per_s_last_calibration_alone"] > 0
    # every window and stage was stamped with the CPU's speed; the run was predicted at the speed measured before it
    assert {"run", "large", "mid", "pieces"} <= set(ran["speed"]["stamps"]) and ran["speed"]["reference"] > 0
    assert report["calibration"]["costs"]["speed"] == ran["speed"]["reference"]
    assert run["predicted"]["cpu_speed"]["calibrated"] == ran["speed"]["reference"]
    assert run["predicted"]["cpu_speed"]["now"] > 0
    # and the bench's own run was folded back: the next prediction stands on it too
    assert run["folded_back"]["runs"] == 1 and set(run["folded_back"]["ratios"]) == {"compute", "attention", "prefill"}
    assert main(["plan", "--model", str(demo_model), "--prompt-len", "20", "--gen-len", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["policy"]["ffn_on"] == "cpu" and plan["history"]["runs"] == 1
    assert main(["plan", "--model", str(demo_model), "--prompt-len", "20", "--gen-len", "8"]) == 0
    assert "this machine's runs spread ±" in capsys.readouterr().out


def test_mlight_run_on_a_cpu_lets_the_planner_pick_the_batch(no_gpu, monkeypatch, tmp_path, demo_model):
    """No GPU, no --batch: the batch is the planner's for this machine (here: every request at once)."""
    import argparse

    from app.commands import run
    from core.io.prompts import read_prompts
    from core.plan import hardware

    monkeypatch.setattr(hardware, "_measure", lambda hw, s: {"cpu_flops": 1e11, "cpu_bw": 2e10, "cpu_isa": "avx2"})
    monkeypatch.setattr(run, "_has_cuda", lambda: False)
    f = tmp_path / "p.txt"
    f.write_text("\n".join(f"prompt number {i}" for i in range(100)) + "\n", encoding="utf-8")
    args = argparse.Namespace(gpu_mem=None, cpu_mem=None, batch=None, micro_batch=None, executor=None, schedule=None,
                              max_new_tokens=8)
    run._plan_batches(args, read_prompts(str(f)), demo_model)
    assert args.batch == 100 and args.micro_batch and args.policy is None
    args = argparse.Namespace(**{**vars(args), "batch": 7, "micro_batch": None})
    run._plan_batches(args, read_prompts(str(f)), demo_model)
    assert args.batch == 7  # the user's batch stands


class CoarseClock:
    """The CPU clock as Windows has it: it says 100 ns but moves in whole ticks (2 ms here, 15.6 ms there)."""

    resolution = 1e-7

    def __init__(self, tick: float = 0.002):
        self.tick = tick

    def __call__(self) -> float:
        return (time.process_time() // self.tick) * self.tick


def test_a_coarse_clock_times_small_points_by_repeating_them():
    """Before: the small GEMMs timed as 0 s and `fit` divided by zero."""
    import torch

    clock = CoarseClock()
    kernel = (lambda w: w, lambda x, w: x @ w.T)
    got = pieces.gemm_terms(kernel, torch.float32, [(32, 32)], 0, rows=(1, 2, 4), clock=clock)
    assert all(0 <= v < float("inf") for v in got) and sum(got[:3]) > 0
    assert pieces.clock_tick(clock) >= 0.999 * clock.tick  # seen, not what the clock claims


def test_fit_refuses_times_of_zero_with_a_clear_error():
    from core.errors import MlightError

    with pytest.raises(MlightError, match="0 seconds.*--clock wall"):
        pieces.fit([[1.0, 1.0], [2.0, 1.0]], [1e-6, 0.0])


def test_attention_costs_the_path_the_kernel_takes():
    """Whole cache rows while the micro-batch's longest context is 0.6 of a row or more, else the sliced
    positions; a widening engine always slices (core.model.attention.slices)."""
    from core.plan.presets import resolve_spec

    d = hrm.dims(resolve_spec("mixtral-8x7b"))
    at = lambda c, longest: cpu_cost.attention_seconds(d, c, 8, 100, row_tokens=900, longest=longest)  # noqa: E731
    kv = lambda s, n: s * 8 * n * 2 * d.kv  # noqa: E731
    assert at(COSTS, 540) - at(dataclasses.replace(COSTS, kv_s=0.0), 540) == pytest.approx(kv(COSTS.kv_s, 900))
    assert at(COSTS, 539) - at(dataclasses.replace(COSTS, kv_copy_s=0.0), 539) == pytest.approx(kv(COSTS.kv_copy_s, 539))
    widened = dataclasses.replace(COSTS, widens=True)
    assert at(widened, 300) - at(dataclasses.replace(widened, kv_copy_s=0.0), 300) == pytest.approx(kv(COSTS.kv_copy_s, 300))


def test_the_workloads_spread_estimates_match_the_spread_the_bench_builds():
    """Mean squared prompt (prefill attention) and the longest of μ requests (decode attention's slices),
    estimated from mean and maximum, against the MT-Bench-like lengths core.io.workloads builds."""
    import random

    from core.io.workloads import target_lengths
    from core.plan.planner import Workload

    for mean, top in ((77, 418), (308, 1672)):
        ls = target_lengths(256, mean=mean, max_len=top)
        w = Workload(prompt_len=mean, gen_len=32, max_prompt_len=top)
        assert w.prompt_sq_mean == pytest.approx(sum(x * x for x in ls) / len(ls), rel=0.15)
        rng = random.Random(0)
        for mu in (4, 16):
            draws = [max(rng.sample(ls, mu)) for _ in range(2000)]
            assert w.micro_batch_context(mu) - 16 == pytest.approx(sum(draws) / len(draws), rel=0.2)
    flat = Workload(prompt_len=100, gen_len=10)
    assert flat.prompt_sq_mean == 100 * 100 and flat.micro_batch_context(8) == flat.decode_context


def test_prefill_shapes_include_many_short_prompts_and_each_is_the_median_of_repeats(demo_model):
    """Defect: each prefill shape was one call, and no shape had many short prompts: on a jittery VM the demo's
    per-prompt term fitted 0 and the attention term took its place (a run's prefill at 77-token prompts 1.1-1.4x its
    prediction, at 308 0.5-0.7x). Now shapes of 8 and 16 prompts too, each timed PREFILL_REPEATS times, the median kept."""
    from core.runtime.engine import Engine

    assert any(p >= 8 and n <= 64 for p, n in pieces.PREFILLS) and pieces.PREFILL_REPEATS >= 3
    engine = Engine.load(demo_model, threads=1)
    now = [0.0]
    durations = iter([0.0, 5.0, 1.0, 3.0])  # the warm-up call, then the three timed ones
    make = engine.runner

    def runner(*a, **kw):
        rn = make(*a, **kw)
        inner = rn.prefill

        def prefill(*pa, **pk):
            out = inner(*pa, **pk)
            now[0] += next(durations)
            return out

        rn.prefill = prefill
        return rn

    engine.runner = runner
    (obs,) = pieces.runner_observations(engine, batches=(), contexts=(), sliced=None, prefills=((3, 8),),
                                        clock=lambda: now[0], repeats=3)
    assert obs.kind == "prefill" and obs.b == 3 and obs.length == 8 and obs.wall == 3.0  # the median, not the last
