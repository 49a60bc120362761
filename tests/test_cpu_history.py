"""This machine's history of calibration windows and measured runs (core.plan.cpu_history, core.runtime.fold_back):
kept bounded beside the calibration, dropped with the code's fingerprint, the factors its median, a run's own
figures folded back. No timing is asserted: entries and runs are made from known costs."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest

from core.plan import cpu_cost, cpu_history, hrm
from core.runtime import fold_back as fb
from core.telemetry import RequestDone, StepDone
from test_cpu_calibration import COSTS
from test_plan_cli import no_gpu  # noqa: F401 - the fixture: no NVML, an isolated cache dir

TRUE = dict(pre_eff=1.2, attn_eff=1.6, post_eff=0.8, ffn_eff=1.1, prefill_eff=1.3)


def _spec():
    from core.plan.presets import resolve_spec

    return resolve_spec("olmoe-1b-7b")


def _machine(monkeypatch):
    from core.plan import hardware

    monkeypatch.setattr(hardware, "_measure", lambda hw, s: {"cpu_flops": 1e11, "cpu_bw": 2e10, "cpu_isa": "avx2"})
    return hardware.probe()


def _base(spec, **kw):
    return dataclasses.replace(COSTS, model=cpu_cost.model_key(hrm.dims(spec)), model_bytes=spec.total_bytes, **kw)


def _windows(d, base, scale=1.0, n=3, when=0.0):
    """A calibration's windows as entries: the machine ran every kind `scale` times TRUE's seconds."""
    return [cpu_history.entry(d, base, {k: v * scale for k, v in TRUE.items()}, "calibration", step_s=3e-4 * scale,
                              when=when + i) for i in range(n)]


def test_one_slow_calibration_or_run_is_outvoted_by_the_history():
    """Defect: the factors were one calibration's (the median of its own windows); one calibration in a slow
    minute (784M: every task kind 1.4-1.8x for 10-70 s) mispredicted every later run. Now the median over
    every window and run kept: a slow calibration after good ones, or slow runs, move the factors nothing."""
    spec = _spec()
    d, base = hrm.dims(spec), _base(spec)
    good = _windows(d, base) + _windows(d, base, when=10)
    slow = _windows(d, base, scale=1.5, when=20)  # a whole calibration in a slow minute
    got = cpu_history.apply(d, base, good + slow)
    for name, v in TRUE.items():
        assert getattr(got, name) == pytest.approx(v, rel=1e-9), name
    assert got.step_s == pytest.approx(3e-4) and got.run_windows == 9
    assert cpu_history.apply(d, base, slow).ffn_eff == pytest.approx(1.5 * TRUE["ffn_eff"])  # alone, it was believed
    # the machine's spread is said: a third of the entries 1.5x slower
    s = cpu_history.summary(good + slow)
    assert s["entries"] == 9 and s["calibration_windows"] == 9 and s["runs"] == 0
    assert s["low"] == pytest.approx(1 / 1.5 - 1) and s["high"] == pytest.approx(0.0) and s["spread"] > 0.3
    assert "±33%" in cpu_history.spread_words(s)


def test_entries_carry_over_between_calibrations_whose_pieces_differ():
    """A later calibration timed its GEMM pieces in a slower minute (every coefficient 2x) and its windows met the
    same machine as before (so their factors read half): the history's seconds turn into its own factors, and
    predictions with either calibration's coefficients are the same."""
    spec = _spec()
    d = hrm.dims(spec)
    a = _base(spec)
    slow_pieces = dataclasses.replace(a, **{f.name: 2 * getattr(a, f.name) for f in dataclasses.fields(CpuCosts)
                                            if f.type in ("float", float) and f.name not in cpu_cost.EFFICIENCIES})
    entries = _windows(d, a)
    got = cpu_history.apply(d, slow_pieces, entries)
    assert got.ffn_eff == pytest.approx(TRUE["ffn_eff"] / 2, rel=1e-9)
    kw = dict(micro_batch=8, expert_batch=16, context=300, row_tokens=512, longest=400)
    want = cpu_cost.decode_tasks(d, cpu_history.apply(d, a, entries), **kw)
    assert cpu_cost.decode_tasks(d, got, **kw) == pytest.approx(want, rel=1e-9)


