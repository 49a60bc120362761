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
    assert [v for _, v in s.history] == [16.0, 16.0, 16.0, 16.0]  # decode tokens/s at each step
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


class _SteppingEngine:
    """Posts `steps` decode events, each `dt` seconds apart on `clock`, then one result per request."""

    context_length = 4096

    def __init__(self, steps: int, clock, dt: float):
        self.steps, self.clock, self.dt = steps, clock, dt

    def prompt_token_ids(self, req) -> list[int]:
        return [0] * 8

    def generate(self, requests, *, batch_size=None, micro_batch_size=None, on_event, should_stop=None):
        from core.runtime.engine import Result

        requests = list(requests)
        for _ in range(self.steps):
            self.clock.t += self.dt
            on_event(StepDone("decode", len(requests), self.dt, {"gpu": self.dt}, active=len(requests)))
        for r in requests:
            yield Result(r.id, r.prompt or "", "x", [1], 8, 1, "length", 0.0)


def _run_job(tmp_path, monkeypatch, steps: int, dt: float) -> list:
    """Run a RunJob over the 16 demo prompts with a stepping engine; the job's throttle reads `clock`."""
    import shutil
    import types

    from app.tui import runjob
    from app.tui.messages import RunEnded
    from core.plan.hardware import preset
    from test_app_support import DEMO_PROMPTS, ScriptedBackend

    clock = FrozenClock(0.0)
    monkeypatch.setattr(runjob, "time", types.SimpleNamespace(monotonic=clock))
    engine = _SteppingEngine(steps, clock, dt)

    class Backend(ScriptedBackend):
        def engine(self, path, policy=None, progress=lambda e: None, choices=None):
            return engine

    shutil.copy(DEMO_PROMPTS, tmp_path / "p.jsonl")
    b = Backend(hardware=preset("t4"), clock=FrozenClock())
    machine = b.machine()
    model = b.open_model("demo", machine)
    prompts = b.read_prompts(tmp_path / "p.jsonl")
    posted = []
    out = tmp_path / f"out-{steps}-{dt}.jsonl"
    job = runjob.RunJob(b, model, prompts, b.plan(model, machine, prompts, None, None), out, posted.append)
    assert job.run() == "done"
    assert isinstance(posted[-1], RunEnded) and posted[-1].snapshot.requests_done == 16
    assert out.read_text(encoding="utf-8").count("\n") == 16
    return [m.snapshot for m in posted if isinstance(m, RunUpdate)]


def test_a_run_posts_few_updates_however_many_events(tmp_path, monkeypatch, demo_model):
    """The worker folds every event into the meter but posts a RunUpdate only at a state change or when
    POST_EVERY_S has passed since the last one: the count follows time, not the number of events."""
    from app.tui.runjob import POST_EVERY_S

    few = _run_job(tmp_path, monkeypatch, steps=10, dt=0.0)
    many = _run_job(tmp_path, monkeypatch, steps=2000, dt=0.0)
    # no time passes: only the state changes post (loading, the store opened, running)
    assert 2 <= len(few) == len(many) <= 5
    assert {"loading", "running"} <= {s.state for s in many}
    # time passes: about one update per POST_EVERY_S, however many events fill it
    dt = POST_EVERY_S / 50
    slow = _run_job(tmp_path, monkeypatch, steps=500, dt=dt)  # 500 events over 10 intervals
    assert len(few) + 8 <= len(slow) <= len(few) + 12, (len(few), len(slow))
    # updates are cumulative: the newest posted during the steps has all but the last interval's tokens
    tokens = [s.tokens_out for s in slow]
    assert tokens == sorted(tokens) and tokens[-1] >= (500 - 50) * 16
