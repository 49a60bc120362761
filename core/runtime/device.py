"""The accelerator as the runtime sees it (docs/CONTRACTS.md, Device): `CudaDevice` is the only code CI cannot run;
every host wait is bounded by `wait_seconds` — on CUDA by polling, since cudaEventSynchronize takes no deadline.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

import psutil
import torch

from core import platform
from core.errors import UsageError
from core.model.device_wait import (WAIT_SECONDS, DeviceStalled, poll,  # noqa: F401 - the runtime's names for them
                                    wait_seconds_default)

PAGE = 4096  # bytes; host memory is registered (pinned) in whole pages


def pin_budget() -> int:
    """Host bytes this process may page-lock (core.platform.pinned_budget); beyond it `Device.pin` refuses."""
    return platform.pinned_budget(int(psutil.virtual_memory().total))


class DeviceTaskError(RuntimeError):
    """Work launched on a stream failed; raised where the host next synchronises with it."""

    def __init__(self, label, cause: BaseException):
        super().__init__(f"{label!r} failed on the device: {type(cause).__name__}: {cause}")
        self.label = label
        self.__cause__ = cause


class CaptureError(RuntimeError):
    """Capture met what CUDA graph capture forbids; the segment runs eagerly instead (core.runtime.graphs)."""


def device_index(spec: str | torch.device | int | None, current: Callable[[], int]) -> int:
    """The index of a CUDA device spec; "cuda" and None: the current device (set_device needs a number)."""
    if isinstance(spec, int):
        return spec
    d = torch.device(spec if spec is not None else "cuda")
    if d.type != "cuda":
        raise ValueError(f"not a CUDA device: {spec!r}")
    return d.index if d.index is not None else current()


class Device:
    """The interface; its defaults are the CPU's (`HostDevice`)."""

    kind = "cpu"  # "cpu" | "cuda" | "emulated"
    accelerator = False  # False: the CPU is the device (no streams, no transfers)
    torch_device = torch.device("cpu")  # where device tensors live
    name = "CPU"
    capability: tuple[int, int] | None = None
    index = 0
    pin_limit_bytes: int | None = None  # page-locked host bytes allowed (None: no limit; see pin_budget)
    wait_seconds = WAIT_SECONDS  # the deadline of every host wait on device work (DeviceStalled past it)

    def set_device(self) -> None:
        """Make this device current on the calling thread (every worker thread calls it once)."""

    def stream(self, name: str, compute: bool = False):
        raise NotImplementedError(f"{self.name} has no streams")

    def release_stream(self, stream) -> None:
        pass

    def current_stream(self):
        return _Done()

    def event(self, timing: bool = False, blocking: bool = True):
        return _Done()

    def launch(self, stream, fn: Callable[[], None], label=None) -> None:
        fn()

    def host_wait(self, event, cancel: Callable[[], bool] | None = None,
                  what: str = "the work before an event") -> None:
        poll(event.query, self.wait_seconds, what, cancel)

    def synchronize(self) -> None:
        """Raise (once) the first error of launched work."""

    def capture(self, fn: Callable[[], object]):
        raise CaptureError(f"{self.name} has no CUDA graphs")

    def replay(self, graph) -> None:
        raise CaptureError(f"{self.name} has no CUDA graphs")

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.torch_device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def tensor(self, data, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.to_device(torch.tensor(data, dtype=dtype))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:  # a sync point
        return t.clone()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = True) -> None:
        dst.copy_(src)

    def pin(self, t: torch.Tensor) -> bool:  # False: copies from `t` are staged (slower, still right)
        return False

    def _pin_fits(self, nbytes: int) -> bool:
        return self.pin_limit_bytes is None or self.pinned_bytes + nbytes <= self.pin_limit_bytes

    def unpin(self, t: torch.Tensor) -> None:
        pass

    @property
    def pinned_bytes(self) -> int:
        return 0

    def is_pinned(self, t: torch.Tensor) -> bool:
        return False

    def pending_error(self) -> str | None:  # left by work outside torch (CUDA's "last error"), taken and cleared
        return None

    def mem_get_info(self) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def compute(self):  # for device compute issued outside any launch (embeddings, logits)
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class _Done:  # the host device's stream and event: work is done when it returns, so there is nothing to wait for
    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class HostDevice(Device):
    """The CPU as the device: the CPU-only mode and the threaded executor's real copies."""


