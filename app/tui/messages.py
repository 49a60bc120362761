"""Typed messages that thread workers post to the screens. Those that can flood (run updates, progress) define
`can_replace`, so Textual keeps only the newest: each carries cumulative state, so dropping older ones loses
nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message

from app.tui.meter import RunSnapshot


@dataclass
class WorkProgress(Message):
    """Progress of a long operation (probe, demo build, download, engine load)."""

    what: str
    done: float
    total: float
    unit: str = ""
    rate: float | None = None

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, WorkProgress)


@dataclass
class MachineReady(Message):
    machine: Any


@dataclass
class ModelReady(Message):
    model: Any


@dataclass
class PromptsReady(Message):
    prompts: Any


@dataclass
class PlanReady(Message):
    """A plan for the budgets asked in request number `gen` (older requests' answers are dropped)."""

    plan: Any
    gen: int = 0


class Checked(PlanReady):
    """Live validation of a user-edited policy: the plan, its `problems` (empty = fits)."""


@dataclass
class RunUpdate(Message):
    snapshot: RunSnapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, RunUpdate)


@dataclass
class RunLog(Message):
    """A line for the run's log (engine warnings, resume notes). Never coalesced."""

    text: str
    level: str = "info"


@dataclass
class RunEnded(Message):
    state: str
    snapshot: RunSnapshot


@dataclass
class SimulatedStep(Message):
    """The planner's replay of one decode step for the running policy (a core.runtime.simulate.Timeline)."""

    timeline: Any
