"""The emulated CUDA device keeps CUDA's semantics: what the GPU path's CI tests stand on.

Each test checks one promise of core.runtime.device against the emulation: work runs later than
it is launched, copies land late, events order streams without blocking the host, errors surface at
the next sync, memory is capped and counted, pinned memory is exact. A `CudaDevice` check that the
two implementations offer the same methods keeps the thin CUDA layer from drifting.
"""

from __future__ import annotations

import inspect
import threading
import time

import pytest
import torch

from core.runtime.device import CudaDevice, Device, DeviceTaskError, HostDevice, device_index, resolve_device
from core.runtime.device_emulated import EmulatedCuda


@pytest.fixture
def dev():
    d = EmulatedCuda(1 << 20)
    yield d
    d.close()


def test_launched_work_runs_later_on_the_stream_thread_in_order(dev):
    s = dev.stream("gpu", compute=True)
    gate, seen = threading.Event(), []
    dev.launch(s, lambda: gate.wait(5))
    dev.launch(s, lambda: seen.append(("a", threading.current_thread().name)))
    dev.launch(s, lambda: seen.append(("b", threading.current_thread().name)))
    assert seen == []  # the host is ahead of the stream
    gate.set()
    s.synchronize()
    assert [x for x, _ in seen] == ["a", "b"] and seen[0][1] == "emulated-gpu"


def test_copies_land_late_and_an_event_says_when(dev):
    dev.copy_delay = 0.2
    s = dev.stream("d2h")
    src = dev.zeros(8, torch.float32) + 1  # noqa: F841 - device memory (a transient of device compute)
    src = dev.to_device(torch.ones(8))
    dst = torch.zeros(8)
    assert dev.pin(dst)
    done = dev.event()
    dev.launch(s, lambda: dev.copy(dst, src))
    done.record(s)
    assert dst.sum() == 0 and not done.query()  # read too early: stale
    dev.host_wait(done)
    assert dst.sum() == 8 and done.query()


def test_wait_event_orders_streams_without_blocking_the_host(dev):
    a, b = dev.stream("a"), dev.stream("b")
    gate, order = threading.Event(), []
    ev = dev.event()
    dev.launch(a, lambda: (gate.wait(5), order.append("a")))
    ev.record(a)
    b.wait_event(ev)  # returns at once
    dev.launch(b, lambda: order.append("b"))
    time.sleep(0.05)
    assert order == []
    gate.set()
    b.synchronize()
    assert order == ["a", "b"]


def test_elapsed_time_needs_completed_timing_events(dev):
    s = dev.stream("gpu")
    t0, t1 = dev.event(timing=True), dev.event(timing=True)
    gate = threading.Event()
    t0.record(s)
    dev.launch(s, lambda: (gate.wait(5), time.sleep(0.05)))
    t1.record(s)
    with pytest.raises(RuntimeError, match="completed"):
        t0.elapsed_time(t1)
    gate.set()
    t1.synchronize()
    assert t0.elapsed_time(t1) >= 45  # milliseconds
    with pytest.raises(RuntimeError, match="enable_timing"):
        dev.event().elapsed_time(t1)


def test_an_error_in_launched_work_surfaces_once_at_the_next_sync(dev):
    s = dev.stream("gpu")
    dev.launch(s, lambda: 1 / 0, label="bad task")  # returns: the failure is the stream's, for later
    ev = dev.event()
    ev.record(s)
    with pytest.raises(DeviceTaskError) as info:
        dev.host_wait(ev)
    assert info.value.label == "bad task" and isinstance(info.value.__cause__, ZeroDivisionError)
    dev.synchronize()  # reported once: the stream is usable again
    dev.launch(s, lambda: None)
    s.synchronize()


