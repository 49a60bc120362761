"""Executors: run one step's task graph on its resources, in dependency order.

A task graph is a list of tasks (anything with `id`, `resource` and `deps`, ids unique, listed in
an order where every dependency comes first) plus a function `run(task)` that does a task's work.

- `SequentialExecutor` runs every task in list order on the calling thread (the CPU mode).
- `ThreadedExecutor` gives each resource a worker thread fed by a queue in list order; a task
  starts once the events of all its dependencies are set. Tensors stay on the CPU and copies are
  real copies, so a missing dependency shows up as wrong tokens.
- `core.runtime.cuda_executor.CudaExecutor` keeps the same shape with CUDA streams and events.

Failures never hang: the first exception sets every pending event, the other workers skip what
is left, and the caller gets a `TaskFailed` naming the task, with the original error as cause.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterable, Protocol

from core.errors import MlightError


class TaskLike(Protocol):
    id: int
    resource: str
    deps: tuple[int, ...]


class TaskFailed(MlightError):
    """A task of the step raised; `__cause__` is the original exception."""


def _describe(task) -> str:
    parts = [getattr(task, "kind", "task")]
    for name in ("layer", "micro_batch", "page"):
        v = getattr(task, name, None)
        if v is not None and v >= 0:
            parts.append(f"{name}={v}")
    return " ".join(parts)


def _sized(times: list[float], n: int) -> list[float]:
    """The executor's timing buffer with room for n tasks: grown once, then reused step after step."""
    if len(times) < 2 * n:
        times.extend([0.0] * (2 * n - len(times)))
    return times


class SequentialExecutor:
    name = "sequential"

    def __init__(self):
        self.times: list[float] = []  # task i of the last step ran from times[2i] to times[2i+1]

    def run(self, tasks: Iterable[TaskLike], fn: Callable[[TaskLike], None]) -> dict[str, float]:
        busy: dict[str, float] = {}
        done: set[int] = set()
        clock = time.perf_counter
        tasks = tasks if isinstance(tasks, (list, tuple)) else list(tasks)
        times = _sized(self.times, len(tasks))
        for i, t in enumerate(tasks):
            missing = [d for d in t.deps if d not in done]
            if missing:
                raise RuntimeError(f"task {t.id} ({_describe(t)}) listed before its dependencies {missing}")
            t0 = clock()
            try:
                fn(t)
            except Exception as e:
                raise TaskFailed(f"{_describe(t)} failed: {type(e).__name__}: {e}") from e
            t1 = clock()
            times[2 * i], times[2 * i + 1] = t0, t1
            busy[t.resource] = busy.get(t.resource, 0.0) + t1 - t0
            done.add(t.id)
        return busy

    def close(self) -> None:
        pass


_STOP = object()


class ThreadedExecutor:
    """One worker thread per resource; dependencies are threading.Events."""

    name = "threaded"

    def __init__(self, resources: Iterable[str], setup: Callable[[], None] | None = None):
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._setup = setup
        self.times: list[float] = []  # task i of the last step ran from times[2i] to times[2i+1]
        for r in resources:
            self._add_worker(r)

    def _add_worker(self, resource: str) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()
        th = threading.Thread(target=self._work, args=(q,), name=f"mlight-{resource}", daemon=True)
        self._queues[resource] = q
        self._threads.append(th)
        th.start()

    def _work(self, q: queue.SimpleQueue) -> None:
        if self._setup is not None:
            self._setup()
        while True:
            item = q.get()
            if item is _STOP:
                return
            step, task, i = item
            self._wait_deps(step, task)
            if not step.failed:
                try:
                    self._execute(step, task, i)
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    step.fail(task, e)
            step.events[task.id].set()

    def _wait_deps(self, step: "_Step", task) -> None:
        for d in task.deps:
            step.events[d].wait()

    def _execute(self, step: "_Step", task, i: int) -> None:
        t0 = time.perf_counter()
        try:
            step.fn(task)
        finally:
            t1 = time.perf_counter()
            self.times[2 * i], self.times[2 * i + 1] = t0, t1  # each task writes its own two slots
            step.add_busy(task.resource, t1 - t0)

    def run(self, tasks: Iterable[TaskLike], fn: Callable[[TaskLike], None]) -> dict[str, float]:
        tasks = list(tasks)
        _sized(self.times, len(tasks))
        step = self._new_step(tasks, fn)
        for i, t in enumerate(tasks):
            if t.resource not in self._queues:
                self._add_worker(t.resource)
            self._queues[t.resource].put((step, t, i))
        for t in tasks:
            step.events[t.id].wait()
        if step.error is not None:
            self._after_failure()
            task, err = step.error
            raise TaskFailed(f"{_describe(task)} failed: {type(err).__name__}: {err}") from err
        return self._finish(step)

    def _new_step(self, tasks: list, fn: Callable) -> "_Step":
        return _Step(tasks, fn)

    def _finish(self, step: "_Step") -> dict[str, float]:
        return step.busy

    def _after_failure(self) -> None:
        pass

    def close(self) -> None:
        for q in self._queues.values():
            q.put(_STOP)
        for th in self._threads:
            th.join(timeout=5)


class _Step:
    """Shared state of one graph run: an event per task, busy time, and the first failure."""

    def __init__(self, tasks: list, fn: Callable):
        self.fn = fn
        self.events = {t.id: threading.Event() for t in tasks}
        self.busy: dict[str, float] = {}
        self.error = None
        self.failed = False
        self._lock = threading.Lock()

    def add_busy(self, resource: str, seconds: float) -> None:
        with self._lock:
            self.busy[resource] = self.busy.get(resource, 0.0) + seconds

    def fail(self, task, err: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = (task, err)
            self.failed = True
        for ev in self.events.values():  # wake every waiter; they see `failed` and skip their task
            ev.set()
