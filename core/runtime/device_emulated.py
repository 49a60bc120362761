"""An emulated CUDA device on the CPU, so that the GPU path's own code runs in CI: streams are threads running their
queue late (`copy_delay`: a host reading a copy before its event reads stale data); device memory counts against
`memory_bytes`; compute reading a host tensor raises, as CUDA does. `fault(point)` is called at "set_device", "launch",
"wait_event", "host_wait", "copy", "alloc", "pin", and at "kernel" on the stream's thread (blocking there: a hung
kernel). Not modelled: bandwidth, concurrency within a stream, allocator reuse across streams.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
import weakref
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from core.runtime.device import CaptureError, Device, DeviceStalled, DeviceTaskError, pin_budget, wait_seconds_default

GiB = 1 << 30


class _Event:
    def __init__(self, dev: "EmulatedCuda", timing: bool, blocking: bool):
        self.dev, self.timing, self.blocking = dev, timing, blocking
        self._cond = threading.Condition()
        self._issued = 0  # records made
        self._done = 0  # records completed
        self.time: float | None = None
        self.error = None  # (label, exception) of failed work before the record

    def record(self, stream=None) -> None:
        stream = stream if stream is not None else self.dev.current_stream()
        self.dev.stats["event_records"] += 1  # a host call each on CUDA
        with self._cond:
            self._issued += 1
            gen = self._issued
        stream._record(self, gen)

    def _complete(self, gen: int, error) -> None:
        with self._cond:
            if gen > self._done:
                self._done, self.time, self.error = gen, time.perf_counter(), error
            self._cond.notify_all()

    def _wait_gen(self, gen: int, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= gen, timeout)

    def query(self) -> bool:
        self.dev._refuse("a query of an event (a host synchronisation)")
        with self._cond:
            return self._done >= self._issued

    def synchronize(self) -> None:
        self.dev._host_sync(self, None)

    def elapsed_time(self, end: "_Event") -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.time is None or end.time is None or not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.time - self.time) * 1e3


class _Stream:
    """A queue of work run in order by one thread; `inline` streams run it on the caller at once."""

    def __init__(self, dev: "EmulatedCuda", name: str, compute: bool, inline: bool = False):
        self.dev, self.name, self.compute, self.inline = dev, name, compute, inline
        self.error = None  # (label, exception): the first failure since the host last saw it
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = None if inline else threading.Thread(target=self._loop, name=f"emulated-{name}", daemon=True)
        if self._thread is not None:
            self._thread.start()

    def _own(self) -> bool:
        return self.inline or threading.current_thread() is self._thread

    def _put(self, item) -> None:
        with self._idle:
            self._pending += 1
        self._q.put(item)

    def _loop(self) -> None:
        self.dev._tls.stream = self
        with _Track(self.dev) if self.compute else contextlib.nullcontext():
            while True:
                item = self._q.get()
                if item is None:
                    return
                try:
                    item()
                finally:
                    item = None  # drop the work's references (and through them its buffers) now
                    with self._idle:
                        self._pending -= 1
                        self._idle.notify_all()

    def _kernel(self, fn: Callable[[], None], label) -> None:
        self.dev._tls.label = label
        try:
            self.dev._fault("kernel")
            fn()
        except BaseException as e:  # noqa: BLE001 - kept for the host, as a GPU keeps a kernel's error
            if self.error is None:
                self.error = (label, e)
        finally:
            self.dev._tls.label = None

    def _wait(self, event: _Event, gen: int, timeout: float | None = None) -> bool:
        """False: not within `timeout`; the event's failure becomes ours."""
        if not event._wait_gen(gen, timeout):
            return False
        if event.error is not None and self.error is None:
            self.error = event.error
        return True

    def _record(self, event: _Event, gen: int) -> None:
        if self._own():
            event._complete(gen, self.error)
        else:
            self._put(lambda: event._complete(gen, self.error))

    def wait_event(self, event: _Event) -> None:
        self.dev._refuse("a wait on an event recorded outside the capture")
        self.dev._fault("wait_event")
        with event._cond:
            gen = event._issued
        if gen == 0:
            return  # never recorded: nothing to wait for, as in CUDA
        if not self._own():
            self._put(lambda: self._wait(event, gen))
        elif not self._wait(event, gen, self.dev.wait_seconds if self.inline else None):  # a host wait, bounded
            raise DeviceStalled("the work before an event the host's stream waits on", self.dev.wait_seconds)

    def wait_stream(self, other: "_Stream") -> None:
        ev = _Event(self.dev, False, True)
        ev.record(other)
        self.wait_event(ev)

    def synchronize(self) -> None:
        ev = _Event(self.dev, False, True)
        ev.record(self)
        self.dev._host_sync(ev, None)

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)


