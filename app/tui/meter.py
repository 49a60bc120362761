"""RunMeter: folds the engine's telemetry events into a RunSnapshot the Run screen draws.

It runs on the worker thread (the engine's event sink) and is the reason the UI can drop all but the
newest update: every snapshot is cumulative, so losing intermediate ones loses nothing. The clock is
injected so that tests and snapshots are deterministic.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from core.telemetry import RESOURCES, MemorySample, Progress, RequestDone, StepDone, WarningEvent

HISTORY = 120  # sparkline points (steps) kept
WINDOW_S = 2.0  # "current" throughput and busy shares are measured over the last WINDOW_S of steps

Clock = Callable[[], float]


@dataclass(frozen=True)
class RunSnapshot:
    state: str = "loading"  # loading | running | paused | stopping | done | stopped | failed
    elapsed: float = 0.0
    requests_done: int = 0
    requests_total: int = 0
    tokens_out: int = 0  # generated tokens (this session and earlier ones of a resumed run)
    tokens_in: int = 0  # prompt tokens prefilled
    current_tps: float = 0.0
    average_tps: float = 0.0
    history: tuple[float, ...] = ()
    busy: dict[str, float] = field(default_factory=dict)  # resource -> share of wall time, 0..1
    gpu_used: int = 0
    gpu_budget: int = 0
    cpu_used: int = 0
    cpu_budget: int = 0
    eta: float | None = None
    loading: str = ""  # what is loading, with its progress, while state == "loading"


class RunMeter:
    """Thread-safe accumulator of one run's telemetry; `snapshot()` is cheap and immutable."""

    def __init__(self, total_requests: int, budget_tokens: int, *, done_before: int = 0,
                 tokens_before: int = 0, gpu_budget: int = 0, cpu_budget: int = 0,
                 clock: Clock = time.monotonic, started: float | None = None):
        self._lock = threading.Lock()
        self._clock = clock
        self._start = clock() if started is None else started  # a resumed run keeps counting from its start
        self._first_step: float | None = None
        self.state = "loading"
        self.loading = ""
        self.total = total_requests
        self.done = done_before
        self.budget_tokens = budget_tokens  # sum of max_new_tokens still to generate (an upper bound)
        self.tokens_out = tokens_before
        self._session_tokens = 0
        self.tokens_in = 0
        self._steps: deque[tuple[float, float, int, dict[str, float]]] = deque()  # (t, seconds, tokens, busy)
        self._history: deque[float] = deque(maxlen=HISTORY)
        self.gpu_used = self.cpu_used = 0
        self.gpu_budget, self.cpu_budget = gpu_budget, cpu_budget

    def set_state(self, state: str) -> None:
        with self._lock:
            self.state = state

    def on_event(self, ev) -> None:
        with self._lock:
            now = self._clock()
            if isinstance(ev, StepDone):
                self._step(now, ev)
            elif isinstance(ev, MemorySample):
                self.gpu_used, self.cpu_used = ev.gpu_used, ev.cpu_used
                self.gpu_budget = ev.gpu_budget or self.gpu_budget
                self.cpu_budget = ev.cpu_budget or self.cpu_budget
            elif isinstance(ev, Progress):
                unit = f" {ev.unit}" if ev.unit else ""
                self.loading = f"{ev.what} {ev.done}/{ev.total}{unit}" if ev.total else ev.what
            elif isinstance(ev, (RequestDone, WarningEvent)):
                pass  # results are counted by `add_result`; warnings go to the log as their own message

    def _step(self, now: float, ev: StepDone) -> None:
        if self.state == "loading":
            self.state = "running"
        if self._first_step is None:
            self._first_step = now - ev.seconds
        if ev.kind == "prefill":
            self.tokens_in += ev.tokens
        else:
            self.tokens_out += ev.tokens
            self._session_tokens += ev.tokens
            self.budget_tokens = max(0, self.budget_tokens - ev.tokens)
            self._history.append(ev.tokens / ev.seconds if ev.seconds > 0 else 0.0)
        self._steps.append((now, ev.seconds, ev.tokens if ev.kind != "prefill" else 0, dict(ev.busy)))
        while self._steps and now - self._steps[0][0] > WINDOW_S and len(self._steps) > 1:
            self._steps.popleft()
        if ev.gpu_mem_bytes:
            self.gpu_used = ev.gpu_mem_bytes
        if ev.cpu_mem_bytes:
            self.cpu_used = ev.cpu_mem_bytes

    def add_result(self, output_tokens: int, max_new_tokens: int) -> None:
        with self._lock:
            self.done += 1
            if output_tokens:
                # a request's first token comes out of its prefill step, which counts prompt tokens only
                self.tokens_out += 1
                self._session_tokens += 1
            # the request will not use the tokens it did not generate: lower the ETA's upper bound
            self.budget_tokens = max(0, self.budget_tokens - max(0, max_new_tokens - output_tokens))

    def snapshot(self) -> RunSnapshot:
        with self._lock:
            now = self._clock()
            wall = sum(s[1] for s in self._steps)
            toks = sum(s[2] for s in self._steps)
            busy = {r: min(1.0, sum(s[3].get(r, 0.0) for s in self._steps) / wall) if wall > 0 else 0.0
                    for r in RESOURCES}
            run_s = now - self._first_step if self._first_step is not None else 0.0
            avg = self._session_tokens / run_s if run_s > 0 else 0.0
            eta = None
            if self.state in ("done",):
                eta = 0.0
            elif avg > 0:
                eta = self.budget_tokens / avg
            return RunSnapshot(
                state=self.state, elapsed=now - self._start, requests_done=self.done,
                requests_total=self.total, tokens_out=self.tokens_out, tokens_in=self.tokens_in,
                current_tps=toks / wall if wall > 0 else 0.0, average_tps=avg, history=tuple(self._history),
                busy=busy, gpu_used=self.gpu_used, gpu_budget=self.gpu_budget, cpu_used=self.cpu_used,
                cpu_budget=self.cpu_budget, eta=eta, loading=self.loading,
            )
