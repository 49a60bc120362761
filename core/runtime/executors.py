"""Run a step's task graph in dependency order: `SequentialExecutor` in list order (the CPU mode), `ThreadedExecutor`
on a worker thread per resource (a missing dependency shows as wrong tokens). Never a hang: the first failure wakes
every waiter; a dead worker or `stall_seconds` without progress fails the step with a `TaskFailed` naming the task.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterable

from core.errors import MlightError
from core.runtime.device import DeviceTaskError

POLL = 0.05  # seconds between the caller's checks of its workers
STALL_SECONDS = 600.0  # a step in which no task finishes for this long has hung
GRACE = 2.0  # after a failure, how long the caller waits for busy workers to notice it


class TaskFailed(MlightError):
    """A task of the step raised (or could not run); `__cause__` is the original exception."""


class WorkerDied(RuntimeError):
    """A worker thread could not start or stopped running tasks."""


class Stalled(RuntimeError):
    """No task of the step finished within the executor's stall limit."""


def describe(task) -> str:
    if task is None:
        return "the step"
    at = ((name, getattr(task, name, None)) for name in ("layer", "micro_batch", "page"))
    return " ".join([getattr(task, "kind", "task"), *(f"{name}={v}" for name, v in at if v is not None and v >= 0)])


def _sized(times: list[float], n: int) -> list[float]:
    """The executor's timing buffer with room for n tasks: grown once, then reused step after step."""
    if len(times) < 2 * n:  # (not a fresh empty list every step)
        times.extend([0.0] * (2 * n - len(times)))
    return times


def _failed(task, err: BaseException) -> TaskFailed:
    e = TaskFailed(f"{describe(task)} failed: {type(err).__name__}: {err}")
    e.__cause__ = err
    return e


class SequentialExecutor:
    def __init__(self):
        self.times: list[float] = []  # task i of the last step ran from times[2i] to times[2i+1]

    def run(self, tasks: Iterable, fn: Callable) -> dict[str, float]:
        busy: dict[str, float] = {}
        done: set[int] = set()
        clock = time.perf_counter
        tasks = tasks if isinstance(tasks, (list, tuple)) else list(tasks)
        times = _sized(self.times, len(tasks))
        for i, t in enumerate(tasks):
            missing = [d for d in t.deps if d not in done]
            if missing:
                raise RuntimeError(f"task {t.id} ({describe(t)}) listed before its dependencies {missing}")
            t0 = clock()
            try:
                fn(t)
            except Exception as e:
                raise _failed(t, e) from e
            t1 = clock()
            times[2 * i], times[2 * i + 1] = t0, t1
            busy[t.resource] = busy.get(t.resource, 0.0) + t1 - t0
            done.add(t.id)
        return busy

    def close(self) -> None:
        pass


_STOP = object()


