"""Measure this machine's CPU cost model (core.plan.cpu_cost.CpuCosts) with the engine's own kernels and steps.

Three stages, each fitting few coefficients from many measurements (weighted least squares on
relative error, coefficients kept ≥ 0):
1. GEMMs: the engine's dense and expert kernels (plain, oneDNN-prepacked or widened from bf16) timed
   in isolation on this model's weight shapes over a spread of row counts, cycling through as many
   weights as the model has (capped past any last-level cache), so they come from RAM exactly when
   the model's do → flop_s, weight_s, call_s (+ gemv_s below `direct_rows`). Where the fused expert
   kernel runs the experts (core.model.cpu.ffn), it is timed instead, whole layers a call (fused_terms).
2. The engine's runner on this model: decode steps over KV rows filled with random values (so any
   batch and context can be had without prefilling it) and prefills, small ones and two of many prompts
   (one past the allocator's threshold, cpu_cost.fresh_tokens) → per-activation, per-task, attention,
   prefill-attention and fresh-activation terms, from what the GEMMs leave unexplained.
3. A few `Engine.generate` steps → the engine's per-step and per-request overhead.
Every cost function is linear in the coefficients, so a coefficient's feature is the cost function
evaluated with that coefficient at 1 and the others at 0: the fit and the prediction cannot drift apart.

`clock` is what seconds are: wall time (time.perf_counter, the default) or this process's CPU time
(time.process_time: on a shared machine, with one thread, what a quiet machine's wall time would
be). With a CPU clock, each task is timed by it as it runs (`TaskClock`), since the executor's own
busy times are wall seconds.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from core.errors import MlightError
from core.model.cpu.ffn import CHUNK_TOKENS
from core.model.cpu.kernels import Widen
from core.platform import llc_bytes
from core.plan import cpu_cost, cpu_history, hrm
from core.plan.cpu_cost import CpuCosts
from core.telemetry import EventSink, Progress, ignore

# Weights cycle through up to this many times the last-level cache (or the model's bytes, if fewer, but at
# least twice the cache) so they come from RAM as the model's do: cycling through the 32 MB L3's worth, a
# Zen 5 core read packed bf16 experts at 45.8 GB/s, through 8x at 31-35 GB/s, what a 1.5 GB model's decode gets.
COLD_FACTOR = 8
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024)
MAX_GEMM_FLOPS = 2e9  # skip points slower than this per call: they add time, not information
POINT_FLOPS = 4e9  # FLOPs of one timed point (all its copies): at large M a weight is reused, cache or not
RESIDUAL_MIN = 0.05  # a step's unexplained share below this is noise, not a term to fit
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXTS = (48, 384)
SLICED = (48, 400)  # (context, cache row): well under the row, attention copies out the slice rather than read it whole
PREFILLS = ((1, 16), (1, 128), (4, 64), (2, 256), (1, 1024))  # (prompts, tokens each)
# ... and a call whose activations are mapped fresh (cpu_cost.fresh_tokens): FRESH_OVER times the tokens from
# which all of them are, in prompts of FRESH_PROMPT tokens, beside one of a quarter of them, where the first
# window's prefill says both take at most FRESH_MOST_S (the 784M: 17,280 and 4,096 tokens, 13-16 s of its calibration;
# a model too slow for them leaves the term 0)
FRESH_PROMPT, FRESH_OVER, FRESH_MOST_S = 128, 1.05, 15.0
# The fused expert kernel is timed whole, a layer's experts a call, over these tokens (up to its chunk)
LAYER_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# ---- fitting ---------------------------------------------------------------------------------------
def fit(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares on relative error: min Σ ((X·c − y) / y)², c ≥ 0, by dropping the most
    negative coefficient and refitting (few unknowns, so this active-set loop is exact enough)."""
    if any(not t > 0 for t in y):  # each row is divided by its time: a zero would divide by zero
        raise MlightError(f"calibration timed {sum(not t > 0 for t in y)} of {len(y)} points as 0 seconds or less "
                          "(a clock coarser than the work)", "calibrate with the wall clock (--clock wall)")
    n = len(rows[0])
    active = list(range(n))
    while active:
        X = torch.tensor([[r[i] / t for i in active] for r, t in zip(rows, y)], dtype=torch.float64)
        ones = torch.ones(len(y), 1, dtype=torch.float64)
        scale = X.abs().amax(0).clamp_min(1e-300)  # column scaling keeps the solve well conditioned
        c = torch.linalg.lstsq(X / scale, ones).solution[:, 0] / scale
        if (c >= 0).all():
            out = [0.0] * n
            for i, v in zip(active, c.tolist()):
                out[i] = v
            return out
        active.pop(int(c.argmin()))
    return [0.0] * n


