"""Measure this machine's CPU cost model (core.plan.cpu_cost): run the engine itself over a few shapes, time
every task and step, and fit the twelve coefficients to them at once (cpu_cost.fit).

The shapes (`SHAPES`) span what the planner chooses among — micro-batches of 2 to 64 requests, prompts of
MT-Bench's mean and three times it — so that each coefficient has rows that move it: GEMMs' rows against their
weights, attention's tokens against its rows, prefill's tokens against its attention. The run stops adding
shapes once it has taken `BUDGET_S` (a large model fits fewer), and each shape's steps are its rows: per task
kind the units its micro-batches did (cpu_cost.decode_units, prefill_units) against the seconds its tasks took,
and the step's span beyond its tasks against the head and the per-step terms.

`calibrate` returns the costs with their band: the largest relative error of a whole shape's run under the fit.
"""

from __future__ import annotations

import dataclasses
import time

from core.plan import cpu_cost, hrm
from core.plan.cpu_cost import CpuCosts
from core.telemetry import EventSink, Progress, StepDone, ignore

# (requests, micro-batch, mean prompt tokens) of each shape, each request to GEN tokens; smallest first
SHAPES = ((8, 2, 77), (16, 8, 231), (32, 32, 77), (64, 16, 231), (128, 64, 77))
GEN = 8
BUDGET_S = 45.0  # the shapes' runs, beside the warm-up: under a minute on two cores with the demo model


@dataclasses.dataclass
class RunStep:
    """One step of a run: its span (from the previous step's end), its tasks' seconds by kind, and per
    micro-batch each request's cached tokens after the step (decode) or prompt tokens (prefill)."""

    kind: str  # "decode" | "prefill"
    seconds: float
    tasks: dict
    groups: list


def run_steps(engine, prompts: list[str], *, batch: int, micro_batch: int, gen: int = GEN,
              clock=time.perf_counter) -> list[RunStep]:
    """Run `prompts` through `engine.generate` at `batch`/`micro_batch`, each to `gen` tokens, and time
    every step and its tasks by kind."""
    from core.runtime.engine import Request

    steps: list[RunStep] = []
    kinds: dict[str, float] = {}
    pending: dict = {}
    make = engine.runner

    def runner(slots, micro_batch_size, max_tokens, on_event=ignore):
        rn = make(slots, micro_batch_size, max_tokens, on_event)
        run, dec, pre = rn._run, rn.decode, rn.prefill

        def timed(task):
            t = clock()
            try:
                run(task)
            finally:
                kinds[task.kind] = kinds.get(task.kind, 0.0) + clock() - t

        def decode(tokens, slot_ids, positions):
            pending.update(kind="decode", groups=[[p + 1 for p in g] for g in positions])
            return dec(tokens, slot_ids, positions)

        def prefill(ps, slot_ids, mbs):
            pending.update(kind="prefill", groups=[[len(ps[i]) for i in g] for g in mbs])
            return pre(ps, slot_ids, mbs)

        rn._run, rn.decode, rn.prefill = timed, decode, prefill
        return rn

    last = [clock()]

    def sink(e):
        if isinstance(e, StepDone) and pending:
            now = clock()
            steps.append(RunStep(seconds=now - last[0], tasks=dict(kinds), **pending))
            last[0] = now
            kinds.clear(), pending.clear()

    reqs = [Request(id=str(i), prompt=p, max_new_tokens=gen) for i, p in enumerate(prompts)]
    eos, engine.eos_ids = engine.eos_ids, set()  # random weights may emit EOS early: every request runs to `gen`
    engine.runner = runner
    try:
        last[0] = clock()
        for _ in engine.generate(reqs, batch_size=batch, micro_batch_size=micro_batch, on_event=sink):
            pass
    finally:
        engine.eos_ids, engine.runner = eos, make
    return steps


def step_rows(d, L: int, s: RunStep, group: int = 1) -> list[tuple[list[float], float]]:
    """A step's (units, seconds) rows: one per task kind (all its tasks in the step), one for the rest of its
    span (the LM head and the per-step terms); `group`: micro-batches per expert batch."""
    rows: dict[str, dict] = {}
    tokens = sum(len(g) for g in s.groups)
    if s.kind == "decode":
        for j in range(0, len(s.groups), group):
            eb = sum(len(g) for g in s.groups[j:j + group])
            for g in s.groups[j:j + group]:
                for k, u in cpu_cost.decode_units(d, len(g), eb, sum(g)).items():
                    if k != "ffn" or g is s.groups[j]:  # one experts task per expert batch
                        rows[k] = cpu_cost._merge(rows.get(k, {}), {n: v * L for n, v in u.items()})
    else:
        for g in s.groups:
            u = cpu_cost.prefill_units(d, len(g), sum(g) / len(g), sum(x * x for x in g) / len(g))
            rows["prefill"] = cpu_cost._merge(rows.get("prefill", {}), {n: v * L for n, v in u.items()})
    rest = cpu_cost._merge(cpu_cost.head_units(d, tokens), {"step_s": 1.0, "wave_s": float(s.kind == "prefill")})
    out = [(cpu_cost.vec(u), s.tasks.get(k, 0.0)) for k, u in rows.items()]
    return out + [(cpu_cost.vec(rest), s.seconds - sum(s.tasks.values()))]


