"""Typed events the engine publishes, and the resource names that engine and simulator share.

Consumers (the app's live panels, `mlight bench`, tests) receive events through a callback; the
engine never prints or sleeps for them. Busy time is keyed by RESOURCES so that a simulated step
(planner) and a measured one (engine) can be put side by side field for field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

# gpu: accelerator compute; cpu_attn: attention on the CPU; h2d / d2h: copies over the host link.
# In the CPU-only mode "gpu" is the compute device that runs the dense work (the CPU itself).
RESOURCES = ("gpu", "cpu_attn", "h2d", "d2h")


@dataclass(frozen=True)
class StepDone:
    """One engine step (a prefill wave or one decode token for every active request)."""

    kind: str  # "prefill" | "decode"
    tokens: int  # tokens produced (decode) or consumed (prefill) by the step
    seconds: float  # wall time of the step
    busy: dict[str, float] = field(default_factory=dict)  # resource -> busy seconds within the step
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    active: int = 0  # requests in flight during the step
    gpu_mem_bytes: int = 0
    cpu_mem_bytes: int = 0


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
    """Progress of a long operation (loading weights, building the demo model, downloading)."""

    what: str
    done: int
    total: int
    unit: str = ""


Event = Union[StepDone, RequestDone, MemorySample, WarningEvent, Progress]
EventSink = Callable[[Event], None]


def ignore(event: Event) -> None:
    """Default sink: drop the event."""