CpuCosts = cpu_cost.CpuCosts


def test_the_history_is_kept_bounded_and_dropped_with_the_codes_fingerprint(no_gpu, monkeypatch):
    spec = _spec()
    d, base = hrm.dims(spec), _base(spec)
    hw = _machine(monkeypatch)
    costs, s = cpu_history.record(hw, d, base, _windows(d, base, n=cpu_history.HISTORY_MAX + 5), calibration=base)
    kept = cpu_history.load(hw, base.math, base.model)
    assert len(kept) == cpu_history.HISTORY_MAX == s["entries"]
    assert [e["time"] for e in kept] == [float(i) for i in range(5, cpu_history.HISTORY_MAX + 5)]  # the newest
    assert costs.ffn_eff == pytest.approx(TRUE["ffn_eff"]) and cpu_history.last_calibration(hw, base.math, base.model) == base
    from core.plan import hardware

    assert hardware.probe().cpu_costs["float32"][base.model]["ffn_eff"] == pytest.approx(TRUE["ffn_eff"])
    # another engine (a kernel changed, torch or mlight upgraded): its calibration and history are not this one's
    monkeypatch.setattr(cpu_cost, "code_fingerprint", lambda: "another-engine")
    assert cpu_cost.load(hw) == {} and cpu_history.load(hw, base.math, base.model) == []
    assert hardware.probe().cpu_costs == {} and cpu_history.stored(hw, d, "float32") is None
    costs, s = cpu_history.record(hw, d, base, _windows(d, base, n=2))
    assert s["entries"] == 2  # started afresh


def _run_events(spec, hw, policy, work, ratios, steps=12):
    """The events of a run whose compute, attention and prefill took `ratios` times what the planner predicts."""
    from core.plan.planner import predict

    p = predict(policy, spec, hw, work)
    L = spec.num_layers
    pre_tok = p.prefill_layer_seconds["gpu"] * L / (policy.batch_size * work.prompt_len)
    out = [StepDone("prefill", policy.batch_size * work.prompt_len, 1.0,
                    {"gpu": ratios["prefill"] * pre_tok * policy.batch_size * work.prompt_len})]
    for _ in range(steps):
        out.append(StepDone("decode", policy.batch_size, 0.1, {"gpu": ratios["compute"] * p.layer_seconds["gpu"] * L,
                                                                "cpu_attn": ratios["attention"] * p.layer_seconds["cpu_attn"] * L},
                            active=policy.batch_size))
    out += [RequestDone(str(i), work.prompt_len, work.gen_len, 1.0, "length") for i in range(policy.batch_size)]
    return out


