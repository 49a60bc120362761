"""The CPU's measured cost model: what each task of a CPU-only step costs on *this* machine.

A roofline with one efficiency factor cannot hold both a batch-1 GEMV (bandwidth-bound), a decode
GEMM with 16 rows per expert and a prefill GEMM with thousands; so a GEMM of M rows over an N×K
weight is costed as  flop_s·2MNK + weight_s·NK + call_s  — affine in M, the smoothed roofline whose
intercept is reading the weight (its bandwidth and the small-M loss of the kernel). Decode attention
costs kv_s per K/V element read plus attn_row_s per (request, KV head) row; elementwise work elem_s
per activation element; and every task, step and request its measured overhead. `mlight bench
--calibrate` measures the coefficients (core.runtime.calibrate) and then how much slower each kind of
task runs inside a short run of the whole engine than those pieces say (the `*_eff` factors: in a run
the tasks follow one another over a working set the isolated measurements never see together); this
module stores them per machine
and per CPU math dtype (cached like the probe) and turns them into the HRM's TaskCosts for the
CPU-only placement, so the planner, `predict` and the simulator all use them.

Boundary: pure functions of (Dims, CpuCosts, numbers) plus the cache file. Legend as in core.plan.hrm.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from math import log
from dataclasses import dataclass
from pathlib import Path

from core.model import limits
from core.model.attention import slices

VERSION = 15  # 2: attention costs whole rows and slices apart (kv_copy_s); 3: a run's efficiency folded back;
# 4: the experts' terms are the fused kernel's where it runs (expert_chunk), prefill's fresh activations;
# 5: the run's efficiency measured at a second, large micro-batch too (the *_eff_large factors); 6: a CPU prefill's
# FFN runs 2,048 tokens at a time, and the run's windows last RUN_MIN_S; 7: a prefill's per-token term
# (prefill_tok_s); 8: the large micro-batch's factors over a fresh process's waves too; 9: a CPU prefill's token
# mixer runs in chunks too, of the model's size (core.model.limits.prefill_chunk); 10: a run's state cache made
# (kv_alloc_s); 11: the state cache made untouched (kvcache.untouched_zeros): a 10's kv_alloc_s priced what runs
# no longer pay; 12: the factors at a micro-batch between the two too (*_eff_mid); the fused attention
# kernel's scores priced by its own per-token term, not elem_s; 13: the CPU's speed stamped (`speed`) and every
# window brought to the pieces' speed (core.plan.cpu_speed); 14: the prefills' fit of sdpa_flop_s bounded by
# the prefill attention timed alone (core.runtime.calibrate_pieces.sdpa_range); 15: a decode step's norms, RoPE
# and cache writes in C (core.model.cpu.row_ops), and an AVX2 CPU's experts in its fp32-math C kernel (3-4x
# the widened tiles): a 14's terms priced kernels that no longer run

# A run of the engine against its pieces (core.runtime.calibrate.fit_run_terms): seconds a task kind took in
# the run over what the fitted coefficients say for the same steps. 1.0 = not measured.
EFFICIENCIES = ("pre_eff", "attn_eff", "post_eff", "ffn_eff", "prefill_eff")
# ... and the same factors measured in a run at a large micro-batch (`large_rows` requests a micro-batch, prompts a
# prefill call): a factor measured at 4 scaled a task's per-call overheads as if they grew with its rows, and the
# demo model's tasks, mostly overhead, ran 0.4-0.6x that at 256 (its prefill, in a fresh process, 1.5-1.8x)
LARGE = {n: n + "_large" for n in EFFICIENCIES}
# ... and at a micro-batch between the two (`mid_rows`): the factors do not move with the log of the rows between
# 4 and 256. The demo model's decode at 36 requests a micro-batch (a planner's batch for 256 requests, seven
# micro-batches a layer) took 0.78-0.97x (mean 0.86) what the two ends' factors said there, in five processes on
# two Zen 5 threads; runs at 252/36 read -17.6 / -23.8 % off the ends' prediction, -8.0 / -12.2 % off one with
# this anchor (bench/RESULTS.md, issue 11, thirteenth session)
MID = {n: n + "_mid" for n in EFFICIENCIES}
FACTORS = (*EFFICIENCIES, *LARGE.values(), *MID.values())  # every run factor, at every anchor


@dataclass(frozen=True)
class CpuCosts:
    math: str  # the CPU math dtype (kernel) these were measured with
    flop_s: float  # dense GEMMs (QKV, O, router, shared expert, LM head): seconds per FLOP (1 / sustained peak)
    weight_s: float  # ... per weight element a call reads
    call_s: float  # ... per call
    expert_flop_s: float = 0.0  # the routed experts' kernel (prepacked, widened or plain): per FLOP
    expert_weight_s: float = 0.0  # ... per weight element
    expert_call_s: float = 0.0  # ... per call
    gemv_s: float = 0.0  # an expert call of ≤ direct_rows rows reads its narrow weights directly: per element
    direct_rows: int = 0
    # the fused expert kernel (core.model.cpu.ffn) takes at most this many tokens a call, each call reading every
    # expert it routes to again; its SwiGLU, gathers and scatter run inside it (in the expert terms, not elem_s).
    # 0: per-expert GEMMs (oneDNN's or widened), one call per expert whatever the tokens
    expert_chunk: int = 0
    # weights that stay in the last-level cache between steps cost less to read: per element when
    # cached (0 = not measured: the model is larger than the cache), and the cache's size
    weight_hot_s: float = 0.0
    expert_weight_hot_s: float = 0.0
    cache_bytes: int = 0
    elem_s: float = 0.0  # seconds per activation element of elementwise work (norms, RoPE, SwiGLU, gathers)
    kv_s: float = 0.0  # seconds per K or V element decode attention reads (whole cache rows, as views)
    kv_copy_s: float = 0.0  # ... per element of the first T positions, sliced (copied) out of longer rows
    widens: bool = False  # attention widens the KV (bf16 on AVX2): it always slices, never reads whole rows
    attn_row_s: float = 0.0  # seconds per (request, KV head) row of decode attention
    # Decode attention in the fused C kernel (core.model.cpu.native) reads each request's own cached tokens in
    # place, whatever the row or the micro-batch's longest, widening in registers; its requests are split over
    # `threads` threads by Σ length, so a call takes as long as its largest share (own_seconds)
    own_rows: bool = False
    # ... and each of its calls over more than one thread costs this: waking its threads and joining them (on
    # this VM 0.1-0.2 ms a call, flat in requests and tokens; a one-request call runs on its caller alone)
    attn_call_s: float = 0.0
    sdpa_flop_s: float = 0.0  # seconds per FLOP of prefill attention
    task_s: float = 0.0  # overhead per task of the step graph (Python, dispatch, small ops)
    # A micro-batch's decode attention streams its KV through each core's L2 (`l2_bytes`), and the tasks after it
    # then fetch their weights, code and buffers again: the demo's post-attention tasks took +70 µs each at 64 and
    # 128 requests of ~380 tokens (6-12 MB of KV a call), none at 64 of ~90 (1.5 MB; AVX2 limits, two Xeon
    # threads with 2 MB of L2 each; bench/RESULTS.md, issue 11, twenty-second session). Seconds a decode layer's
    # post-attention and expert tasks pay after a stream that fills the L2 (flush_share); 0: not measured
    flush_s: float = 0.0
    l2_bytes: int = 0  # one core's L2 (core.platform.l2_bytes); 0: not known, no flush priced
    prompt_s: float = 0.0  # overhead per prompt in a prefill task (its own attention call)
    # per token of a prefill call: work the decode steps' pieces do not show, which grows with a call's tokens
    # (routing's sort and gathers over the whole call, the experts' scatter back). The demo's prefill ran 38-42 µs
    # a token at 1,237-19,708 tokens a call whatever the prompts' lengths, 2.2x what its GEMMs and elementwise
    # terms say; without this term the fit gave the gap to attention, 8x its measured cost a FLOP, and priced
    # prompts of 308 tokens at 1.5-2x what they took (bench/RESULTS.md, issue 11, ninth session)
    prefill_tok_s: float = 0.0
    prefill_act_s: float = 0.0  # per activation element (token x hidden) of a prefill call mapped fresh (fresh_tokens)
    step_s: float = 0.0  # overhead per engine step (embedding, sampling set-up, bookkeeping)
    seq_s: float = 0.0  # overhead per request per step (sampling, stop checks)
    wave_s: float = 0.0  # overhead per prefill step beyond step_s: admitting a wave (its runner and cache made,
    # prompts tokenized, in a fresh process the first buffers faulted in), measured in the calibration's run
    # once a run, per token of its prefill calls (a micro-batch's prompts): a fresh process's first large call maps
    # and faults in its memory — the demo's first call of 256 prompts (19,700 tokens) took 2.1 s, the next 0.9 s,
    # one of 4 prompts 0.07 then 0.06 (bench/RESULTS.md, issue 11, seventh session)
    fresh_s: float = 0.0
    # once a run, per byte of its state cache: what making it takes at admission. Zeroed, every page faulted in, it
    # was 5.9 s of the 784M's 4x-prompts run (3.6 GB for 256 slots of 1,704 tokens; bench/RESULTS.md, issue 11,
    # eleventh session); made untouched (core.model.kvcache.untouched_zeros) its pages fault in where requests
    # write them, inside their prefill and decode tasks, and this measures what admission still pays (~0)
    kv_alloc_s: float = 0.0
    pre_eff: float = 1.0  # decode tasks in a run of the engine / the coefficients' prediction: pre-attention,
    attn_eff: float = 1.0  # ... attention,
    post_eff: float = 1.0  # ... post-attention,
    ffn_eff: float = 1.0  # ... routed experts,
    prefill_eff: float = 1.0  # ... and prefill tasks
    run_batch: tuple = ()  # (batch, micro-batch) of the run the factors were measured in; () = never
    # the factors in a run at `large_rows` requests a micro-batch (0: not measured, the factors above hold at any
    # size); between the two micro-batches a factor moves with the log of the rows (`eff`), and stays past either
    large_rows: int = 0
    pre_eff_large: float = 1.0
    attn_eff_large: float = 1.0
    post_eff_large: float = 1.0
    ffn_eff_large: float = 1.0
    prefill_eff_large: float = 1.0
    # ... and in a run at `mid_rows` requests a micro-batch, between the two (0: not measured); `eff` then moves
    # with the log of the rows from the small micro-batch's factors to these, and on to the large one's
    mid_rows: int = 0
    pre_eff_mid: float = 1.0
    attn_eff_mid: float = 1.0
    post_eff_mid: float = 1.0
    ffn_eff_mid: float = 1.0
    prefill_eff_mid: float = 1.0
    run_windows: int = 0  # windows of that run the decode factors are the median of (0: never measured)
    threads: int = 0  # torch threads when measured
    model: str = ""  # model_key() of the model the costs were measured on
    model_bytes: int = 0  # its weights, for picking the nearest calibration for another model
    measured: bool = True  # False: `defaults`, the model of a machine never calibrated
    # the CPU's speed (core.plan.cpu_speed.measure, FLOP/s) these seconds hold at: the calibration's pieces were
    # measured at it and its run's windows brought to it; 0 = not measured (seconds as measured, whenever)
    speed: float = 0.0

    def gemm(self, rows: float, n: int, k: int, mats: float = 1.0, expert: bool = False) -> float:
        """`mats` GEMMs over N×K weights with `rows` rows between them (dense, or the experts' kernel)."""
        if not expert:
            return self.flop_s * 2 * rows * n * k + (self.weight_s * n * k + self.call_s) * mats
        return self.expert_flop_s * 2 * rows * n * k + (self.expert_weight_s * n * k + self.expert_call_s) * mats

    def gemv(self, n: int, k: int, mats: float = 1.0) -> float:
        """`mats` expert calls of ≤ direct_rows rows: they read the narrow weights directly."""
        return (self.gemv_s * n * k + self.expert_call_s) * mats

    def for_step(self, kv_bytes: float) -> "CpuCosts":
        """The costs of a step that streams `kv_bytes` of KV cache (what attention reads, not the rows
        allocated: read_tokens): the weights stay cached only as far as the cache holds them beside that
        stream (a model larger than the cache never does)."""
        if not self.cache_bytes or not self.model_bytes or not (self.weight_hot_s or self.expert_weight_hot_s):
            return self
        hot = min(1.0, max(0.0, (self.cache_bytes - kv_bytes) / self.model_bytes))
        blend = lambda cold, warm: warm * hot + cold * (1 - hot) if warm else cold  # noqa: E731
        return dataclasses.replace(self, weight_s=blend(self.weight_s, self.weight_hot_s),
                                   expert_weight_s=blend(self.expert_weight_s, self.expert_weight_hot_s),
                                   weight_hot_s=0.0, expert_weight_hot_s=0.0)

    def anchors(self) -> list[tuple[int, dict]]:
        """The micro-batches the run's factors were measured at, ascending, each with its factors' names
        (EFFICIENCIES' own, MID's, LARGE's): the small run's, and the mid and large ones' where measured."""
        small = self.run_batch[1] if len(self.run_batch) > 1 else 0
        out = [(small, {n: n for n in EFFICIENCIES})]
        if small and self.large_rows > small:
            if small < self.mid_rows < self.large_rows:
                out.append((self.mid_rows, MID))
            out.append((self.large_rows, LARGE))
        return out

    def nearest(self, rows: float) -> dict:
        """The factors' names (as `anchors`) of the measured micro-batch nearest `rows` in the log of the rows."""
        at = [(abs(log(max(rows, 1) / max(m, 1))), names) for m, names in self.anchors()]
        return min(at, key=lambda x: x[0])[1]

    def eff(self, name: str, rows: float) -> float:
        """The run's efficiency factor `name` (EFFICIENCIES) for a task of `rows` requests (prompts): a measured
        micro-batch's, or between two of them with the log of the rows; past either end, that end's."""
        pts = [(m, getattr(self, names[name])) for m, names in self.anchors()]
        if len(pts) == 1 or rows <= pts[0][0]:
            return pts[0][1]
        for (m0, f0), (m1, f1) in zip(pts, pts[1:]):
            if rows < m1:
                return f0 + (f1 - f0) * log(rows / m0) / log(m1 / m0)
        return pts[-1][1]

    def at_speed(self, now: float) -> "CpuCosts":
        """These costs on a CPU running at `now` (cpu_speed.measure's FLOP/s) rather than at `speed`: every
        seconds term scaled by speed / now (the run's factors are ratios and stay); unchanged where either is
        unknown."""
        if not (self.speed > 0 and now > 0):
            return self
        r = self.speed / now
        return dataclasses.replace(self, speed=now, **{n: getattr(self, n) * r for n in SECONDS})

    def unscaled(self) -> "CpuCosts":
        """These coefficients with every run factor 1 at every size: the pieces alone."""
        return dataclasses.replace(self, **{n: 1.0 for n in EFFICIENCIES}, large_rows=0, mid_rows=0)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "run_batch": list(self.run_batch)}  # as JSON has it

    @classmethod
    def from_dict(cls, d: dict) -> "CpuCosts":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        if "run_batch" in d:  # JSON has lists; the dataclass is frozen and hashable
            d["run_batch"] = tuple(d["run_batch"] or ())
        return cls(**d)


