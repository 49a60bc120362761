"""RunMeter: folds the engine's telemetry into cumulative RunSnapshots; paused time counts nowhere. The last
decode step's timeline is copied out (the executor reuses its buffer) at most every TIMELINE_EVERY_S."""

from __future__ import annotations

import heapq
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from core.telemetry import MemorySample, Progress, StepDone, TaskSpan, task_spans

HISTORY = 600  # chart points (decode steps) kept
WINDOW_S = 2.0  # "current" decode throughput and the typical step are measured over the last WINDOW_S of steps
TIMELINE_EVERY_S = 0.25  # the UI redraws at 4 Hz: a fresher timeline would never be seen

Clock = Callable[[], float]


@dataclass(frozen=True)
class StepTimeline:
    """One decode step as the executor ran it: every task's span, on the step's own clock."""

    spans: tuple[TaskSpan, ...]
    seconds: float  # the step's wall time
    active: int  # requests decoded by it


@dataclass(frozen=True)
class RunSnapshot:
    state: str = "loading"  # loading | running | paused | stopping | done | stopped | failed
    elapsed: float = 0.0  # seconds running (pauses left out)
    requests_done: int = 0
    requests_total: int = 0
    tokens_out: int = 0  # generated tokens (this session: a resumed run's earlier ones are in saved_out)
    tokens_in: int = 0  # prompt tokens prefilled (this session)
    saved_out: int = 0  # generated tokens in the finished results (earlier sessions of a resumed run too)
    saved_in: int = 0  # prompt tokens of the finished results
    average_tps: float = 0.0
    decode_tps: float = 0.0  # decode tokens / decode seconds over the window
    full_batch: bool = False  # decode_tps was measured on steps with the whole planned batch in flight
    history: tuple[tuple[float, float], ...] = ()  # (engine seconds so far, decode tokens/s) per decode step
    gpu_used: int = 0
    gpu_budget: int = 0
    cpu_used: int = 0
    cpu_budget: int = 0
    eta: float | None = None
    loading: str = ""  # what is loading, with its progress, while state == "loading"
    timeline: StepTimeline | None = None  # the last decode step (None before the first)
    decode_steps: int = 0
    comparison: Any = None  # core.plan.tracking.Comparison: measured against the plan, as `mlight bench` says it
    engine_seconds: float = 0.0  # time the engine spent in steps (the chart's x axis)
    stepped: bool = False  # a step has ended in this session (before it, the first batch is being prefilled)
    # the median comparable decode step of the window and how many steps it is of, to set beside the simulation
    typical_step_s: float = 0.0
    typical_steps: int = 0


