"""The Hierarchical Roofline Model: each decoder-layer task's FLOPs and bytes, and one layer's busy time per
resource (core.telemetry.RESOURCES). Pure functions; no search, memory accounting (core.plan.planner) or I/O.
Legend: t = tokens, c = context length, D = hidden, I = expert intermediate, E = experts, k = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from core.plan import cpu_cost
from core.plan.hardware import HardwareSpec
from core.plan.mixer_costs import MixerCost, mixer_costs
from core.model.limits import LOOKAHEAD  # CGOPipe runs CPU attention this many micro-batches ahead of the GPU
from core.model.limits import LAYOUT_ALIGN  # each stacked expert tensor of a layer buffer starts at a multiple of this
from core.model.limits import FUSED_MAX_TOKENS  # longer dense expert calls take grouped_mm where it runs
from core.model.quant import dense_spec
from core.model.quant.formats import GGUF_BLOCKS, KERNEL_ROWS, Format, workspace_bytes
from core.model.spec import ModelSpec
from core.telemetry import RESOURCES

# Achieved fraction of a datasheet peak, for rates not measured (HardwareSpec.measured): from the paper's L4 +
# Xeon kernel latencies (shared/paper.md: Mixtral's FFN and the KV copy at 0.77, CPU attention ≈ 0.5 of 90 GB/s);
# tensor-core matmuls reach about half their peak in practice.
DERATE = {"gpu_flops": 0.5, "gpu_bw": 0.77, "h2d_bw": 0.77, "d2h_bw": 0.77, "cpu_flops": 0.5, "cpu_bw": 0.5}

# Fixed cost of launching one task, seconds: a CUDA kernel, a copy, a CPU attention call on a thread pool.
GPU_LAUNCH = 10e-6
COPY_LAUNCH = 10e-6
CPU_LAUNCH = 30e-6
# Share of the CPU's matmul rate torch's weight-only kernels reach (≈ 170 against ≈ 380 GFLOP/s a Zen 5 core)
# where the probe has not measured them (HardwareSpec.cpu_matmul["int4"]).
CPU_KERNEL_FLOPS = {"int8": 0.45, "int4": 0.45}
# One all-reduce between tensor-parallel ranks: a fixed cost (assumed until bench/gpu_check.py --multi-gpu
# measures it) plus a ring's 2·(K−1)/K of the bytes over each rank's link.
ALLREDUCE_LATENCY = 50e-6

# The host side of a task, serialised by the GIL: a cost per task plus one per torch op, as bench/gpu_check.py
# measured on an H200 host; HardwareSpec.host_task_seconds / host_op_seconds where measured here.
TASK_SECONDS = 80e-6
OP_SECONDS = 25e-6
# torch ops each task kind issues, views included, for a Qwen2-MoE layer (the family with the most parts;
# tests/test_gpu_findings.py recounts them on the emulated device).
HOST_OPS = {"pre_attn": 25, "post_attn": 24, "ffn": 12, "gpu_attn": 27, "d1": 2, "d2": 2, "cpu_attn": 14,
            "weight_page": 2, "kv_load": 14, "kv_store": 10, "prefill": 118}
# An FFN task's ops by expert path (core.model.moe.device_experts): (fixed, per expert); tests/test_launch_budget.py.
EXPERT_PATHS = {"fused": (HOST_OPS["ffn"], 0), "grouped": (33, 0)}
# Page-locking host memory (cudaHostRegister) once per loaded model, bytes/s, as on the H200 host.
PIN_BW = 2e9


@dataclass(frozen=True)
class Rates:
    """Achievable rates of one machine, all GPUs together (tensor parallel splits every GPU task)."""

    gpu_flops: float
    gpu_bw: float
    h2d_bw: float
    d2h_bw: float
    cpu_flops: float
    cpu_bw: float
    has_gpu: bool
    cpu_costs: object  # core.plan.cpu_cost.CpuCosts of this machine for the CPU's math dtype (the CPU-only mode's)
    tp: int = 1  # tensor-parallel ranks summing their partial outputs (rates are then one rank's)
    task_seconds: float = TASK_SECONDS  # the executor's host cost per task
    op_seconds: float = OP_SECONDS  # ... and per torch op a task issues
    # (("int4", FLOP/s), ("int4@1", FLOP/s), ...): the probe's weight-only kernel rates at 64 rows and at one
    cpu_kernel_flops: tuple = ()
    gpu_capability: tuple = ()  # () unknown: taken to have every kernel
    pin_bw: float = PIN_BW
    host_measured: bool = False  # task_seconds and op_seconds measured on this machine (bench/gpu_check.py)

    def kernel_flops(self, qkind: str, rows: int | None = None) -> float:
        rates = dict(self.cpu_kernel_flops)
        if rows == 1 and rates.get(f"{qkind}@1"):
            return rates[f"{qkind}@1"]
        return rates.get(qkind) or self.cpu_flops * CPU_KERNEL_FLOPS.get(qkind, 1.0)

    def kernel_seconds(self, qkind: str, rows: float, weights: float) -> float:
        """One weight-only kernel call: it expands every weight whatever the rows (the one-row rate bounds it)."""
        return 2 * weights * max(rows / self.kernel_flops(qkind), 1 / self.kernel_flops(qkind, rows=1))


def effective_rates(hw: HardwareSpec, dtype: str | None = None, model=None) -> Rates:
    """Achievable rates; `dtype` (the weights' storage dtype) picks the CPU's math dtype's matmul rate and
    calibrated costs (for `model` or the nearest); without it, fp32 and uncalibrated costs."""
    def rate(name: str, per_gpu: bool) -> float:
        v = getattr(hw, name) * (1.0 if name in hw.measured else DERATE[name])
        return v * (hw.gpu_count if per_gpu else 1)

    cpu_flops, math, width = rate("cpu_flops", False), "float32", 4
    if dtype is not None:
        v, math, measured = hw.cpu_flops_for(dtype)
        cpu_flops = v * (1.0 if measured else DERATE["cpu_flops"])
        width = 4 if dtype in ("float32", "torch.float32") else 2
    if dtype is not None and hw.cpu_costs.get(math):
        costs = cpu_cost.pick(hw.cpu_costs[math], dims(model) if model is not None else None)
    else:  # never calibrated: the probe's rates with what calibration learned on other machines
        costs = cpu_cost.defaults(math, cpu_flops, rate("cpu_bw", False), width, hw.cpu_threads or 0,
                                  _gguf_expert_bytes(model))
    return Rates(gpu_flops=rate("gpu_flops", True), gpu_bw=rate("gpu_bw", True), h2d_bw=rate("h2d_bw", True),
                 d2h_bw=rate("d2h_bw", True), cpu_flops=cpu_flops, cpu_bw=rate("cpu_bw", False),
                 has_gpu=hw.has_gpu, cpu_costs=costs, task_seconds=hw.host_task_seconds or TASK_SECONDS,
                 op_seconds=hw.host_op_seconds or OP_SECONDS, gpu_capability=hw.gpu_capability,
                 pin_bw=hw.pin_bw or PIN_BW, host_measured=bool(hw.host_task_seconds and hw.host_op_seconds),
                 cpu_kernel_flops=tuple((k, hw.cpu_rate(k)) for q in CPU_KERNEL_FLOPS for k in (q, f"{q}@1")
                                        if hw.cpu_rate(k)))


@dataclass(frozen=True)
class Work:
    """One task: FLOPs, and bytes moved in the memory of the level that runs it."""

    flops: float
    bytes: float

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes)


@dataclass(frozen=True)
class Dims:
    """A ModelSpec's numbers, read once (its properties are too slow for the planner's inner loop): `dims`.
    Per-layer costs are of the average layer, each kind weighted by its share of the layers."""

    layers: int
    D: int
    q: int  # Hq·hd
    kv: int  # Hkv·hd
    heads: int
    head_dim: int
    E: int
    k: int
    I: int
    Is: int
    V: int
    dt: int  # bytes per weight
    expert_bytes: int
    layer_expert_bytes: int
    nonexpert_bytes: int
    total_expert_bytes: int
    total_bytes: int
    mixers: tuple[MixerCost, ...]  # one per kind of token mixer, with its layer count
    moe_frac: float = 1.0  # share of the layers with experts (the rest run a dense MLP)
    Id: int = 0  # dense MLP intermediate
    dtype: str = "bfloat16"
    router_dt: int = 0  # bytes per router weight on the GPU: 4 where the router computes in fp32 (kept so), else dt

    def avg(self, f) -> float:
        return sum(m.count * f(m) for m in self.mixers) / self.layers

    @property
    def d1(self) -> float:
        return self.avg(lambda m: m.d1)

    @property
    def d2(self) -> float:
        return self.avg(lambda m: m.d2)

    def state_layer_bytes(self, tokens: float) -> float:
        return sum(m.count * m.state.bytes(tokens, self.dt) for m in self.mixers) / self.layers

    def new_token_bytes(self) -> float:
        return self.avg(lambda m: m.new_token_bytes(self.dt))
    scratch: int = 0  # quantized experts: one expert expanded to the compute dtype where it runs + workspace
    expanded: int = 0  # bytes of one quantized expert expanded to the compute dtype (written, then read)
    qkind: str = "none"  # experts: none | int8 | int4 (CPU kernels) | blocks (GGUF/MXFP4: block kernels)
    act_temps: int = 1  # [tokens, I] arrays the experts' activation makes besides its input (gpt-oss's clamped: 4)
    expert_bias: bool = False  # biases on the experts' projections (gpt-oss)
    # a MoE layer's expert region in its host buffer, and one expert's share of its first tensor (page-locking)
    expert_region: int = 0
    expert_lead: int = 0
    # --quantize-dense: the dense weights' kernel, their bytes, per matrix kind the share of layers it runs
    dense_qkind: str = "none"
    cpu_nonexpert_bytes: int = 0
    dense_shares: tuple = ()
    dense_bytes_per_weight: float = 0.0  # in the kernel's layout, scales included


@lru_cache(maxsize=32)
def _dims(m: ModelSpec) -> Dims:
    return Dims(layers=m.num_layers, D=m.hidden_size, q=m.q_size, kv=m.kv_size, heads=m.num_heads,
                head_dim=m.head_dim, E=m.num_experts, k=m.top_k, I=m.expert_intermediate, Is=m.shared_intermediate,
                V=m.vocab_size, dt=m.dtype_bytes, expert_bytes=m.expert_bytes, layer_expert_bytes=m.layer_expert_bytes,
                nonexpert_bytes=m.nonexpert_bytes, total_expert_bytes=m.total_expert_bytes, total_bytes=m.total_bytes,
                mixers=mixer_costs(m), moe_frac=m.moe_layers / m.num_layers, Id=m.dense_intermediate,
                scratch=_scratch(m), qkind=_qkind(m.expert_format), dtype=m.dtype,
                act_temps=4 if m.expert_act == "clamped_swiglu" else 1, expert_bias=m.expert_bias,
                router_dt=max(4, m.dtype_bytes) if m.router_fp32 else m.dtype_bytes,
                expanded=m.expert_params * m.dtype_bytes if m.expert_format != "none" else 0,
                **_expert_layout(m), **_dense_quant(m))


def _dense_quant(m: ModelSpec) -> dict:
    if m.dense_format == "none":
        return {}
    return dict(dense_qkind=_qkind(m.dense_format), cpu_nonexpert_bytes=dense_spec.cpu_nonexpert_bytes(m),
                dense_shares=tuple(dense_spec.layer_shares(m).items()),
                dense_bytes_per_weight=dense_spec.bits_per_weight(m) / 8)


def _scratch(m: ModelSpec) -> int:
    if m.expert_format == "none":
        return 0
    D, I = m.hidden_size, m.expert_intermediate
    fmt = Format.from_label(m.expert_format) or Format(m.expert_format.split("/")[0])  # mixed GGUF: as blocks
    return workspace_bytes(fmt, ((2 * I, D), (D, I)), m.dtype_bytes)


def _expert_layout(m: ModelSpec) -> dict[str, int]:
    """expert_region and expert_lead as core.model.weights.LayerLayout lays a layer out (stacked, padded)."""
    E, D, I, dt = m.num_experts, m.hidden_size, m.expert_intermediate, m.dtype_bytes
    biases = [2 * I * dt, D * dt] if m.expert_bias else []

    def padded(per_expert_bytes: int, unit: int) -> int:
        return -(-E * per_expert_bytes // (LAYOUT_ALIGN * unit)) * LAYOUT_ALIGN * unit

    if m.expert_format == "none":
        tensors = [2 * I * D * dt, D * I * dt] + biases
        return dict(expert_region=sum(padded(b, dt) for b in tensors), expert_lead=tensors[0])
    fmt = Format.from_label(m.expert_format)
    if fmt is None:  # mixed GGUF formats: the spec's bytes, and a lead no larger than the smallest format's w1
        lead = min(Format(f).nbytes(I, D) for f in m.expert_format.split("/"))
        return dict(expert_region=E * m.expert_bytes, expert_lead=lead)
    parts = [p.nbytes for n, k in ((2 * I, D), (D, I)) for p in fmt.parts(n, k)] + biases
    return dict(expert_region=sum(padded(b, 1) for b in parts), expert_lead=parts[0])


def _gguf_expert_bytes(m: ModelSpec | None) -> float:
    """A GGUF file's experts' bytes a weight as it stores them (mixed formats: their mean); 0.0 for any other."""
    gguf = m is not None and set(m.expert_format.split("/")) <= set(GGUF_BLOCKS)
    return m.expert_bytes / m.expert_params if gguf else 0.0


def _qkind(expert_format: str) -> str:
    """none | int8 | int4 (torch's CPU kernels) | blocks (GGUF, MXFP4: block kernels)."""
    if expert_format in ("none", "int8"):
        return expert_format
    return "int4" if expert_format.startswith("int4") else "blocks"


def dims(m: "ModelSpec | Dims") -> Dims:
    return m if isinstance(m, Dims) else _dims(m)


def expected_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Distinct experts `tokens` uniformly routed tokens touch: E·(1 − (1 − k/E)^t), not t·k."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def qkv_proj(d: Dims, t: float) -> Work:
    """Before attention: norm + QKV, MLA's low-rank Q and absorbed W_UK, DeltaNet's in_proj."""
    params = d.avg(lambda x: x.pre_params)
    return Work(2 * t * params, (params + t * (d.D + d.d1)) * d.dt)


def o_proj(d: Dims, t: float) -> Work:
    """After attention: O, MLA's W_UV, DeltaNet's out_proj."""
    params = d.avg(lambda x: x.post_params)
    return Work(2 * t * params, (params + t * (d.d2 + d.D)) * d.dt)


def router(d: Dims, t: float) -> Work:
    return Work(d.moe_frac * 2 * t * d.D * d.E, d.moe_frac * (d.E * d.D * (d.router_dt or d.dt) + t * d.D * d.dt))


def gpu_nonexpert_bytes(m: "ModelSpec | Dims") -> int:
    """The non-expert weights as the GPU holds them (an fp32 router kept in fp32)."""
    d = dims(m)
    widen = max(0, (d.router_dt or d.dt) - d.dt) * d.E * d.D
    return d.nonexpert_bytes + round(d.moe_frac * d.layers) * widen


def moe_ffn(m: "ModelSpec | Dims", t: float, expand: bool = False) -> Work:
    """Routed experts for t tokens of one expert batch; `expand`: quantized experts written expanded, then read."""
    d = dims(m)
    touched = expected_experts(t, d.E, d.k)
    acts = t * d.k * (2 * d.D + 3 * d.I) * d.dt
    read = touched * (d.expert_bytes + (2 * d.expanded if expand else 0))
    return Work(d.moe_frac * 6 * t * d.k * d.D * d.I, d.moe_frac * (read + acts))


def quant_cpu_ffn(d: Dims, r: Rates, t: float) -> float:
    """CPU seconds of int8/int4 routed experts for t tokens on the weight-only kernels; int8 past KERNEL_ROWS rows
    is expanded and multiplied by the ordinary matmul, as core.model.quant.experts does."""
    touched = expected_experts(t, d.E, d.k)
    if not touched:
        return 0.0
    rows = t * d.k / touched
    if d.qkind == "int8" and rows > KERNEL_ROWS:
        return roofline_seconds(moe_ffn(d, t, expand=True), r.cpu_flops, r.cpu_bw)
    return d.moe_frac * touched * r.kernel_seconds(d.qkind, rows, 3 * d.D * d.I)


def quant_dense_swap(d: Dims, r: Rates, c, t: float) -> dict[str, float]:
    """--quantize-dense: seconds the weight-only kernel adds over what the cost model `c` charges for the dtype's
    GEMMs (negative where faster), for "pre" (QKV), "post" (O, shared expert) and "head"."""
    if d.dense_qkind not in CPU_KERNEL_FLOPS or t <= 0:
        return {"pre": 0.0, "post": 0.0, "head": 0.0}
    share = dict(d.dense_shares)

    def swap(n: int, k: int) -> float:
        kernel = max(r.kernel_seconds(d.dense_qkind, t, n * k), d.dense_bytes_per_weight * n * k / r.cpu_bw)
        return kernel - (c.flop_s * 2 * t * n * k + c.weight_s * n * k)

    return {"pre": share["qkv"] * swap(d.q + 2 * d.kv, d.D),
            "post": share["o"] * swap(d.D, d.q) + share["shared_w13"] * swap(2 * d.Is, d.D)
            + share["shared_w2"] * swap(d.D, d.Is),
            "head": share["lm_head"] * swap(d.V, d.D)}


def shared_expert(d: Dims, t: float) -> Work:
    """MoE layers' shared expert and dense layers' MLP."""
    width = d.moe_frac * d.Is + (1 - d.moe_frac) * d.Id
    if not width:
        return Work(0.0, 0.0)
    return Work(6 * t * d.D * width, (3 * d.D * width + t * (2 * d.D + 3 * width)) * d.dt)


def decode_attention(m: "ModelSpec | Dims", t: float, c: float) -> Work:
    """t queries over c cached tokens each: each reads its own state, so intensity does not grow with t."""
    d = dims(m)
    return _mixed(d, lambda x: x.decode(t, c, d.dt))


def prefill_attention(d: Dims, seqs: float, s: float) -> Work:
    """Causal attention over seqs prompts of s tokens, flash-style (K, V read once per query block)."""
    return _mixed(d, lambda x: x.prefill(seqs, s, d.dt))


def _mixed(d: Dims, work) -> Work:
    parts = [(x.count, *work(x)) for x in d.mixers]
    return Work(sum(n * f for n, f, _ in parts) / d.layers, sum(n * b for n, _, b in parts) / d.layers)


def lm_head(d: Dims, t: float) -> Work:
    return Work(2 * t * d.D * d.V, (d.V * d.D + t * d.D) * d.dt)


def roofline_seconds(w: Work, flops: float, bw: float) -> float:
    return max(w.flops / flops, w.bytes / bw)


# A task kind's cost is defined once here; core.runtime.simulate replays core.runtime.schedule's graphs with these
# same costs, so a simulated layer and decode_layer_seconds agree on every resource's busy time.
@dataclass(frozen=True)
class TaskCost:
    resource: str  # a key of core.telemetry.RESOURCES
    seconds: float  # one task
    per_layer: float  # how many such tasks one layer runs


def all_reduce_seconds(m: "ModelSpec | Dims", r: Rates, tokens: float) -> float:
    if r.tp <= 1:
        return 0.0
    d = dims(m)
    link = r.h2d_bw if r.has_gpu else r.cpu_bw
    return ALLREDUCE_LATENCY + 2 * (r.tp - 1) / r.tp * tokens * d.D * d.dt / link


def decode_tasks(m: "ModelSpec | Dims", r: Rates, *, batch: int, micro_batch: int, expert_batch: int,
                 attention_on: str, ffn_on: str, gpu_weight_fraction: float, gpu_kv_fraction: float,
                 context: float, pages: int | None = None) -> dict[str, TaskCost]:
    """The tasks of one decode layer (a token for each of `batch` requests), by kind (core.runtime.schedule's).
    In the CPU-only placement the dense kinds run on the CPU under the "compute" key."""
    m = dims(m)
    n_mb, n_eb = batch / micro_batch, batch / expert_batch
    pages = pages or max(1, round(n_mb))
    if ffn_on == "cpu":  # the CPU-only mode: core.plan.cpu_cost
        costs = r.cpu_costs
        secs = cpu_cost.decode_tasks(m, costs, micro_batch=micro_batch, expert_batch=expert_batch, context=context)
        if m.qkind in CPU_KERNEL_FLOPS:  # calibrated on the dtype's matmuls: quantized experts run other kernels
            secs["ffn"] = max(quant_cpu_ffn(m, r, expert_batch), moe_ffn(m, expert_batch).bytes / r.cpu_bw) \
                + costs.elem_s * expert_batch * m.k * (3 * m.D + 3 * m.I) + costs.task_s
        swap = quant_dense_swap(m, r, costs, micro_batch)  # so do quantized dense weights
        secs["pre_attn"] += swap["pre"]
        secs["post_attn"] += swap["post"]
        return {k: TaskCost("cpu_attn" if k == "cpu_attn" else "compute", v, n_eb if k == "ffn" else n_mb)
                for k, v in secs.items()}
    fl, bw, launch = r.gpu_flops, r.gpu_bw, GPU_LAUNCH  # a GPU dequantizes inside its fused kernel
    post = o_proj(m, micro_batch) + router(m, micro_batch) + shared_expert(m, micro_batch)
    # kernel launches: pre_attn 3 (norm, qkv, rope), post_attn 5 (o, norm, router, top-k, combine), ffn 3;
    # tensor parallel: post_attn and ffn each end in an all-reduce on the compute stream
    t = {
        "pre_attn": TaskCost("compute", roofline_seconds(qkv_proj(m, micro_batch), fl, bw) + 3 * launch, n_mb),
        "post_attn": TaskCost("compute", roofline_seconds(post, fl, bw) + 5 * launch + all_reduce_seconds(m, r, micro_batch),
                              n_mb),
        "ffn": TaskCost("compute", roofline_seconds(moe_ffn(m, expert_batch), fl, bw) + 3 * launch
                        + all_reduce_seconds(m, r, expert_batch), n_eb),
    }
    attn = decode_attention(m, micro_batch, context)
    if attention_on == "cpu":
        t["cpu_attn"] = TaskCost("cpu_attn", roofline_seconds(attn, r.cpu_flops, r.cpu_bw) + CPU_LAUNCH, n_mb)
    streamed = (1 - gpu_weight_fraction) * m.layer_expert_bytes * m.moe_frac  # dense layers stream nothing
    # launch cost in proportion to the streamed share: affine in r_w, nothing when nothing streams
    t["weight_page"] = TaskCost("h2d", (streamed / pages / r.h2d_bw + COPY_LAUNCH * (1 - gpu_weight_fraction)), pages)
    if attention_on == "cpu":
        t["d1"] = TaskCost("d2h", micro_batch * m.d1 * m.dt / r.d2h_bw + COPY_LAUNCH, n_mb)
        t["d2"] = TaskCost("h2d", micro_batch * m.d2 * m.dt / r.h2d_bw + COPY_LAUNCH, n_mb)
    else:
        cpu_share = 1 - gpu_kv_fraction
        t["gpu_attn"] = TaskCost("compute", roofline_seconds(attn, r.gpu_flops, r.gpu_bw) + GPU_LAUNCH, n_mb)
        t["kv_load"] = TaskCost("h2d", cpu_share * micro_batch * m.state_layer_bytes(context) / r.h2d_bw + COPY_LAUNCH,
                                n_mb)
        t["kv_store"] = TaskCost("d2h", cpu_share * micro_batch * m.new_token_bytes() / r.d2h_bw + COPY_LAUNCH, n_mb)
    return t


def prefill_tasks(m: "ModelSpec | Dims", r: Rates, *, batch: int, micro_batch: int, attention_on: str, ffn_on: str,
                  gpu_weight_fraction: float, gpu_kv_fraction: float, prompt_len: float,
                  pages: int | None = None, prompt_sq: float | None = None) -> dict[str, TaskCost]:
    m = dims(m)
    n_mb = batch / micro_batch
    toks = micro_batch * prompt_len
    if ffn_on == "cpu":
        swap = quant_dense_swap(m, r, r.cpu_costs, toks)
        return {"prefill": TaskCost("compute", cpu_cost.prefill_seconds(m, r.cpu_costs, micro_batch, prompt_len, prompt_sq)
                                    + swap["pre"] + swap["post"], n_mb)}
    work = (qkv_proj(m, toks) + o_proj(m, toks) + router(m, toks) + shared_expert(m, toks)
            + moe_ffn(m, toks, expand=m.qkind != "none") + prefill_attention(m, micro_batch, prompt_len))
    reduce = 2 * all_reduce_seconds(m, r, toks)  # after the O projection and after the FFN
    pages = pages or max(1, round(n_mb))
    streamed = (1 - gpu_weight_fraction) * m.layer_expert_bytes * m.moe_frac
    kv_to_cpu = 1.0 if attention_on == "cpu" else 1 - gpu_kv_fraction
    return {
        "prefill": TaskCost("compute", roofline_seconds(work, r.gpu_flops, r.gpu_bw) + 16 * GPU_LAUNCH + reduce, n_mb),
        "weight_page": TaskCost("h2d", streamed / pages / r.h2d_bw + COPY_LAUNCH * (1 - gpu_weight_fraction), pages),
        "kv_store": TaskCost("d2h", kv_to_cpu * micro_batch * m.state_layer_bytes(prompt_len) / r.d2h_bw + COPY_LAUNCH,
                             n_mb),
    }


def busy_seconds(tasks: dict[str, TaskCost]) -> dict[str, float]:
    out = {"compute": 0.0, "cpu_attn": 0.0, "h2d": 0.0, "d2h": 0.0}
    for c in tasks.values():
        out[c.resource] += c.seconds * c.per_layer
    return out


def decode_layer_seconds(m: "ModelSpec | Dims", r: Rates, **kw) -> dict[str, float]:
    """Busy seconds per resource and the "pipeline" and "host" bounds: each affine in (r_w, r_c) for the LP."""
    tasks = decode_tasks(m, r, **kw)
    bounds = pipeline_bounds(tasks) or (0.0, 0.0, 0.0)
    host = host_seconds(tasks, r, ffn_ops(m, r, kw["expert_batch"])) if kw.get("ffn_on") == "gpu" else 0.0
    return {**busy_seconds(tasks), "pipeline": max(bounds), **{f"pipeline{i}": b for i, b in enumerate(bounds)},
            "host": host}


def prefill_layer_seconds(m: "ModelSpec | Dims", r: Rates, **kw) -> dict[str, float]:
    tasks = prefill_tasks(m, r, **kw)
    ffn = ffn_ops(m, r, kw["micro_batch"] * kw["prompt_len"]) if kw.get("ffn_on") == "gpu" else None
    return {**busy_seconds(tasks), "host": host_seconds(tasks, r, ffn) if ffn is not None else 0.0}


def expert_path(m: "ModelSpec | Dims", r: Rates, tokens: float) -> str:
    """The EXPERT_PATHS key the runtime picks (core.model.fused_moe.expert_path)."""
    d = dims(m)
    grouped_mm = d.dtype == "bfloat16" and (not r.gpu_capability or tuple(r.gpu_capability) >= (8, 0))
    return "grouped" if grouped_mm and d.qkind == "none" and tokens > FUSED_MAX_TOKENS else "fused"


def ffn_ops(m: "ModelSpec | Dims", r: Rates, tokens: float) -> float:
    d = dims(m)
    fixed, per = EXPERT_PATHS[expert_path(d, r, tokens)]
    return fixed + per * d.moe_frac * expected_experts(tokens, d.E, d.k)


def _ops(ffn: float) -> dict[str, float]:
    """Torch ops of a task of each kind; `ffn`: the FFN task's (ffn_ops)."""
    return {**HOST_OPS, "ffn": ffn, "prefill": HOST_OPS["prefill"] + ffn - HOST_OPS["ffn"]}


def host_task_seconds(r: Rates, ffn: float) -> dict[str, float]:
    return {kind: r.task_seconds + n * r.op_seconds for kind, n in _ops(ffn).items()}


def host_seconds(tasks: dict[str, TaskCost], r: Rates, ffn: float) -> float:
    """A GPU layer's tasks one after another on one interpreter: keeps the search off tiny micro-batches."""
    per = host_task_seconds(r, ffn)
    return sum(c.per_layer * per.get(kind, r.task_seconds) for kind, c in tasks.items())


def host_ops(tasks: dict[str, TaskCost], ffn: float) -> dict[str, float]:
    return {kind: c.per_layer * _ops(ffn).get(kind, 0) for kind, c in tasks.items()}


def pin_seconds(pinned_bytes: float, r: Rates) -> float:
    return pinned_bytes / r.pin_bw if r.has_gpu else 0.0


BOUNDS = (*RESOURCES, "pipeline", "host")  # a decode layer's bounds: each resource's busy time, pipeline and host


def bottleneck(layer: dict[str, float]) -> str:
    """What bounds a decode layer (the largest figure); a pipeline bound mostly made of link time is named h2d."""
    top = max((k for k in BOUNDS if k in layer), key=lambda k: layer[k])
    if top == "pipeline" and layer.get("h2d", 0.0) >= layer["pipeline"] / 2:
        return "h2d"
    return top


def pipeline_bounds(tasks: dict[str, TaskCost]) -> tuple[float, ...]:
    """Bounds on a CGOPipe layer beyond each resource's busy time; () where they do not apply.

    While the GPU runs an expert batch the link has only LOOKAHEAD micro-batches' pages queued, then idles:
    (n_eb − 1)·max(0, t_ffn − LOOKAHEAD·h2d/n_mb); the last expert batch holds back the next pages:
    max(0, t_post + t_ffn − h2d/n_mb). Returned as affine pieces for the LP (checked in tests/test_simulate.py).
    """
    if "d2" not in tasks or "ffn" not in tasks or "weight_page" not in tasks:
        return ()
    n_mb, n_eb = tasks["d2"].per_layer, tasks["ffn"].per_layer
    h2d = busy_seconds(tasks)["h2d"]
    t_ffn, t_post = tasks["ffn"].seconds, tasks["post_attn"].seconds
    middle = (n_eb - 1) * (t_ffn - LOOKAHEAD * h2d / n_mb)
    last = t_post + t_ffn - h2d / n_mb
    return h2d + middle, h2d + last, h2d + middle + last


def layer_time(busy: dict[str, float], ffn_on: str, pipeline: float = 0.0) -> float:
    """Wall time of a layer: resources overlap up to the pipeline bound, except CPU-only (one set of cores)."""
    if ffn_on == "cpu":
        return busy["compute"] + busy["cpu_attn"]
    return max(max(busy.values()), pipeline)


def head_seconds(m: "ModelSpec | Dims", r: Rates, *, tokens: int, micro_batches: int, on_gpu: bool) -> float:
    d = dims(m)
    if not on_gpu:
        return cpu_cost.head_seconds(d, r.cpu_costs, tokens) + quant_dense_swap(d, r, r.cpu_costs, tokens)["head"]
    return micro_batches * (roofline_seconds(lm_head(d, tokens / micro_batches), r.gpu_flops, r.gpu_bw) + GPU_LAUNCH)


def wave_seconds(r: Rates, *, on_gpu: bool) -> float:
    """Admitting a wave: CPU-only, as calibrated (CpuCosts.wave_s)."""
    return 0.0 if on_gpu else r.cpu_costs.wave_s