def shape_prompts(engine, n: int, mean: int, seed: int = 1) -> list[str]:
    """n MT-Bench-like prompts of `mean` tokens on average (a log-normal spread, within the context)."""
    from core.io.workloads import build_prompts, target_lengths

    cap = engine.context_length - GEN - 1
    return build_prompts(engine.tokenizer, target_lengths(n, mean=min(mean, cap), max_len=min(cap, mean * 418 // 77)),
                         seed=seed)


def calibrate(engine, *, progress: EventSink = ignore, clock=time.perf_counter, budget_s: float = BUDGET_S,
              shapes=SHAPES, notes: dict | None = None) -> CpuCosts:
    """This machine's CPU cost model for `engine`'s model, kernels and threads (see the module's doc)."""
    d, L = hrm.dims(engine.spec), engine.spec.num_layers
    group = max(1, getattr(engine.config, "expert_group", 1))
    run_steps(engine, shape_prompts(engine, 4, 77, seed=2), batch=4, micro_batch=2, clock=clock)  # warm-up
    runs, t0 = [], clock()
    for i, (n, mb, mean) in enumerate(shapes):
        if runs and clock() - t0 > budget_s:
            break
        progress(Progress("calibrating the CPU cost model", i, len(shapes), "shapes"))
        runs.append(((n, mb, mean), run_steps(engine, shape_prompts(engine, n, mean), batch=n, micro_batch=mb,
                                              clock=clock)))
    rows = [r for _, steps in runs for s in steps for r in step_rows(d, L, s, group)]
    coef = cpu_cost.fit(rows)
    costs = CpuCosts(math=engine.cpu.math, **dict(zip(cpu_cost.NAMES, coef)), threads=engine.threads.threads,
                     model=cpu_cost.model_key(d), model_bytes=d.total_bytes)
    errors = []
    for shape, steps in runs:  # each shape's whole run under the fit, as a prediction of it would be
        got = sum(s.seconds for s in steps)
        want = sum(cpu_cost.seconds(costs, u) for s in steps for u, _ in step_rows(d, L, s, group))
        errors.append(want / got - 1 if got > 0 else 0.0)
    costs = dataclasses.replace(costs, band=cpu_cost.band_of(errors))
    if notes is not None:
        notes.update(shapes=[{"requests": s[0], "micro_batch": s[1], "prompt_mean": s[2], "error": e,
                              "seconds": sum(x.seconds for x in st)} for (s, st), e in zip(runs, errors)],
                     rows=len(rows), seconds=clock() - t0)
    progress(Progress("calibrating the CPU cost model", len(shapes), len(shapes), "shapes"))
    return costs


class StepClock:
    """An event sink keeping an engine's StepDone events with `clock`'s seconds: the clock's time between
    consecutive events is the step's, and the busy seconds by resource are timed around every task (with the
    wall clock the executor's own). `spans[i]`: step i's seconds, the engine's work between steps included."""

    def __init__(self, engine, clock=time.perf_counter, forward: EventSink = ignore):
        self.clock, self.forward, self.busy = clock, forward, {}
        self.steps: list = []
        self.spans: list[float] = []
        self._last = clock()
        if clock is not time.perf_counter:
            make = engine.runner
            engine.runner = lambda *a, **kw: self._install(make(*a, **kw))

    def _install(self, runner):
        run = runner._run

        def timed(task):
            t = self.clock()
            try:
                run(task)
            finally:
                self.busy[task.resource] = self.busy.get(task.resource, 0.0) + self.clock() - t

        runner._run = timed
        return runner

    def __call__(self, e) -> None:
        if isinstance(e, StepDone):
            now = self.clock()
            if self.clock is not time.perf_counter:
                e = dataclasses.replace(e, seconds=now - self._last, busy=self.busy)
                self.busy = {}
            self.spans.append(now - self._last)
            self._last = now
            self.steps.append(e)
        self.forward(e)
