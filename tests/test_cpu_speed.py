"""The CPU's speed now against when it was calibrated (core.plan.cpu_speed): a calibration's windows brought to the
speed its pieces were measured at, a prediction scaled to the speed measured where it is made, a run folded back
against its pieces at the speed it ran at. The probe itself is stubbed where a test needs a speed it can know."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from core.plan import cpu_cost, cpu_history, cpu_speed, hrm
from core.runtime import calibrate as cal
from core.runtime import fold_back as fb
from test_cpu_calibration import COSTS
from test_cpu_history import TRUE, _base, _machine, _run_events, _spec, _windows
from test_plan_cli import no_gpu  # noqa: F401 - the fixture: no NVML, an isolated cache dir

SPEED = 4e11  # FLOP/s the stub probe read while the calibration measured


def test_the_probe_measures_a_gemm_rate_on_the_threads_it_is_given():
    import torch

    before = torch.get_num_threads()
    rate = cpu_speed.measure("float32", threads=1, seconds=0.05)
    assert 1e8 < rate < 1e14 and torch.get_num_threads() == before
    assert cpu_speed.measure("no-such-dtype", seconds=0.0) > 0  # an unknown math name measures fp32


def test_a_process_first_probe_warms_up_before_it_times(monkeypatch):
    """A fresh process's first probe (per math and threads) runs the GEMM WARM_S untimed first — one in six read
    half the rate of the next two on a 2-core VM — and later probes do not spend that again."""
    monkeypatch.setattr(cpu_speed, "_warmed", set())
    now = [0.0]

    def clock():  # every reading advances 1 ms: a call's time is the readings around it
        now[0] += 1e-3
        return now[0]

    cpu_speed.measure("float32", threads=1, seconds=0.01, clock=clock)
    first = now[0]
    now[0] = 0.0
    cpu_speed.measure("float32", threads=1, seconds=0.01, clock=clock)
    assert first >= cpu_speed.WARM_S + 0.01 and now[0] < 0.05 < cpu_speed.WARM_S  # 0.01 s timed, no warm-up
    now[0] = 0.0
    cpu_speed.measure("float32", threads=2, seconds=0.01, clock=clock)  # other threads: their own first probe
    assert now[0] >= cpu_speed.WARM_S


def test_a_prediction_follows_the_speed_the_cpu_runs_at_now(no_gpu, monkeypatch):
    """Defect: a calibration's seconds were used whenever a prediction was made; this VM's speed moves 15-20 % over
    tens of minutes, and the 784M's 4x-prompt runs after three of five calibrations ran 10-15 % slower than
    predicted. Now a prediction made while the probe reads the CPU 1.25x slower than at calibration is 1.25x slower,
    and the run's factors (ratios) are not scaled twice."""
    from core.plan import hardware
    from core.plan.planner import Workload, predict

    spec = _spec()
    d = hrm.dims(spec)
    hw = _machine(monkeypatch)
    base = _base(spec, speed=SPEED, threads=2)
    cpu_history.record(hw, d, base, _windows(d, base))
    policy, work = fb.cpu_policy(64, 16), Workload(prompt_len=77, gen_len=64, max_prompt_len=200, num_requests=64)
    seen = []

    def probe_at(rate):
        def probe(math, threads):
            seen.append((math, threads))
            return rate
        return probe

    same = hardware.probe(speed=probe_at(SPEED))
    slow = hardware.probe(speed=probe_at(SPEED / 1.25))
    assert seen == [("float32", 2)] * 2 and slow.cpu_speed == {"float32@2": SPEED / 1.25}
    at, later = predict(policy, spec, same, work), predict(policy, spec, slow, work)
    assert later.tokens_per_s == pytest.approx(at.tokens_per_s / 1.25, rel=1e-9)
    assert later.layer_seconds["gpu"] == pytest.approx(at.layer_seconds["gpu"] * 1.25, rel=1e-9)
    costs = hrm.effective_rates(slow, "float32", spec).cpu_costs
    assert costs.flop_s == pytest.approx(base.flop_s * 1.25) and costs.ffn_eff == pytest.approx(TRUE["ffn_eff"])
    # a calibration without a stamped speed is used as measured, and nothing is probed for it
    cpu_cost.write(hw, {})  # a fresh cache: the same calibration as before this change
    cpu_history.record(hw, d, _base(spec), _windows(d, _base(spec)))
    seen.clear()
    plain = hardware.probe(speed=probe_at(SPEED / 1.25))
    assert seen == [] and plain.cpu_speed == {}
    assert predict(policy, spec, plain, work).tokens_per_s == pytest.approx(at.tokens_per_s, rel=1e-9)