# every seconds term of CpuCosts (what a slower or faster CPU scales: CpuCosts.at_speed, the pieces' fit's unknowns)
SECONDS = tuple(f.name for f in dataclasses.fields(CpuCosts)
                if f.type in ("float", float) and f.name not in FACTORS and f.name != "speed")


# ---- before any calibration -------------------------------------------------------------------------
# Before a machine is calibrated its CPU-only predictions use the probe's rates with the shares and
# overheads below, fitted to what `mlight bench --calibrate` measured on a Zen 5 box (2 threads, quiet: the
# demo model in fp32 and the 784M Mixtral of bench/cpu_vs_hf.py in bf16; bench/RESULTS.md, issue 11). The
# overheads are the engine's Python and dispatch, CPU-bound, so they do not shrink with cores. Before them
# the uncalibrated prediction was the probe's roofline plus 30 µs a task: ~7x too fast on the demo model
# (5,700 tok/s predicted, 600-850 measured), whose steps are mostly overhead.
DEFAULT_READ = 0.45  # dense weights, and experts outside oneDNN's prepacked layout: a share of the bandwidth
DEFAULT_PACKED_READ = 1.2  # prepacked bf16 experts (oneDNN's blocked layout streams better than the probe's sum)
# ... but not one token at a time: an expert call of one row is a GEMV over the blocked layout, which read
# 36 GB/s of a 50.7 GB/s probe on two Zen 5 cores (bench/quant_predict.py, batch 1: priced at 1.2 it made
# bf16's experts 1.4x too fast there, and so int4's speed-up over bf16 at batch 1 1.24x against 1.75x)
DEFAULT_PACKED_GEMV_READ = 0.7
DEFAULT_WIDEN_READ = 0.2  # weights stored narrower than the math (bf16 on AVX2), widened tile by tile
DEFAULT_KV_READ = 0.5  # decode attention's K/V
DEFAULT_SDPA = 0.5  # prefill attention: a share of the matmul rate
DEFAULT_CALL = {"plain": 2.2e-6, "packed": 18e-6}  # per GEMM call (a prepacked weight dispatches through Python)
DEFAULT_ELEM = 1.0e-9  # per activation element of elementwise work
DEFAULT_ROW = 0.2e-6  # per (request, KV head) row of decode attention
DEFAULT_TASK, DEFAULT_STEP, DEFAULT_SEQ, DEFAULT_PROMPT = 85e-6, 200e-6, 5e-6, 350e-6


