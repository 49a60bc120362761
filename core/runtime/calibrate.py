"""Measure this machine's CPU cost model (core.plan.cpu_cost.CpuCosts): the pieces (core.runtime.calibrate_pieces:
GEMMs, the engine's runner, its step overhead), then a short run of the whole engine against them — how much
slower each kind of task runs inside a run than its pieces say (the `*_eff` factors), timed in several
windows spread over the calibration, each brought to the speed the CPU ran the pieces at (core.plan.cpu_speed).
`calibrate` does all of it; `mlight bench --calibrate` caches the result
per machine (core.plan.cpu_history).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from core.model.cpu.ffn import CHUNK_TOKENS
from core.platform import l2_bytes, llc_bytes
from core.plan import cpu_cost, cpu_history, cpu_speed, hrm
from core.plan.cpu_cost import CpuCosts
from core.runtime.calibrate_cache import effective_cache_bytes
from core.runtime.calibrate_fresh import fresh_first_wave
from core.runtime.calibrate_pieces import (ATTN_LENGTHS, COLD_FACTOR, LAYER_TOKENS, QUICK_COLD_BYTES, ROWS,
                                           engine_kernels, fit_engine_terms, fit_step_terms, fresh_prefills,
                                           fused_layers, fused_terms, gemm_terms, model_shapes, own_rows,
                                           plain_attention, prefill_attention_terms, runner_observations, sdpa_range)
from core.telemetry import EventSink, Progress, ignore

# ---- 4. a short run of the whole engine -------------------------------------------------------------------
# Timed apart, the pieces explain a run only so far: on two Zen 5 threads a run's decode tasks took 7-40 %
# longer than the coefficients fitted in stages 1-3 said for the very same steps (attention most, with its
# micro-batches' spread of lengths; experts least), so every calibrated prediction was optimistic. A short
# run at the batch the user runs measures that, per task kind, and folds it back (CpuCosts.*_eff).
RUN_PROMPT_MEANS = (77, 231)  # mean prompt tokens of the run's waves: MT-Bench's, and three times it
RUN_GEN = 16  # tokens each request of the run generates: one-time costs (fresh buffers) spread as in a run
# The run is timed in this many windows spread over the calibration (its start, after the GEMMs, its end) and
# each decode factor is their median. One window was one snapshot of a machine that moves: on a 2-core Zen 5
# VM the 784M Mixtral's decode ran 25-30 % slower for tens of seconds at a time (read bandwidth 45 against
# 68 GB/s), and a calibration whose only window fell in such a stretch predicted every later run 30 % slow
# (in a fast one, 20 % fast when the stretch came later); a median of three needs two of them to be unlucky.
RUN_WINDOWS = 3
# ... and while fewer than a majority of them have their decode within RUN_AGREE of the windows' median (the
# machine moved during the calibration), more, up to RUN_WINDOWS_MOST: the median then stands on a majority
RUN_AGREE, RUN_WINDOWS_MOST = 0.1, 5
# A window runs its waves again, up to RUN_REPEATS_MOST times, until it has lasted RUN_MIN_S: the demo model's
# two waves took 0.5-1.1 s, and five such windows of one calibration (2 Xeon threads) read decode factors
# 0.91-2.03 and prefill 0.40-0.94 — the VM's jitter, not the engine — so the median stood on whichever two
# windows were lucky, while a user's run of 256 requests lasts 2-13 s (bench/RESULTS.md, issue 11, eighth
# session). A model whose waves take longer (the 784M: tens of seconds) runs them once, as before.
RUN_MIN_S, RUN_REPEATS_MOST = 3.0, 8
# The same run at a large micro-batch too: a factor measured at 4 requests a micro-batch also scales the tasks'
# per-call overheads, which do not grow with the rows, so at the planner's micro-batches (16-256, prefill calls of
# tens of thousands of tokens) an overhead-bound model was mispriced: the demo's decode tasks at 256 took 0.4-0.6x
# what the factors measured at 4 said, its prefill in a fresh process 1.5-1.8x; the 784M's dense tasks 0.33-0.39x
# and its experts 1.13x (bench/RESULTS.md, issue 11, seventh session). At most LARGE_ROWS requests, one wave of
# MT-Bench's mean prompt, each to LARGE_GEN tokens, fewer while the first window says a window would take more
# than LARGE_WINDOW_S. Run right after the first window, and at once again to REPEAT_GEN tokens: a fresh process
# pays for its first large prefill call's memory once (the demo: 2.1 s for 256 prompts, 0.9 s the same call
# again), the repeat does not — CpuCosts.fresh_s, prefill_eff_large. Then once more after the GEMMs: decode's
# factors are the median of the three. Each lasts RUN_MIN_S as the small run's windows do (its wave again): the
# demo's large windows took 0.8-1.6 s, and two calibrations' factors there differed by up to 2x (attention 0.23
# against 0.48), which moved the prediction at the planner's batch from +10 % to -28 % of the same runs.
LARGE_ROWS, LARGE_GEN, REPEAT_GEN, LARGE_WINDOW_S, LARGE_WINDOWS = 256, 8, 3, 60.0, 3
# And the large run's requests at a micro-batch between the two, the geometric middle (4 and 256: 32), in this many
# windows (one after the large ones, one after the GEMMs): between the two ends a factor did not move with the log of
# the rows — the demo's decode at 36 requests a micro-batch, the planner's pick for 256 requests, took 0.78-0.97x
# what the ends' factors said there (CpuCosts.mid_rows)
MID_WINDOWS = 2


@dataclasses.dataclass
class RunStep:
    """One step of a run, by `clock`: its tasks' seconds by kind, its whole span (from the previous step's
    end: the engine's work between steps included) and what it held."""

    kind: str  # "decode" | "prefill"
    seconds: float
    tasks: dict  # task kind -> seconds
    groups: list  # per micro-batch: each request's cached tokens after the step (decode) / prompt tokens (prefill)
    row: int  # tokens a cache row holds
    slots: int