class RunMeter:
    """Thread-safe accumulator of one run's telemetry; `snapshot()` is cheap and immutable."""

    def __init__(self, total_requests: int, budget_tokens: int, *, gpu_budget: int = 0, cpu_budget: int = 0,
                 clock: Clock = time.monotonic, previous: RunSnapshot | None = None, batch_size: int = 0,
                 tracker: Callable | None = None):
        self._lock = threading.Lock()
        self._clock = clock
        self._start = clock()
        # a run resumed on the same screen goes on from where the stopped one was: time and chart
        self._before = previous.elapsed if previous is not None else 0.0
        self._paused_total = 0.0
        self._paused_at: float | None = None
        self._first_step: float | None = None
        self._paused_before_first = 0.0
        self.state = "loading"
        self.loading = ""
        self.total = total_requests
        self.done = 0  # the run job counts the results a resumed run already holds
        self.budget_tokens = budget_tokens  # sum of max_new_tokens still to generate (an upper bound)
        self.prompt_tokens_left = 0  # prompt tokens not yet prefilled (the run job counts them with the tokenizer)
        self._prefill_s = 0.0  # seconds of this session's prefill steps (their tokens: tokens_in)
        self._saves = [0, 0.0]  # results, seconds: this session's saves of a result (a line and an fsync each)
        # for the ETA: waiting (id, prompt tokens, max new), longest prompt first; admitted id -> (max new, steps then)
        self._waiting: deque[tuple[str, int, int]] = deque()
        self._admitted: dict[str, tuple[int, int]] = {}
        self._slots = 0
        self.tokens_out = 0
        self.tokens_in = 0
        self.saved_out = self.saved_in = 0  # the finished results' tokens (the run job counts them)
        self.batch_size = batch_size  # the plan's N: steps with this many in flight are comparable to it
        self._steps: deque[tuple[float, float, int, str, int]] = deque()
        self._history: deque[tuple[float, float]] = deque(previous.history if previous else (), maxlen=HISTORY)
        self._timeline: StepTimeline | None = None
        self._timeline_at = float("-inf")
        self._decode_steps = 0
        self._engine_s = previous.engine_seconds if previous else 0.0  # seconds the engine spent in steps
        self.gpu_used = self.cpu_used = 0
        self.gpu_budget, self.cpu_budget = gpu_budget, cpu_budget
        self.tracker = tracker  # core.plan.tracking.Tracker of the plan's prediction, fed every event

    def expect(self, requests: list[tuple[str, int, int]], slots: int) -> None:
        """(id, prompt tokens, max new tokens) of each request, admitted longest prompt first, as the engine does."""
        with self._lock:
            self._waiting = deque(sorted(requests, key=lambda r: -r[1]))
            self._admitted.clear()
            self._slots = max(1, slots)
            self.prompt_tokens_left = sum(r[1] for r in requests)
            self.budget_tokens = sum(r[2] for r in requests)

    def set_state(self, state: str) -> None:
        with self._lock:
            now = self._clock()
            if state == "paused" and self._paused_at is None:
                self._paused_at = now
            elif state != "paused" and self._paused_at is not None:
                self._paused_total += now - self._paused_at
                self._paused_at = None
            self.state = state

    def _paused(self, now: float) -> float:
        return self._paused_total + (now - self._paused_at if self._paused_at is not None else 0.0)

    def on_event(self, ev) -> None:
        with self._lock:
            now = self._clock()
            if self.tracker is not None:
                self.tracker(ev)
            if isinstance(ev, StepDone):
                self._step(now, ev)
            elif isinstance(ev, MemorySample):
                self.gpu_used, self.cpu_used = ev.gpu_used, ev.cpu_used
                self.gpu_budget = ev.gpu_budget or self.gpu_budget
                self.cpu_budget = ev.cpu_budget or self.cpu_budget
            elif isinstance(ev, Progress):
                unit = f" {ev.unit}" if ev.unit else ""
                self.loading = f"{ev.what} {ev.done}/{ev.total}{unit}" if ev.total else ev.what

    def _step(self, now: float, ev: StepDone) -> None:
        if self.state == "loading":
            self.state = "running"
        if self._first_step is None:
            self._first_step = now - ev.seconds
            self._paused_before_first = self._paused(now)
        decode = ev.kind != "prefill"
        if decode:
            self.tokens_out += ev.tokens
            self.budget_tokens = max(0, self.budget_tokens - ev.tokens)
            self._decode_steps += 1
            if ev.tasks and now - self._timeline_at >= TIMELINE_EVERY_S:
                self._timeline_at = now
                self._timeline = StepTimeline(tuple(task_spans(ev)), ev.seconds, ev.active)
        else:
            self.tokens_in += ev.tokens
            self.prompt_tokens_left = max(0, self.prompt_tokens_left - ev.tokens)
            prompt = ev.tokens  # a prefill step admits the next waiting requests: their prompt tokens
            while self._waiting and prompt > 0:
                rid, n, max_new = self._waiting.popleft()
                self._admitted[rid] = (max_new, self._decode_steps)
                prompt -= n
            self._prefill_s += ev.seconds
        self._steps.append((now, ev.seconds, ev.tokens if decode else 0, ev.kind, ev.active))
        while self._steps and now - self._steps[0][0] > WINDOW_S and len(self._steps) > 1:
            self._steps.popleft()
        self._engine_s += ev.seconds
        if decode:
            self._history.append((self._engine_s, self._decode_rate()[0]))
        self.gpu_used = ev.gpu_mem_bytes or self.gpu_used
        self.cpu_used = ev.cpu_mem_bytes or self.cpu_used

    def _comparable(self) -> tuple[list, bool]:
        """The window's decode steps, only its full-batch ones when there are any; and whether they were."""
        decode = [s for s in self._steps if s[3] != "prefill"]
        full = [s for s in decode if self.batch_size and s[4] >= self.batch_size]
        return full or decode, bool(full)

    def _decode_rate(self) -> tuple[float, bool]:
        use, full = self._comparable()
        secs = sum(s[1] for s in use)
        return (sum(s[2] for s in use) / secs if secs > 0 else 0.0), full

    def _steps_left(self) -> int:
        """Decode steps to the end at max new tokens, a waiting request taking the slot that frees first."""
        free_at = [max(0, max_new - 1 - (self._decode_steps - at)) for max_new, at in self._admitted.values()]
        free_at += [0] * max(0, self._slots - len(free_at))
        heapq.heapify(free_at)
        end = max(free_at, default=0)
        for _, _, max_new in self._waiting:
            start = heapq.heappop(free_at)
            heapq.heappush(free_at, start + max_new - 1)  # its first token comes from its prefill
            end = max(end, start + max_new - 1)
        return end

    def _step_cost(self) -> tuple[float, float] | None:
        """(a, b): a decode step of k requests takes a + b·k seconds (a: reading weights), least squares over the
        window; all per token where k has not varied."""
        pts = [(float(st[4] or st[2]), st[1]) for st in self._steps if st[3] != "prefill"]
        xs, ys = [x for x, _ in pts], [y for _, y in pts]
        if not pts or sum(xs) <= 0:
            return None
        mx = statistics.fmean(xs)
        if statistics.pvariance(xs, mx) <= max(1.0, (0.1 * mx) ** 2):  # k spread under a tenth: a fit fits the noise
            return 0.0, sum(ys) / sum(xs)
        b, a = statistics.linear_regression(xs, ys)
        if b < 0:
            return statistics.fmean(ys), 0.0
        return (a, b) if a >= 0 else (0.0, sum(ys) / sum(xs))

    def _eta(self) -> float | None:
        """Seconds left at this run's measured rates, every request taken to its max new tokens (early stops make
        it long); None until the rates are measured."""
        cost = self._step_cost()
        if cost is None:
            return None
        a, b = cost
        left = (a * self._steps_left() if self._slots else 0.0) + b * self.budget_tokens
        if self.prompt_tokens_left:
            if self.tokens_in <= 0:
                return None
            left += self.prompt_tokens_left * self._prefill_s / self.tokens_in
        saved, seconds = self._saves
        if saved:
            left += max(0, self.total - self.done) * seconds / saved
        return left

    def result_saved(self, seconds: float) -> None:
        """A result took `seconds` to save: work no engine step counts."""
        with self._lock:
            self._saves[0] += 1
            self._saves[1] += seconds

    def add_result(self, output_tokens: int, max_new_tokens: int, request_id: str | None = None,
                   eos: bool = False) -> None:
        with self._lock:
            self.done += 1
            self._admitted.pop(request_id, None)
            if output_tokens:
                # the first token comes from the prefill step, which counts none; an EOS is counted but not output
                self.tokens_out += 0 if eos else 1
            # neither the tokens it did not generate nor its first one (made by its prefill) are work left
            self.budget_tokens = max(0, self.budget_tokens - max(0, max_new_tokens - output_tokens)
                                     - (1 if output_tokens else 0))

    def snapshot(self) -> RunSnapshot:
        with self._lock:
            now = self._clock()
            run_s = 0.0
            if self._first_step is not None:
                run_s = now - self._first_step - (self._paused(now) - self._paused_before_first)
            avg = self.tokens_out / run_s if run_s > 0 else 0.0
            decode_tps, full = self._decode_rate()
            eta = 0.0 if self.state == "done" else self._eta()
            secs = sorted(s[1] for s in self._comparable()[0])  # the window's comparable decode steps: their median
            return RunSnapshot(
                state=self.state, elapsed=self._before + now - self._start - self._paused(now),
                requests_done=self.done, requests_total=self.total, tokens_out=self.tokens_out,
                tokens_in=self.tokens_in, saved_out=self.saved_out, saved_in=self.saved_in, average_tps=avg,
                decode_tps=decode_tps, full_batch=full, history=tuple(self._history), gpu_used=self.gpu_used,
                gpu_budget=self.gpu_budget, cpu_used=self.cpu_used, cpu_budget=self.cpu_budget, eta=eta,
                loading=self.loading, timeline=self._timeline, decode_steps=self._decode_steps,
                engine_seconds=self._engine_s, stepped=self._first_step is not None,
                typical_step_s=secs[len(secs) // 2] if secs else 0.0, typical_steps=len(secs),
                comparison=self.tracker.comparison() if self.tracker is not None else None,
            )
