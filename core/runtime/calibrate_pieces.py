"""The pieces of this machine's CPU cost model (core.plan.cpu_cost.CpuCosts), each measured with the engine's own
kernels and steps — stages 1-3 of the calibration (core.runtime.calibrate runs them, then stage 4, a run of the
whole engine, against them).

Each stage fits few coefficients from many measurements (weighted least squares on relative error,
coefficients kept ≥ 0):
1. GEMMs: the engine's dense and expert kernels (plain, oneDNN-prepacked or widened from bf16) timed
   in isolation on this model's weight shapes over a spread of row counts, cycling through as many
   weights as the model has (capped past any last-level cache), so they come from RAM exactly when
   the model's do → flop_s, weight_s, call_s (+ gemv_s below `direct_rows`). Where the fused expert
   kernel runs the experts (core.model.cpu.ffn), it is timed instead, whole layers a call (fused_terms).
2. The engine's runner on this model: decode steps over KV rows filled with random values (so any
   batch and context can be had without prefilling it) and prefills, small ones and two of many prompts
   (one as large as a planner's call) → per-activation, per-task, attention and prefill-attention terms, and
   the fresh-activation one where a call spans past the allocator's threshold (cpu_cost.fresh_tokens), from
   what the GEMMs leave unexplained.
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
from core.model.cpu.kernels import Widen
from core.plan import cpu_cost, hrm
from core.plan.cpu_cost import CpuCosts
from core.telemetry import EventSink, Progress, ignore

# Weights cycle through up to this many times the last-level cache (or the model's bytes, if fewer, but at
# least twice the cache) so they come from RAM as the model's do: cycling through the 32 MB L3's worth, a
# Zen 5 core read packed bf16 experts at 45.8 GB/s, through 8x at 31-35 GB/s, what a 1.5 GB model's decode gets.

COLD_FACTOR = 8
# A quick calibration (the tests') cycles through at most this much: on a VM reporting a 480 MB L3, a quick
# calibration of the demo model made ~290,000 copies of its 4 KB router and spent 47 of its 49 s calling them.
QUICK_COLD_BYTES = 32 << 20
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024)
MAX_GEMM_FLOPS = 2e9  # skip points slower than this per call: they add time, not information
POINT_FLOPS = 4e9  # FLOPs of one timed point (all its copies): at large M a weight is reused, cache or not
RESIDUAL_MIN = 0.05  # a step's unexplained share below this is noise, not a term to fit
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXTS = (48, 384)
SLICED = (48, 400)  # (context, cache row): well under the row, attention copies out the slice rather than read it whole
PREFILLS = ((1, 16), (1, 128), (4, 64), (2, 256), (1, 1024), (16, 16), (8, 64),
            (64, 16), (4, 256))  # (prompts, tokens each)
# Pairs of the same tokens a call in few long prompts and many short ones (256, 512, 1,024 tokens) tell the
# per-token term (prefill_tok_s) from attention's, which grows with the square of a prompt's length
# Each timed PREFILL_REPEATS times, the median kept. One call a shape, and no shape of many short prompts: on two
# Xeon threads the demo's per-prompt term fitted 0 and attention 9.7e-11 s a FLOP took its place, so a run's
# prefill at prompts of 77 tokens took 1.1-1.4x its prediction and at 308 tokens 0.5-0.7x (bench/RESULTS.md,
# issue 11, eighth session)
PREFILL_REPEATS = 3
# ... and a call as large as a planner's: FRESH_OVER times the tokens from which a whole call's activations would
# be mapped fresh (cpu_cost.fresh_from), in prompts of FRESH_PROMPT tokens, beside one of a quarter of them, where
# the first window's prefill says both take at most FRESH_MOST_S (the 784M: 17,280 and 4,096 tokens, 13-16 s of its
# calibration). The engine runs them a chunk at a time, so they map nothing fresh: they price a large call by its
# chunks; the fresh term is fitted only where a call's prompts pass the threshold
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
    zero = {n: 0.0 for n in cpu_cost.SECONDS}
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
    if w.packed and math == w.dtype:  # bf16 math, experts prepacked (AVX2's fused experts leave the dense in fp32)
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
                clock=time.perf_counter, math: torch.dtype = torch.bfloat16) -> tuple[float, float, float]:
    """(expert_flop_s, expert_weight_s, expert_call_s) of the fused kernel (cpu_cost.fused_experts_seconds):
    whole-layer calls over `tokens` tokens routed uniformly (as the cost model assumes), cycling through
    `resident` bytes of layers — the engine's own, and copies at other addresses where they hold fewer (a
    model the cache holds) — so they come from memory as a run's do. The call's time is the slower of its
    arithmetic and its weights: a roofline fitted as one (`roofline`); expert_call_s stays 0 (a call's own
    overhead is its task's, task_s). `math`: the activations' dtype (fp32: the AVX2 kernel's)."""
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
        h = torch.randn(t, first.D, generator=g).to(math)
        idx = torch.rand(t, first.E, generator=g).topk(d.k, dim=-1).indices
        w = torch.full((t, d.k), 1.0 / d.k)
        out = torch.empty(t, first.D, dtype=math)
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


# ---- 1b. prefill attention -------------------------------------------------------------------------------
# Prompt lengths the engine's prefill attention is timed at alone, one prompt a call (prefill_attention_terms)
ATTN_LENGTHS = (16, 32, 64, 128, 256, 512, 1024)


def plain_attention(spec) -> bool:
    """Whether every layer's prefill attention is core.model.attention's causal SDPA over grouped-query heads (no
    window, sinks, latent or linear layers): the one kernel prefill_attention_terms times."""
    return (not spec.attn_sinks and spec.mla is None
            and all(spec.layer_type(i) == "full" for i in range(spec.num_layers)))


# The range the prefills' fit may put sdpa_flop_s in: within this factor of the kernel's own timing. Timed inside
# real prefills, the kernel took 0.82-1.64x its time alone from 64 to 1,024 tokens (2.4x at 16) on the 784M and
# 0.92-1.47x on the demo (bench/prefill_attention.py), and its cost a FLOP falls by almost half from 128 to 1,024
# tokens (torch's CPU attention blocks by length), which one linear term cannot follow: the whole prefills' fit, at
# the lengths runs have, prices it; the timing bounds it
SDPA_SPAN = 2.0


def sdpa_range(timed: float) -> dict[str, tuple[float, float]]:
    """fit_engine_terms' bounds for sdpa_flop_s from the kernel's own timing (none without one)."""
    return {"sdpa_flop_s": (timed / SDPA_SPAN, timed * SDPA_SPAN)} if timed > 0 else {}


def prefill_attention_terms(spec, math: torch.dtype, lengths=ATTN_LENGTHS,
                            clock=time.perf_counter) -> tuple[float, float]:
    """(sdpa_flop_s, a call's own seconds) of the engine's prefill attention (core.model.attention.prefill_attention)
    timed alone, one prompt a call at each of `lengths`, in the math dtype the engine's activations have. Fitted
    only from what a whole prefill's other terms left unexplained, sdpa_flop_s came out 0 in three of six
    calibrations of the 784M and 1.7e-10 s a FLOP in one of four of the demo's (0.5-2.6e-11 in the others), and
    the runs' prefill at 308-token prompts took 0.56 of that calibration's prediction (bench/RESULTS.md, issue 11,
    fourteenth and fifteenth sessions): this timing bounds that fit (sdpa_range)."""
    from core.model.attention import prefill_attention

    d = hrm.dims(spec)
    g = torch.Generator().manual_seed(0)
    tick = clock_tick(clock)
    obs = []
    for n in lengths:
        if n > spec.max_position:
            continue
        q = torch.randn(n, spec.num_heads, spec.head_dim, generator=g).to(math)
        k = torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=g).to(math)
        v = torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=g).to(math)
        sec = _typical(lambda q=q, k=k, v=v: prefill_attention(q, k, v, spec.scale), reps=3, clock=clock, tick=tick)
        if sec is not None:
            obs.append((cpu_cost.prefill_attention_flops(d, 1, n), sec))
    if len(obs) < 2:
        return 0.0, 0.0
    flop_s, call_s = fit([[f, 1.0] for f, _ in obs], [t for _, t in obs])
    return flop_s, call_s


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
                        clock=time.perf_counter, repeats: int = PREFILL_REPEATS) -> list[Obs]:
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
        timed = []
        for _ in range(repeats):
            t0 = clock()
            _, busy = runner.prefill(prompts, list(range(p)), [list(range(p))])
            timed.append((clock() - t0, tc.take(busy)))
        wall, busy = sorted(timed, key=lambda x: x[0])[len(timed) // 2]
        out.append(Obs("prefill", p, n, busy, wall))
        progress(Progress("calibrating: prefills", i + 1, len(prefills), "shapes"))
    return out


def fresh_prefills(d, math_dtype: str, token_s: float, limit: int) -> list[tuple[int, int]]:
    """Two prefill calls of many prompts of the same length: one past the allocator's threshold as one piece
    (FRESH_OVER), one at a quarter of it (they anchor the per-prompt term at many prompts a call) — if at
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


def fit_engine_terms(engine, base: CpuCosts, obs: list[Obs],
                     bounds: dict[str, tuple[float, float]] | None = None) -> CpuCosts:
    """elem_s and task_s (and flush_s, where the L2 is known) from the dense work, kv_s, kv_copy_s and attn_row_s
    from attention, sdpa_flop_s, prompt_s and prefill_tok_s from prefills — each from what the terms already known
    leave unexplained. `bounds`: a prefill term's range from its own kernel's timing (sdpa_range): fitted outside it,
    the term is held at the nearer bound and the others are fitted around it."""
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
    # the dense work and experts do not grow with the context: what they took more at 384 tokens than at 48 is
    # the L2 the attention's longer stream evicted (flush_s, where the L2 is known)
    names = ("elem_s", "task_s", "flush_s") if base.l2_bytes else ("elem_s", "task_s")
    got = residual_fit([(o, dense) for o in dec], names, lambda o: o.busy.get("gpu", 0) / L,
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
        fresh = [o for o in pre if cpu_cost.fresh_tokens(d, base, o.b * o.length, o.length) > 0]
        names = ("sdpa_flop_s", "prompt_s", "prefill_tok_s")
        base = dataclasses.replace(base, **{n: 0.0 for n in names})
        warm = [(o, fn) for o in pre if o not in fresh]
        got = residual_fit(warm, names, busy, lambda o: fn(base, o))
        for name, (lo, hi) in (bounds or {}).items():
            v = got.get(name, 0.0)
            if not lo <= v <= hi:
                held = dataclasses.replace(base, **{name: min(hi, max(lo, v))})
                rest = residual_fit(warm, tuple(n for n in names if n != name), busy, lambda o, c=held: fn(c, o))
                got = {name: getattr(held, name), **rest}
        base = dataclasses.replace(base, **got)
        got = residual_fit([(o, fn) for o in fresh], ("prefill_act_s",), busy, lambda o: fn(base, o))
        base = dataclasses.replace(base, **got)
    return base


# ---- 3. the engine's own step overhead -------------------------------------------------------------------
def fit_step_terms(engine, base: CpuCosts, batches=(1, 8, 32), clock=time.perf_counter) -> CpuCosts:
    """step_s and seq_s: what a decode step of `Engine.generate` costs beyond its tasks and its LM head."""
    from core.runtime.engine import Request

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