def test_costs_at_a_speed_scale_every_seconds_term_and_no_factor():
    c = dataclasses.replace(COSTS, speed=2e11, ffn_eff=1.3, prefill_eff_large=0.9, large_rows=256, fresh_s=1e-5)
    got = c.at_speed(1e11)  # half as fast: every seconds term twice
    for name in cpu_cost.SECONDS:
        assert getattr(got, name) == pytest.approx(2 * getattr(c, name), rel=1e-12), name
    assert got.speed == 1e11 and got.ffn_eff == 1.3 and got.prefill_eff_large == 0.9 and got.large_rows == 256
    assert {"flop_s", "prefill_tok_s", "step_s", "fresh_s", "kv_alloc_s"} <= set(cpu_cost.SECONDS)
    assert not set(cpu_cost.SECONDS) & {*cpu_cost.FACTORS, "speed"}
    assert COSTS.at_speed(1e11) is COSTS and c.at_speed(0.0) is c  # a speed unknown on either side: as measured


def test_back_to_back_stretches_share_their_boundary_probe():
    """A calibration's windows follow one another: the probe closing one opens the next (REUSE_S), so a window costs
    one probe, not two; after a gap (work between them) the next stretch probes afresh."""
    now, calls = [0.0], []

    def probe(math, threads, seconds):
        calls.append(now[0])
        return 1e11 * (1 + len(calls))

    st = cpu_speed.Stamps("float32", probe=probe, clock=lambda: now[0])

    def work(seconds):
        now[0] += seconds

    assert st.around("run", lambda: work(5.0)) == (None, 2.5e11)  # probes 2e11 then 3e11
    assert st.around("large", lambda: work(5.0)) == (None, 3.5e11)  # opens on the 3e11 that closed "run"
    assert len(calls) == 3
    work(cpu_speed.REUSE_S + 0.5)  # a stage between them, unstamped
    assert st.around("pieces", lambda: work(1.0)) == (None, 5.5e11) and len(calls) == 5
    assert st.rates == {"run": [2.5e11], "large": [3.5e11], "pieces": [5.5e11]} and st.mean("run", "large") == 3e11


def test_a_window_timed_in_a_fast_stretch_is_brought_to_the_pieces_speed():
    s = cal.RunStep("decode", 2.0, {"ffn": 1.0, "cpu_attn": 0.5}, [[10, 11]], 64, 2)
    got = cal.at_rate([s], rate=2e11, ref=1e11)[0]  # the box ran twice as fast as while the pieces were measured
    assert got.seconds == 4.0 and got.tasks == {"ffn": 2.0, "cpu_attn": 1.0} and got.groups == s.groups
    assert cal.at_rate([s], rate=0.0, ref=1e11) == [s]
    fresh = {"first": 3.0, "again": 1.0, "tokens": 100, "waves": [[dataclasses.asdict(s)]]}
    f = cal.fresh_at_rate(fresh, 1e11, 2e11)
    assert (f["first"], f["again"], f["tokens"]) == (1.5, 0.5, 100) and f["waves"][0][0]["tasks"]["ffn"] == 0.5


def test_a_calibration_stamps_every_window_and_stage(demo_model, monkeypatch):
    """Defect: one calibration measured its own minutes: the 784M's large windows in a stretch where the box ran
    15 % fast set a prefill factor no later run reached. Now each window and each stage of the pieces is stamped
    with the probe, the pieces' mean is the costs' speed, and every window reaches the fit at that speed."""
    from core.runtime.engine import Engine

    rates = iter([1e11, 3e11] * 100)  # a box that swings between two speeds, stamp to stamp
    monkeypatch.setattr(cpu_speed, "measure", lambda math, threads, seconds: next(rates))
    raw, fitted = [], {}
    lasting, fit = cal.lasting, cal.fit_run_windows
    monkeypatch.setattr(cal, "lasting", lambda *a, **k: raw.append(lasting(*a, **k)) or raw[-1])

    def capture(engine, base, windows, notes=None, **kw):
        fitted.update(windows=windows, **kw)
        return fit(engine, base, windows, notes, **kw)

    monkeypatch.setattr(cal, "fit_run_windows", capture)
    engine = Engine.load(demo_model, threads=1)
    notes: dict = {}
    costs = cal.calibrate(engine, quick=True, clock=time.process_time, batch=4, micro_batch=2, notes=notes)
    stamps = notes["speed"]["stamps"]
    assert set(stamps) == {"run", "large", "mid", "pieces"} and all(r == 2e11 for v in stamps.values() for r in v)
    assert costs.speed == notes["speed"]["reference"] == 2e11  # the mean of the pieces' stamps
    # every window reached the fit, scaled by its stamp over the reference (here: the same speed)
    got = fitted["windows"] + fitted["large"] + fitted["mid"]
    assert sorted(_seconds(w) for w in got) == pytest.approx(sorted(_seconds(w) for w in raw), rel=1e-12)