class ThreadedExecutor:
    def __init__(self, resources: Iterable[str], setup: Callable[[str], None] | None = None,
                 stall_seconds: float = STALL_SECONDS):
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._dead: dict[str, BaseException] = {}  # resource -> why its worker stopped
        self._setup = setup
        self.stall_seconds = stall_seconds
        self._broken: str | None = None  # a worker stuck in a task: this executor cannot run more steps
        self.times: list[float] = []  # task i of the last step ran from times[2i] to times[2i+1]
        for r in resources:
            self._add_worker(r)

    def _add_worker(self, resource: str) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()
        th = threading.Thread(target=self._work, args=(resource, q), name=f"mlight-{resource}", daemon=True)
        self._queues[resource] = q
        self._threads[resource] = th
        th.start()

    def _work(self, resource: str, q: queue.SimpleQueue) -> None:
        try:
            if self._setup is not None:
                self._setup(resource)
        except BaseException as e:  # noqa: BLE001 - the caller's watch turns it into TaskFailed
            self._dead[resource] = e
            return
        while True:
            item = q.get()
            if item is _STOP:
                return
            step, task, i = item
            item = None
            try:
                if self._wait_deps(step, task) and not step.failed:
                    self._execute(step, task, i)
            except DeviceTaskError as e:  # launched work failed; name it, not the task that noticed
                step.fail(e.label or task, e.__cause__)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                step.fail(task, e)
            finally:
                step.finished(task)
            # nothing of the step may outlive its tasks here (its device buffers under the next run)
            step = task = None

    def _wait_deps(self, step: "_Step", task) -> bool:
        """Wait for the task's dependencies; False when the step failed meanwhile."""
        for d in task.deps:
            step.events[d].wait()
            if step.failed:
                return False
        return True

    def _execute(self, step: "_Step", task, i: int) -> None:
        t0 = time.perf_counter()
        try:
            step.fn(task)
        finally:
            t1 = time.perf_counter()
            self.times[2 * i], self.times[2 * i + 1] = t0, t1  # each task writes its own two slots
            step.add_busy(task.resource, t1 - t0)

    def run(self, tasks: Iterable, fn: Callable) -> dict[str, float]:
        if self._broken:
            raise TaskFailed(f"the executor is stuck ({self._broken})", "restart mlight")
        tasks = list(tasks)
        _sized(self.times, len(tasks))
        step = self._new_step(tasks, fn)
        for i, t in enumerate(tasks):
            if t.resource not in self._queues:
                self._add_worker(t.resource)
            self._queues[t.resource].put((step, t, i))
        self._watch(step)
        if step.error is None:
            try:
                return self._finish(step)
            except DeviceTaskError as e:  # work launched on a device failed after the fact
                step.fail(e.label, e.__cause__)
        self._after_failure(step)
        task, err = step.error
        step = None
        raise _failed(task, err)

    def _watch(self, step: "_Step") -> None:
        """Return once every task of the step has finished (or been skipped after a failure)."""
        seen, since = -1, time.monotonic()
        while not step.all_done.wait(POLL):
            for r, th in list(self._threads.items()):
                if not th.is_alive() and not step.failed:
                    why = self._dead.get(r)
                    died = WorkerDied(f"the {r} worker " + (f"could not start: {type(why).__name__}: {why}"
                                                            if why is not None else "stopped"))
                    died.__cause__ = why
                    self._broken = str(died)
                    step.fail(None, died)
            if len(step.left) != seen:  # progress: a task finished (or was skipped)
                seen, since = len(step.left), time.monotonic()
            elif not step.failed and time.monotonic() - since > self.stall_seconds:
                step.fail(None, Stalled(f"no task finished in {self.stall_seconds:g} s; waiting on "
                                        + ", ".join(describe(t) for t in step.running())))
            if step.failed:
                if not step.all_done.wait(GRACE):
                    stuck = step.running()
                    self._broken = "a worker is stuck in " + ", ".join(describe(t) for t in stuck[:3])
                return

    def _new_step(self, tasks: list, fn: Callable) -> "_Step":
        return _Step(tasks, fn)

    def _finish(self, step: "_Step") -> dict[str, float]:
        return step.busy

    def _after_failure(self, step: "_Step") -> None:
        pass

    def close(self) -> None:
        for q in self._queues.values():
            q.put(_STOP)
        for th in self._threads.values():
            th.join(timeout=5)


class _Step:
    """Shared state of one graph run: an event per task, busy time, progress, and the first failure."""

    def __init__(self, tasks: list, fn: Callable):
        self.fn = fn
        self.tasks = {t.id: t for t in tasks}
        self.events = {t.id: threading.Event() for t in tasks}
        self.busy: dict[str, float] = {}
        self.error = None
        self.failed = False
        self.all_done = threading.Event()
        self.left = set(self.tasks)  # not finished (nor skipped)
        self._lock = threading.Lock()
        if not tasks:
            self.all_done.set()

    def add_busy(self, resource: str, seconds: float) -> None:
        with self._lock:
            self.busy[resource] = self.busy.get(resource, 0.0) + seconds

    def finished(self, task) -> None:
        self.events[task.id].set()
        with self._lock:
            self.left.discard(task.id)
            if not self.left:
                self.all_done.set()

    def running(self) -> list:
        with self._lock:
            return [self.tasks[i] for i in sorted(self.left)[:5]]

    def fail(self, task, err: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = (task, err)
            self.failed = True
        for ev in self.events.values():  # wake every waiter; they see `failed` and skip their task
            ev.set()