def test_a_runs_own_measurements_are_folded_back(no_gpu, monkeypatch):
    """A CPU-only run's busy seconds, set beside the planner's prediction for its workload, become a history entry
    (its factors: the current ones times the run's ratios), and later predictions stand on it. A slow calibration
    is outvoted by the runs that follow it."""
    from core.plan import hardware
    from core.plan.planner import Workload

    spec = _spec()
    d = hrm.dims(spec)
    hw = _machine(monkeypatch)
    base = _base(spec)
    costs, _ = cpu_history.record(hw, d, base, _windows(d, base, scale=1.4))  # calibrated in a slow minute
    engine = SimpleNamespace(spec=spec, tp=None, cpu=SimpleNamespace(math="float32"), policy=None,
                             config=SimpleNamespace(device="cpu", ffn_on="cpu", attention_on="cpu", expert_group=1))
    policy, work = fb.cpu_policy(16, 4), Workload(prompt_len=77, gen_len=13, max_prompt_len=77, num_requests=16)
    truth = cpu_history.apply(d, base, _windows(d, base))  # the machine as it usually runs
    usual = dataclasses.replace(hw, cpu_costs={"float32": {base.model: truth.to_dict()}})
    scale = 1.4
    for i in range(4):  # runs at the machine's usual speed
        meter = fb.RunSums()
        for e in _run_events(spec, usual, policy, work, {"compute": 1.0, "attention": 1.0, "prefill": 1.0}):
            meter(e)
        got = fb.fold_back(engine, meter, 4, hw=hardware.probe())
        assert got["runs"] == i + 1 and got["ratios"]["compute"] == pytest.approx(1 / scale, rel=1e-6)
        entry = cpu_history.load(hw, "float32", base.model)[-1]
        for name, v in TRUE.items():  # the run's own factors are the machine's
            assert getattr(cpu_history.apply(d, base, [entry]), name) == pytest.approx(v, rel=1e-6), name
        costs = cpu_history.stored(hardware.probe(), d, "float32")[0]
        scale = costs.ffn_eff / TRUE["ffn_eff"]
    for name, v in TRUE.items():  # 4 runs against 3 slow windows: the median is the runs'
        assert getattr(costs, name) == pytest.approx(v, rel=1e-6), name
    last = cpu_history.load(hw, "float32", base.model)[-1]
    assert last["source"] == "run" and last["batch"] == [16, 4]
    # not folded: too short, quantized, on a GPU, or a model never calibrated here
    meter = fb.RunSums()
    for e in _run_events(spec, hw, policy, work, {"compute": 1, "attention": 1, "prefill": 1}, steps=3):
        meter(e)
    assert fb.fold_back(engine, meter, 4, hw=hw) is None
    meter = fb.RunSums()
    for e in _run_events(spec, hw, policy, work, {"compute": 1, "attention": 1, "prefill": 1}):
        meter(e)
    gpu = SimpleNamespace(**{**vars(engine), "config": SimpleNamespace(**{**vars(engine.config), "device": "cuda"})})
    assert fb.fold_back(gpu, meter, 4, hw=hw) is None
    other = SimpleNamespace(**{**vars(engine), "spec": __import__("core.plan.presets", fromlist=["x"]).resolve_spec("mixtral-8x7b")})
    assert fb.fold_back(other, meter, 4, hw=hw) is None
    assert len(cpu_history.load(hw, "float32", base.model)) == 7
    # folding runs after a finished run's results are saved: its failure costs the next prediction, not the run
    meter = fb.RunSums()
    for e in _run_events(spec, hw, policy, work, {"compute": 1, "attention": 1, "prefill": 1}):
        meter(e)
    for broken in (OSError("read-only cache"), ValueError("a damaged calibration file")):
        def refuse(*a, err=broken, **k):
            raise err
        monkeypatch.setattr(cpu_history, "record", refuse)
        assert fb.fold_back(engine, meter, 4, hw=hw) is None


