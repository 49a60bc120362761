"""The run meter and the run-update messages: numbers from telemetry, and coalescing in the queue."""

from __future__ import annotations

from app.tui.messages import RunLog, RunUpdate, WorkProgress
from app.tui.meter import RunMeter, RunSnapshot
from core.telemetry import MemorySample, Progress, StepDone
from test_app_support import FrozenClock


def test_meter_folds_steps_into_throughput_busy_shares_memory_and_eta():
    clock = FrozenClock(100.0)
    m = RunMeter(total_requests=4, budget_tokens=40, gpu_budget=0, cpu_budget=8_000_000_000, clock=clock)
    m.on_event(Progress("loading weights", 2, 4, "layers"))
    assert m.snapshot().state == "loading" and m.snapshot().loading == "loading weights 2/4 layers"
    clock.t = 101.0
    m.on_event(StepDone("prefill", 200, 0.5, {"gpu": 0.4, "cpu_attn": 0.1}, active=4, cpu_mem_bytes=10**9))
    for _ in range(4):
        clock.t += 0.25
        m.on_event(StepDone("decode", 4, 0.25, {"gpu": 0.2, "cpu_attn": 0.05}, active=4))
    m.on_event(MemorySample(gpu_used=0, gpu_budget=0, cpu_used=2 * 10**9, cpu_budget=0))
    m.add_result(output_tokens=5, max_new_tokens=10)  # stopped early: its 5 unused tokens leave the ETA
    s = m.snapshot()
    assert s.state == "running"
    assert s.tokens_in == 200 and s.tokens_out == 16 + 1  # decode tokens + the finished one's first token
    assert s.current_tps == 16 / 1.5  # decode tokens over the wall time of the steps in the window
    assert s.history == (16.0, 16.0, 16.0, 16.0)
    assert abs(s.busy["gpu"] - (0.4 + 0.8) / 1.5) < 1e-9 and s.busy["h2d"] == 0.0
    assert s.cpu_used == 2 * 10**9 and s.cpu_budget == 8_000_000_000
    assert s.requests_done == 1 and s.requests_total == 4
    assert s.eta is not None and s.eta > 0
    m.set_state("done")
    assert m.snapshot().eta == 0.0


def test_run_updates_replace_each_other_but_logs_do_not():
    a, b = RunUpdate(RunSnapshot(requests_done=1)), RunUpdate(RunSnapshot(requests_done=2))
    assert a.can_replace(b) and b.can_replace(a)
    assert not RunLog("x").can_replace(RunLog("y"))
    assert not a.can_replace(RunLog("x"))
    assert WorkProgress("download", 1, 10).can_replace(WorkProgress("download", 2, 10))


def test_a_run_posts_few_updates_however_many_events(tmp_path, demo_model):
    """The worker folds every event but posts a RunUpdate at most every POST_EVERY_S (plus state changes)."""
    import shutil

    from app.tui.backend import PlanView
    from app.tui.messages import RunEnded
    from app.tui.runjob import RunJob
    from core.plan.hardware import preset
    from test_app_support import DEMO_PROMPTS, ScriptedBackend

    shutil.copy(DEMO_PROMPTS, tmp_path / "p.jsonl")
    b = ScriptedBackend(hardware=preset("t4"), clock=FrozenClock())
    machine = b.machine()
    model = b.open_model("demo", machine)
    prompts = b.read_prompts(tmp_path / "p.jsonl")
    plan: PlanView = b.plan(model, machine, prompts, None, None)
    posted = []
    job = RunJob(b, model, prompts, plan, tmp_path / "out.jsonl", posted.append)
    assert job.run() == "done"
    updates = [m for m in posted if isinstance(m, RunUpdate)]
    assert 26 + 16 > 10 >= len(updates)  # 26 telemetry events and 16 results, a handful of redraws
    assert isinstance(posted[-1], RunEnded) and posted[-1].snapshot.requests_done == 16
    assert (tmp_path / "out.jsonl").read_text(encoding="utf-8").count("\n") == 16
