"""Threads for the CPU's share of the work, as many as there are free cores: an OpenMP team is as fast as its
slowest thread (with one of two cores busy elsewhere a decode step ran 1.3–75× slower on two threads than on one).
A `Governor` re-checks the count between engine steps, and the GPU schedules give the attention worker and the
device thread disjoint cores (`split`); where the OS has no affinity (macOS), all logical cores and no pinning.
"""

from __future__ import annotations

import math
import os
import time

import psutil

from core import platform

CHECK_EVERY_S = 2.0  # how often the governor re-reads the load between steps
SAMPLE_S = 0.2  # first look at the load: utilisation over this long


def allowed_cores() -> list[int]:
    """Logical CPUs this process may run on (its affinity mask), as many as a container's CPU quota
    lets run unthrottled (core.platform.usable_cores)."""
    try:
        cores = sorted(psutil.Process().cpu_affinity() or ())
    except (AttributeError, NotImplementedError, OSError, psutil.Error):
        cores = []
    cores = cores or list(range(os.cpu_count() or 1))
    return cores[:platform.usable_cores()]


class LoadMeter:
    """Cores' worth of CPU that *other* processes use on our cores, since the last look."""

    def __init__(self, cores: list[int] | None = None):
        self.cores = cores or allowed_cores()
        self._me = psutil.Process()
        self.reset()

    def reset(self) -> None:
        psutil.cpu_percent(percpu=True)  # starts both counters: the next reads cover the time from here
        self._me.cpu_percent()
        self._since = time.monotonic()

    def others(self) -> float:
        per = psutil.cpu_percent(percpu=True)
        mine = self._me.cpu_percent() / 100.0
        self._since = time.monotonic()
        return max(0.0, sum(per[c] for c in self.cores if c < len(per)) / 100.0 - mine)

    @property
    def age(self) -> float:
        return time.monotonic() - self._since


def free_threads(busy_elsewhere: float, cores: int) -> int:
    """Threads to run with when other processes keep `busy_elsewhere` cores busy: a core counts as ours
    unless more than a quarter of it is taken (a quarter-busy core still adds more than it stalls)."""
    return max(1, min(cores, math.floor(cores - busy_elsewhere + 0.75)))


class Governor:
    """Keeps torch's intra-op thread count at the free cores (or at `fixed`): `tick()`, once a step, costs two
    psutil reads every CHECK_EVERY_S seconds and nothing in between."""

    def __init__(self, fixed: int | None = None, every_s: float = CHECK_EVERY_S, set_threads=None,
                 meter: LoadMeter | None = None):
        if fixed is not None and fixed < 1:
            raise ValueError(f"threads must be at least 1, got {fixed}")
        self.fixed, self.every_s = fixed, every_s
        self._set = set_threads
        self.meter = None if fixed is not None else (meter or LoadMeter())
        self.threads: int | None = None
        self.history: list[tuple[float, int]] = []  # (time, threads) at each change

    def start(self, sample_s: float = SAMPLE_S) -> int:
        """Set the first thread count: `fixed`, else the cores free over the last `sample_s` seconds."""
        if self.fixed is not None:
            return self._apply(self.fixed)
        if self.meter.age < sample_s:
            time.sleep(sample_s - self.meter.age)
        return self._apply(free_threads(self.meter.others(), len(self.meter.cores)))

    def tick(self) -> int:
        if self.threads is None:
            return self.start()
        if self.fixed is not None or self.meter.age < self.every_s:
            return self.threads
        return self._apply(free_threads(self.meter.others(), len(self.meter.cores)))

    def _apply(self, n: int) -> int:
        if n != self.threads:
            if self._set is not None:
                self._set(n)
            else:
                import torch

                torch.set_num_threads(n)
            self.threads = n
            self.history.append((time.monotonic(), n))
        return n


def split(cores: list[int], device: str) -> tuple[list[int], list[int]]:
    """(compute cores, attention cores) for the GPU schedules: on CUDA the compute thread only launches, so one
    core; on the emulated device an even split; with one core both share it."""
    if len(cores) < 2:
        return list(cores), list(cores)
    k = 1 if device == "cuda" else len(cores) // 2
    return list(cores[:k]), list(cores[k:])


def pin_current_thread(cores: list[int]) -> bool:
    """Restrict the calling thread (and the OpenMP team it starts) to `cores`; False where the OS cannot or refuses."""
    if not cores:
        return False
    if platform.SYSTEM == "linux" and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, set(cores))
            return True
        except OSError:
            return False
    if platform.is_windows():
        try:
            import ctypes

            mask = sum(1 << c for c in cores if c < 64)
            k32 = ctypes.windll.kernel32
            k32.GetCurrentThread.restype = ctypes.c_void_p
            k32.SetThreadAffinityMask.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
            return bool(k32.SetThreadAffinityMask(k32.GetCurrentThread(), mask))
        except (AttributeError, OSError):
            return False
    return False


def worker_setup(device: str, cores: list[int] | None = None):
    """The executors' per-worker setup (any arguments): the CPU-attention worker on one set of cores (`split`),
    the others on the other, each OpenMP team as large as its set; `.pinned` maps resource -> cores."""
    import threading

    compute, attention = split(cores or allowed_cores(), device)
    pinned: dict[str, list[int]] = {}

    def setup(*_):
        resource = threading.current_thread().name.removeprefix("mlight-")
        mine = attention if resource == "cpu_attn" else compute
        if pin_current_thread(mine):
            pinned[resource] = mine

    setup.pinned = pinned
    setup.threads = len(attention) if device == "cuda" else min(len(compute), len(attention))
    return setup