def test_a_run_with_a_smaller_last_wave_is_folded_back_against_every_waves_prediction(no_gpu, monkeypatch):
    """Defect: a run's busy seconds a decode step (every wave's) were set beside a full wave's predicted step, so a
    run with a smaller last wave (whose steps cost less) folded factors back too low: the demo's 256 requests at
    204 read compute 0.90 and attention 0.72 of predicted where its full wave's tasks ran 1.0-1.2 of their prices."""
    from core.plan import hardware
    from core.plan.planner import Workload, predict

    spec = _spec()
    d = hrm.dims(spec)
    hw = _machine(monkeypatch)
    base = _base(spec)
    cpu_history.record(hw, d, base, _windows(d, base))
    hw = hardware.probe()
    engine = SimpleNamespace(spec=spec, tp=None, cpu=SimpleNamespace(math="float32"), policy=None,
                             config=SimpleNamespace(device="cpu", ffn_on="cpu", attention_on="cpu", expert_group=1))
    work = Workload(prompt_len=77, gen_len=13, max_prompt_len=418, num_requests=20)
    long, short = work.longest_first(16)
    # the run exactly as priced: a wave of the 16 longest at 16/4, then the 4 shortest in one micro-batch of 4
    waves = [(fb.cpu_policy(16, 4), long), (fb.cpu_policy(4, 4), short)]
    L = spec.num_layers
    meter = fb.RunSums()
    for policy, part in waves:
        p = predict(policy, spec, hw, part)
        meter(StepDone("prefill", policy.batch_size * part.prompt_len, 1.0, {"gpu": p.prefill_layer_seconds["gpu"] * L}))
        for _ in range(work.gen_len - 1):
            meter(StepDone("decode", policy.batch_size, 0.1, {"gpu": p.layer_seconds["gpu"] * L,
                                                              "cpu_attn": p.layer_seconds["cpu_attn"] * L},
                           active=policy.batch_size))
    lengths = [77] * 20
    lengths[0] = 418
    for i in range(1, 20):  # the mean stays 77
        lengths[i] -= (418 - 77) // 19 + (1 if i <= (418 - 77) % 19 else 0)
    assert sum(lengths) == 20 * 77
    for i, n in enumerate(lengths):
        meter(RequestDone(str(i), n, work.gen_len, 1.0, "length"))
    got = fb.fold_back(engine, meter, 4, hw=hw)
    for key in ("compute", "attention"):
        assert got["ratios"][key] == pytest.approx(1.0, rel=1e-6), key
    assert got["ratios"]["prefill"] == pytest.approx(1.0, rel=0.02)  # the parts' prompt tokens, rounded


def test_mlight_run_says_the_spread_and_folds_its_run_back(no_gpu, monkeypatch, capsys, tmp_path, demo_model):
    """`mlight run` on a calibrated CPU: the planned batch's prediction with this machine's spread, and the run's
    own figures join the history at its end (after the results are saved)."""
    from app.cli import main
    from app.commands import run
    from core.model.families import load_spec

    monkeypatch.setattr(run, "_has_cuda", lambda: False)
    spec = load_spec(demo_model)
    d = hrm.dims(spec)
    hw = _machine(monkeypatch)
    base = _base(spec)
    cpu_history.record(hw, d, base, _windows(d, base) + _windows(d, base, scale=1.2, when=5))
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"prompt number {i}" for i in range(6)) + "\n", encoding="utf-8")
    assert main(["run", "--model", str(demo_model), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                 "--max-new-tokens", "12", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"planned batch \d+: predicted [\d,.]+ tokens/s \(this machine's runs spread ±\d+% "
                     r"\(6 calibration windows, 0 runs\)\)", err), err
    kept = cpu_history.load(hw, "float32", base.model)
    assert len(kept) == 7 and kept[-1]["source"] == "run" and set(kept[-1]["seconds"]) == set(cpu_cost.EFFICIENCIES)


def test_prediction_error_reports_each_calibration_against_its_runs_median(tmp_path, capsys):
    """bench/prediction_error.py --summary: per calibration and workload, the prediction right after it (its first
    run's) and the calibration-alone one against the median of the runs after it, and those runs' own spread."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import prediction_error

    run = lambda m, p, alone: {"measured": m, "predicted": p, "predicted_alone": alone,  # noqa: E731
                               "history": {"calibration_windows": 6, "runs": 2}}
    rows = [{"model": "/m/mixtral-800m", "time": 0.0, "history": {},
             "workloads": {"77": [run(110.0, 100.0, 80.0), run(100.0, 104.0, 80.0), run(90.0, 101.0, 80.0)]}}]
    (tmp_path / "k.json").write_text(json.dumps(rows))
    assert prediction_error.main(["--summary", str(tmp_path / "k.json")]) == 0
    out = capsys.readouterr().out
    assert "| 00:00 | mixtral-800m | 77 | 6 windows, 2 runs | 100.0 | **+0.0%** | 80.0 | +25.0% | 100.0 (3) | -10.0% … +10.0% |" in out
    assert "mixtral-800m: 1 of 1 calibration-workloads within 10 %" in out
