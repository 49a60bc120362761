"""The timeline each StepDone carries: when every task of the step started and ended, as the executor ran it.

The app draws the last decode step from it (lanes per resource, a bar per task). Checked on the real
engine with each executor: one span per task of the graph, every span inside the step, a resource
running one task at a time, no task starting before its dependencies ended, and the spans of a
resource adding up to the busy seconds the same event reports; and the process memory each step reports.
"""

from __future__ import annotations

import pytest

from core.runtime.engine import Engine, Request
from core.runtime.executors import SequentialExecutor, ThreadedExecutor
from core.telemetry import StepDone, task_spans

EPS = 1e-6  # perf_counter readings taken on different threads: allow for rounding, not for overlap


def _decode_steps(engine) -> list[tuple[StepDone, list]]:
    steps = []

    def sink(ev):
        if isinstance(ev, StepDone) and ev.kind == "decode":
            steps.append((ev, [(s.resource, s.kind, s.start, s.end) for s in task_spans(ev)]))  # copied now: the executor refills its buffer next step

    reqs = [Request(id=str(i), prompt="Tell me about the sea " * (i + 1), max_new_tokens=4) for i in range(4)]
    list(engine.generate(reqs, batch_size=4, micro_batch_size=2, on_event=sink))
    return steps


@pytest.mark.parametrize("executor,schedule", [("sequential", None), ("threaded", "cgopipe"), ("threaded", "s4"),
                                               ("cuda", "cgopipe")])  # the CUDA executor's events, emulated GPU
def test_every_task_of_a_decode_step_has_its_span(demo_model, executor, schedule):
    engine = Engine.load(demo_model, executor=executor, schedule=schedule, pages_per_layer=2,
                         resident_layers=0 if schedule else None, device="emulated" if executor == "cuda" else None)
    engine.eos_ids = set()
    try:
        steps = _decode_steps(engine)
    finally:
        engine.close()
    assert len(steps) == 3  # 4 new tokens: one from the prefill, three decode steps
    for ev, spans in steps:
        assert len(spans) == len(ev.tasks) > 0
        assert min(s[2] for s in spans) == 0.0
        assert max(s[3] for s in spans) <= ev.seconds + EPS  # inside the step's wall time
        by_task = dict(zip((t.id for t in ev.tasks), spans))
        for t, (resource, kind, start, end) in zip(ev.tasks, spans):
            assert (resource, kind) == (t.resource, t.kind) and start <= end
            for d in t.deps:
                assert by_task[d][3] <= start + EPS, f"{t.name} started before its dependency {d} ended"
        for r in {s[0] for s in spans}:
            mine = sorted((s[2], s[3]) for s in spans if s[0] == r)
            assert all(a[1] <= b[0] + EPS for a, b in zip(mine, mine[1:])), f"{r} ran two tasks at once"
            assert sum(e - s for s, e in mine) == pytest.approx(ev.busy[r], rel=1e-6, abs=1e-9)
    if schedule == "cgopipe":  # the point of the pipeline: copies and CPU attention overlap GPU work
        ev, spans = steps[-1]
        assert {s[0] for s in spans} == {"compute", "cpu_attn", "h2d", "d2h"}


@pytest.mark.parametrize("make", [SequentialExecutor, lambda: ThreadedExecutor(("a", "b"))])
def test_the_timing_buffer_is_reused_not_reallocated(make):
    """Timing costs the hot path no allocation: the same buffer, grown once, is refilled each step."""

    class T:
        def __init__(self, i, resource, deps=()):
            self.id, self.resource, self.deps, self.kind = i, resource, deps, "k"

    ex = make()
    try:
        graph = [T(0, "a"), T(1, "b", (0,)), T(2, "a", (1,))]
        ex.run(graph, lambda t: None)
        buf, first = ex.times, list(ex.times)
        ex.run(graph, lambda t: None)
        assert ex.times is buf and len(buf) == 6 and buf != first
        ex.run(graph[:2], lambda t: None)  # a smaller graph reuses the same buffer
        assert ex.times is buf and len(buf) == 6
    finally:
        ex.close()


def test_each_step_reports_this_process_resident_memory(demo_model):
    """The app's CPU memory bar reads StepDone.cpu_mem_bytes: the engine's process RSS at the step's end."""
    import psutil

    engine = Engine.load(demo_model)
    engine.eos_ids = set()
    steps = [ev for ev, _ in _decode_steps(engine)]
    rss = psutil.Process().memory_info().rss
    assert steps and all(0.5 * rss < ev.cpu_mem_bytes <= 2 * rss for ev in steps)