class CudaDevice(Device):
    """torch.cuda behind the Device interface, deliberately thin: CI exercises the logic through the emulation."""

    kind = "cuda"
    accelerator = True
    _registered: dict[int, int] = {}  # base address -> bytes, the process's (CUDA refuses a second registration)
    _lock = threading.Lock()

    def __init__(self, device: str | torch.device | int | None = None, pin_limit_bytes: int | None = None,
                 wait_seconds: float | None = None):
        self.index = device_index(device, torch.cuda.current_device)
        self.wait_seconds = wait_seconds_default() if wait_seconds is None else wait_seconds
        self._streams: list = []  # the streams made here: what `synchronize` waits for
        self.torch_device = torch.device("cuda", self.index)
        self.name = torch.cuda.get_device_name(self.index)
        self.capability = tuple(torch.cuda.get_device_capability(self.index))
        self.pin_limit_bytes = pin_budget() if pin_limit_bytes is None else pin_limit_bytes
        self._mine: set[int] = set()  # the registrations this device made
        self.runtime_errors: list[str] = []  # failed cudaHostRegister/Unregister calls (each also cleared)
        self._graph_pool = None  # the captured graphs' memory (see capture)

    def set_device(self) -> None:
        torch.cuda.set_device(self.index)

    def stream(self, name: str, compute: bool = False):
        s = torch.cuda.Stream(device=self.torch_device)
        self._streams.append(s)
        return s

    def release_stream(self, stream) -> None:
        if stream in self._streams:
            self._streams.remove(stream)

    def current_stream(self):
        return torch.cuda.current_stream(self.torch_device)

    def event(self, timing: bool = False, blocking: bool = True):
        # blocking: a host thread waiting on it sleeps instead of spinning a core (cudaEventBlockingSync)
        return torch.cuda.Event(enable_timing=timing, blocking=blocking)

    def launch(self, stream, fn, label=None) -> None:
        with torch.cuda.stream(stream):
            fn()

    def capture(self, fn):
        # one memory pool for every graph (they replay one at a time, in capture order; a pool each would hold
        # a few MB times thousands of graphs); thread-local capture: other streams go on launching meanwhile
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._graph_pool, stream=torch.cuda.current_stream(self.torch_device),
                              capture_error_mode="thread_local"):
            out = fn()
        return g, out

    def replay(self, graph) -> None:
        graph.replay()

    def synchronize(self) -> None:
        for i, s in enumerate([*self._streams, self.current_stream()]):
            ev = torch.cuda.Event()
            ev.record(s)
            poll(ev.query, self.wait_seconds, f"the work queued on stream {i}")

    def to_device(self, t):
        return t.to(self.torch_device)

    def to_host(self, t):
        return t.cpu()

    def copy(self, dst, src, non_blocking=True) -> None:
        dst.copy_(src, non_blocking=non_blocking)
        stream = torch.cuda.current_stream(self.torch_device)
        for t in (src, dst):  # keep the caching allocator from reusing it before this stream is past the copy
            if t.is_cuda:
                t.record_stream(stream)

    def pin(self, t) -> bool:
        """cudaHostRegister over exactly the tensor's pages (torch's allocator rounds to a power of two)."""
        if not t.is_contiguous() or t.numel() == 0:
            return False
        start = t.data_ptr() // PAGE * PAGE
        end = -(-(t.data_ptr() + t.numel() * t.element_size()) // PAGE) * PAGE
        with self._lock:
            if start in self._registered:
                self._mine.add(start)
                return True
            if not self._pin_fits(end - start):
                return False
            err = torch.cuda.cudart().cudaHostRegister(start, end - start, 0)
            if int(err) != 0:  # the OS or driver refused (out of lockable memory, or already registered)
                self._runtime_failed("cudaHostRegister", err, end - start)
                return False
            self._registered[start] = end - start
            self._mine.add(start)
        return True

    def _pin_fits(self, nbytes: int) -> bool:
        return self.pin_limit_bytes is None or sum(self._registered.values()) + nbytes <= self.pin_limit_bytes

    def _runtime_failed(self, call: str, err, nbytes: int) -> None:
        """Note it and clear CUDA's "last error": torch would report it as the next kernel's failure, far from here."""
        self.runtime_errors.append(f"{call} of {nbytes:,} bytes: error {int(err)}")
        self.pending_error()

    def pending_error(self) -> str | None:
        try:  # a tiny kernel's launch check reads (and clears) the thread's last error
            torch.zeros(1, device=self.torch_device).add_(1)
        except RuntimeError as e:
            return str(e).splitlines()[0]
        return None

    def unpin(self, t) -> None:
        start = t.data_ptr() // PAGE * PAGE
        with self._lock:
            if start in self._mine:
                self._mine.discard(start)
                nbytes = self._registered.pop(start, None)
                if nbytes is not None:
                    err = torch.cuda.cudart().cudaHostUnregister(start)
                    if int(err) != 0:
                        self._runtime_failed("cudaHostUnregister", err, nbytes)

    @property
    def pinned_bytes(self) -> int:
        return sum(self._registered.get(a, 0) for a in self._mine)

    def is_pinned(self, t) -> bool:
        return t.is_pinned()

    def mem_get_info(self):
        return torch.cuda.mem_get_info(self.index)

    def memory_allocated(self):
        return torch.cuda.memory_allocated(self.index)

    def max_memory_allocated(self):
        return torch.cuda.max_memory_allocated(self.index)

    def reset_peak_memory_stats(self):
        torch.cuda.reset_peak_memory_stats(self.index)

    def empty_cache(self):
        torch.cuda.empty_cache()


def default_device_kind() -> str:
    """$MLIGHT_DEVICE (cpu | cuda | emulated; the tests set cpu) if set, else CUDA where torch sees one, else cpu."""
    return os.environ.get("MLIGHT_DEVICE", "").strip().lower() or ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: "str | torch.device | Device | None" = None) -> Device:
    """A Device from a name ("cpu", "cuda", "cuda:1", "emulated") or None (default_device_kind())."""
    if isinstance(device, Device):
        return device
    name = str(device) if device is not None else default_device_kind()
    if name == "cpu":
        return HostDevice()
    if name == "emulated":
        from core.runtime.device_emulated import EmulatedCuda

        return EmulatedCuda()
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("CUDA was asked for but torch sees no CUDA GPU",
                             "run on the CPU (omit --executor cuda), or install a CUDA build of torch")
        return CudaDevice(name)
    raise UsageError(f"unknown device {name!r}", "use one of cpu, cuda, emulated (or cuda:N)")
