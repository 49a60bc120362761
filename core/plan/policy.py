"""Policy (how to run a model on a machine) and Prediction (what the HRM expects of it): validated data with a
JSON round-trip. Names follow the paper (N, μ, A_g, F_g, r_w, r_c) in comments.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from core.telemetry import Busy

PLACES = ("cpu", "gpu")
SCHEDULES = ("cgopipe", "s3", "s4")  # the decode schedules core.runtime.schedule builds (CGOPipe, FlexGen's S3, S4)


class JsonRecord:
    """A frozen dataclass's JSON round-trip, refusing unknown fields; its __post_init__ turns JSON's lists back
    into the tuples it holds."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) - names:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(set(d) - names)}; expected {sorted(names)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class Policy(JsonRecord):
    batch_size: int  # N: requests decoded together in one step
    micro_batch_size: int  # μ: requests per attention micro-batch; N / μ micro-batches per layer
    expert_batch_size: int  # tokens meeting at the experts at once: a multiple of μ dividing N (MoE-Gen's module batching)
    attention_on: str = "cpu"  # A_g: decode attention on "cpu" (next to the KV cache) or "gpu"
    ffn_on: str = "gpu"  # F_g: MoE FFN (and the dense projections) on "gpu", or everything on "cpu"
    gpu_weight_fraction: float = 0.0  # r_w: share of expert weights resident on the GPU; the rest is streamed
    gpu_kv_fraction: float = 0.0  # r_c: share of the KV cache on the GPU (only with attention on the GPU)
    pages_per_layer: int = 1  # the CPU-resident part of a layer's weights is sent in this many pages
    tensor_parallel: int = 1  # ranks (GPUs) splitting the model; the sizes and fractions above are one rank's

    def __post_init__(self):
        for name in ("batch_size", "micro_batch_size", "expert_batch_size", "pages_per_layer", "tensor_parallel"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Policy.{name} must be a positive integer, got {v!r}")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}")
        if self.expert_batch_size % self.micro_batch_size or self.batch_size % self.expert_batch_size:
            raise ValueError(f"expert_batch_size {self.expert_batch_size} must be a multiple of micro_batch_size "
                             f"{self.micro_batch_size} and divide batch_size {self.batch_size}")
        for name in ("attention_on", "ffn_on"):
            if getattr(self, name) not in PLACES:
                raise ValueError(f"Policy.{name} must be 'cpu' or 'gpu', got {getattr(self, name)!r}")
        if self.attention_on == "gpu" and self.ffn_on == "cpu":
            raise ValueError("attention on the GPU with the FFN on the CPU is not a supported placement")
        for name in ("gpu_weight_fraction", "gpu_kv_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"Policy.{name} must lie in [0, 1], got {v}")
        if self.ffn_on == "cpu" and self.gpu_weight_fraction:
            raise ValueError("gpu_weight_fraction must be 0 when the FFN runs on the CPU")
        if self.attention_on == "cpu" and self.gpu_kv_fraction:
            raise ValueError("gpu_kv_fraction must be 0 when attention runs on the CPU (the KV cache lives there)")

    @property
    def num_micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def micro_batches_per_expert_batch(self) -> int:
        return self.expert_batch_size // self.micro_batch_size


def expert_split(gpu_weight_fraction: float, num_layers: int, num_experts: int, dense=()) -> list[int]:
    """Experts each layer keeps on the GPU for a resident share r_w: round(r_w·L'·E) in all over the L' MoE layers,
    spread evenly, earlier layers taking the remainder; `dense` layers get 0. Runtime and planner both use it."""
    dense = set(dense)
    moe = [i for i in range(num_layers) if i not in dense]
    total = int(gpu_weight_fraction * len(moe) * num_experts + 0.5)
    base, extra = divmod(min(total, len(moe) * num_experts), max(1, len(moe)))
    out = [0] * num_layers
    for n, i in enumerate(moe):
        out[i] = base + (n < extra)
    return out


def dense_layers(num_layers: int, moe_share: float) -> range:
    """The layers without experts: the first ones (`first_k_dense_replace`), as the MoE share leaves."""
    return range(num_layers - round(moe_share * num_layers))


def kv_gpu_layers(gpu_kv_fraction: float, num_layers: int) -> int:
    """The runtime splits the KV cache by whole layers."""
    return int(gpu_kv_fraction * num_layers + 1e-9)


BOTTLENECK_WORDS = {
    "compute": "GPU compute (the MoE FFN and projections)",
    "cpu_attn": "CPU attention (host memory bandwidth reading the KV cache)",
    "h2d": "PCIe host→device (streaming expert weights)",
    "d2h": "PCIe device→host (sending QKV to the CPU)",
    "pipeline": "the pipeline (the link idles while the GPU runs a large expert batch)",
    "host": "the host launching the GPU's tasks (many small tasks: a larger micro-batch needs fewer)",
}


@dataclass(frozen=True)
class Prediction(JsonRecord):
    tokens_per_s: float  # end to end: generated tokens / (prefill + decode time) of one batch
    decode_tokens_per_s: float
    prefill_tokens_per_s: float  # prompt tokens per second during prefill
    bottleneck: str  # what bounds a decode layer: a key of core.telemetry.RESOURCES, or "pipeline"
    gpu_bytes: int  # accounted GPU memory (all GPUs together, as are the breakdowns below)
    cpu_bytes: int
    layer_seconds: dict[str, float]  # decode: busy seconds of one layer on each resource (+ "pipeline" bound)
    prefill_layer_seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: float = 0.0  # one decode step (all layers, all N requests, one token each)
    prefill_seconds: float = 0.0  # the prefill of one batch
    gpu_breakdown: dict[str, int] = field(default_factory=dict)  # what the GPU bytes are
    cpu_breakdown: dict[str, int] = field(default_factory=dict)
    bottleneck_text: str = ""  # the bottleneck in words; defaults from BOTTLENECK_WORDS
    pinned_bytes: int = 0  # page-locked host memory (part of cpu_bytes)
    # busy seconds per resource over the whole run, all layers and waves: what a measured run's sums compare with
    decode_busy: dict[str, float] = field(default_factory=dict)
    prefill_busy: dict[str, float] = field(default_factory=dict)
    decode_steps: int = 0
    prompt_tokens: float = 0.0
    band: float = 0.0  # the rates' relative half-width (CPU-only: the calibration's, core.plan.cpu_cost); 0: none

    def quote(self, rate: float | None = None) -> str:
        """A rate as a prediction of it is shown: "≈ 596 tok/s ± 12 %" (end to end unless `rate` is given)."""
        rate = self.tokens_per_s if rate is None else rate
        return f"≈ {rate:,.0f} tok/s" + (f" ± {self.band:.0%}".replace("%", " %") if self.band else "")

    def __post_init__(self):  # "gpu", compute's old name, is read as "compute" (core.telemetry.Busy)
        object.__setattr__(self, "bottleneck", "compute" if self.bottleneck == "gpu" else self.bottleneck)
        for name in ("layer_seconds", "prefill_layer_seconds", "decode_busy", "prefill_busy"):
            object.__setattr__(self, name, Busy(getattr(self, name)))
        if not self.bottleneck_text:
            object.__setattr__(self, "bottleneck_text", BOTTLENECK_WORDS.get(self.bottleneck, self.bottleneck))