def defaults(math: str, flops: float, bw: float, storage_bytes: int, kv_bytes: int, threads: int = 0) -> CpuCosts:
    """The cost model of a machine never calibrated: the probe's `flops` (matmuls in `math`) and read
    bandwidth `bw`, with the shares and overheads above. Weights stored narrower than the math (bf16 on
    AVX2) are read at their own width and widened in cache."""
    packed = math == "bfloat16"  # bf16 math is chosen only where it is native, and then oneDNN prepacks
    widened = math == "float32" and storage_bytes < 4
    read = storage_bytes / ((DEFAULT_WIDEN_READ if widened else DEFAULT_READ) * bw)
    expert_read = storage_bytes / ((DEFAULT_PACKED_READ if packed else DEFAULT_WIDEN_READ if widened
                                    else DEFAULT_READ) * bw)
    call = DEFAULT_CALL["packed" if packed else "plain"]
    kv = kv_bytes / (DEFAULT_KV_READ * bw)
    gemv = dict(gemv_s=storage_bytes / (DEFAULT_PACKED_GEMV_READ * bw), direct_rows=1) if packed else {}
    return CpuCosts(math=math, flop_s=1 / flops, weight_s=read, call_s=call, expert_flop_s=1 / flops,
                    expert_weight_s=expert_read, expert_call_s=call, **gemv, elem_s=DEFAULT_ELEM, kv_s=kv,
                    kv_copy_s=3 * kv, widens=math == "float32" and kv_bytes < 4,
                    attn_row_s=DEFAULT_ROW, sdpa_flop_s=1 / (DEFAULT_SDPA * flops), task_s=DEFAULT_TASK,
                    prompt_s=DEFAULT_PROMPT, step_s=DEFAULT_STEP, seq_s=DEFAULT_SEQ, threads=threads, measured=False)