def _feature(fn, base: CpuCosts, name: str) -> float:
    """The cost function's coefficient on `name`: evaluated with that field at 1 and the other coefficients
    at 0 (the run's efficiency factors, which multiply them, as in `base`)."""
    zero = {f.name: 0.0 for f in dataclasses.fields(CpuCosts)
            if f.type in ("float", float) and f.name not in cpu_cost.EFFICIENCIES}
    return fn(dataclasses.replace(base, **{**zero, name: 1.0}))


# ---- 1. GEMM kernels ---------------------------------------------------------------------------------
TICKS = 10  # a timed point spans at least this many clock ticks, so one tick's rounding is ≤ 10 %
MAX_REPEAT = 1 << 20


def clock_tick(clock=time.perf_counter, limit_s: float = 0.1) -> float:
    """The smallest step `clock` moves by: the larger of what it reports and what it is seen to do. Windows'
    process_time reports 100 ns but moves in 15.6 ms steps (the scheduler's tick)."""
    names = {time.perf_counter: "perf_counter", time.process_time: "process_time", time.monotonic: "monotonic",
             time.thread_time: "thread_time"}
    told = time.get_clock_info(names[clock]).resolution if clock in names else getattr(clock, "resolution", 0.0)
    steps, last, end = [], clock(), time.perf_counter() + limit_s
    while len(steps) < 3 and time.perf_counter() < end:  # the clock's own steps (a CPU clock advances as this spins)
        now = clock()
        if now != last:
            steps.append(now - last)
            last = now
    return max(told, min(steps, default=0.0))