def test_an_error_follows_a_wait_into_the_waiting_stream(dev):
    a, b = dev.stream("a"), dev.stream("b")
    dev.launch(a, lambda: [][1], label="a's task")
    ev = dev.event()
    ev.record(a)
    b.wait_event(ev)
    end = dev.event()
    end.record(b)
    with pytest.raises(DeviceTaskError, match="a's task"):
        end.synchronize()


def test_memory_is_capped_counted_and_released(dev):
    x = dev.empty(100_000, torch.float32)  # 400 kB of 1 MiB
    assert dev.memory_allocated() == 400_000
    with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory"):
        dev.empty(200_000, torch.float32)
    y = x[10:20]
    del x
    assert dev.memory_allocated() == 400_000  # a view keeps it alive
    del y
    assert dev.memory_allocated() == 0 and dev.max_memory_allocated() == 400_000
    assert dev.mem_get_info() == (1 << 20, 1 << 20)


def test_device_compute_counts_its_activations_and_can_run_out(dev):
    w = dev.to_device(torch.randn(64, 64))
    s = dev.stream("gpu", compute=True)
    peaks = []

    def work():
        a = w @ w  # 16 kB of activations on top of the 16 kB weight
        b = a + 1  # noqa: F841
        peaks.append(dev.memory_allocated())

    dev.launch(s, work)
    s.synchronize()
    assert peaks == [3 * 64 * 64 * 4]
    assert dev.memory_allocated() == 64 * 64 * 4  # the activations are gone with the task
    dev.launch(s, lambda: torch.empty(1 << 20, device="cpu").fill_(0) + w.sum())
    ev = dev.event()
    ev.record(s)
    with pytest.raises(DeviceTaskError) as info:
        ev.synchronize()
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)


def test_device_compute_refuses_host_tensors_as_a_gpu_would(dev):
    w = dev.to_device(torch.randn(4, 4))
    host, scalar, ones = torch.randn(4, 4), torch.tensor(2.0), torch.ones(3)
    with dev.compute():
        w + scalar  # a 0-dim CPU scalar is fine on CUDA
        ones + ones  # host compute is host compute
        with pytest.raises(RuntimeError, match="same device"):
            w @ host


def test_pinned_memory_is_registered_at_its_exact_size_and_capped():
    d = EmulatedCuda(1 << 20, pin_limit_bytes=10_000)
    a, b = torch.empty(1000), torch.empty(5000)
    assert d.pin(a) and d.pinned_bytes == 4000 and d.is_pinned(a[10:20]) and not d.is_pinned(b)
    assert not d.pin(b)  # over the cap, as Windows refuses: the caller falls back to pageable memory
    d.unpin(a)
    assert d.pinned_bytes == 0


def test_copies_from_pageable_or_strided_host_memory_are_counted_as_staged(dev):
    s = dev.current_stream()
    src = dev.to_device(torch.ones(4, 4))
    pinned, pageable = torch.zeros(4, 8), torch.zeros(4, 4)
    dev.pin(pinned)
    dev.copy(pinned[:, :4], src)  # strided host destination (the old D1)
    dev.copy(pageable, src)
    dev.copy(pinned.view(-1)[:16], src.view(-1))  # contiguous and pinned: a real asynchronous copy
    s.synchronize()
    assert dev.stats["staged_copies"] == 2 and dev.stats["copies"] == 3


def test_a_host_waiting_on_a_non_blocking_event_spins_a_core(dev):
    s = dev.stream("d2h")

    def cpu_seconds_waiting(blocking: bool) -> float:
        dev.launch(s, lambda: time.sleep(0.3))
        ev = dev.event(blocking=blocking)
        ev.record(s)
        t0 = time.thread_time()
        ev.synchronize()
        return time.thread_time() - t0

    def cpu_seconds_busy() -> float:  # a plain busy loop over as long a wall time
        t0, c0 = time.monotonic(), time.thread_time()
        while time.monotonic() - t0 < 0.3:
            pass
        return time.thread_time() - c0

    busy = cpu_seconds_busy()
    spun, slept = cpu_seconds_waiting(False), cpu_seconds_waiting(True)
    # CPU seconds of the waiting thread over a 0.3 s wait, beside a busy loop's just before: with a neighbour on
    # the cores each running thread gets the scheduler's share (0.03 s of 0.3 at load 12), so compare, do not time
    assert spun > 0.3 * busy and spun > 5 * slept and dev.stats["spin_waits"] == 1


