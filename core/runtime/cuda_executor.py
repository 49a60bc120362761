"""The CUDA executor: the threaded executor's shape, with the GPU's work on CUDA streams.

Resources "gpu", "h2d" and "d2h" are CUDA streams (compute, host→device copies, device→host
copies); each has a host thread that only *enqueues* its tasks, in list order. A dependency on
another stream becomes `stream.wait_event`, so the host never blocks on the device for it; a host
task (CPU attention) that needs a copy to have landed waits on that copy's event alone. There is
no device-wide synchronisation inside a step: the caller's stream waits on the streams' last
events at the end, and reading the logits is the step's one sync point.
"""

from __future__ import annotations

import time

import torch

from core.runtime.executors import ThreadedExecutor, _Step

STREAMS = ("gpu", "h2d", "d2h")


class _CudaStep(_Step):
    def __init__(self, tasks, fn):
        super().__init__(tasks, fn)
        self.stream_of = {t.id: t.resource for t in tasks if t.resource in STREAMS}
        self.cuda_events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        self.last_on: dict[str, int] = {}
        self.index: dict[int, int] = {}  # task id -> position, for the timeline
        self.origin = None
        self.origin_host = 0.0
        for t in tasks:
            if t.resource in STREAMS:
                self.last_on[t.resource] = t.id


class CudaExecutor(ThreadedExecutor):
    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda"):
        self.device = torch.device(device)
        self.streams = {r: torch.cuda.Stream(device=self.device) for r in STREAMS}
        super().__init__(STREAMS + ("cpu_attn",), setup=lambda: torch.cuda.set_device(self.device))

    def _new_step(self, tasks, fn):
        step = _CudaStep(tasks, fn)
        caller = torch.cuda.current_stream(self.device)
        for s in self.streams.values():  # see what the caller enqueued before the step (embeddings)
            s.wait_stream(caller)
        # the device clock's zero for this step's timeline, next to the host clock's
        step.origin = torch.cuda.Event(enable_timing=True)
        step.origin.record(caller)
        step.origin_host = time.perf_counter()
        return step

    def _wait_deps(self, step: _CudaStep, task) -> None:
        mine = task.resource
        for d in task.deps:
            step.events[d].wait()  # enqueued (stream task) or finished (host task)
            other = step.stream_of.get(d)
            if other is None or other == mine or step.failed:
                continue
            if mine in STREAMS:
                self.streams[mine].wait_event(step.cuda_events[d][1])
            else:
                step.cuda_events[d][1].synchronize()  # this host thread alone waits for that copy

    def _execute(self, step: _CudaStep, task, i: int) -> None:
        if task.resource not in STREAMS:
            return super()._execute(step, task, i)
        stream = self.streams[task.resource]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            step.fn(task)
            end.record(stream)
        step.cuda_events[task.id] = (start, end)
        step.index[task.id] = i

    def _finish(self, step: _CudaStep) -> dict[str, float]:
        caller = torch.cuda.current_stream(self.device)
        for r, tid in step.last_on.items():
            caller.wait_event(step.cuda_events[tid][1])
        busy = dict(step.busy)
        # Timings are read once the step's last events are done (the caller syncs on the logits anyway).
        for tid, (a, b) in step.cuda_events.items():
            b.synchronize()
            r = step.stream_of[tid]
            busy[r] = busy.get(r, 0.0) + a.elapsed_time(b) / 1e3
            i = step.index[tid]  # the timeline: device times on the host clock, from the step's origin
            self.times[2 * i] = step.origin_host + step.origin.elapsed_time(a) / 1e3
            self.times[2 * i + 1] = step.origin_host + step.origin.elapsed_time(b) / 1e3
        return busy

    def _after_failure(self) -> None:
        torch.cuda.synchronize(self.device)  # let in-flight copies land before buffers are dropped
