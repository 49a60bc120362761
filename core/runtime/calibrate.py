"""This machine's CPU cost model (core.plan.cpu_cost), fitted to every step's task seconds of engine runs over
shapes spanning the planner's choices. The band: the largest relative error of a shape's run under the fit, or of
one shape run again (the noise).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from typing import NamedTuple

from core.plan import cpu_cost, hrm
from core.plan.cpu_cost import CpuCosts
from core.runtime.engine import Request
from core.telemetry import EventSink, Progress, StepDone, ignore

# (requests, micro-batch, mean prompt tokens) of each shape, each request to GEN tokens; smallest first
SHAPES = ((8, 2, 77), (16, 8, 231), (32, 32, 77), (64, 16, 154))
GEN = 8
BUDGET_S = 40.0  # the shapes' runs, beside the warm-up: under a minute on two cores with the demo model


class RunStep(NamedTuple):
    kind: str  # "decode" | "prefill"
    seconds: float  # from the previous step's end
    tasks: dict  # its tasks' seconds by kind
    groups: list  # per micro-batch, each request's cached tokens after the step (decode) or prompt tokens (prefill)


def run_steps(engine, prompts: list[str], *, batch: int, micro_batch: int, gen: int = GEN,
              clock=time.perf_counter) -> list[RunStep]:
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=gen) for i, p in enumerate(prompts)]
    eos, make, engine.eos_ids = engine.eos_ids, engine.runner, set()  # random weights may emit EOS early: none does
    sink = StepClock(engine, clock, by_kind=True)
    try:
        for _ in engine.generate(reqs, batch_size=batch, micro_batch_size=micro_batch, on_event=sink):
            pass
    finally:
        engine.eos_ids, engine.runner = eos, make
    return [RunStep(kind, span, kinds, groups)
            for (kind, groups), span, kinds in zip(sink.shapes, sink.spans, sink.kinds)]


def step_rows(d, L: int, s: RunStep, group: int = 1) -> list[tuple[list[float], float]]:
    """A step's (units, seconds) rows: one per task kind, one for the rest of its span (head, per-step terms)."""
    rows: dict[str, Counter] = defaultdict(Counter)
    for j in range(0, len(s.groups), group if s.kind == "decode" else 1):
        eb = sum(len(g) for g in s.groups[j:j + group])
        for g in s.groups[j:j + group] if s.kind == "decode" else [s.groups[j]]:
            units = (cpu_cost.decode_units(d, len(g), eb, sum(g)) if s.kind == "decode" else
                     {"prefill": cpu_cost.prefill_units(d, len(g), sum(g) / len(g), sum(x * x for x in g) / len(g))})
            for k, u in units.items():
                if k != "ffn" or g is s.groups[j]:  # one experts task per expert batch
                    rows[k] += u
    rest = cpu_cost.head_units(d, sum(map(len, s.groups))) + Counter(step_s=1.0, wave_s=float(s.kind == "prefill"))
    out = [([L * x for x in cpu_cost.vec(u)], s.tasks.get(k, 0.0)) for k, u in rows.items()]
    return out + [(cpu_cost.vec(rest), s.seconds - sum(s.tasks.values()))]


def calibrate(engine, prompts, *, progress: EventSink = ignore, clock=time.perf_counter, budget_s: float = BUDGET_S,
              shapes=SHAPES, notes: dict | None = None) -> CpuCosts:
    """`prompts(n, mean)`: n prompts of `mean` tokens on average (core.io.workloads makes them, above this package)."""
    d, L, group = hrm.dims(engine.spec), engine.spec.num_layers, max(1, getattr(engine.config, "expert_group", 1))

    def run(n, mb, mean):
        return (n, mb, mean), run_steps(engine, prompts(n, mean), batch=n, micro_batch=mb, clock=clock)

    run(4, 2, 77)  # warm-up
    runs, t0 = [], clock()
    for i, shape in enumerate(shapes):
        if runs and clock() - t0 > budget_s:
            break
        progress(Progress("calibrating the CPU cost model", i, len(shapes), "shapes"))
        runs.append(run(*shape))
    shape, first = runs[min(1, len(runs) - 1)]  # one shape again: the machine's own noise bounds the band
    runs.append(run(*shape))
    noise = sum(s.seconds for s in runs[-1][1]) / sum(s.seconds for s in first) - 1
    rows = [r for _, steps in runs for s in steps for r in step_rows(d, L, s, group)]
    fitted = dict(zip(cpu_cost.NAMES, cpu_cost.fit(rows)))
    errors = [sum(sum(a * b for a, b in zip(fitted.values(), u)) for s in steps for u, _ in step_rows(d, L, s, group))
              / sum(s.seconds for s in steps) - 1 for _, steps in runs]  # each shape's run under the fit
    costs = CpuCosts(math=engine.cpu.math, **fitted, band=cpu_cost.band_of(errors + [noise]), model_bytes=d.total_bytes,
                     threads=engine.threads.threads, model=cpu_cost.model_key(d))
    if notes is not None:
        notes.update(shapes=[{"requests": s[0], "micro_batch": s[1], "prompt_mean": s[2], "error": e,
                              "seconds": sum(x.seconds for x in st)} for (s, st), e in zip(runs, errors)],
                     noise=noise, rows=len(rows), seconds=clock() - t0)
    progress(Progress("calibrating the CPU cost model", len(shapes), len(shapes), "shapes"))
    return costs


class StepClock:
    """Keeps StepDone events with `clock`'s seconds; another clock, or `by_kind` (and RunStep `shapes`), times tasks."""

    def __init__(self, engine, clock=time.perf_counter, forward: EventSink = ignore, by_kind: bool = False):
        self.clock, self.forward, self.wall = clock, forward, clock is time.perf_counter
        self.steps, self.spans, self.kinds = [], [], []  # per step: its event, its span, its seconds by task kind
        self.busy, self.kind = {}, {}  # the step's so far: by resource, by task kind
        self.shapes: list | None = [] if by_kind else None
        if by_kind or not self.wall:
            make = engine.runner
            engine.runner = lambda *a, **kw: self._install(make(*a, **kw))
        self._last = clock()

    def _install(self, runner):
        run, decode, prefill, shapes = runner._run, runner.decode, runner.prefill, self.shapes

        def timed(task):
            t = self.clock()
            try:
                run(task)
            finally:
                dt = self.clock() - t
                self.busy[task.resource] = self.busy.get(task.resource, 0.0) + dt
                self.kind[task.kind] = self.kind.get(task.kind, 0.0) + dt

        runner._run = timed
        if shapes is not None:
            runner.decode = lambda tokens, slots, at: shapes.append(("decode", [[p + 1 for p in g] for g in at])) \
                or decode(tokens, slots, at)
            runner.prefill = lambda ps, slots, mbs: shapes.append(("prefill", [[len(ps[i]) for i in g] for g in mbs])) \
                or prefill(ps, slots, mbs)
        return runner

    def __call__(self, e) -> None:
        if isinstance(e, StepDone):
            now = self.clock()
            if not self.wall:
                e = dataclasses.replace(e, seconds=now - self._last, busy=self.busy)
            self.spans.append(now - self._last)
            self.kinds.append(self.kind)
            self._last, self.busy, self.kind = now, {}, {}
            self.steps.append(e)
        self.forward(e)