def run_lengths(n: int, mean: float, longest: int, sigma: float | None = None) -> list[int]:
    """n prompt lengths spread log-normally about `mean` as the planner assumes MT-Bench's are
    (core.plan.planner.SPREAD_SIGMA), at evenly spaced quantiles, within [4, longest]."""
    from statistics import NormalDist

    from core.plan.planner import SPREAD_SIGMA

    s = SPREAD_SIGMA if sigma is None else sigma
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    return [min(longest, max(4, round(mean * math.exp(s * x - s * s / 2)))) for x in z]


def run_steps(engine, prompts: list[str], *, batch: int, micro_batch: int, gen: int = RUN_GEN,
              clock=time.perf_counter, progress: EventSink = ignore, what: str = "a short run") -> list[RunStep]:
    """Run `prompts` through `engine.generate` at `batch`/`micro_batch`, each to `gen` tokens, and time
    every step (its span and its tasks by kind) with what it held."""
    from core.runtime.engine import Request
    from core.telemetry import StepDone

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
                dt = clock() - t
                kinds[task.kind] = kinds.get(task.kind, 0.0) + dt

        def decode(tokens, slot_ids, positions):
            pending.update(kind="decode", groups=[[p + 1 for p in g] for g in positions], row=max_tokens, slots=slots)
            return dec(tokens, slot_ids, positions)

        def prefill(ps, slot_ids, mbs):
            pending.update(kind="prefill", groups=[[len(ps[i]) for i in g] for g in mbs], row=max_tokens, slots=slots)
            return pre(ps, slot_ids, mbs)

        rn._run, rn.decode, rn.prefill = timed, decode, prefill
        return rn

    last = [clock()]
    total = len(prompts) // max(1, batch) * gen + 1

    def sink(e):
        if isinstance(e, StepDone):
            now = clock()
            steps.append(RunStep(seconds=now - last[0], tasks=dict(kinds), **pending))
            last[0] = now
            kinds.clear(), pending.clear()
            progress(Progress(f"calibrating: {what}", min(len(steps), total), total, "steps"))

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


def lasting(run, min_s: float = RUN_MIN_S, most: int = RUN_REPEATS_MOST) -> list[RunStep]:
    """`run()`'s steps, run again and joined (one window) until they last `min_s` seconds or it ran `most` times."""
    steps = run()
    for _ in range(most - 1):
        if sum(s.seconds for s in steps) >= min_s:
            break
        steps += run()
    return steps


def _text(tok, ids: list[int], most: int) -> str:
    """A prompt of about these tokens (decoded text re-tokenizes a little differently), at most `most`."""
    text = tok.decode(ids)
    again = tok(text).input_ids
    return text if len(again) <= most else tok.decode(again[:most])


def step_model(d, L: int, c: CpuCosts, s: RunStep, group: int = 1) -> dict[str, float]:
    """What `c` says the tasks of a run's step cost, by kind, for the step's own micro-batches and lengths
    (`group`: micro-batches per expert batch)."""
    out: dict[str, float] = {}
    if s.kind == "decode":
        read = sum(len(g) * cpu_cost.read_tokens(c, sum(g) / len(g), s.row, max(g)) for g in s.groups)
        cc = c.for_step(read * d.kv_tok)
        for j in range(0, len(s.groups), group):
            eb = sum(len(g) for g in s.groups[j:j + group])
            for g in s.groups[j:j + group]:
                t = cpu_cost.decode_tasks(d, cc, micro_batch=len(g), expert_batch=eb, context=sum(g) / len(g),
                                          row_tokens=s.row, longest=max(g), lengths=g)
                for k, v in t.items():
                    if k != "ffn" or g is s.groups[j]:  # one experts task per expert batch
                        out[k] = out.get(k, 0.0) + v * L
        return out
    for g in s.groups:
        n, mean = len(g), sum(g) / len(g)
        cc = c.for_step(sum(g) * d.kv_tok)
        out["prefill"] = out.get("prefill", 0.0) + cpu_cost.prefill_seconds(d, cc, n, mean, sum(x * x for x in g) / n) * L
    return out