class EmulatedCuda(Device):
    kind = "emulated"
    accelerator = True

    def __init__(self, memory_bytes: int = 16 * GiB, *, capability=(8, 9), name: str = "emulated GPU",
                 copy_delay: float | Callable[[], float] = 0.0, pin_limit_bytes: int | None = None,
                 wait_seconds: float | None = None):
        self.name, self.capability = name, tuple(capability)
        self.total = int(memory_bytes)
        self.copy_delay = copy_delay
        self.pin_limit_bytes = pin_budget() if pin_limit_bytes is None else pin_limit_bytes
        self.wait_seconds = wait_seconds_default() if wait_seconds is None else wait_seconds
        self.fault: Callable[[str], None] | None = None
        self.stats: collections.Counter = collections.Counter()
        self._lock = threading.RLock()  # re-entered when a finalizer releases memory during an allocation
        self._blocks: dict[int, int] = {}  # storage address -> bytes, all live device memory
        self.allocated = self.peak = 0
        self._pins: dict[int, int] = {}  # host address -> bytes
        self._tls = threading.local()
        self._streams: list[_Stream] = []
        self._inline = _Stream(self, "host", compute=False, inline=True)

    def _fault(self, point: str) -> None:
        if self.fault is not None:
            self.fault(point)

    def set_device(self) -> None:
        self._fault("set_device")

    def stream(self, name: str, compute: bool = False) -> _Stream:
        s = _Stream(self, name, compute)
        self._streams.append(s)
        return s

    def release_stream(self, stream: _Stream) -> None:
        stream.close()
        if stream in self._streams:
            self._streams.remove(stream)

    def current_stream(self) -> _Stream:
        return getattr(self._tls, "stream", None) or self._inline

    def event(self, timing: bool = False, blocking: bool = True) -> _Event:
        self.stats["events_created"] += 1
        return _Event(self, timing, blocking)

    def launch(self, stream: _Stream, fn: Callable[[], None], label=None) -> None:
        self._refuse("work launched on another stream")
        self._fault("launch")
        if stream._own():
            fn()
        else:
            stream._put(lambda: stream._kernel(fn, label))

    def host_wait(self, event: _Event, cancel: Callable[[], bool] | None = None,
                  what: str = "the work before an event") -> None:
        self._host_sync(event, cancel, what, self.wait_seconds)

    def _host_sync(self, event: _Event, cancel, what: str = "", seconds: float | None = None) -> None:
        """`seconds` None: no deadline, as torch's own synchronize has none (the Device's waits pass one)."""
        self._refuse("a host synchronisation")
        self._fault("host_wait")
        self.stats["host_syncs"] += 1
        with event._cond:
            gen = event._issued
        deadline = time.monotonic() + seconds if seconds is not None else float("inf")
        if not event.blocking:  # CUDA's default: the waiting thread spins on a core
            self.stats["spin_waits"] += 1
        while not event._wait_gen(gen, 0 if not event.blocking else 0.05):
            if cancel is not None and cancel():
                return
            if time.monotonic() > deadline:
                raise DeviceStalled(what, seconds)
        if event.error is not None:
            for s in [*self._streams, self._inline]:  # reported once
                if s.error is event.error:
                    s.error = None
            raise DeviceTaskError(*event.error)

    def synchronize(self) -> None:
        self._refuse("a device synchronisation")
        deadline = time.monotonic() + self.wait_seconds
        for s in list(self._streams):
            with s._idle:
                if not s._idle.wait_for(lambda: s._pending == 0, max(0.0, deadline - time.monotonic())):
                    raise DeviceStalled(f"the {s.name} stream's queue", self.wait_seconds)
        errors = [s.error for s in [*self._streams, self._inline] if s.error is not None]
        for s in [*self._streams, self._inline]:
            s.error = None
        if errors:
            raise DeviceTaskError(*errors[0])

    def _account(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr, n = s.data_ptr(), s.nbytes()
        if not n:
            return t
        with self._lock:
            if ptr in self._blocks:
                return t
            self._blocks[ptr] = n
            self.allocated += n
            over = self.allocated > self.total
            if not over:
                self.peak = max(self.peak, self.allocated)
        weakref.finalize(s, self._release, ptr, n)
        if over:
            free = self.total - (self.allocated - n)
            self.stats["ooms"] += 1
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory (emulated). Tried to allocate {n / 2**20:.2f} MiB; {self.name} has "
                f"{self.total / 2**20:.2f} MiB in total of which {max(0, free) / 2**20:.2f} MiB is free.")
        return t

    def _release(self, ptr: int, n: int) -> None:
        with self._lock:
            if self._blocks.get(ptr) == n:
                del self._blocks[ptr]
                self.allocated -= n

    def running(self):
        return getattr(self._tls, "label", None)

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._blocks

    def _new(self, make) -> torch.Tensor:
        self._refuse("an allocation through the device's allocator")
        self._fault("alloc")
        with _disable_current_modes():
            return self._account(make())

    def empty(self, shape, dtype):
        return self._new(lambda: torch.empty(shape, dtype=dtype))

    def zeros(self, shape, dtype):
        return self._new(lambda: torch.zeros(shape, dtype=dtype))

    def to_device(self, t):
        if self.is_device(t):
            raise ValueError("to_device of a tensor already on the device")
        return self._new(lambda: t.detach().clone(memory_format=torch.contiguous_format))

    def to_host(self, t):
        self._refuse("a copy to the host (a host synchronisation)")
        self._delay()  # a copy over the link, as `copy`'s
        with _disable_current_modes():
            return t.clone()

    def _delay(self) -> None:
        delay = self.copy_delay() if callable(self.copy_delay) else self.copy_delay
        if delay:
            time.sleep(delay)

    def copy(self, dst, src, non_blocking=True) -> None:
        self._fault("copy")
        host = [x for x in (dst, src) if not self.is_device(x)]
        if len(host) == 2:
            raise RuntimeError("emulated device: copy between two host tensors through the device")
        if host and not non_blocking:
            self.stats["blocking_copies"] += 1  # asked for: setup-time uploads
        elif any(not self.is_pinned(x) or not x.is_contiguous() for x in host):
            # on a GPU: staged through a pageable bounce buffer, the host blocked (a strided device side is fine)
            self._refuse("a copy from pageable host memory (staged: the host blocks)")
            self.stats["staged_copies"] += 1
        capture = getattr(self._tls, "capture", None)
        if capture is not None:  # a copy node: both addresses baked into the graph
            capture.trace.append(("copy", capture.ident(dst), capture.ident(src)))
            if capture.undo is not None:
                capture.undo.save(dst)
        self._delay()
        with _disable_current_modes():
            dst.copy_(src)
        self.stats["copies"] += 1

    def pin(self, t) -> bool:
        if not t.is_contiguous() or t.numel() == 0:
            return False
        n = t.numel() * t.element_size()
        with self._lock:
            if t.data_ptr() in self._pins:
                return True
            if not self._pin_fits(n):
                return False
            try:
                self._fault("pin")
            except Exception:  # noqa: BLE001 - the OS refused, as cudaHostRegister can
                return False
            self._pins[t.data_ptr()] = n
            self.stats["pins"] += 1  # registrations made (cudaHostRegister calls: ≈ 2 GB/s on a GPU)
        return True

    def unpin(self, t) -> None:
        with self._lock:
            if self._pins.pop(t.data_ptr(), None) is not None:
                self.stats["unpins"] += 1

    @property
    def pinned_bytes(self) -> int:
        return sum(self._pins.values())

    def is_pinned(self, t) -> bool:
        lo = t.data_ptr()
        hi = lo + (t.numel() and (max((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1)) * t.element_size()
        with self._lock:
            return any(p <= lo and hi <= p + n for p, n in self._pins.items())

    def mem_get_info(self):
        return self.total - self.allocated, self.total

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def compute(self):
        return _Track(self)

    def _refuse(self, what: str) -> None:
        """Raise CaptureError if the calling thread is capturing (thread-local capture, as the executor's)."""
        if getattr(self._tls, "capture", None) is not None:
            self.stats["capture_refusals"] += 1
            raise CaptureError(f"{what} while capturing a CUDA graph")

    @contextlib.contextmanager
    def _capturing(self, undo: "_Undo | None"):
        stream = self.current_stream()
        if stream.inline or not stream._own():
            raise CaptureError("capture outside launched work (torch captures on a side stream, not the host's)")
        capture = self._tls.capture = _Capture(undo)
        try:
            with _HostReads(self), capture:
                yield capture
        finally:
            self._tls.capture = None

    def capture(self, fn):
        undo = _Undo()
        try:
            with self._capturing(undo) as capture:
                out = fn()
        finally:
            undo.restore()  # a GPU's capture runs nothing: what fn wrote is as it was
        self.stats["graphs_captured"] += 1
        return _Graph(fn, out, capture.trace), out

    def replay(self, graph: "_Graph") -> None:
        """Run the segment's Python again, and check that it issued the captured kernels over the same memory:
        a GPU replays those kernels whatever the Python would do now (a cache hit, a buffer made this step)."""
        with self._capturing(None) as capture:
            out = graph.fn()
        _same_kernels(graph.trace, capture.trace)
        static, fresh = tree_flatten(graph.out)[0], tree_flatten(out)[0]
        if len(static) != len(fresh):
            raise CaptureError("a replay returned other outputs than its capture")
        with _disable_current_modes():  # into the captured outputs, where a GPU's replay writes
            for a, b in zip(static, fresh):
                if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
                    if a is not b:
                        a.copy_(b)
                elif a is not b and a != b:
                    raise CaptureError(f"a replay returned {b!r} where its capture returned {a!r}")
        self.stats["graph_replays"] += 1

    def close(self) -> None:
        for s in list(self._streams):
            self.release_stream(s)


class _Track(TorchDispatchMode):
    """Counts what device compute allocates; refuses host tensors as its inputs."""

    _depth = threading.local()

    def __init__(self, dev: EmulatedCuda):
        super().__init__()
        self.dev = dev

    def __enter__(self):  # once per thread, however deeply nested
        _Track._depth.n = getattr(_Track._depth, "n", 0) + 1
        return self if _Track._depth.n > 1 else super().__enter__()

    def __exit__(self, *exc):
        _Track._depth.n -= 1
        return None if _Track._depth.n else super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_in = _tensors((args, kwargs))
        dev = self.dev
        on_device = [a for a in flat_in if dev.is_device(a)]
        host = [a for a in flat_in if a.dim() and not dev.is_device(a)]  # 0-dim CPU scalars are fine on CUDA
        if on_device and host:
            if func in _CROSS_DEVICE_OK:  # CUDA moves the host operand itself (a hidden transfer)
                dev.stats["implicit_transfers"] += 1
            else:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device (emulated): {func} mixes device tensors "
                    f"with a host tensor {tuple(host[0].shape)} {host[0].dtype}; move it with Device.to_device")
        if on_device and getattr(dev._tls, "capture", None) is not None and _syncs(func, args, kwargs):
            dev._refuse(f"{func} (its output's size depends on the data: a host synchronisation)")
        if func is torch.ops.aten._local_scalar_dense.default and on_device:
            dev.stats["item_syncs"] += 1  # .item() on device data: a host sync on a GPU
        out = func(*args, **kwargs)
        if on_device or not flat_in:  # device compute (or a factory on the device): its new memory counts
            for t in _new(flat_in, out):
                dev._account(t)
        return out


_CROSS_DEVICE_OK = {torch.ops.aten.copy_.default, torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default,
                    torch.ops.aten.index_put.default, torch.ops.aten._index_put_impl_.default}


class _Capture(TorchDispatchMode):
    """The calling thread's capture or replay in progress: its kernels, each with the memory it read and wrote
    (older memory by address, as a graph bakes it in; the segment's own by shape, its pool)."""

    def __init__(self, undo: "_Undo | None"):
        super().__init__()
        self.undo = undo
        self.trace: list[tuple] = []
        self._made: set[int] = set()  # storage addresses the segment made

    def ident(self, t: torch.Tensor) -> tuple:
        # the segment's own memory by kind alone: the host allocator's reuse varies between runs, a pool's does not
        p = t.untyped_storage().data_ptr()
        return ("made", tuple(t.shape)) if p in self._made else ("before", p, t.storage_offset(), tuple(t.shape))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.undo is not None:  # first what the op overwrites
            self.undo.save_writes(func, args, kwargs)
        flat = _tensors((args, kwargs))
        self.trace.append((func, tuple(self.ident(a) for a in flat)))
        out = func(*args, **kwargs)
        self._made.update(t.untyped_storage().data_ptr() for t in _new(flat, out))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [a for a in tree_flatten(tree)[0] if isinstance(a, torch.Tensor)]


def _new(inputs: list[torch.Tensor], out) -> list[torch.Tensor]:
    """Memory the op made: its outputs in storage none of its inputs has."""
    have = {a.untyped_storage().data_ptr() for a in inputs}
    return [t for t in _tensors(out) if t.untyped_storage().data_ptr() not in have]


def _same_kernels(captured: list, replayed: list) -> None:
    for n, (a, b) in enumerate(zip(captured, replayed)):
        if a != b:
            raise CaptureError(f"a replay diverged from its capture at kernel {n}: captured {_show(a)}, now "
                               f"{_show(b)} (a CUDA graph would replay the captured one: state kept in Python, "
                               "or memory other than the graph's static inputs)")
    if len(captured) != len(replayed):
        raise CaptureError(f"a replay issued {len(replayed)} kernels where its capture issued {len(captured)}")


def _show(entry: tuple) -> str:
    return f"{entry[0]} over {[x[0] + ('@' + hex(x[1]) if x[0] == 'before' else '') for x in entry[1]]}"


_Graph = collections.namedtuple("_Graph", "fn out trace")  # a captured segment: its callable, outputs, kernels


class _Undo:
    """Keeps the first contents of every storage a capture writes, to put them back."""

    def __init__(self):
        self.saved: dict[int, tuple] = {}  # storage address -> (storage, its contents before the first write)

    def save(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in self.saved:
            with _disable_current_modes():
                self.saved[s.data_ptr()] = (s, s.clone())

    def restore(self) -> None:
        with _disable_current_modes():
            for s, before in self.saved.values():
                s.copy_(before)
        self.saved.clear()

    def save_writes(self, func, args, kwargs) -> None:
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for t in v if isinstance(v, (list, tuple)) else (v,):
                    if isinstance(t, torch.Tensor):
                        self.save(t)


# Tensor methods that read device data on the host (a sync, and a value baked into the graph)
_HOST_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__",
               "equal", "allclose"}


class _HostReads(TorchFunctionMode):
    def __init__(self, dev: EmulatedCuda):
        super().__init__()
        self.dev = dev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS and any(isinstance(a, torch.Tensor) and self.dev.is_device(a) for a in args):
            self.dev._refuse(f"a host read of a device tensor (Tensor.{name})")
        return func(*args, **(kwargs or {}))


_aten = torch.ops.aten
_SYNCING = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default, _aten.unique_dim.default,
            _aten.unique_consecutive.default, _aten.bincount.default, _aten._local_scalar_dense.default,
            _aten.argwhere.default}


def _syncs(func, args, kwargs) -> bool:  # a GPU must synchronise with the host: an output sized by the data
    if func in _SYNCING:
        return True
    if func is _aten.repeat_interleave.Tensor or func is _aten.repeat_interleave.self_Tensor:
        return kwargs.get("output_size") is None
    if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    return False