def test_a_calibration_whose_windows_ran_fast_gets_the_factors_of_the_pieces_speed(demo_model, monkeypatch):
    """The same as the box slowing down: windows stamped at 1.5x the pieces' speed reach the fit 1.5x as long."""
    from core.runtime.engine import Engine

    state = {"in": False}
    monkeypatch.setattr(cpu_speed, "REUSE_S", -1.0)  # each stretch its own two stamps: the fast one's both fast
    monkeypatch.setattr(cpu_speed, "measure", lambda math, threads, seconds: 1.5e11 if state["in"] else 1e11)
    around = cpu_speed.Stamps.around

    def stretch(self, name, fn):  # a window and its stamps in a fast stretch, the pieces not
        state["in"] = name != "pieces"
        try:
            return around(self, name, fn)
        finally:
            state["in"] = False

    monkeypatch.setattr(cpu_speed.Stamps, "around", stretch)
    raw, fitted = [], {}
    lasting, fit = cal.lasting, cal.fit_run_windows
    monkeypatch.setattr(cal, "lasting", lambda *a, **k: raw.append(lasting(*a, **k)) or raw[-1])
    monkeypatch.setattr(cal, "fit_run_windows", lambda e, b, w, n=None, **kw: fitted.update(w=w, **kw) or fit(e, b, w, n, **kw))
    engine = Engine.load(demo_model, threads=1)
    costs = cal.calibrate(engine, quick=True, clock=time.process_time, batch=4, micro_batch=2)
    assert costs.speed == 1e11
    got = fitted["w"] + fitted["large"] + fitted["mid"]
    assert sorted(_seconds(w) for w in got) == pytest.approx(sorted(1.5 * _seconds(w) for w in raw), rel=1e-12)
    assert len(raw) >= 5  # the small run's windows, the large and the mid ones


def _seconds(window) -> float:
    return sum(s.seconds + sum(s.tasks.values()) for s in window)


def test_a_run_is_folded_back_against_its_pieces_at_the_speed_it_ran_at(no_gpu, monkeypatch):
    """Defect (with the speed stamped): a run on a box 1.25x slower than at calibration would enter the history as
    factors 1.25x the machine's, and the next prediction, scaled to its own speed, would count the slowdown twice.
    Folded back at the speed measured now, the run's factors are the machine's."""
    from core.plan import hardware
    from core.plan.planner import Workload

    spec = _spec()
    d = hrm.dims(spec)
    hw = _machine(monkeypatch)
    base = _base(spec, speed=SPEED, threads=2)
    cpu_history.record(hw, d, base, _windows(d, base))
    engine = SimpleNamespace(spec=spec, tp=None, cpu=SimpleNamespace(math="float32"), policy=None,
                             config=SimpleNamespace(device="cpu", ffn_on="cpu", attention_on="cpu", expert_group=1))
    policy, work = fb.cpu_policy(16, 4), Workload(prompt_len=77, gen_len=13, max_prompt_len=77, num_requests=16)
    usual = hardware.probe(speed=lambda m, t: SPEED)
    meter = fb.RunSums()
    for e in _run_events(spec, usual, policy, work, {"compute": 1.25, "attention": 1.25, "prefill": 1.25}):
        meter(e)  # a run 1.25x slower than the calibration's speed predicts...
    monkeypatch.setattr(cpu_speed, "measure", lambda math, threads, seconds=0: SPEED / 1.25)
    got = fb.fold_back(engine, meter, 4)  # ...while the CPU runs 1.25x slower (measured at the fold)
    assert got["ratios"]["compute"] == pytest.approx(1.0, rel=1e-9)
    entry = cpu_history.load(hw, "float32", base.model)[-1]
    for name, v in TRUE.items():
        assert getattr(cpu_history.apply(d, base, [entry]), name) == pytest.approx(v, rel=1e-6), name


def test_the_drift_bench_divides_the_probe_out():
    """bench/cpu_speed_drift.py's summary: an engine whose seconds move exactly as the probe's rate does spreads
    alone and not at all times the rate (slope 1)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import cpu_speed_drift

    rows = [{"probe": p, "prefill": 3e12 / p, "decode": 0.5} for p in (6e11, 7e11, 8e11, 6.5e11) for _ in range(2)]
    prefill, decode = cpu_speed_drift.summary(rows, 2)[1:]
    assert "±0.0% times the probe's rate; slope on the probe 1.00" in prefill and "alone" in prefill
    assert "±0.0% alone" in decode and "slope on the probe 0.00" in decode


def test_the_probe_noise_bench_reads_a_box_that_moves_in_stretches_and_one_that_jitters():
    """bench/probe_noise.py's `follow`: on a trace whose speed changes in 20-second stretches a reading foretells the
    next seconds (slope near 1); on one that alternates fast and slow every half-second, nothing (slope near 0)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import probe_noise

    calls = lambda speed: [(i * 0.01, 0.01 / speed(i * 0.01)) for i in range(12000)]  # noqa: E731 - 120 s, 10 ms a call
    stretches = probe_noise.follow(calls(lambda t: 1.0 if int(t // 20) % 2 else 1.5), probe=1.5, run=2.0)
    jitter = probe_noise.follow(calls(lambda t: 1.0 if int(t // 0.5) % 2 else 1.5), probe=1.5, run=2.0)
    assert stretches["slope"] > 0.7 and stretches["corr"] > 0.7  # off only where a reading straddles a change
    assert abs(jitter.get("slope", 0.0)) < 0.2
    assert probe_noise.follow(calls(lambda t: 1.0)[:50], probe=1.5, run=2.0) == {"n": 0}