DECODE_EFF = cpu_history.DECODE_EFF


def first_decodes(steps: list[RunStep]) -> set[int]:
    """The indices of each wave's first decode step (the one right after a prefill), where a window has steadier
    decode steps too. That step pays what a wave's first decode does once: on the demo at 256 rows 1.18x the
    attention and 1.22x the experts of the steps after it in a warm process (2.4x and 3.3x in a process that met
    that size first, timing its experts), the 784M's +4 %. A calibration's large windows have 7 decode steps where
    a user's run of 32 tokens has 31: counted in the factors, it weighed a seventh of the windows' decode and was
    priced into every step of a run (bench/RESULTS.md, issue 11, twenty-third session)."""
    first = {i for i, s in enumerate(steps) if s.kind == "decode" and i and steps[i - 1].kind == "prefill"}
    decodes = sum(s.kind == "decode" for s in steps)
    return first if decodes > len(first) else set()


def fit_run_terms(engine, base: CpuCosts, steps: list[RunStep], notes: dict | None = None) -> CpuCosts:
    """The run's efficiency factors and per-step overhead: per task kind (decode's four, prefill), the
    seconds its tasks took over what `base` says for the same steps (decode's: the steps after each wave's
    first, first_decodes); step_s from those decode steps' spans beyond their tasks and head (the median step);
    wave_s from the prefill steps' spans beyond theirs, with what the first decode steps took beyond the next."""
    d, L = hrm.dims(engine.spec), engine.spec.num_layers
    group = max(1, getattr(engine.config, "expert_group", 1))
    base = base.unscaled()
    kinds = {**DECODE_EFF, "prefill": "prefill_eff"}
    model = {k: 0.0 for k in kinds}
    measured = dict(model)
    first = first_decodes(steps)
    for i, s in enumerate(steps):
        if i in first:  # a wave's first decode step: wave_s's (below), not the steady steps' factors
            continue
        for k, v in step_model(d, L, base, s, group).items():
            model[k] += v
        for k in kinds:
            measured[k] += s.tasks.get(k, 0.0)
    costs = dataclasses.replace(base, **{kinds[k]: measured[k] / model[k] for k in kinds
                                         if model[k] > 0 and measured[k] > 0})
    head0 = dataclasses.replace(costs, step_s=0.0, seq_s=0.0)
    dec = [s for i, s in enumerate(steps) if s.kind == "decode" and i not in first]
    over = sorted(s.seconds - sum(s.tasks.values()) - cpu_cost.head_seconds(d, head0, sum(len(g) for g in s.groups))
                  - costs.seq_s * sum(len(g) for g in s.groups) for s in dec)
    if over:
        costs = dataclasses.replace(costs, step_s=max(0.0, over[len(over) // 2]))
    # a prefill step's span beyond its tasks, head and step_s: admitting a wave (the runner and its cache
    # made, prompts tokenized; the first in a process faults in its buffers). The mean: a run has few waves.
    waves = [s.seconds - sum(s.tasks.values()) - cpu_cost.head_seconds(d, costs, sum(len(g) for g in s.groups))
             for s in steps if s.kind == "prefill"]
    if waves and first:  # and what each wave's first decode step took beyond the step after it
        waves = [w + sum(max(0.0, steps[i].seconds - steps[i + 1].seconds) for i in first
                         if i + 1 < len(steps) and steps[i + 1].kind == "decode") / len(waves) for w in waves]
    if waves:
        costs = dataclasses.replace(costs, wave_s=max(0.0, sum(waves) / len(waves)))
    if steps:
        costs = dataclasses.replace(costs, run_batch=(steps[0].slots, max(len(g) for g in steps[0].groups)))
    if notes is not None:
        notes.update(tasks={k: {"run": measured[k], "pieces": model[k]} for k in kinds},
                     step_s={"run": costs.step_s, "pieces": base.step_s}, wave_s=costs.wave_s, steps=len(steps),
                     seconds=sum(s.seconds for s in steps), factors={n: getattr(costs, n) for n in cpu_cost.EFFICIENCIES},
                     tokens=sum(len(g) for s in steps for g in s.groups))  # a token per request a step
    return costs


def fit_run_windows(engine, base: CpuCosts, windows: list[list[RunStep]], notes: dict | None = None,
                    large: list[list[RunStep]] = (), fresh: dict | None = None,
                    mid: list[list[RunStep]] = ()) -> CpuCosts:
    """fit_run_terms over several windows of the same run: each decode factor and step_s the median of the
    windows', prefill_eff and wave_s the first window's. The first window runs first in its process, as a
    user's run does: its prefill faults in the fresh buffers the later windows reuse (its prefill factor
    read 1.0-1.5x the later windows' on the demo model and the 784M), and prefill, compute-bound, moved
    little with the machine's slow stretches (0.89-1.01 within one calibration). `large`: windows of the run
    at a large micro-batch — the *_eff_large factors — the first in a process fresh at that size, the second the
    same prompts at once again. `fresh` (calibrate_fresh.fresh_first_wave): the same prompts as the first waves of
    a fresh process; its waves' steps (`fresh["waves"]`) are large windows too. Decode's *_eff_large: the median
    over all of them; prefill_eff_large: over the warm waves (the repeat's, the child's after its first: one warm
    wave alone moved the 784M's predicted prefill by a fifth between calibrations); fresh_s (CpuCosts): what the
    child's first wave's prefill took beyond its warm waves and their spread, a token of its call (fresh_beyond) —
    without a child, what the first window's first wave took beyond the repeat's waves (fresh_seconds). `mid`: windows
    of the run at a micro-batch between the two (a warm process's): the *_eff_mid factors, each the median over them."""
    from statistics import median

    if base.own_rows:
        base = run_call_cost(engine, base, windows)
    per = []
    fits = []
    for w in windows:
        n: dict = {}
        fits.append(fit_run_terms(engine, base, w, n))
        per.append(n)
    if not fits:
        return base
    pick = {name: median(getattr(f, name) for f in fits) for name in DECODE_EFF.values()}
    costs = dataclasses.replace(fits[0], **pick, step_s=median(f.step_s for f in fits), run_windows=len(fits))
    large = [w for w in large if w]
    child = [w for w in ([RunStep(**s) for s in wave] for wave in (fresh or {}).get("waves", [])) if w]
    nl = [{} for _ in large + child]
    big = [fit_run_terms(engine, base, w, n) for w, n in zip(large + child, nl)]
    # the windows whose prefill is a warm wave's, as a run's after its first: the in-process repeat, the child's
    # waves after its first (its first pays a fresh process's one-time cost: fresh_s)
    warm = ([1] if len(large) > 1 else [0] if large else []) + [len(large) + i for i in range(1, len(child))]
    if big:
        got = {cpu_cost.LARGE[name]: median(getattr(f, name) for f in big) for name in DECODE_EFF.values()}
        hot = [big[i].prefill_eff for i in warm]
        once = (fresh_beyond(fresh, hot) if fresh else fresh_seconds(large[0], large[1]) if len(large) > 1 else 0.0)
        costs = dataclasses.replace(costs, **got, prefill_eff_large=median(hot), large_rows=big[0].run_batch[1],
                                    fresh_s=once, kv_alloc_s=kv_alloc_seconds(hrm.dims(engine.spec), costs, big,
                                                                              large + child))
    mid = [w for w in mid if w]
    nm = [{} for _ in mid]
    between = [fit_run_terms(engine, base, w, n) for w, n in zip(mid, nm)]
    if between:
        costs = dataclasses.replace(costs, mid_rows=between[0].run_batch[1],
                                    **{cpu_cost.MID[name]: median(getattr(f, name) for f in between)
                                       for name in cpu_cost.EFFICIENCIES})
        if notes is not None:
            notes["mid"] = {"batch": list(between[0].run_batch),
                            "factors": {n: getattr(costs, n) for n in cpu_cost.MID.values()},
                            "windows": [{"factors": n["factors"], "seconds": n["seconds"],
                                         "tokens_per_s": n["tokens"] / n["seconds"] if n["seconds"] else 0.0}
                                        for n in nm]}
    if notes is not None and big:
        notes["large"] = {"batch": list(big[0].run_batch), "fresh_s": costs.fresh_s, "kv_alloc_s": costs.kv_alloc_s,
                          "fresh_process": fresh and {k: v for k, v in fresh.items() if k != "waves"},
                          "factors": {n: getattr(costs, n) for n in cpu_cost.LARGE.values()},
                          "windows": [{"factors": n["factors"], "seconds": n["seconds"], "prefill": i in warm,
                                       "fresh_process": i >= len(large),
                                       "tokens_per_s": n["tokens"] / n["seconds"] if n["seconds"] else 0.0}
                                      for i, n in enumerate(nl)]}
    if notes is not None:
        notes.update(per[0], windows=[{"factors": n["factors"], "step_s": f.step_s, "seconds": n["seconds"],
                                       "decode_task_seconds": decode_seconds(w),
                                       "tokens_per_s": n["tokens"] / n["seconds"] if n["seconds"] else 0.0}
                                      for n, f, w in zip(per, fits, windows)],
                     step_s={"run": costs.step_s, "pieces": per[0]["step_s"]["pieces"]},
                     factors={name: getattr(costs, name) for name in cpu_cost.EFFICIENCIES})
    return costs


def kv_alloc_seconds(d, small: CpuCosts, big: list[CpuCosts], windows: list[list[RunStep]]) -> float:
    """Seconds a byte of a run's state cache takes to make (the runner's, once a run; made untouched, its pages
    fault in inside the tasks that write them, which their factors price): what admitting a large window's wave
    took beyond the first window's (wave_s: a wave of 16 short rows), over its cache's bytes — the median over
    the large windows, each of which made its runner."""
    from statistics import median

    per = []
    for f, w in zip(big, windows):
        pre = next((s for s in w if s.kind == "prefill"), None)
        size = pre.slots * d.state_bytes(pre.row) if pre is not None else 0.0
        if size > 0:
            per.append(max(0.0, f.wave_s - small.wave_s) / size)
    return median(per) if per else 0.0


def fresh_beyond(fresh: dict, warm: list[float]) -> float:
    """A fresh process's one-time cost a token of its first large wave (`fresh`: calibrate_fresh's report): what
    that wave's prefill took beyond the warm waves', less the warm waves' own spread (their prefill factors `warm`,
    max - min over the median, times a warm wave's seconds). The difference of two noisy waves is never below
    nothing, so noise alone read as a cost: the 784M's waves of 18-23 s on two Zen 5 threads put 2.3 and 4.9 s
    once a run where two other calibrations' children saw none, and those two calibrations' runs read their
    prefill 0.79 and 0.86 of predicted (bench/RESULTS.md, issue 11, tenth session)."""
    from statistics import median

    mid = median(warm) if warm else 0.0
    noise = (max(warm) - min(warm)) / mid * fresh["again"] if mid > 0 else 0.0
    return max(0.0, fresh["first"] - fresh["again"] - noise) / fresh["tokens"]


def fresh_seconds(first: list[RunStep], again: list[RunStep]) -> float:
    """A fresh process's one-time cost a token of its largest prefill call: what the first prefill step of `first`
    took beyond the median prefill step of `again` (the same prompts at once again, a wave a step) (≥ 0)."""
    from statistics import median

    pre = [s for s in first if s.kind == "prefill"]
    rep = [s.tasks.get("prefill", 0.0) for s in again if s.kind == "prefill"]
    call = max((sum(g) for g in pre[0].groups), default=0) if pre else 0
    if not call or not rep:
        return 0.0
    return max(0.0, pre[0].tasks.get("prefill", 0.0) - median(rep)) / call


def run_call_cost(engine, base: CpuCosts, windows: list[list[RunStep]]) -> CpuCosts:
    """The fused attention kernel's calls, as a run makes them: what the run's attention took beyond the pieces,
    per call (the windows' median), joins attn_call_s rather than scaling attention (attn_eff). A run's
    attention task cost about the same per call whatever its requests and contexts (the 784M: 0.24 ms a
    call in quiet runs of 94- and 324-token contexts; 1.2-1.4 ms on a busy box, 4 or 16 requests a call)
    while the kernel reads its tokens in tens of µs: scaled, that fixed cost made longer contexts and larger
    micro-batches 1.5-3x too slow in attention (bench/RESULTS.md, issue 11, sixth session)."""
    from statistics import median

    d, L = hrm.dims(engine.spec), engine.spec.num_layers
    group = max(1, getattr(engine.config, "expert_group", 1))
    unit = dataclasses.replace(base, **{n: 1.0 for n in cpu_cost.EFFICIENCIES})
    extra = []
    for w in windows:
        dec = [s for s in w if s.kind == "decode"]
        calls = sum(min(base.threads, len(g)) > 1 for s in dec for g in s.groups) * L  # a one-request call has none
        if calls:
            run = sum(s.tasks.get("cpu_attn", 0.0) for s in dec)
            extra.append((run - sum(step_model(d, L, unit, s, group).get("cpu_attn", 0.0) for s in dec)) / calls)
    return dataclasses.replace(base, attn_call_s=max(0.0, base.attn_call_s + median(extra))) if extra else base


def window_entries(d, costs: CpuCosts, notes: dict) -> list[dict]:
    """The calibration's windows (fit_run_windows' `notes`) as history entries (core.plan.cpu_history), each
    against `costs`' coefficients: every window's decode factors and step_s; the first window's prefill
    and wave_s only (a fresh process's, as a user's run is: later windows reuse its buffers); the large
    micro-batch's windows as their *_eff_large factors (prefill the warm waves': the repeat and a fresh process's
    after its first, fit_run_windows); the mid micro-batch's as their *_eff_mid."""
    out = []
    for i, w in enumerate(notes.get("windows", [])):
        f = {n: v for n, v in w["factors"].items() if i == 0 or n != "prefill_eff"}
        out.append(cpu_history.entry(d, costs, f, "calibration", step_s=w["step_s"],
                                     wave_s=costs.wave_s if i == 0 else None, batch=costs.run_batch))
    big = notes.get("large", {})
    for i, w in enumerate(big.get("windows", [])):
        f = {cpu_cost.LARGE[n]: v for n, v in w["factors"].items() if w.get("prefill", i == 1) or n != "prefill_eff"}
        out.append(cpu_history.entry(d, costs, f, "calibration", batch=big["batch"]))
    between = notes.get("mid", {})
    for w in between.get("windows", []):
        out.append(cpu_history.entry(d, costs, {cpu_cost.MID[n]: v for n, v in w["factors"].items()}, "calibration",
                                     batch=between["batch"]))
    return out


def decode_seconds(window: list[RunStep]) -> float:
    """Seconds a window's decode tasks took."""
    return sum(v for s in window if s.kind == "decode" for v in s.tasks.values())


def agreeing(windows: list[list[RunStep]]) -> int:
    """How many windows' decode tasks took within RUN_AGREE of the median window's seconds."""
    from statistics import median

    secs = [decode_seconds(w) for w in windows]
    mid = median(secs) if secs else 0.0
    return sum(abs(t - mid) <= RUN_AGREE * mid for t in secs)


def run_workload(engine, batch: int, means=RUN_PROMPT_MEANS, gen: int = RUN_GEN, seed: int = 0) -> list[str]:
    """A wave of `batch` prompts per mean length, spread as MT-Bench's, within the context: random tokens
    (the app passes MT-Bench text: core.io.workloads)."""
    g = torch.Generator().manual_seed(seed)
    longest = max(4, engine.context_length - gen - 1)
    out = []
    for mean in means:
        for n in run_lengths(batch, min(mean, longest), min(longest, round(mean * 418 / 77))):
            ids = torch.randint(0, engine.spec.vocab_size, (n,), generator=g).tolist()
            out.append(_text(engine.tokenizer, ids, longest))
    return out


def large_rows(first: list[RunStep], gen: int = LARGE_GEN, mean: float = RUN_PROMPT_MEANS[0], most: int = LARGE_ROWS,
               least: int = 16, budget: float = LARGE_WINDOW_S) -> int:
    """Requests of the large window (one micro-batch): `most`, halved while the speeds of the run's first window
    (its prefill a prompt token, its decode a request a step) say a wave of them, prompts of `mean` tokens each
    generating `gen`, would take over `budget` seconds; 0 under `least`."""
    pre = [s for s in first if s.kind == "prefill"]
    dec = [s for s in first if s.kind == "decode"]
    tokens = sum(sum(g) for s in pre for g in s.groups)
    rows = sum(len(g) for s in dec for g in s.groups)
    if not tokens or not rows:
        return 0
    per = mean * sum(s.seconds for s in pre) / tokens + (gen - 1) * sum(s.seconds for s in dec) / rows
    n = most
    while n >= least and n * per > budget:
        n //= 2
    return n if n >= least else 0


def calibrate(engine, *, progress: EventSink = ignore, quick: bool = False, clock=time.perf_counter,
              batch: int = 16, micro_batch: int = 4, prompts: list[str] | None = None,
              notes: dict | None = None, windows: int = RUN_WINDOWS, large: int = LARGE_ROWS,
              large_prompts=None, window_s: float = RUN_MIN_S) -> CpuCosts:
    """The CPU cost model of this machine, measured with `engine` (a CPU-only engine) and its model, then
    its efficiency in a short run of `prompts` (default: run_workload's) at `batch`/`micro_batch`, timed in
    `windows` windows of at least `window_s` seconds each (lasting; 0 in `quick`) (fit_run_windows; `notes`, when
    given, get what the run measured against the pieces),
    and at a large micro-batch of at most `large` requests (large_rows; 0: none), whose prompts
    `large_prompts(n)` gives (default: run_workload's, MT-Bench's mean length), and those requests at the micro-batch
    between the two (mid_rows). Every window and stage runs between two of the CPU's speed probes (cpu_speed.Stamps):
    the costs hold at the pieces' mean speed (CpuCosts.speed), and each window and stage is brought to it (at_rate)."""
    engine.threads.tick()  # measure with the threads the engine will run with
    # the CPU's speed around every window and stage: the windows are brought to the pieces' speed (at_rate)
    stamps = cpu_speed.Stamps(engine.cpu.math, cpu_speed.QUICK_S if quick else cpu_speed.STAMP_S)
    gen = 3 if quick else RUN_GEN
    prompts = prompts or run_workload(engine, batch, means=(8, 24) if quick else RUN_PROMPT_MEANS, gen=gen)
    # one request through first, untimed: set-up done once per process or machine (a native kernel's build,
    # lazy imports) is no step's cost — it made the run's attention 7-29x the pieces'
    run_steps(engine, prompts[:1], batch=1, micro_batch=1, gen=2, clock=clock)
    # then the run, while the process is otherwise as fresh as a user's run's is (no buffers yet to reuse),
    # and again after the GEMMs and at the end (RUN_WINDOWS)
    def window():
        return stamps.around("run", lambda: lasting(lambda: run_steps(
            engine, prompts, batch=batch, micro_batch=micro_batch, gen=gen, clock=clock, progress=progress),
            0.0 if quick else window_s))

    runs = [window()]
    # the large micro-batch right after it, while the process is still fresh at that size too (a 256-prompt
    # prefill in a process that ran one before took half as long on the demo model)
    gen_large = gen if quick else LARGE_GEN
    n_large = large_rows(runs[0][0], gen_large, most=min(large, 4 * micro_batch) if quick else large,
                         least=4 * micro_batch) if large else 0
    big_prompts = ((large_prompts or (lambda n: run_workload(engine, n, means=RUN_PROMPT_MEANS[:1], gen=gen_large,
                                                              seed=1)))(n_large) if n_large else [])

    def large_window(gen=gen_large):
        return stamps.around("large", lambda: lasting(lambda: run_steps(
            engine, big_prompts, batch=n_large, micro_batch=n_large, gen=gen, clock=clock, progress=progress,
            what=f"a short run at micro-batch {n_large}"), 0.0 if quick else window_s))

    bigs = [large_window(), large_window(min(gen_large, REPEAT_GEN))] if n_large else []
    n_mid = mid_rows(micro_batch, n_large)

    def mid_window():
        return stamps.around("mid", lambda: lasting(lambda: run_steps(
            engine, big_prompts, batch=n_large, micro_batch=n_mid, gen=gen_large, clock=clock, progress=progress,
            what=f"a short run at micro-batch {n_mid}"), 0.0 if quick else window_s))

    mids = [mid_window()] if n_mid else []
    fresh_wave = None
    if n_large and not quick:  # what this process, no longer fresh, cannot show: a fresh one's first large wave
        progress(Progress("calibrating: a fresh process's first large wave", 0, 1, "runs"))
        fresh_wave = stamps.around("fresh", lambda: fresh_first_wave(engine, big_prompts, gen=gen_large,
                                                                     wall=clock is time.perf_counter))
        progress(Progress("calibrating: a fresh process's first large wave", 1, 1, "runs"))
    spec = engine.spec
    d = hrm.dims(spec)
    # the calls as large as a planner's (fresh_prefills) before the GEMM stage: when a call's activations were
    # one piece its freed weights served them after it, and a call of 19,000 tokens took no longer a token than
    # one of 4,000 where the runs that followed took 11-12 % longer (in chunks, limits.prefill_chunk, neither maps
    # anything fresh)
    pre = [s for s in runs[0][0] if s.kind == "prefill"]
    token_s = sum(s.tasks.get("prefill", 0.0) for s in pre) / max(1, sum(sum(g) for s in pre for g in s.groups))
    fresh, fresh_rate = ([], 0.0) if quick else stamps.around("pieces", lambda: runner_observations(
        engine, batches=(), contexts=(), sliced=None, progress=progress, clock=clock, repeats=1,  # once: fresh
        prefills=fresh_prefills(d, engine.cpu.math, token_s, spec.max_position - 2)))
    kernels, kernel_rate = stamps.around("pieces", lambda: kernel_costs(engine, quick=quick, clock=clock,
                                                                        progress=progress))
    if windows > 1:
        runs.append(window())
        bigs += [large_window() for _ in range(LARGE_WINDOWS - 2) if n_large]
        mids += [mid_window() for _ in range(MID_WINDOWS - 1) if n_mid]
    kw = dict(batches=(1, 4, 16), contexts=(32,), prefills=((1, 16), (2, 32)), steps=2, sliced=(16, 64)) if quick else {}
    obs, obs_rate = stamps.around("pieces", lambda: runner_observations(engine, progress=progress, clock=clock, **kw))
    # the speed the pieces hold at, and every stage and window brought to it
    ref = stamps.mean("pieces")
    if notes is not None:
        notes["speed"] = {"reference": ref, "stamps": {k: list(v) for k, v in stamps.rates.items()}}
    base = dataclasses.replace(kernels, speed=kernel_rate).at_speed(ref) if kernel_rate > 0 else kernels
    timed = base.sdpa_flop_s  # kernel_costs timed the prefill attention alone: it bounds the prefills' fit
    base = fit_engine_terms(engine, base, obs_at_rate(obs, obs_rate, ref) + obs_at_rate(fresh, fresh_rate, ref),
                            sdpa_range(timed))
    if notes is not None:
        notes["prefill_attention"] = {"timed_flop_s": timed, "flop_s": base.sdpa_flop_s}
    base = fit_step_terms(engine, base, batches=(1, 4) if quick else (1, 8, 32), clock=clock)
    at = lambda pairs: [at_rate(w, r, ref) for w, r in pairs]  # noqa: E731
    wave, rate = fresh_wave if fresh_wave else (None, 0.0)
    return fit_run_windows(engine, base, more_windows(at(runs), lambda: at_rate(*window(), ref), windows), notes,
                           large=at(bigs), fresh=fresh_at_rate(wave, rate, ref), mid=at(mids))


def at_rate(steps: list[RunStep], rate: float, ref: float) -> list[RunStep]:
    """`steps`, timed while the CPU's speed probe read `rate`, as they would have taken at `ref` (cpu_speed's
    FLOP/s): a stretch the box ran fast in takes longer at the reference. As timed where either is unknown."""
    if not (rate > 0 and ref > 0):
        return steps
    r = rate / ref
    return [dataclasses.replace(s, seconds=s.seconds * r, tasks={k: v * r for k, v in s.tasks.items()}) for s in steps]


def obs_at_rate(obs: list, rate: float, ref: float) -> list:
    """The pieces' observations (calibrate_pieces.Obs) brought to `ref` as at_rate does a window's steps."""
    if not (rate > 0 and ref > 0):
        return obs
    r = rate / ref
    return [dataclasses.replace(o, wall=o.wall * r, busy={k: v * r for k, v in o.busy.items()}) for o in obs]


def fresh_at_rate(fresh: dict | None, rate: float, ref: float) -> dict | None:
    """A fresh process's waves (calibrate_fresh.fresh_first_wave) brought to `ref` as at_rate does a window."""
    if not fresh or not (rate > 0 and ref > 0):
        return fresh
    r = rate / ref
    waves = [[dataclasses.asdict(s) for s in at_rate([RunStep(**x) for x in w], rate, ref)] for w in fresh["waves"]]
    return {**fresh, "first": fresh["first"] * r, "again": fresh["again"] * r, "waves": waves}


def kernel_costs(engine, *, quick: bool = False, clock=time.perf_counter, progress: EventSink = ignore) -> CpuCosts:
    """The GEMM kernels' terms (dense and experts', from RAM and, for a model the cache holds, from the cache)."""
    spec = engine.spec
    d = hrm.dims(spec)
    dense, expert, math = engine_kernels(engine)
    dense_shapes, expert_shapes = model_shapes(spec)
    rows = ROWS[:8] if quick else ROWS
    direct = engine.cpu.direct_rows if engine.cpu.widens else 0
    cache = llc_bytes() if quick else effective_cache_bytes(llc_bytes())  # measured: what a run can count on
    fits = spec.total_bytes < cache  # a model this small can stay cached between steps: measure both ways
    progress(Progress("calibrating: GEMM kernels", 0, 2, "kernels"))
    cold = min(COLD_FACTOR * cache, max(2 * cache, spec.total_bytes))
    if quick:  # test-size: every term measured, not from RAM
        cold = min(cold, QUICK_COLD_BYTES)
    fd, wd, cd, _ = gemm_terms(dense, math, dense_shapes, cold, 0, rows, clock)
    fused = fused_layers(engine)
    base = CpuCosts(math=engine.cpu.math, flop_s=fd, weight_s=wd, call_s=cd, direct_rows=direct, cache_bytes=cache,
                    expert_chunk=CHUNK_TOKENS if fused else 0, threads=torch.get_num_threads(),
                    model=cpu_cost.model_key(d), model_bytes=spec.total_bytes, widens=engine.cpu.widens,
                    own_rows=own_rows(spec), l2_bytes=l2_bytes())
    tokens = LAYER_TOKENS[:6] if quick else LAYER_TOKENS
    if fused:
        fx, wx, cx = fused_terms(fused, d, cold, tokens, clock, math)
        gx = 0.0
    else:
        fx, wx, cx, gx = gemm_terms(expert, math, expert_shapes, cold, direct, rows, clock)
    progress(Progress("calibrating: GEMM kernels", 1, 2, "kernels"))
    hot_d = hot_x = 0.0
    if fits:
        hot_d = gemm_terms(dense, math, dense_shapes, spec.total_bytes, 0, rows, clock)[1]
        hot_x = (fused_terms(fused, d, sum(x.held_bytes for x in fused), tokens, clock, math)[1] if fused
                 else gemm_terms(expert, math, expert_shapes, spec.total_bytes, direct, rows, clock)[1])
    progress(Progress("calibrating: GEMM kernels", 2, 2, "kernels"))
    sdpa = 0.0
    if plain_attention(spec):  # other mixers' prefill is fitted from the whole prefills' residual alone
        sdpa = prefill_attention_terms(spec, math, ATTN_LENGTHS[::2] if quick else ATTN_LENGTHS, clock)[0]
    return dataclasses.replace(base, expert_flop_s=fx, expert_weight_s=wx, expert_call_s=cx, gemv_s=gx,
                               weight_hot_s=hot_d, expert_weight_hot_s=hot_x, sdpa_flop_s=sdpa)



def mid_rows(small: int, large: int) -> int:
    """The micro-batch between `small` and `large` the run is also measured at (their geometric middle), or 0 where
    no whole number lies strictly between them."""
    m = round((small * large) ** 0.5) if small > 0 and large > 0 else 0
    return m if small < m < large else 0


def more_windows(runs: list, window, windows: int = RUN_WINDOWS) -> list:
    """`runs` with windows run by `window()` added until there are `windows`, and while fewer than a
    majority of them agree with their median (`agreeing`), up to RUN_WINDOWS_MOST."""
    most = max(windows, RUN_WINDOWS_MOST) if windows > 1 else windows
    while len(runs) < windows or (len(runs) < most and agreeing(runs) <= len(runs) // 2):
        runs.append(window())
    return runs
