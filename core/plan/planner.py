"""Policy search (`plan`), what a policy overfills (`validate`) and what it costs (`predict`). Memory is counted
item by item as the runtime allocates it (core.runtime.pipeline); task costs are core.plan.hrm's. Never prints.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

from core.plan import hrm
from core.plan.parallel import rank_view
from core.errors import BudgetError, UsageError
from core.plan.hardware import HardwareSpec
from core.plan.policy import Policy, Prediction, dense_layers, expert_split, kv_gpu_layers
from core.plan.workload import Workload  # noqa: F401 (planner.Workload: the planner's input)
from core.model.limits import LOGIT_CHUNK_BYTES
from core.model.limits import FUSED_MAX_TOKENS as FUSED_TOKENS  # longer dense expert calls take grouped_mm
from core.model.limits import fused_block_rows, fused_slots
from core.model.limits import STAGING_ALIGN as ALIGN  # the runtime's host staging arena aligns each buffer to this
from core.model.spec import ModelSpec
from core.telemetry import RESOURCES

# Share of a budget the plan may use: the paper's 0.86 of GPU memory (CUDA context, allocator
# fragmentation) and 0.8 of CPU memory (the OS, the page cache, the rest of the process).
GPU_USABLE = 0.86
CPU_USABLE = 0.80
MAX_BATCH = 8192  # beyond this the KV cache of any real workload is the limit anyway
PLACEMENTS_GPU = (("cpu", "gpu"), ("gpu", "gpu"), ("cpu", "cpu"))
RC_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)  # r_c values tried by the fast path; the LP refines them
TIE_BREAK = 1e-6  # weight of the summed busy time: among equally fast policies, prefer less work
REFINE = 6  # (placement, μ) pairs whose smaller batches and neighbouring μ the search also tries
DENSE_MU = 1024  # μ up to here on the paper's full grid; beyond, sparser (then refined)
CPU_ONLY_WORDS = {"compute": "CPU compute and memory bandwidth (dense layers and experts on the CPU)",
                  "cpu_attn": "CPU attention (host memory bandwidth reading the KV cache)"}


@dataclass(frozen=True)
class Budget:
    gpu_bytes: int  # all GPUs together
    cpu_bytes: int

    def __post_init__(self):
        if self.gpu_bytes < 0 or self.cpu_bytes <= 0:
            raise UsageError(f"memory budget must be positive, got GPU {self.gpu_bytes} and CPU {self.cpu_bytes} bytes",
                             "give --gpu-mem and --cpu-mem in GB")

    @classmethod
    def for_hardware(cls, hw: HardwareSpec, gpu_gb: float | None = None, cpu_gb: float | None = None) -> "Budget":
        """The machine's memory (what detect found free, else its total), or the user's GB figures."""
        if gpu_gb is not None and not gpu_gb >= 0:  # said back in the GB the user typed, not in bytes
            raise UsageError(f"--gpu-mem must be 0 or more GB, got {gpu_gb:g}", "give the GPU memory to use, in GB")
        if cpu_gb is not None and not cpu_gb > 0:
            raise UsageError(f"--cpu-mem must be more than 0 GB, got {cpu_gb:g}", "give the CPU memory to use, in GB")
        gpu = hw.gpu_count * (hw.gpu_mem_free_bytes if hw.gpu_mem_free_bytes is not None else hw.gpu_mem_bytes)
        cpu = hw.cpu_mem_available_bytes if hw.cpu_mem_available_bytes is not None else hw.cpu_mem_bytes
        return cls(gpu_bytes=int(gpu_gb * 1e9) if gpu_gb is not None else int(gpu),
                   cpu_bytes=int(cpu_gb * 1e9) if cpu_gb is not None else int(cpu))


@dataclass(frozen=True)
class Overrun:
    where: str  # "gpu" | "cpu"
    needed: int  # bytes the policy uses there
    limit: int  # usable bytes of the budget
    breakdown: dict[str, int]

    @property
    def over(self) -> int:
        return self.needed - self.limit

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in self.breakdown.items() if v)
        return (f"{self.where.upper()} memory: needs {_gb(self.needed)} ({parts}) but {_gb(self.limit)} is usable "
                f"— {_gb(self.over)} ({self.over:,} bytes) over")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


# ---- memory: tests/test_gpu_memory.py checks peak device bytes ≤ the plan's figure ≤ 1.1 × that peak ----


def memory_use(m: "ModelSpec | hrm.Dims", p: Policy, w: Workload) -> tuple[dict[str, int], dict[str, int]]:
    gpu, cpu, _ = _memory(hrm.dims(m), p, w)
    return gpu, cpu


def _memory(d: hrm.Dims, p: Policy, w: Workload) -> tuple[dict[str, int], dict[str, int], int]:
    T = w.longest_prompt + w.gen_len  # cached tokens a slot has room for: any waiting request may refill it
    N, mu = p.batch_size, p.micro_batch_size
    # what a sequence keeps depends on each layer's kind (ModelSpec.layer_state): the average layer's
    kv_layer = N * d.state_layer_bytes(T)
    cpu_attn_ws = mu * d.heads * T * 4  # fp32 scores of one micro-batch
    if p.ffn_on == "cpu":
        weights = (d.cpu_nonexpert_bytes or d.nonexpert_bytes) + d.total_expert_bytes  # dense ones maybe quantized
        # the runner's decode and prefill logits buffers (fp32, a row per batch slot), reused every step
        return {}, {"weights": weights, "kv_cache": int(d.layers * kv_layer),
                    "activations": _cpu_activations(d, p, w) + cpu_attn_ws, "dequant_scratch": d.scratch,
                    "logits_buffers": _arena_bytes([(N * d.V * 4, 2)])}, 0
    L, E, eb = d.layers, d.E, d.expert_bytes
    dense = dense_layers(L, d.moe_frac)
    resident = [r for i, r in enumerate(expert_split(p.gpu_weight_fraction, L, E, dense)) if i not in dense]
    width = E - min(resident)  # experts in each half of the streaming buffer
    gpu_attn = p.attention_on == "gpu"
    kv_gpu = kv_gpu_layers(p.gpu_kv_fraction, L) if gpu_attn else 0
    # two micro-batches' state in flight, each slot sized for the layer kind that keeps most
    ring_seq = max(x.state.bytes(T, d.dt) for x in d.mixers)
    kv_ring = int(2 * mu * ring_seq) if gpu_attn and kv_gpu < L else 0
    d1, d2 = max(x.d1 for x in d.mixers), max(x.d2 for x in d.mixers)  # per token: QKV out, attention back
    qkv_o = N * (d1 + d2) * d.dt if not gpu_attn else 0  # D1 source, D2 target per micro-batch
    gpu = {
        "non_expert_weights": hrm.gpu_nonexpert_bytes(d),
        "resident_experts": sum(resident) * eb,
        "weight_double_buffer": 2 * width * eb,
        "kv_cache": int(kv_gpu * kv_layer),
        "kv_buffers": kv_ring,
        "staging": qkv_o + 2 * T * d.head_dim * d.dt,  # + the RoPE tables
        "dequant_scratch": 0,  # the fused expert path dequantizes inside its kernel (core.model.fused_moe)
        "activations": _gpu_activations(d, p, w, split=any(0 < r < E for r in resident)),
    }
    # the runtime's arena, in its order: per micro-batch its D1 and D2 buffers, decode and prefill logits (fp32)
    n_mb = -(-N // mu)
    host = ([(mu * d1 * d.dt, n_mb), (mu * d2 * d.dt, n_mb)] if qkv_o else []) + [(N * d.V * 4, 2)]
    if kv_ring:
        new_tok = max(x.new_token_bytes(d.dt) for x in d.mixers)
        host += [(kv_ring // 2, 2), (int(mu * new_tok), 1)]  # per ring slot its state; the store's new entries
    staging = _arena_bytes(host)
    cpu = {  # the runtime keeps every weight in host memory; the GPU holds copies
        "non_expert_weights": d.nonexpert_bytes,
        "experts": d.total_expert_bytes,
        "kv_cache": int((L - kv_gpu) * kv_layer),
        "pinned_staging": staging,
        "attention_workspace": cpu_attn_ws if not gpu_attn else 0,
    }
    # page-locked: from each streaming layer's first streamed expert to its buffer's end, as one registration
    pinned = sum(d.expert_region - r * d.expert_lead for r in resident if r < E) + staging
    return gpu, cpu, pinned


def _arena_bytes(runs: list[tuple[int, int]]) -> int:
    """core.runtime.pipeline._arena's bytes for (size, count) runs of buffers, each aligned, the last not padded."""
    total = 0
    for x, n in runs:
        if n:
            total = -(-total // ALIGN) * ALIGN + (n - 1) * -(-x // ALIGN) * ALIGN + x
    return total


def _gpu_activations(d: hrm.Dims, p: Policy, w: Workload, split: bool = False) -> int:
    """Transient device memory at its peak, decode or prefill: what a step holds plus its largest intermediates.
    `split`: some layer's experts are part resident, part streamed (grouped matmuls hold one more gate/up output)."""
    N, mu, beta, dt = p.batch_size, p.micro_batch_size, p.expert_batch_size, d.dt
    D, k, I, q, kv, E, V = d.D, d.k, d.I, d.q, d.kv, d.E, d.V
    shared = 3 * d.Is * dt
    # grouped_mm's kernels are bf16 (on SM80+); quantized experts and short calls take the fused path
    dense = d.dtype == "bfloat16" and d.qkind == "none"

    a, bias = d.act_temps, d.expert_bias

    def ffn(t):
        if dense and t > FUSED_TOKENS:  # routing's indices and masks; the pairs' input, gate/up, activation, biases
            return t * k * 33 + t * k * (D + ((4 if split else 3) + a - 1) * I + (4 * I if bias else 0)) * dt
        # the fused path (core.model.fused_moe): its block alignment, then the largest of its successive
        # intermediates (each freed once the next is made), at the torch form's block rows (core.model.limits)
        bm = fused_block_rows(t * k, E)
        S = fused_slots(t * k, E, bm)
        return 4 * (S + S // bm + 1) + max(t * k * (2 + a) * I, t * k * (I + D), t * k * D + t * D) * dt

    def pre(t):  # fp32 norm; QKV, roped q and k, attention output
        return t * (D * (8 + dt) + 3 * (q + kv) * dt)

    logits = mu * (V * 4 + 3 * D * 4)
    metadata = N * (5 * 8 + w.longest_prompt + w.gen_len)  # per-step ids, positions, lengths, slots; padding mask
    routing = 2 * k * (8 + dt)  # expert ids and weights per token, and their concatenation for the expert batch
    # + one more hidden-state block: a stream's last reference lives as long as its thread's timing says
    decode = N * D * dt + beta * (3 * D * dt + shared + routing) + max(ffn(beta), pre(mu), logits) + metadata
    s = w.longest_prompt
    tok = mu * s
    # two micro-batches' state await the link (core.runtime.schedule.prefill), in the kind that keeps most
    stored = 2 * mu * max(x.state.bytes(s, dt) for x in d.mixers)
    held = N * s * D * dt + tok * 2 * D * dt + stored + N * (2 * s + 1) * 8  # + token ids, positions, last rows
    # the token mixer's own working set, by kind (core.plan.mixer_costs): the largest kind's
    mix = max(x.prefill_bytes(tok, s) for x in d.mixers)
    prefill = held + max(ffn(tok) + tok * shared, mix, logits)
    return int(max(decode, prefill))


def _cpu_activations(d: hrm.Dims, p: Policy, w: Workload) -> int:
    pre_tok = p.micro_batch_size * w.longest_prompt
    d1 = max(m.d1 for m in d.mixers)
    prefill_act = pre_tok * (3 * d.D + d1 + d.k * 3 * d.I) * d.dt
    decode_act = (2 * p.batch_size * d.D + 2 * p.micro_batch_size * d1
                  + p.expert_batch_size * d.k * (3 * d.I + d.D)) * d.dt
    # + the head's output on its way into the fp32 logits buffer, a chunk of rows at a time (final_logits)
    head_out = 0 if d.dt == 4 else min(p.micro_batch_size * d.V * d.dt, max(LOGIT_CHUNK_BYTES, d.V * d.dt))
    return int(max(prefill_act, decode_act) + head_out)


def validate(policy: Policy, model: ModelSpec, hardware: HardwareSpec, workload: Workload,
             budget: Budget | None = None) -> list[Overrun]:
    """What the policy overfills, by how many bytes; [] when it fits. Refuses GPU placements without a GPU."""
    budget = budget or Budget.for_hardware(hardware)
    if policy.ffn_on == "gpu" and not hardware.has_gpu:
        raise UsageError("the policy puts the FFN on the GPU but this machine has none",
                         "set ffn_on and attention_on to \"cpu\"")
    model, hardware, budget = rank_view(model, hardware, budget, policy.tensor_parallel)  # one rank's share
    gpu, cpu = memory_use(model, policy, workload)
    out = []
    for where, use, total, share in (("gpu", gpu, budget.gpu_bytes, GPU_USABLE), ("cpu", cpu, budget.cpu_bytes, CPU_USABLE)):
        need, limit = int(sum(use.values())), int(total * share)
        if need > limit:
            out.append(Overrun(where, need, limit, use))
    return out


def predict(policy: Policy, model: ModelSpec, hardware: HardwareSpec, workload: Workload) -> Prediction:
    """The HRM's prediction (memory reported, not checked). Tensor parallel: one rank's time, every rank's memory."""
    p, k, requests = policy, policy.tensor_parallel, workload.num_requests
    # full waves, then a smaller last one: the engine admits the longest prompts first, so it holds the shortest
    full, rest = divmod(requests, p.batch_size) if requests and requests > p.batch_size else (1, 0)
    front, tail = workload.longest_first(full * p.batch_size) if rest else (workload, None)
    # (equal prompts: longest_first gives both parts the whole workload's shape)
    last = last_wave(policy, model, hardware, dataclasses.replace(tail, num_requests=rest)) if rest else None
    model, hardware, _ = rank_view(model, hardware, None, k)
    r = _rates(hardware, k, model)
    kw = dict(batch=p.batch_size, micro_batch=p.micro_batch_size, attention_on=p.attention_on, ffn_on=p.ffn_on,
              gpu_weight_fraction=p.gpu_weight_fraction, gpu_kv_fraction=p.gpu_kv_fraction, pages=p.pages_per_layer)
    dec = hrm.decode_layer_seconds(model, r, expert_batch=p.expert_batch_size, context=front.decode_context, **kw)
    pre = hrm.prefill_layer_seconds(model, r, prompt_len=front.prompt_len, prompt_sq=front.prompt_sq_mean, **kw)
    on_gpu = p.ffn_on == "gpu"
    l = model.num_layers
    head = hrm.head_seconds(model, r, tokens=p.batch_size, micro_batches=p.num_micro_batches, on_gpu=on_gpu)
    step = l * hrm.layer_time(dec, p.ffn_on, dec["pipeline"]) + head
    prefill = l * hrm.layer_time(pre, p.ffn_on) + head + hrm.wave_seconds(r, on_gpu=on_gpu)
    n = workload.gen_len
    total = prefill + (n - 1) * step
    gpu, cpu, pinned = _memory(hrm.dims(model), p, workload)  # one rank's: every rank's is k times that
    gpu, cpu = ({key: v * k for key, v in x.items()} for x in (gpu, cpu))
    last_prefill, last_step = (last.prefill_seconds, last.step_seconds) if last else (0.0, 0.0)
    seconds = full * total + last_prefill + (n - 1) * last_step
    decode_s = (n - 1) * (full * step + last_step)
    prefill_s = full * prefill + last_prefill
    tokens = full * p.batch_size + rest
    prompt_tokens = full * p.batch_size * front.prompt_len + (rest * tail.prompt_len if tail else 0)
    decode_busy = {key: full * (n - 1) * l * dec[key] + (last.decode_busy[key] if last else 0.0) for key in RESOURCES}
    prefill_busy = {key: full * l * pre[key] + (last.prefill_busy[key] if last else 0.0) for key in RESOURCES}
    return Prediction(
        tokens_per_s=tokens * n / seconds,
        decode_tokens_per_s=tokens * (n - 1) / decode_s if n > 1 else p.batch_size / step,
        prefill_tokens_per_s=prompt_tokens / prefill_s,
        bottleneck=hrm.bottleneck(dec) if on_gpu else max(RESOURCES, key=lambda k: dec[k]),
        gpu_bytes=int(sum(gpu.values())), cpu_bytes=int(sum(cpu.values())),
        layer_seconds={k: dec[k] for k in hrm.BOUNDS}, prefill_layer_seconds={k: pre[k] for k in RESOURCES},
        step_seconds=step, prefill_seconds=prefill, gpu_breakdown=gpu, cpu_breakdown=cpu, pinned_bytes=pinned * k,
        bottleneck_text="" if on_gpu else CPU_ONLY_WORDS[max(("compute", "cpu_attn"), key=lambda k: dec[k])],
        decode_busy=decode_busy, prefill_busy=prefill_busy, decode_steps=(n - 1) * (full + (1 if last else 0)),
        prompt_tokens=prompt_tokens, band=0.0 if on_gpu else r.cpu_costs.band,
    )


def last_wave(policy: Policy, model: ModelSpec, hardware: HardwareSpec, tail: Workload) -> Prediction:
    """The prediction for a smaller last wave, in as few micro-batches as hold it, as the engine deals them."""
    p, rest = policy, tail.num_requests
    groups = -(-rest // p.micro_batch_size)
    mu = -(-rest // groups)
    per = math.gcd(p.expert_batch_size // p.micro_batch_size, groups)  # micro-batches an expert batch, of these
    wave = dataclasses.replace(p, batch_size=mu * groups, micro_batch_size=mu, expert_batch_size=mu * per)
    return predict(wave, model, hardware, dataclasses.replace(tail, num_requests=mu * groups))


# ---- the continuous part: fractions for fixed integers ------------------------------------------------
@dataclass(frozen=True)
class _Lin:
    """Everything about one integer candidate that is affine in (r_w, r_c)."""

    dec: tuple  # decode busy per resource: (at r_w = r_c = 0, change per unit r_w, change per unit r_c)
    pre: tuple  # the same for prefill
    fixed: float  # seconds independent of the layers' overlap (LM head) over the whole batch
    serial: bool  # CPU-only: resources add up instead of overlapping
    mem: tuple[float, ...]  # (gpu0, gpu_w, gpu_c, cpu0, cpu_w, cpu_c): bytes at r = 0 and per unit r_w, r_c


def _memory_lin(d: hrm.Dims, w: Workload, place, n: int, mu: int, beta: int) -> tuple[float, ...]:
    a, f = place

    def use(r_w: float, r_c: float) -> list[int]:
        return [sum(x.values()) for x in memory_use(d, Policy(n, mu, beta, a, f, r_w, r_c, n // mu), w)]

    g00, c00 = use(0.0, 0.0)
    g10, c10 = use(1.0, 0.0) if f == "gpu" else (g00, c00)
    g01, c01 = use(0.0, 1.0) if a == "gpu" else (g00, c00)
    return g00, g10 - g00, g01 - g00, c00, c10 - c00, c01 - c00


def _linearise(d: hrm.Dims, r: hrm.Rates, w: Workload, place, n: int, mu: int, beta: int, mem=None,
               prefill=None) -> _Lin:
    """`mem` and `prefill` (independent of the expert batch) may be passed in when already known."""
    dec = _corners(hrm.decode_layer_seconds, d, r, place, batch=n, micro_batch=mu, expert_batch=beta,
                   context=w.decode_context)
    head = hrm.head_seconds(d, r, tokens=n, micro_batches=n // mu, on_gpu=place[1] == "gpu")
    fixed = head * w.gen_len + hrm.wave_seconds(r, on_gpu=place[1] == "gpu")
    return _Lin(dec, prefill or _prefill_lin(d, r, w, place, n, mu), fixed=fixed, serial=place[1] == "cpu",
                mem=mem or _memory_lin(d, w, place, n, mu, beta))


def _prefill_lin(d: hrm.Dims, r: hrm.Rates, w: Workload, place, n: int, mu: int):
    return _corners(hrm.prefill_layer_seconds, d, r, place, batch=n, micro_batch=mu, prompt_len=w.prompt_len,
                    prompt_sq=w.prompt_sq_mean)


def _corners(layer_seconds, d: hrm.Dims, r: hrm.Rates, place, **kw) -> tuple:
    """A layer's figures (_vec) at r_w = r_c = 0, and their change per unit r_w and per unit r_c."""
    def at(r_w: float, r_c: float) -> tuple[float, ...]:
        return _vec(layer_seconds(d, r, attention_on=place[0], ffn_on=place[1], gpu_weight_fraction=r_w,
                                  gpu_kv_fraction=r_c, **kw))

    p00 = at(0.0, 0.0)
    p10, p01 = at(1.0, 0.0), at(0.0, 1.0) if place[0] == "gpu" else p00
    return p00, tuple(x - y for x, y in zip(p10, p00)), tuple(x - y for x, y in zip(p01, p00))


_LIN_KEYS = (*RESOURCES, "pipeline0", "pipeline1", "pipeline2", "host")  # resources, pipeline_bounds' pieces, host


def _vec(x: dict) -> tuple[float, ...]:
    return tuple(x.get(k, 0.0) for k in _LIN_KEYS)


def _at(affine: tuple, r_w, r_c) -> list:
    return [a + b * r_w + c * r_c for a, b, c in zip(*affine)]


def _total(lin: _Lin, layers: int, gen: int, r_w: float, r_c: float) -> float:
    dec, pre = _at(lin.dec, r_w, r_c), _at(lin.pre, r_w, r_c)
    agg = sum if lin.serial else max
    return layers * (agg(pre) + (gen - 1) * agg(dec) + TIE_BREAK * (gen - 1) * sum(dec)) + lin.fixed


def _rw_interval(mem: tuple[float, ...], r_c: float, gpu_limit: float, cpu_limit: float) -> tuple[float, float] | None:
    """The r_w values for which both memories fit at this r_c, or None."""
    g0, gw, gc, c0, cw, cc = mem
    lo, hi = 0.0, 1.0 if gw or cw else 0.0
    for base, slope, limit in ((g0 + gc * r_c, gw, gpu_limit), (c0 + cc * r_c, cw, cpu_limit)):
        if abs(slope) < 1e-9:
            if base > limit:
                return None
        elif slope > 0:
            hi = min(hi, (limit - base) / slope)
        else:
            lo = max(lo, (limit - base) / slope)
    return (lo, hi) if lo <= hi + 1e-12 else None


def _best_fractions(lin: _Lin, layers: int, gen: int, gpu_limit: float, cpu_limit: float,
                    gpu_attn: bool) -> tuple[float, float, float] | None:
    """(seconds, r_w, r_c) minimising the batch time, or None; exact in r_w for each r_c of RC_GRID (a convex
    piecewise-linear minimum lies at an end or where two pieces cross)."""
    best = None
    for r_c in (RC_GRID if gpu_attn else (0.0,)):
        iv = _rw_interval(lin.mem, r_c, gpu_limit, cpu_limit)
        if iv is None:
            continue
        lo, hi = iv
        hi = max(lo, min(hi, 1.0))
        pts = {lo, hi}
        for base, slope, per_c in (lin.dec, lin.pre):
            a = [x + y * r_c for x, y in zip(base, per_c)]
            for i in range(len(a)):
                for j in range(i + 1, len(a)):
                    if slope[i] != slope[j]:
                        x = (a[j] - a[i]) / (slope[i] - slope[j])
                        if lo < x < hi:
                            pts.add(x)
        for r_w in pts:
            t = _total(lin, layers, gen, r_w, r_c)
            if best is None or t < best[0] - 1e-12:
                best = (t, r_w, r_c)
    return best


def solve_fractions_lp(lin: _Lin, layers: int, gen: int, gpu_limit: float, cpu_limit: float,
                       gpu_attn: bool) -> tuple[float, float, float] | None:
    """`_best_fractions` jointly in (r_w, r_c), as an LP (CBC)."""
    import pulp

    prob = pulp.LpProblem("fractions", pulp.LpMinimize)
    # PuLP ≥ 3.3 warns about PULP_CBC_CMD; the bundled CBC is what we want (HiGHS prints to the terminal)
    var = getattr(prob, "add_variable", None) or (lambda name, lo=None, up=None: pulp.LpVariable(name, lo, up))
    rw = var("r_w", 0, 1)
    rc = var("r_c", 0, 1 if gpu_attn else 0)
    td, tp = var("t_dec", 0), var("t_pre", 0)
    dec, pre = _at(lin.dec, rw, rc), _at(lin.pre, rw, rc)
    prob += layers * (tp + (gen - 1) * td + TIE_BREAK * (gen - 1) * sum(dec))
    for t, busy in ((td, dec), (tp, pre)):
        for e in ([sum(busy)] if lin.serial else busy):  # CPU-only: the resources add up
            prob += t >= e
    g0, gw, gc, c0, cw, cc = lin.mem  # memory rows in GB keep CBC's coefficients well scaled
    prob += (g0 + gw * rw + gc * rc) / 1e9 <= gpu_limit / 1e9
    prob += (c0 + cw * rw + cc * rc) / 1e9 <= cpu_limit / 1e9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        status = prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[status] != "Optimal":
        return None
    r_w = min(max(rw.value() or 0.0, 0.0), 1.0)
    r_c = min(max(rc.value() or 0.0, 0.0), 1.0)
    return _total(lin, layers, gen, r_w, r_c), r_w, r_c


# ---- the integer part -------------------------------------------------------------------------------
def micro_batch_sizes(limit: int) -> list[int]:
    """The paper's μ candidates: 1, 2, 3, 4, then 36, 68, … in steps of 32, up to `limit`; beyond DENSE_MU only
    points ≥ 1/8 above the previous one (the search refines around the best)."""
    mus = [mu for mu in (1, 2, 3, 4) if mu <= limit] + list(range(36, min(limit, DENSE_MU) + 1, 32))
    mu = mus[-1] if mus else 0
    while True:
        mu = 4 + 32 * math.ceil((mu * 1.125 - 4) / 32)
        if mu > limit:
            return mus
        mus.append(mu)


def _mus(place: tuple[str, str], n_cap: int, has_gpu: bool = True) -> list[int]:
    """μ candidates; without a GPU also powers of two and every request at once, since a CPU-only micro-batch is
    a slice of one chain (the best μ is usually the batch) and a batch covering all requests leaves no tail wave."""
    mus = micro_batch_sizes(n_cap)
    if place != ("cpu", "cpu") or has_gpu:
        return mus + ([n_cap] if n_cap < MAX_BATCH and n_cap not in mus else [])  # all requests at once too
    twos = [1 << i for i in range(n_cap.bit_length()) if 1 << i <= n_cap]
    return sorted(set(mus) | set(twos) | {n_cap})


def _expert_groups(n_mb: int) -> list[int]:
    gs = [1 << i for i in range(n_mb.bit_length()) if n_mb % (1 << i) == 0]
    return gs + ([n_mb] if n_mb not in gs else [])


@dataclass(frozen=True)
class _Candidate:
    seconds_per_token: float
    place: tuple[str, str]
    n: int
    mu: int
    beta: int
    r_w: float
    r_c: float
    lin: _Lin


def _rates(hw: HardwareSpec, ranks: int, model: ModelSpec) -> hrm.Rates:
    return dataclasses.replace(hrm.effective_rates(hw, model.dtype, model), tp=ranks)


def _search(m: ModelSpec, hw: HardwareSpec, w: Workload, budget: Budget, ranks: int = 1) -> list[_Candidate]:
    d, r = hrm.dims(m), _rates(hw, ranks, m)
    gpu_limit, cpu_limit = budget.gpu_bytes * GPU_USABLE, budget.cpu_bytes * CPU_USABLE
    places = PLACEMENTS_GPU if hw.has_gpu else (("cpu", "cpu"),)
    n_cap = min(MAX_BATCH, w.num_requests or MAX_BATCH)
    l, gen = d.layers, w.gen_len
    found: list[_Candidate] = []

    @functools.lru_cache(maxsize=None)
    def memory(place, n, mu):  # at β = μ: the searches below ask for many points again
        return _memory_lin(d, w, place, n, mu, mu)

    def fits(place, n, mu):
        # memory grows with N; an expert batch of one micro-batch is the cheapest in activations
        mem = memory(place, n, mu)
        grid = RC_GRID if place[0] == "gpu" else (0.0,)
        return any(_rw_interval(mem, r_c, gpu_limit, cpu_limit) is not None for r_c in grid)

    def expert_batches(place, n_mb, mu):
        n = n_mb * mu
        mem = memory(place, n, mu)
        pre = _prefill_lin(d, r, w, place, n, mu)
        best_here, worse = None, 0
        for g in _expert_groups(n_mb):  # time vs expert batch: falls, then rises (pipeline stalls)
            beta = g * mu
            lin = _linearise(d, r, w, place, n, mu, beta, mem=None if g > 1 else mem, prefill=pre)
            best = _best_fractions(lin, l, gen, gpu_limit, cpu_limit, place[0] == "gpu")
            if best is None:
                break  # bigger expert batches need more memory still
            t, r_w, r_c = best
            found.append(_Candidate(t / (n * gen), place, n, mu, beta, r_w, r_c, lin))
            if best_here is not None and t / n >= best_here:
                worse += 1
                if worse == 2:
                    break
            else:
                best_here, worse = t / n, 0
        return best_here

    def largest_batch(place, mu):
        """(time per token, placement, μ, micro-batches) at the largest batch that fits, or None."""
        if not fits(place, mu, mu):
            return None
        hi = 1  # largest feasible number of micro-batches: doubling, then binary search
        while hi * 2 * mu <= n_cap and fits(place, hi * 2 * mu, mu):
            hi *= 2
        lo, top = hi, min(hi * 2, n_cap // mu)
        while lo < top:
            mid = (lo + top + 1) // 2
            if fits(place, mid * mu, mu):
                lo = mid
            else:
                top = mid - 1
        t = expert_batches(place, lo, mu)
        return None if t is None else (t, place, mu, lo)

    # phase 1: for each placement and μ, the largest batch that fits
    largest, tried = [], set()
    for place in places:
        for mu in _mus(place, n_cap, hw.has_gpu):
            tried.add((place, mu))
            got = largest_batch(place, mu)
            if got is None:
                break  # a larger μ needs more memory still
            largest.append(got)
    # phase 2: around the best few (placement, μ): the full μ grid nearby (where phase 1 was sparse),
    # and smaller batches, which can leave room for resident weights or KV
    largest.sort(key=lambda x: x[0])
    for _, place, mu, n_max in largest[:REFINE]:
        for near in (mu - 64, mu - 32, mu + 32, mu + 64):
            if near > DENSE_MU and near <= n_cap and (place, near) not in tried:
                tried.add((place, near))
                largest_batch(place, near)
        for n_mb in sorted({max(1, n_max - 1), max(1, (3 * n_max) // 4), max(1, n_max // 2), max(1, n_max // 4)} - {n_max}):
            expert_batches(place, n_mb, mu)
    found.sort(key=lambda c: c.seconds_per_token)
    return found[:4]  # the best few: plan() re-solves their fractions and, with uneven waves, re-ranks them


def _shortfall(m: ModelSpec, hw: HardwareSpec, w: Workload, budget: Budget) -> BudgetError:
    """The error for a budget nothing fits in: what one request at a time needs, for the closest placement."""
    d = hrm.dims(m)
    gpu_limit = budget.gpu_bytes * GPU_USABLE
    best = None
    for a, f in (PLACEMENTS_GPU if hw.has_gpu else (("cpu", "cpu"),)):
        g0, gw, *_ = _memory_lin(d, w, (a, f), 1, 1, 1)
        r_w = min(1.0, max(0.0, (gpu_limit - g0) / gw)) if gw > 0 else 0.0
        p = Policy(1, 1, 1, attention_on=a, ffn_on=f, gpu_weight_fraction=r_w if f == "gpu" else 0.0)
        over = validate(p, m, hw, w, budget)
        total = sum(o.over for o in over)
        if best is None or total < best[0]:
            best = (total, over, p)
    _, over, p = best
    return BudgetError(
        f"nothing fits in the memory budget, not even one request at a time (closest: attention on {p.attention_on}, "
        f"FFN on {p.ffn_on}, {p.gpu_weight_fraction:.0%} of expert weights on the GPU): "
        + "; ".join(str(o) for o in over),
        "raise --gpu-mem / --cpu-mem, pick a machine with more memory, or shorten --prompt-len / --gen-len",
    )


def plan(model: ModelSpec, hardware: HardwareSpec, workload: Workload, budget: Budget | None = None,
         ranks: int | None = None) -> tuple[Policy, Prediction]:
    """The policy with the highest predicted tokens/s that fits; `ranks` (default one per GPU) plan their share."""
    budget = budget or Budget.for_hardware(hardware)
    ranks = ranks or hardware.gpu_count or 1
    full_model, full_hw, full_budget = model, hardware, budget
    model, hardware, budget = rank_view(model, hardware, budget, ranks)
    top = _search(model, hardware, workload, budget, ranks=ranks)
    if not top:
        raise _shortfall(model, hardware, workload, budget)
    gpu_limit, cpu_limit = budget.gpu_bytes * GPU_USABLE, budget.cpu_bytes * CPU_USABLE
    if workload.num_requests and any(workload.num_requests % c.n for c in top):
        # the search prices full waves; a batch that leaves a smaller last wave pays for it (last_wave)
        top.sort(key=lambda c: -predict(_policy(c, c.r_w, c.r_c, model, ranks), full_model, full_hw,
                                        workload).tokens_per_s)
    best = None
    # GPU-attention candidates re-solved jointly in (r_w, r_c) by CBC, which can beat the fast path's r_c grid
    for c in [top[0]] + [c for c in top[1:] if c.place[0] == "gpu"]:
        t, r_w, r_c = c.seconds_per_token * c.n * workload.gen_len, c.r_w, c.r_c
        if c.place[0] == "gpu":
            lp = solve_fractions_lp(c.lin, model.num_layers, workload.gen_len, gpu_limit, cpu_limit, True)
            if lp is not None and lp[0] < t:
                t, r_w, r_c = lp
        if best is None or t / c.n < best[0]:
            best = (t / c.n, c, r_w, r_c)
    _, c, r_w, r_c = best
    policy = _policy(c, r_w, r_c, model, ranks)
    if validate(policy, full_model, full_hw, workload, full_budget):  # rounding pushed it over: step back a hair
        policy = _shrink(policy, full_model, full_hw, workload, full_budget)
    return policy, predict(policy, full_model, full_hw, workload)


def _policy(c: _Candidate, r_w: float, r_c: float, model: ModelSpec, ranks: int) -> Policy:
    """Fractions rounded down to whole experts and layers (core.plan.policy.expert_split)."""
    L, E = model.num_layers, model.num_experts
    LE = model.moe_layers * E  # routed experts in all (dense layers hold none)
    r_w, r_c = math.floor(r_w * LE + 1e-6) / LE, math.floor(r_c * L + 1e-6) / L
    n_mb = c.n // c.mu
    return Policy(batch_size=c.n, micro_batch_size=c.mu, expert_batch_size=c.beta, attention_on=c.place[0],
                  ffn_on=c.place[1], gpu_weight_fraction=r_w if c.place[1] == "gpu" else 0.0,
                  gpu_kv_fraction=r_c if c.place[0] == "gpu" else 0.0,
                  pages_per_layer=n_mb if r_w < 1.0 and c.place[1] == "gpu" else 1, tensor_parallel=ranks)


def _shrink(p: Policy, m, hw, w, budget) -> Policy:
    """Step fractions pushed past a memory limit by rounding to whole experts/layers back inside it."""
    step_w, step_c = 1 / (m.moe_layers * m.num_experts), 1 / m.num_layers
    for _ in range(m.num_layers * (m.num_experts + 1)):
        over = validate(p, m, hw, w, budget)
        if not over:
            return p
        gpu_over = any(o.where == "gpu" for o in over)
        if gpu_over and p.gpu_weight_fraction > 0:
            p = dataclasses.replace(p, gpu_weight_fraction=max(0.0, p.gpu_weight_fraction - step_w))
        elif gpu_over and p.gpu_kv_fraction > 0:
            p = dataclasses.replace(p, gpu_kv_fraction=max(0.0, p.gpu_kv_fraction - step_c))
        elif not gpu_over and p.attention_on == "gpu" and p.gpu_kv_fraction < 1:
            # the host is over: whole layers of KV rounded back onto the CPU go to the GPU again
            p = dataclasses.replace(p, gpu_kv_fraction=min(1.0, p.gpu_kv_fraction + step_c))
        else:
            break
    return p
