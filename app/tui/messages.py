"""Typed messages that thread workers post to the screens. Those that can flood (run updates, progress) define
`can_replace`, so Textual keeps only the newest: each carries cumulative state, so dropping older ones loses
nothing."""

from __future__ import annotations

from typing import Any

from textual.message import Message

from app.tui.meter import RunSnapshot


class WorkProgress(Message):
    """Progress of a long operation (probe, demo build, download, engine load)."""

    def __init__(self, what: str, done: float, total: float, unit: str = "", rate: float | None = None):
        super().__init__()
        self.what, self.done, self.total, self.unit, self.rate = what, done, total, unit, rate

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, WorkProgress)


class MachineReady(Message):
    def __init__(self, machine: Any):
        super().__init__()
        self.machine = machine


class ModelReady(Message):
    def __init__(self, model: Any):
        super().__init__()
        self.model = model


class PromptsReady(Message):
    def __init__(self, prompts: Any):
        super().__init__()
        self.prompts = prompts


class PlanReady(Message):
    """A plan for the budgets asked in request number `gen` (older requests' answers are dropped)."""

    def __init__(self, plan: Any, gen: int = 0):
        super().__init__()
        self.plan, self.gen = plan, gen


class Checked(PlanReady):
    """Live validation of a user-edited policy: the plan, its `problems` (empty = fits)."""


class RunUpdate(Message):
    def __init__(self, snapshot: RunSnapshot):
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, RunUpdate)


class RunLog(Message):
    """A line for the run's log (engine warnings, resume notes). Never coalesced."""

    def __init__(self, text: str, level: str = "info"):
        super().__init__()
        self.text, self.level = text, level


class RunEnded(Message):
    def __init__(self, state: str, snapshot: RunSnapshot):
        super().__init__()
        self.state, self.snapshot = state, snapshot


class SimulatedStep(Message):
    """The planner's replay of one decode step for the running policy (a core.runtime.simulate.Timeline)."""

    def __init__(self, timeline: Any):
        super().__init__()
        self.timeline = timeline