def test_device_index_of_a_bare_cuda_is_the_current_device():
    # torch.cuda.set_device(torch.device("cuda")) raises: every worker needs the number (finding 1)
    assert device_index("cuda", lambda: 3) == 3 and device_index("cuda:1", lambda: 0) == 1
    with pytest.raises(ValueError):
        device_index("cpu", lambda: 0)


def test_cuda_device_and_its_emulation_offer_the_same_interface():
    base = {n for n, _ in inspect.getmembers(Device, callable) if not n.startswith("_")}
    for impl in (CudaDevice, EmulatedCuda, HostDevice):
        for name in base:
            mine, theirs = inspect.signature(getattr(impl, name)), inspect.signature(getattr(Device, name))
            assert list(mine.parameters) == list(theirs.parameters), f"{impl.__name__}.{name}{mine}"
    assert isinstance(resolve_device("cpu"), HostDevice) and isinstance(resolve_device("emulated"), EmulatedCuda)


# ---- every host wait on device work has a deadline ------------------------------------------------------
def test_the_devices_host_waits_give_up_at_its_deadline_naming_what_stalled():
    """A hung kernel made host_wait and the device's synchronize (the drain after a failure) wait forever."""
    from core.runtime.device import DeviceStalled

    dev = EmulatedCuda(1 << 20, wait_seconds=0.3)
    s = dev.stream("h2d")
    gate = threading.Event()
    dev.launch(s, lambda: gate.wait(30), label="a hung copy")
    ev = dev.event()
    ev.record(s)
    try:
        for wait, what in ((lambda: dev.host_wait(ev, what="the pages"), "the pages"),
                           (dev.synchronize, "the h2d stream"),
                           (lambda: dev.current_stream().wait_event(ev), "the host's stream")):
            t0 = time.perf_counter()
            with pytest.raises(DeviceStalled, match=what) as info:
                wait()
            assert 0.3 <= time.perf_counter() - t0 < 2 and "0.3 s" in str(info.value)
        assert not ev.query()
    finally:
        gate.set()
    dev.host_wait(ev)  # the work ended: the same waits return
    dev.synchronize()
    dev.close()


class _FakeCudaEvent:
    """A CUDA event as Device.host_wait sees it (CudaDevice uses that base method): only `query`."""

    def __init__(self, done_after: float):
        self.at = time.monotonic() + done_after
        self.queries = 0

    def query(self):
        self.queries += 1
        return time.monotonic() >= self.at


def test_the_cuda_host_wait_polls_the_event_within_the_deadline():
    """CudaDevice's wait cannot be cudaEventSynchronize (no deadline): it polls query(), sleeping between polls."""
    from core.runtime.device import DeviceStalled

    d = Device()
    d.wait_seconds = 0.3
    ev = _FakeCudaEvent(0.05)
    d.host_wait(ev)  # ends when the work does ...
    assert ev.query() and ev.queries < 200  # ... without spinning a core (sleeps grow to 1 ms)
    done = _FakeCudaEvent(0)
    d.host_wait(done)
    assert done.queries == 1  # finished work costs one query
    t0 = time.perf_counter()
    with pytest.raises(DeviceStalled, match="the logits did not complete on the device within 0.3 s"):
        d.host_wait(_FakeCudaEvent(60), what="the logits")
    assert time.perf_counter() - t0 < 1
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    d.host_wait(_FakeCudaEvent(60), cancel=stop.is_set)  # a failed step cancels the wait: no error