# ---- the CPU-only layer's tasks --------------------------------------------------------------------
def _experts(d, tokens: float) -> tuple[float, float]:
    """(distinct experts touched, rows each) for `tokens` routed tokens (uniform routing)."""
    from core.plan.hrm import expected_experts

    e = max(expected_experts(tokens, d.E, d.k), 1e-9)
    return e, tokens * d.k / e


def dense_seconds(d, c: CpuCosts, t: float) -> tuple[float, float]:
    """(pre-attention, post-attention) of t tokens: QKV + norm + RoPE; O + norm + router + shared expert."""
    qkv = d.q + 2 * d.kv
    pre = c.gemm(t, qkv, d.D) + c.elem_s * t * (3 * d.D + 3 * qkv)
    post = c.gemm(t, d.D, d.q) + c.gemm(t, d.E, d.D) + c.elem_s * t * (5 * d.D + 3 * d.E)
    if d.Is:
        post += c.gemm(t, 2 * d.Is, d.D) + c.gemm(t, d.D, d.Is) + c.elem_s * t * (3 * d.Is + 2 * d.D)
    return pre, post


def _direct(d, t: float, direct_rows: int) -> tuple[float, float]:
    """(experts, rows) expected among the experts that get 1..direct_rows of t tokens: an expert's rows are
    Binomial(t, k/E) under uniform routing, so even at 1.5 rows per expert on average some get four."""
    if not direct_rows or t < 1:
        return 0.0, 0.0
    from math import comb

    n, p = int(round(t)), d.k / d.E
    probs = [comb(n, r) * p ** r * (1 - p) ** (n - r) for r in range(1, min(direct_rows, n) + 1)]
    return d.E * sum(probs), d.E * sum(r * q for r, q in enumerate(probs, 1))


