"""Typed events the engine publishes through a callback, and the resource names engine and simulator share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence, Union

# compute: the dense work and the experts (the GPU; the CPU in the CPU-only mode); h2d / d2h: the host link's copies
RESOURCES = ("compute", "cpu_attn", "h2d", "d2h")


class Busy(dict):
    """{resource: seconds}; "compute" still reads as its old name "gpu", without being held twice."""

    def __init__(self, d=()):
        super().__init__(("compute" if k == "gpu" else k, v) for k, v in dict(d).items())

    def __missing__(self, key):
        return self["compute"] if key == "gpu" else {}[key]

    def get(self, key, default=None):
        return super().get("compute" if key == "gpu" else key, default)


def with_gpu_keys(out):
    """A JSON output as outside readers know it: "compute" also under its old key "gpu"; a bottleneck says "gpu"."""
    if isinstance(out, dict):
        out = {k: "gpu" if k == "bottleneck" and v == "compute" else with_gpu_keys(v) for k, v in out.items()}
        return {**out, "gpu": out["compute"]} if "compute" in out else out
    return [with_gpu_keys(v) for v in out] if isinstance(out, (list, tuple)) else out


@dataclass(frozen=True)
class StepDone:
    """One engine step (a prefill wave or one decode token for every active request)."""

    kind: str  # "prefill" | "decode"
    tokens: int  # tokens produced (decode) or consumed (prefill) by the step
    seconds: float  # wall time of the step
    busy: dict[str, float] = field(default_factory=dict)  # resource -> busy seconds within the step (a Busy)
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    active: int = 0  # requests in flight during the step
    gpu_mem_bytes: int = 0
    cpu_mem_bytes: int = 0
    # task i of the step's graph ran from times[2i] to times[2i+1] (perf_counter); both are shared with later steps
    # (`times` is refilled by the next, so timing costs no allocation): copy inside the callback (`task_spans`)
    tasks: Sequence = ()
    times: Sequence[float] = ()

    def __post_init__(self):
        if type(self.busy) is not Busy:  # the engine hands one over made: no copy a step
            object.__setattr__(self, "busy", Busy(self.busy))


class TaskSpan(NamedTuple):
    resource: str  # a key of RESOURCES
    kind: str  # the task's kind (core.runtime.schedule.RESOURCE_OF)
    layer: int
    start: float  # seconds from the step's first task's start
    end: float


def task_spans(step: StepDone) -> list[TaskSpan]:
    """Seconds from the step's first task's start; a copy to keep."""
    n, times = min(len(step.tasks), len(step.times) // 2), step.times
    origin = min(times[0:2 * n:2], default=0.0)
    return [TaskSpan(t.resource, t.kind, getattr(t, "layer", -1), times[2 * i] - origin, times[2 * i + 1] - origin)
            for i, t in enumerate(step.tasks[:n])]


@dataclass(frozen=True)
class RequestDone:
    id: str
    prompt_tokens: int
    output_tokens: int
    seconds: float
    finish_reason: str


@dataclass(frozen=True)
class MemorySample:
    gpu_used: int
    gpu_budget: int
    cpu_used: int
    cpu_budget: int


@dataclass(frozen=True)
class WarningEvent:
    message: str


@dataclass(frozen=True)
class Progress:
    what: str
    done: int
    total: int
    unit: str = ""


Event = Union[StepDone, RequestDone, MemorySample, WarningEvent, Progress]
EventSink = Callable[[Event], None]


def ignore(event: Event) -> None:
    pass
