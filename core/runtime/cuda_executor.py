"""The threaded executor with "compute", "h2d" and "d2h" as streams, each fed by a host thread that only launches:
one host sync a step, at its end; a wait past the device's `wait_seconds` fails the step naming the hung task, and
the executor refuses further steps. Timing: one event per task, the one other streams wait on (no extra device op).
"""

from __future__ import annotations

import functools
import time

from core.runtime.device import Device, DeviceStalled, DeviceTaskError
from core.runtime.executors import STALL_SECONDS, Stalled, ThreadedExecutor, _Step, describe

STREAMS = ("compute", "h2d", "d2h")


class _CudaStep(_Step):
    def __init__(self, tasks, fn, events: list):
        super().__init__(tasks, fn)
        self.stream_of = {t.id: t.resource for t in tasks if t.resource in STREAMS}
        # `events`, the executor's, reused step after step: the device clock's zero for this step's timeline; the
        # join, on the caller's stream behind every stream's last task and the tail; then each stream task's end
        self.origin, self.joined, *ends = events
        self.end = dict(zip(self.stream_of, ends))
        self.index = {t.id: i for i, t in enumerate(tasks)}  # task id -> position, for the timeline
        self.launched: set[int] = set()  # stream tasks whose work the host has enqueued
        self.origin_host = 0.0  # the host clock's reading at the origin
        self.hung: str | None = None  # a stream that ran past the device's deadline: what is stuck on it
        self.last_on: dict[str, int] = {}
        self.before: dict[int, int | None] = {}  # stream task -> the task before it on its stream
        for tid, r in self.stream_of.items():
            self.before[tid] = self.last_on.get(r)
            self.last_on[r] = tid

    def started(self, tid: int) -> bool:
        prev, task = self.before[tid], self.tasks[tid]
        return (tid in self.launched and (prev is None or self.end[prev].query())
                and all(self.end[d].query() if d in self.end else self.events[d].is_set() for d in task.deps))

    def stuck(self, stream: str | None, err: DeviceStalled) -> DeviceTaskError:
        """The failure for a wait on `stream` (None: all), naming the task that hangs."""
        running = [t for t in self.stream_of if not self.end[t].query() and self.started(t)]
        mine = [t for t, r in self.stream_of.items() if stream is None or r == stream]
        tid = running[0] if running else next((t for t in mine if not self.end[t].query()), mine[-1])
        why = Stalled(f"the {self.stream_of[tid]} stream has not finished {describe(self.tasks[tid])} in "
                      f"{err.seconds:g} s " + ("(it started: a hung kernel or copy)" if running else
                                               "(it never started: its stream waits on work that does not end)"))
        why.__cause__ = err
        self.hung = f"the {self.stream_of[tid]} stream is stuck in {describe(self.tasks[tid])}"
        return DeviceTaskError(self.tasks[tid], why)


class CudaExecutor(ThreadedExecutor):
    takes_tail = True  # run(..., then=): see _finish

    def __init__(self, device: Device, *, stall_seconds: float = STALL_SECONDS, placement=None):
        self.dev = device
        self.placement = placement  # run on each worker first (core.model.cpu.threads.worker_setup)
        self.streams = {r: device.stream(r, compute=r == "compute") for r in STREAMS}
        self._events = [device.event(timing=True), device.event()]  # the origin, the join: see _CudaStep
        self._then = None  # the running step's tail (run's `then`)
        super().__init__(STREAMS + ("cpu_attn",), setup=self._setup, stall_seconds=stall_seconds)

    def _setup(self, resource: str) -> None:
        self.dev.set_device()
        if self.placement is not None:
            self.placement(resource)

    def run(self, tasks, fn, then=None) -> dict[str, float]:
        self._then = then  # enqueues the caller's tail before the step's one host wait
        try:
            return super().run(tasks, fn)
        finally:
            self._then = None

    def _new_step(self, tasks, fn):
        n = 2 + sum(t.resource in STREAMS for t in tasks)
        self._events += [self.dev.event(timing=True) for _ in range(n - len(self._events))]
        step = _CudaStep(tasks, fn, self._events)
        caller = self.dev.current_stream()
        for s in self.streams.values():  # see what the caller enqueued before the step (embeddings)
            s.wait_stream(caller)
        step.origin.record(caller)  # the step's timeline: device times from here, on the host clock
        step.origin_host = time.perf_counter()
        return step

    def _wait_deps(self, step: _CudaStep, task) -> bool:
        mine = task.resource
        for d in task.deps:
            step.events[d].wait()  # launched (stream task) or finished (host task)
            if step.failed:
                return False
            other = step.stream_of.get(d)
            if other is None or other == mine:
                continue
            end = step.end[d]
            if mine in STREAMS:
                self.streams[mine].wait_event(end)
            else:  # this host thread alone waits for that stream's task
                try:
                    self.dev.host_wait(end, cancel=lambda: step.failed)
                except DeviceStalled as e:
                    raise step.stuck(other, e)  # (its cause: Stalled, whose cause is the DeviceStalled)
                if step.failed:
                    return False
        return True

    def _execute(self, step: _CudaStep, task, i: int) -> None:
        if task.resource not in STREAMS:
            return super()._execute(step, task, i)
        stream = self.streams[task.resource]
        self.times[2 * i] = time.perf_counter()  # the launch: the earliest the task can start (see _finish)
        step.launched.add(task.id)
        self.dev.launch(stream, functools.partial(step.fn, task), label=task)
        step.end[task.id].record(stream)

    def _finish(self, step: _CudaStep) -> dict[str, float]:
        caller = self.dev.current_stream()
        try:
            for tid in step.last_on.values():  # the join, on the device: the caller's later work follows the step
                caller.wait_event(step.end[tid])
            if self._then is not None:
                try:
                    self._then()
                except DeviceStalled:
                    raise
                except Exception as e:  # noqa: BLE001 - the step's failure, as a task's would be (an OOM: retried)
                    raise DeviceTaskError(None, e) from e
            step.joined.record(caller)
            self.dev.host_wait(step.joined, what="the step's last tasks")  # the step's one host sync, bounded
        except DeviceStalled as e:  # (the emulated device's caller stream is the host: its join waits there)
            raise step.stuck(None, e)
        busy, times, at = dict(step.busy), self.times, step.index
        for tid, ev in step.end.items():  # in list order: a task's dependencies and predecessor come first
            i, prev = at[tid], step.before[tid]  # the timeline: device times on the host clock, from the step's origin
            end = step.origin_host + step.origin.elapsed_time(ev) / 1e3
            # from its launch, or the end of its predecessor or of a task it waits for (on a stream, or the host's)
            after = [times[2 * at[d] + 1] for d in (*step.tasks[tid].deps, *(() if prev is None else (prev,)))]
            start = min(max([times[2 * i], *after]), end)  # the two clocks' readings meet within rounding
            times[2 * i], times[2 * i + 1] = start, end
            r = step.stream_of[tid]
            busy[r] = busy.get(r, 0.0) + end - start
        return busy

    def _after_failure(self, step: _CudaStep) -> None:
        if step.hung is not None:  # waiting for the device again would only run into the deadline again
            self._broken = step.hung
        else:
            try:  # let in-flight work land before buffers are dropped; its errors are already reported
                self.dev.synchronize()
            except DeviceStalled as e:
                self._broken = f"the device did not drain after a failure: {e.problem}"
            except Exception:  # noqa: BLE001
                pass
        self._events = [self.dev.event(timing=True), self.dev.event()]  # none may keep the failure (its frames) alive

    def close(self) -> None:
        super().close()
        for s in self.streams.values():
            self.dev.release_stream(s)