def experts_seconds(d, c: CpuCosts, t: float) -> float:
    """Routed experts of t tokens in one expert batch: each touched expert's two GEMMs (GEMVs for the
    experts with ≤ direct_rows rows, where narrow weights are read directly), plus the gather, SwiGLU,
    scaling and scatter of the t·k routed rows; or the fused kernel's calls (fused_experts_seconds)."""
    if c.expert_chunk:
        return fused_experts_seconds(d, c, t)
    e, _rows = _experts(d, t)
    rows = t * d.k
    few_e, few_rows = _direct(d, t, c.direct_rows)
    many_e, many_rows = max(0.0, e - few_e), max(0.0, rows - few_rows)
    return (c.gemm(many_rows, 2 * d.I, d.D, many_e, expert=True) + c.gemm(many_rows, d.D, d.I, many_e, expert=True)
            + c.gemv(2 * d.I, d.D, few_e) + c.gemv(d.D, d.I, few_e) + c.elem_s * rows * (3 * d.D + 3 * d.I))


def fused_experts_seconds(d, c: CpuCosts, t: float) -> float:
    """The fused kernel's routed experts of t tokens: `expert_chunk` tokens a call — a prefill of 4,900 tokens
    is ten calls, each reading the experts' weights again (priced as one, a prefill's experts per token
    looked 17 % cheaper at 64 prompts a call than at 4; measured: the same) — and in a call, the slower of
    its arithmetic and its weights: it streams the weights while it computes. On two Zen 5 cores the
    784M's layer took 4.0-4.4 ms from 8 to 64 tokens (the weights) and 7, 14, 28 ms at 128, 256, 512
    (the arithmetic): their sum, the per-expert GEMMs' shape, was 20-29 % off at both ends."""
    return _in_chunks(t, c.expert_chunk, lambda n: _fused_call(d, c, n))