def _typical(fn, reps: int = 3, clock=time.perf_counter, tick: float = 0.0) -> float | None:
    """Seconds per call of `fn`, the median of `reps` timings (what a run meets, not its luckiest moment: on
    a shared machine the minimum made every prediction optimistic, -6 to -25 % against the runs); calls
    are repeated until a timing spans TICKS clock ticks (a coarse clock would time small points as 0).
    None: too fast for the clock even repeated."""
    fn()
    n = 1
    while True:
        times = []
        for _ in range(reps):
            t = clock()
            for _ in range(n):
                fn()
            times.append(clock() - t)
        mid = sorted(times)[len(times) // 2]
        if min(times) > TICKS * tick:
            return mid / n
        if n >= MAX_REPEAT:
            return None
        best = min(times)
        n = min(MAX_REPEAT, n * 8 if best <= 0 else max(2 * n, int(n * TICKS * tick / best) + 1))


class TaskClock:
    """Per-resource busy seconds by `clock`, timed around every task of the runners it is installed on
    (sequential executor: the tasks run on this thread). With the wall clock it changes nothing."""

    def __init__(self, clock=time.perf_counter):
        self.clock, self.busy = clock, {}

    @property
    def wall(self) -> bool:
        return self.clock is time.perf_counter

    def install(self, runner):
        if self.wall:
            return runner
        run, clock = runner._run, self.clock

        def timed_run(task):
            t = clock()
            try:
                run(task)
            finally:
                self.busy[task.resource] = self.busy.get(task.resource, 0.0) + clock() - t

        runner._run = timed_run
        return runner

    def take(self, measured: dict) -> dict:
        """This step's busy seconds: ours, or `measured` (the executor's) with the wall clock."""
        busy, self.busy = self.busy, {}
        return measured if self.wall else busy

    def engine(self, engine):
        """Time every runner `engine` makes from now on."""
        make = engine.runner
        engine.runner = lambda *a, **kw: self.install(make(*a, **kw))
        return engine


def engine_kernels(engine):
    """(dense, expert) kernels the engine runs: each is (prepare(w_fp32 [N, K]) -> weight, apply(x, weight))
    and the dtype of its inputs."""
    w = engine.weights
    math = w.math_dtype
    dense = (lambda t: t.to(math).contiguous(), F.linear)
    if w.packed:
        from core.model.cpu.kernels import pack_dense
        from core.model.moe import _packed_linear, _reorder

        dense = (lambda t: pack_dense(t.to(w.dtype).contiguous()), F.linear)  # as LayerWeights.pack_for_cpu does

        reorder = _reorder()
        expert = (lambda t: reorder(t.to(w.dtype).contiguous(), 16), _packed_linear)
    elif math != w.dtype:
        widen = Widen(math, engine.cpu.direct_rows)
        expert = (lambda t: t.to(w.dtype).contiguous(), widen.linear)
    else:
        expert = dense
    return dense, expert, math


def fused_layers(engine) -> list:
    """The engine's layers' experts where the fused kernel runs them (core.model.cpu.ffn.NativeExperts); []
    elsewhere. Timing oneDNN's packed GEMMs in their place made the expert terms another kernel's: its cost
    falls with rows per expert where the fused kernel's, 512 tokens a call, does not."""
    return [lw.packed for lw in engine.weights.layers if hasattr(lw.packed, "fused_swiglu")]


def fused_terms(layers: list, d, resident: int, tokens=LAYER_TOKENS,
                clock=time.perf_counter) -> tuple[float, float, float]:
    """(expert_flop_s, expert_weight_s, expert_call_s) of the fused kernel (cpu_cost.fused_experts_seconds):
    whole-layer calls over `tokens` tokens routed uniformly (as the cost model assumes), cycling through
    `resident` bytes of layers — the engine's own, and copies at other addresses where they hold fewer (a
    model the cache holds) — so they come from memory as a run's do. The call's time is the slower of its
    arithmetic and its weights: a roofline fitted as one (`roofline`); expert_call_s stays 0 (a call's own
    overhead is its task's, task_s)."""
    import copy

    from core.plan.hrm import expected_experts

    first = layers[0]
    use = list(layers)
    while sum(x.held_bytes for x in use) < resident:  # a small model: copies at other addresses, read cold
        twin = copy.copy(use[len(use) % len(layers)])
        twin.w13, twin.w2 = twin.w13.clone(), twin.w2.clone()
        use.append(twin)
    while len(use) > 1 and sum(x.held_bytes for x in use[:-1]) >= resident:
        use.pop()
    g = torch.Generator().manual_seed(0)
    tick = clock_tick(clock)
    per = 3 * first.I * first.D  # weight elements of one expert
    obs = []
    for t in tokens:
        h = torch.randn(t, first.D, generator=g).bfloat16()
        idx = torch.rand(t, first.E, generator=g).topk(d.k, dim=-1).indices
        w = torch.full((t, d.k), 1.0 / d.k)
        out = torch.empty(t, first.D, dtype=torch.bfloat16)
        n = max(1, min(len(use), int(POINT_FLOPS // (2 * t * d.k * per))))

        def run(n=n, h=h, idx=idx, w=w, out=out):
            for x in use[:n]:
                x(h, w, idx, out)

        sec = _typical(run, reps=3, clock=clock, tick=tick)
        if sec is not None:
            obs.append((2 * t * d.k * per, expected_experts(t, d.E, d.k) * per, sec / n))
    return (*roofline(obs), 0.0)


def roofline(obs: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) with seconds ≈ max(a·flops, b·weights) over (flops, weights, seconds) points: each split of the
    points by arithmetic intensity, the lower ones fitted by their weights and the upper by their flops
    (a median ratio each), and the split that fits all of them best by relative error."""
    from statistics import median

    pts = sorted(obs, key=lambda o: o[0] / o[1])
    best = None
    for i in range(len(pts) + 1):
        lo, hi = pts[:i], pts[i:]
        b = median(s / w for _, w, s in lo) if lo else 0.0
        a = median(s / f for f, _, s in hi) if hi else 0.0
        err = sum((max(a * f, b * w) / s - 1) ** 2 for f, w, s in pts)
        if best is None or err < best[0]:
            best = (err, a, b)
    return (best[1], best[2]) if best else (0.0, 0.0)


def model_shapes(spec) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(dense, expert) weight shapes (N, K) of a model's GEMMs."""
    D, I, Is = spec.hidden_size, spec.expert_intermediate, spec.shared_intermediate
    dense = [(spec.q_size + 2 * spec.kv_size, D), (D, spec.q_size), (spec.num_experts, D), (spec.vocab_size, D)]
    if Is:
        dense += [(2 * Is, D), (D, Is)]
    return dense, [(2 * I, D), (D, I)]


def gemm_terms(kernel, math: torch.dtype, shapes, resident: int, direct_rows: int = 0, rows=ROWS,
               clock=time.perf_counter):
    """(flop_s, weight_s, call_s, gemv_s) of one kernel: seconds per FLOP, per weight element, per call;
    gemv_s per weight element for calls of ≤ direct_rows rows (they read the narrow weight directly).
    The weights cycle through `resident` bytes: more than the cache holds, or a model's that fits."""
    prepare, apply = kernel
    obs, gemv = [], []
    tick = clock_tick(clock)
    for n, k in shapes:
        first = prepare(torch.randn(n, k) / k ** 0.5)
        ws = [first] + [prepare(torch.randn(n, k) / k ** 0.5)
                        for _ in range(max(1, resident // (n * k * first.dtype.itemsize)) - 1)]
        for m in rows:
            if 2 * m * n * k > MAX_GEMM_FLOPS:
                continue
            x = torch.randn(m, k, dtype=math)
            use = ws[:max(1, min(len(ws), int(POINT_FLOPS // (2 * m * n * k))))]

            def run():
                for w in use:
                    apply(x, w)

            t = _typical(run, reps=3, clock=clock, tick=tick)
            if t is not None:  # dropped: below the clock's resolution even repeated
                (gemv if m <= direct_rows else obs).append((m, n, k, t / len(use)))
        del ws
    flop_s, weight_s, call_s = fit([[2 * m * n * k, n * k, 1.0] for m, n, k, _ in obs], [t for *_, t in obs])
    gemv_s = 0.0
    if gemv:
        gemv_s = sum(max(0.0, t - call_s) / (n * k) for m, n, k, t in gemv) / len(gemv)
    return flop_s, weight_s, call_s, gemv_s


# ---- 2. the engine's runner ----------------------------------------------------------------------------
@dataclasses.dataclass
class Obs:
    kind: str  # "decode" | "prefill"
    b: int  # requests in the step (decode) or prompts (prefill)
    length: int  # cached tokens per request after the step (decode) / prompt tokens (prefill)
    busy: dict  # resource -> seconds, the whole step
    wall: float
    rows: int = 0  # tokens a KV cache row holds (decode)


def runner_observations(engine, *, batches=DECODE_BATCHES, contexts=DECODE_CONTEXTS, prefills=PREFILLS,
                        steps: int = 3, sliced=SLICED, progress: EventSink = ignore,
                        clock=time.perf_counter) -> list[Obs]:
    spec, out = engine.spec, []
    limit = spec.max_position - steps - 2
    plan = [(b, c, c + steps + 1) for b in batches for c in contexts if c <= limit]
    if sliced and sliced[1] <= limit:
        plan += [(b, sliced[0], sliced[1]) for b in batches]
    g = torch.Generator().manual_seed(0)
    tc = TaskClock(clock)
    for i, (b, c, row) in enumerate(plan):
        runner = tc.install(engine.runner(slots=b, micro_batch_size=b, max_tokens=row))
        for store in runner.cache.layers:  # a filled state without a prefill: timing only (any layer kind)
            for t, axis in zip(store.tensors if store is not None else (), store.token_axes if store else ()):
                (t if axis is None else t.narrow(axis, 0, store.kept(c))).normal_(generator=g)
        tokens = [torch.randint(0, spec.vocab_size, (b,), generator=g).tolist()]
        runner.decode(tokens, [list(range(b))], [[c] * b])  # warm-up
        tc.take({})
        for s in range(steps):
            t0 = clock()
            _, busy = runner.decode(tokens, [list(range(b))], [[c + s] * b])
            out.append(Obs("decode", b, c + s + 1, tc.take(busy), clock() - t0, row))
        del runner
        progress(Progress("calibrating: decode steps", i + 1, len(plan), "shapes"))
    prefills = [pf for pf in prefills if pf[1] <= limit]
    for i, (p, n) in enumerate(prefills):
        runner = tc.install(engine.runner(slots=p, micro_batch_size=p, max_tokens=n + 1))
        prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for _ in range(p)]
        runner.prefill(prompts[:1], [0], [[0]])  # warm-up
        tc.take({})
        t0 = clock()
        _, busy = runner.prefill(prompts, list(range(p)), [list(range(p))])
        out.append(Obs("prefill", p, n, tc.take(busy), clock() - t0))
        progress(Progress("calibrating: prefills", i + 1, len(prefills), "shapes"))
    return out


def fresh_prefills(d, math_dtype: str, token_s: float, limit: int) -> list[tuple[int, int]]:
    """Two prefill calls of many prompts of the same length: one past the allocator's threshold (FRESH_OVER),
    one at a quarter of it (nothing fresh; it anchors the per-prompt term at many prompts a call) — if at
    `token_s` seconds a prompt token (a whole prefill's, as a run measured it) they take FRESH_MOST_S at most."""
    n = min(FRESH_PROMPT, limit)
    hi = cpu_cost.fresh_from(d, math_dtype)
    calls = [(max(1, math.ceil(x / n)), n) for x in (hi / 4, FRESH_OVER * hi)]
    return calls if token_s * sum(p * n for p, n in calls) <= FRESH_MOST_S else []


def _layer_decode(d, c: CpuCosts, o: Obs) -> tuple[float, float]:
    """(dense + experts, attention) seconds of one layer for an observed decode step (one micro-batch)."""
    c = c.for_step(o.b * cpu_cost.read_tokens(c, o.length, o.rows, o.length) * d.kv_tok)
    t = cpu_cost.decode_tasks(d, c, micro_batch=o.b, expert_batch=o.b, context=o.length, row_tokens=o.rows,
                              longest=o.length, lengths=[o.length] * o.b)
    return t["pre_attn"] + t["post_attn"] + t["ffn"], t["cpu_attn"]


def own_rows(spec) -> bool:
    """Whether the engine's decode attention runs in the fused C kernel (core.model.attention.decode_over_rows:
    built here, no sinks, heads in its range), which reads each request's own tokens (cpu_cost.own_shares)."""
    from core.model.cpu import native

    plain = not spec.attn_sinks and spec.mla is None and all(t != "linear" for t in spec.layer_types)
    return (plain and spec.num_heads % spec.num_kv_heads == 0 and spec.num_heads // spec.num_kv_heads <= native.MAX_G
            and spec.head_dim <= native.MAX_D and native.library() is not None)


def fit_engine_terms(engine, base: CpuCosts, obs: list[Obs]) -> CpuCosts:
    """elem_s and task_s from the dense work, kv_s, kv_copy_s and attn_row_s from attention, sdpa_flop_s and prompt_s
    from prefills — each from what the terms already known leave unexplained."""
    d, L = hrm.dims(engine.spec), engine.spec.num_layers
    dec = [o for o in obs if o.kind == "decode"]

    def residual_fit(items, names, measured, known):
        # Only what the known terms leave unexplained: a step they already over-explain (noise) would enter
        # the relative-error fit with a near-zero target and an enormous weight, pinning every term to 0.
        kept = [(o, fn, measured(o) - known(o)) for o, fn in items]
        kept = [(o, fn, r) for o, fn, r in kept if r > RESIDUAL_MIN * measured(o)]
        if len(kept) < len(names):
            return {}
        rows = [[_feature(lambda c, o=o, fn=fn: fn(c, o), base, n) for n in names] for o, fn, _ in kept]
        return dict(zip(names, fit(rows, [r for *_, r in kept])))

    dense = lambda c, o: _layer_decode(d, c, o)[0]  # noqa: E731
    got = residual_fit([(o, dense) for o in dec], ("elem_s", "task_s"), lambda o: o.busy.get("gpu", 0) / L,
                       lambda o: dense(base, o))
    base = dataclasses.replace(base, **got)
    attn = lambda c, o: _layer_decode(d, c, o)[1]  # noqa: E731
    # the fused kernel reads own tokens (kv_s alone; its calls cost attn_call_s); a widening engine always slices
    kv = ("kv_s", "attn_call_s") if base.own_rows else ("kv_copy_s",) if base.widens else ("kv_s", "kv_copy_s")
    got = residual_fit([(o, attn) for o in dec], (*kv, "attn_row_s"), lambda o: o.busy.get("cpu_attn", 0) / L,
                       lambda o: attn(base, o))
    base = dataclasses.replace(base, **got)
    pre = [o for o in obs if o.kind == "prefill"]
    if pre:
        fn = lambda c, o: cpu_cost.prefill_seconds(d, c.for_step(o.b * o.length * d.kv_tok), o.b, o.length)  # noqa: E731
        busy = lambda o: o.busy.get("gpu", 0) / L  # noqa: E731
        # attention and the per-prompt term from the calls whose activations are reused, then the fresh
        # activations' term from what those leave of the calls past the threshold: fitted together, one call
        # of 148 prompts let an inflated per-prompt term explain it (prefill_act_s 0 in one calibration of two)
        fresh = [o for o in pre if cpu_cost.fresh_tokens(d, base, o.b * o.length) > 0]
        got = residual_fit([(o, fn) for o in pre if o not in fresh], ("sdpa_flop_s", "prompt_s"), busy,
                           lambda o: fn(base, o))
        base = dataclasses.replace(base, **got)
        got = residual_fit([(o, fn) for o in fresh], ("prefill_act_s",), busy, lambda o: fn(base, o))
        base = dataclasses.replace(base, **got)
    return base


# ---- 3. the engine's own step overhead -------------------------------------------------------------------
def fit_step_terms(engine, base: CpuCosts, batches=(1, 8, 32), clock=time.perf_counter) -> CpuCosts:
    """step_s and seq_s: what a decode step of `Engine.generate` costs beyond its tasks and its LM head."""
    from core.runtime.engine import Request
    from core.telemetry import StepDone

    d, rows, y = hrm.dims(engine.spec), [], []
    eos, engine.eos_ids = engine.eos_ids, set()
    make = engine.runner
    try:
        for b in batches:
            events = StepClock(engine, clock)
            reqs = [Request(id=str(i), prompt="Hello", max_new_tokens=5) for i in range(b)]
            list(engine.generate(reqs, batch_size=b, micro_batch_size=b, on_event=events))
            engine.runner = make
            for e, span in zip(events.steps, events.spans):
                if e.kind == "decode":  # the whole span: the engine's bookkeeping between steps is a step's cost too
                    head = cpu_cost.head_seconds(d, dataclasses.replace(base, step_s=0.0, seq_s=0.0), e.tokens)
                    rows.append([1.0, float(e.tokens)])
                    y.append(max(1e-9, span - sum(e.busy.values()) - head))
    finally:
        engine.eos_ids = eos
        engine.runner = make
    step_s, seq_s = fit(rows, y)
    return dataclasses.replace(base, step_s=step_s, seq_s=seq_s)


class StepClock:
    """An event sink keeping an engine's StepDone events with their seconds and busy times in `clock`'s
    seconds: the clock's time between consecutive events is the step's (the engine emits one at each
    step's end), and a TaskClock on the engine times its tasks. `spans[i]`: the clock's time from the
    previous event (or the sink's making) to step i's, the engine's work between steps included; with
    the wall clock a StepDone's own seconds start at the step's compute and leave that out."""

    def __init__(self, engine, clock=time.perf_counter, forward: EventSink = ignore):
        self.clock, self.forward = clock, forward
        self.tasks = TaskClock(clock)
        self.tasks.engine(engine)
        self.steps: list = []
        self.spans: list[float] = []
        self._last = clock()

    def __call__(self, e) -> None:
        from core.telemetry import StepDone

        if isinstance(e, StepDone):
            now = self.clock()
            if not self.tasks.wall:
                e = dataclasses.replace(e, seconds=now - self._last, busy=self.tasks.take(e.busy))
            self.spans.append(now - self._last)
            self._last = now
            self.steps.append(e)
        self.forward(e)


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
              clock=time.perf_counter, progress: EventSink = ignore) -> list[RunStep]:
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
            progress(Progress("calibrating: a short run", min(len(steps), total), total, "steps"))

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


def fit_run_terms(engine, base: CpuCosts, steps: list[RunStep], notes: dict | None = None) -> CpuCosts:
    """The run's efficiency factors and per-step overhead: per task kind (decode's four, prefill), the
    seconds its tasks took over what `base` says for the same steps; step_s from the decode steps' spans
    beyond their tasks and head (the median step)."""
    d, L = hrm.dims(engine.spec), engine.spec.num_layers
    group = max(1, getattr(engine.config, "expert_group", 1))
    base = dataclasses.replace(base, **{n: 1.0 for n in cpu_cost.EFFICIENCIES})
    kinds = {**DECODE_EFF, "prefill": "prefill_eff"}
    model = {k: 0.0 for k in kinds}
    measured = dict(model)
    for s in steps:
        for k, v in step_model(d, L, base, s, group).items():
            model[k] += v
        for k in kinds:
            measured[k] += s.tasks.get(k, 0.0)
    costs = dataclasses.replace(base, **{kinds[k]: measured[k] / model[k] for k in kinds
                                         if model[k] > 0 and measured[k] > 0})
    head0 = dataclasses.replace(costs, step_s=0.0, seq_s=0.0)
    dec = [s for s in steps if s.kind == "decode"]
    over = sorted(s.seconds - sum(s.tasks.values()) - cpu_cost.head_seconds(d, head0, sum(len(g) for g in s.groups))
                  - costs.seq_s * sum(len(g) for g in s.groups) for s in dec)
    if over:
        costs = dataclasses.replace(costs, step_s=max(0.0, over[len(over) // 2]))
    # a prefill step's span beyond its tasks, head and step_s: admitting a wave (the runner and its cache
    # made, prompts tokenized; the first in a process faults in its buffers). The mean: a run has few waves.
    waves = [s.seconds - sum(s.tasks.values()) - cpu_cost.head_seconds(d, costs, sum(len(g) for g in s.groups))
             for s in steps if s.kind == "prefill"]
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


def fit_run_windows(engine, base: CpuCosts, windows: list[list[RunStep]], notes: dict | None = None) -> CpuCosts:
    """fit_run_terms over several windows of the same run: each decode factor and step_s the median of the
    windows', prefill_eff and wave_s the first window's. The first window runs first in its process, as a
    user's run does: its prefill faults in the fresh buffers the later windows reuse (its prefill factor
    read 1.0-1.5x the later windows' on the demo model and the 784M), and prefill, compute-bound, moved
    little with the machine's slow stretches (0.89-1.01 within one calibration)."""
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
    if notes is not None:
        notes.update(per[0], windows=[{"factors": n["factors"], "step_s": f.step_s, "seconds": n["seconds"],
                                       "decode_task_seconds": decode_seconds(w),
                                       "tokens_per_s": n["tokens"] / n["seconds"] if n["seconds"] else 0.0}
                                      for n, f, w in zip(per, fits, windows)],
                     step_s={"run": costs.step_s, "pieces": per[0]["step_s"]["pieces"]},
                     factors={name: getattr(costs, name) for name in cpu_cost.EFFICIENCIES})
    return costs


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
    and wave_s only (a fresh process's, as a user's run is: later windows reuse its buffers)."""
    out = []
    for i, w in enumerate(notes.get("windows", [])):
        f = {n: v for n, v in w["factors"].items() if i == 0 or n != "prefill_eff"}
        out.append(cpu_history.entry(d, costs, f, "calibration", step_s=w["step_s"],
                                     wave_s=costs.wave_s if i == 0 else None, batch=costs.run_batch))
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


def calibrate(engine, *, progress: EventSink = ignore, quick: bool = False, clock=time.perf_counter,
              batch: int = 16, micro_batch: int = 4, prompts: list[str] | None = None,
              notes: dict | None = None, windows: int = RUN_WINDOWS) -> CpuCosts:
    """The CPU cost model of this machine, measured with `engine` (a CPU-only engine) and its model, then
    its efficiency in a short run of `prompts` (default: run_workload's) at `batch`/`micro_batch`, timed in
    `windows` windows (fit_run_windows; `notes`, when given, get what the run measured against the pieces)."""
    engine.threads.tick()  # measure with the threads the engine will run with
    gen = 3 if quick else RUN_GEN
    prompts = prompts or run_workload(engine, batch, means=(8, 24) if quick else RUN_PROMPT_MEANS, gen=gen)
    # one request through first, untimed: set-up done once per process or machine (a native kernel's build,
    # lazy imports) is no step's cost — it made the run's attention 7-29x the pieces'
    run_steps(engine, prompts[:1], batch=1, micro_batch=1, gen=2, clock=clock)
    # then the run, while the process is otherwise as fresh as a user's run's is (no buffers yet to reuse),
    # and again after the GEMMs and at the end (RUN_WINDOWS)
    def window():
        return run_steps(engine, prompts, batch=batch, micro_batch=micro_batch, gen=gen, clock=clock, progress=progress)

    runs = [window()]
    spec = engine.spec
    d = hrm.dims(spec)
    # the calls past the allocator's threshold now, while the process holds no large free memory, as a user's
    # run's does not: after the GEMM stage its freed weights served them, and a call of 19,000 tokens took no
    # longer a token than one of 4,000 (prefill_act_s fitted 0) where the runs that followed took 11-12 % longer
    pre = [s for s in runs[0] if s.kind == "prefill"]
    token_s = sum(s.tasks.get("prefill", 0.0) for s in pre) / max(1, sum(sum(g) for s in pre for g in s.groups))
    fresh = [] if quick else runner_observations(
        engine, batches=(), contexts=(), sliced=None, progress=progress, clock=clock,
        prefills=fresh_prefills(d, engine.cpu.math, token_s, spec.max_position - 2))
    dense, expert, math = engine_kernels(engine)
    dense_shapes, expert_shapes = model_shapes(spec)
    rows = ROWS[:8] if quick else ROWS
    direct = engine.cpu.direct_rows if engine.cpu.widens else 0
    cache = llc_bytes()
    fits = spec.total_bytes < cache  # a model this small can stay cached between steps: measure both ways
    progress(Progress("calibrating: GEMM kernels", 0, 2, "kernels"))
    cold = min(COLD_FACTOR * cache, max(2 * cache, spec.total_bytes))
    fd, wd, cd, _ = gemm_terms(dense, math, dense_shapes, cold, 0, rows, clock)
    fused = fused_layers(engine)
    base = CpuCosts(math=engine.cpu.math, flop_s=fd, weight_s=wd, call_s=cd, direct_rows=direct, cache_bytes=cache,
                    expert_chunk=CHUNK_TOKENS if fused else 0, threads=torch.get_num_threads(),
                    model=cpu_cost.model_key(d), model_bytes=spec.total_bytes, widens=engine.cpu.widens,
                    own_rows=own_rows(spec))
    tokens = LAYER_TOKENS[:6] if quick else LAYER_TOKENS
    if fused:
        fx, wx, cx = fused_terms(fused, d, cold, tokens, clock)
        gx = 0.0
    else:
        fx, wx, cx, gx = gemm_terms(expert, math, expert_shapes, cold, direct, rows, clock)
    progress(Progress("calibrating: GEMM kernels", 1, 2, "kernels"))
    hot_d = hot_x = 0.0
    if fits:
        hot_d = gemm_terms(dense, math, dense_shapes, spec.total_bytes, 0, rows, clock)[1]
        hot_x = (fused_terms(fused, d, sum(x.held_bytes for x in fused), tokens, clock)[1] if fused
                 else gemm_terms(expert, math, expert_shapes, spec.total_bytes, direct, rows, clock)[1])
    progress(Progress("calibrating: GEMM kernels", 2, 2, "kernels"))
    if windows > 1:
        runs.append(window())
    base = dataclasses.replace(base, expert_flop_s=fx, expert_weight_s=wx, expert_call_s=cx, gemv_s=gx,
                               weight_hot_s=hot_d, expert_weight_hot_s=hot_x)
    kw = dict(batches=(1, 4, 16), contexts=(32,), prefills=((1, 16), (2, 32)), steps=2, sliced=(16, 64)) if quick else {}
    obs = runner_observations(engine, progress=progress, clock=clock, **kw) + fresh
    base = fit_engine_terms(engine, base, obs)
    base = fit_step_terms(engine, base, batches=(1, 4) if quick else (1, 8, 32), clock=clock)
    return fit_run_windows(engine, base, more_windows(runs, window, windows), notes)


def more_windows(runs: list, window, windows: int = RUN_WINDOWS) -> list:
    """`runs` with windows run by `window()` added until there are `windows`, and while fewer than a
    majority of them agree with their median (`agreeing`), up to RUN_WINDOWS_MOST."""
    most = max(windows, RUN_WINDOWS_MOST) if windows > 1 else windows
    while len(runs) < windows or (len(runs) < most and agreeing(runs) <= len(runs) // 2):
        runs.append(window())
    return runs