def _in_chunks(t: float, chunk: int, cost) -> float:
    """`cost(n)` summed over t tokens taken `chunk` at a time (whole chunks, then the rest)."""
    whole = int(t // chunk)
    rest = t - whole * chunk
    return whole * cost(chunk) + (cost(rest) if rest > 0 else 0.0)


def _fused_call(d, c: CpuCosts, t: float) -> float:
    e, _rows = _experts(d, t)
    per = 3 * d.I * d.D  # weight elements of one expert (gate and up, down)
    return max(c.expert_flop_s * 2 * t * d.k * per, c.expert_weight_s * e * per) + c.expert_call_s * e


def attention_seconds(d, c: CpuCosts, b: float, context: float, row_tokens: float | None = None,
                      longest: float | None = None, lengths: list[int] | None = None) -> float:
    """Decode attention of b requests over `context` cached tokens each (and the new token's KV write).
    The fused kernel (`own_rows`) reads each request's own tokens, `lengths` when known, else a workload's
    spread (own_shares). Otherwise as core.model.attention.decode_attention chooses (`slices`): rows
    whole (views, masked past each length), or the first `longest` positions copied out; a widening
    engine always copies."""
    hkv = d.kv // d.head_dim
    if c.own_rows:
        # scores and softmax run inside the kernel, in its per-token term (kv_s), not as torch's elementwise ops:
        # priced at elem_s a score they made the 784M's attention cost per token 3x what the kernel's fit said,
        # the 4x prompts' attention read 0.44-0.69 of predicted and the demo's 0.33-0.54 (elem_s, fitted from
        # the dense work, left the per-token fit nothing: kv_s 0); only the new token's K and V are torch's
        tokens, rows, parts = own_shares(c, b, context, longest, lengths)
        return (c.kv_s * tokens * 2 * d.kv + c.attn_row_s * rows * hkv + (c.attn_call_s if parts > 1 else 0.0)
                + c.elem_s * b * 2 * d.kv)
    n = read_tokens(c, context, row_tokens, longest)
    whole = n == max(context, row_tokens or 0.0) and not c.widens  # rows read in place, else a slice copied out
    kv = (c.kv_s if whole else c.kv_copy_s) * b * n * 2 * d.kv
    return kv + c.attn_row_s * b * hkv + c.elem_s * b * (2 * d.kv + 4 * d.heads * n)


def own_shares(c: CpuCosts, b: float, context: float, longest: float | None = None,
               lengths: list[int] | None = None) -> tuple[float, float, float]:
    """(tokens, requests) the fused kernel's slowest thread reads in a call, times the threads: the call's
    span in units of a token (a request) read by all of them at once; and the threads the call uses. Its threads each take a run of
    requests by Σ length (native.cuts), the request that crosses a share going whole to the earlier run,
    so a share overshoots by part of a request, and a call of fewer requests than threads leaves some idle.
    Known `lengths` are split as the kernel splits them; a workload's spread (`longest` above `context`:
    the planner's micro-batch) overshoots by half a mean request, as the engine's micro-batches do
    (longest-first into the emptiest, cut by length: 1.26-1.30x the mean at 4 requests, 2 threads)."""
    from core.model.cpu.native import cuts

    threads = max(1, c.threads)
    if lengths:
        parts = min(threads, len(lengths))
        bounds = cuts(lengths, parts)
        share = max(range(parts), key=lambda j: sum(lengths[bounds[j]:bounds[j + 1]]))
        return (threads * sum(lengths[bounds[share]:bounds[share + 1]]),
                float(threads * (bounds[share + 1] - bounds[share])), float(parts))
    parts = max(1.0, min(float(threads), b))
    uneven = (longest or context) > context or b % parts
    return threads * (b * context / parts + (context / 2 if uneven else 0.0)), threads * b / parts, parts


def read_tokens(c: CpuCosts, context: float, row_tokens: float | None = None, longest: float | None = None) -> float:
    """Cached tokens decode attention reads per request: its own (the fused kernel), the micro-batch's
    `longest` context, copied out, or whole rows (attention_seconds). What a step streams through the
    cache beside the weights (for_step)."""
    if c.own_rows:
        return context
    row = max(context, row_tokens or 0.0)
    t = max(context, longest or context)
    return t if c.widens or slices(t, row) else row


def head_seconds(d, c: CpuCosts, tokens: float) -> float:
    """Per step: final norm + LM head over `tokens` rows, sampling, and the step's own overhead."""
    return c.gemm(tokens, d.V, d.D) + c.elem_s * tokens * (4 * d.D + 2 * d.V) + c.step_s + c.seq_s * tokens


# A tensor larger than this is mapped fresh from the OS at every allocation and page-faulted as it is first
# written (glibc's largest mmap threshold; smaller ones are reused from the heap). A prefill layer makes a dozen
# [tokens, hidden] activations a chunk (fresh_tokens): when it made them a call, on two Zen 5 cores the 784M's
# prefill ran 67-69 µs a token per layer from 277 to 4,879 tokens a call and 77-85 µs at 19,497 — its norms, sums
# and copies 4x slower a token — and 67-68 µs again at 19,497 with the allocator told to keep its memory. In
# chunks only a prompt longer than one can reach it.
FRESH_BYTES = 32 << 20


def fresh_from(d, math: str) -> float:
    """Tokens of a prefill call from which a [tokens, hidden] activation in `math` is over FRESH_BYTES."""
    return FRESH_BYTES / (d.D * (2 if math == "bfloat16" else 4))


def fresh_tokens(d, c: CpuCosts, t: float, prompt_len: float = 0.0) -> float:
    """Tokens of a prefill call of t tokens in prompts of `prompt_len` whose activations are mapped fresh
    (FRESH_BYTES): the engine runs a call a chunk at a time (prefill_chunk), a longer prompt alone, so by what
    a chunk spans — none while a [span, hidden] activation in the math dtype is under half of FRESH_BYTES, all
    from the whole of it, in between a ramp (its fp32 temporaries and the wider QKV cross first)."""
    hi = fresh_from(d, c.math)
    span = min(t, max(prefill_chunk(d), prompt_len))
    return t * min(1.0, max(0.0, 2 * span / hi - 1))


def prefill_chunk(d) -> int:
    """Tokens a CPU prefill runs a layer on at a time for a model of dims `d` (core.model.limits)."""
    return limits.prefill_chunk(d.D, d.q, d.kv, d.I, d.Is, d.Id, d.E, d.k)


def prefill_seconds(d, c: CpuCosts, prompts: float, prompt_len: float, prompt_sq: float | None = None) -> float:
    """One CPU-only prefill task: a micro-batch of `prompts` prompts of `prompt_len` tokens on average
    through one layer; `prompt_sq` is the mean of the squared prompt lengths (causal attention grows
    with it: a spread of lengths costs more than equal prompts of the same mean)."""
    t = prompts * prompt_len
    pre, post = dense_seconds(d, c, t)
    flops = prefill_attention_flops(d, prompts, prompt_len, prompt_sq)
    spill = c.prefill_act_s * fresh_tokens(d, c, t, prompt_len) * d.D
    return (pre + post + prefill_experts_seconds(d, c, t) + c.sdpa_flop_s * flops + c.prompt_s * prompts
            + c.prefill_tok_s * t + spill + c.task_s) * c.eff("prefill_eff", prompts)


def prefill_attention_flops(d, prompts: float, prompt_len: float, prompt_sq: float | None = None) -> float:
    """FLOPs of one layer's causal attention over `prompts` prompts of `prompt_len` tokens (`prompt_sq`: the
    mean of their squared lengths), as sdpa_flop_s prices them."""
    sq = prompt_sq if prompt_sq is not None else prompt_len * prompt_len
    return 4 * prompts * ((sq + prompt_len) / 2) * d.heads * d.head_dim


def prefill_experts_seconds(d, c: CpuCosts, t: float) -> float:
    """A CPU prefill call's routed experts of t tokens: a chunk at a time (prefill_chunk)."""
    return _in_chunks(t, prefill_chunk(d), lambda n: experts_seconds(d, c, n))


def decode_tasks(d, c: CpuCosts, *, micro_batch: float, expert_batch: float, context: float,
                 row_tokens: float | None = None, longest: float | None = None,
                 lengths: list[int] | None = None) -> dict[str, float]:
    """Seconds of one task of each kind of a CPU-only decode layer (core.runtime.schedule._cpu_only);
    `longest`: the longest context in a micro-batch, `lengths` its requests' own when known (attention_seconds).
    Post-attention carries what the tasks after the attention pay once its KV stream evicted the L2 (flush_s)."""
    pre, post = dense_seconds(d, c, micro_batch)
    attn = attention_seconds(d, c, micro_batch, context, row_tokens, longest, lengths)
    mb = micro_batch
    flush = c.flush_s * flush_share(c, micro_batch * context * d.kv_tok_layer) if c.flush_s else 0.0
    return {"pre_attn": (pre + c.task_s) * c.eff("pre_eff", mb), "cpu_attn": (attn + c.task_s) * c.eff("attn_eff", mb),
            "post_attn": (post + c.task_s + flush) * c.eff("post_eff", mb),
            "ffn": (experts_seconds(d, c, expert_batch) + c.task_s) * c.eff("ffn_eff", expert_batch)}


def flush_share(c: CpuCosts, stream_bytes: float) -> float:
    """How much of flush_s a decode layer pays after an attention task streaming `stream_bytes` of KV over
    c.threads cores: none while a core's share is under half its L2, all from one and a half L2s, a ramp between
    (at 1.5 MB a core of a 2 MB L2 the demo's tasks after it took +8 µs, at 3 MB +70)."""
    if not c.l2_bytes:
        return 0.0
    per_core = stream_bytes / max(1, c.threads)
    return min(1.0, max(0.0, per_core / c.l2_bytes - 0.5))


# ---- the cache: per machine, by math dtype and model -------------------------------------------------
def model_key(d) -> str:
    """The shapes that decide a model's CPU costs (a core.plan.hrm.Dims)."""
    return f"L{d.layers}-D{d.D}-q{d.q}-kv{d.kv}-E{d.E}x{d.I}-k{d.k}-s{d.Is}-V{d.V}-b{d.dt}"


def pick(entries: dict, d=None) -> CpuCosts | None:
    """From {model_key: costs dict}, the costs measured on this model, else on the model nearest in size."""
    if not entries:
        return None
    if d is not None and model_key(d) in entries:
        return CpuCosts.from_dict(entries[model_key(d)])
    import math

    size = d.total_bytes if d is not None else 0
    best = min(entries.values(), key=lambda c: abs(math.log(max(c.get("model_bytes") or 1, 1) / max(size, 1))))
    return CpuCosts.from_dict(best)


def cache_path(hw) -> Path:
    from core.plan.hardware import cache_dir, machine_key

    return cache_dir() / "calibration" / f"v{VERSION}-{machine_key(hw)}.json"


# What a calibration measured depends on more than the machine (machine_key): the engine's CPU kernels (their
# C sources and the Python that dispatches them), torch, and mlight's version. Any of them changed, the
# calibration and its history (core.plan.cpu_history) describe another engine, and are measured again.
# besides every module of core.model.cpu:
FINGERPRINT_MODULES = ("core.model.moe", "core.model.attention", "core.model.expert_choice")


def _fingerprint_files() -> list[Path]:
    """The files whose contents the fingerprint hashes (found without importing them: no torch here)."""
    from importlib.util import find_spec

    from core.assets import HERE

    files = sorted((HERE / "kernels").glob("*.c"))
    files += sorted(Path(next(iter(find_spec("core.model.cpu").submodule_search_locations))).glob("*.py"))
    # the int4 kernel computes quantized experts only, which the calibration does not measure (nor folds back)
    return [f for f in files if not f.name.startswith("int4")] + [Path(find_spec(m).origin) for m in FINGERPRINT_MODULES]


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of what decides the CPU's speed besides the hardware: the kernels' sources, torch, mlight."""
    from importlib import metadata

    h = hashlib.sha256(str(VERSION).encode())
    for dist in ("torch", "mlight"):
        try:
            h.update(f"{dist}={metadata.version(dist)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=?;".encode())
    for f in _fingerprint_files():
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def read(hw) -> dict:
    """This machine's calibration file as stored ({} when absent, damaged, or of other code: code_fingerprint)."""
    try:
        raw = json.loads(cache_path(hw).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) and raw.get("fingerprint") == code_fingerprint() else {}


def write(hw, data: dict) -> Path:
    from core.plan.hardware import _write_json

    path = cache_path(hw)
    _write_json(path, {**data, "fingerprint": code_fingerprint()})
    return path


def load(hw) -> dict[str, dict[str, dict]]:
    """This machine's calibrations: {math dtype: {model_key: costs dict}} ({} when never calibrated)."""
    try:
        raw = read(hw)["cpu"]
        return {m: {k: CpuCosts.from_dict(v).to_dict() for k, v in per.items()} for m, per in raw.items()}
    except (KeyError, TypeError, AttributeError):
        return {}


def save(hw, costs: CpuCosts) -> Path:
    """Add (or replace) the costs of `costs.math` on `costs.model`, keeping every other entry (and the history)."""
    data = read(hw)
    known = load(hw)
    known.setdefault(costs.math, {})[costs.model] = costs.to_dict()
    return write(hw, {**data, "cpu": known})
