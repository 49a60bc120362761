"""How fast this CPU runs now: one fixed GEMM, timed for a second or two, against the same GEMM timed while a
calibration measured its costs (CpuCosts.speed).

A shared or throttled machine's speed moves while nothing about the model or the engine does. On the 2-core Zen 5
VM this project measures on, the 784M Mixtral's prefill of 4,096 tokens took 3.0-3.6 s averaged over 45-second
stretches of ten minutes, and this probe's rate moved with it (prefill seconds x probe rate within +-3 % where the
seconds alone spread +-9 %; decode +-8 % against +-11 %; bench/RESULTS.md, issue 11, fourteenth session). One
calibration measures its own minutes, so its prediction for a run ten minutes later was off by what the box did in
between (the 784M's 4x prompts: 10-15 % in three of five calibrations). So every window of a calibration is
stamped with this probe and brought to one reference speed, the pieces'; and a prediction scales the calibrated
seconds by that reference over the speed measured now (CpuCosts.at_speed, HardwareSpec.cpu_speed).

Boundary: torch and a clock; no engine, no model.
"""

from __future__ import annotations

import statistics
import time

SHAPE = (512, 1024, 4096)  # rows, K, N: a prefill chunk's GEMM of a small MoE, tens of ms on two cores
PROBE_S = 1.5  # a prediction's probe: 0.6 s of it tracked a run's speed at 0.6 of its moves, ~3 s at 0.9
STAMP_S = 0.5  # each probe of a calibration (one opens and one closes every window and stage; REUSE_S)
QUICK_S = 0.0  # a quick calibration's stamps: one call each
# A stamp this recent (the stretch before's closing one) opens the next stretch too: back to back, two probes a
# window made the demo model's calibration 95 s against 65-73 (its windows last ~3 s)
REUSE_S = 1.0
# A process's first probe (for its math and threads) first runs the GEMM this long untimed: on a 2-core Zen 4 VM
# one fresh process in six read 204 GFLOP/s there and 377-382 in the next two probes (others 363-397 throughout);
# each `mlight bench` or `mlight run` predicts from such a first probe, and two predictions of one cell parted
# 1.8x while the runs measured the same (bench/RESULTS.md, issue 11, seventeenth session)
WARM_S = 0.3
_warmed: set[tuple[str, int]] = set()


def key(math: str, threads: int) -> str:
    """The name HardwareSpec.cpu_speed keeps a speed under: the math dtype and the threads it ran on."""
    return f"{math}@{threads}"


def measure(math: str = "float32", threads: int | None = None, seconds: float = PROBE_S,
            clock=time.perf_counter) -> float:
    """FLOP/s of SHAPE's GEMM in `math` on `threads` torch threads (the current ones if None): the median call
    over about `seconds` (at least three calls), so one preempted call does not move it."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, math, None)
    dt = dt if isinstance(dt, torch.dtype) and dt.is_floating_point else torch.float32
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        m, k, n = SHAPE
        g = torch.Generator().manual_seed(0)
        a, w = torch.randn(m, k, generator=g).to(dt), torch.randn(n, k, generator=g).to(dt)
        out = torch.empty(m, n, dtype=dt)
        F.linear(a, w, out=out)  # warm-up: the kernel's first call packs and allocates
        first = (str(dt), torch.get_num_threads())
        if first not in _warmed:  # and a process's first probe brings its threads and clock up first (WARM_S)
            _warmed.add(first)
            end = clock() + WARM_S
            while clock() < end:
                F.linear(a, w, out=out)
        times, end = [], clock() + seconds
        while len(times) < 3 or clock() < end:
            t = clock()
            F.linear(a, w, out=out)
            times.append(clock() - t)
        return 2 * m * k * n / max(statistics.median(times), 1e-9)
    finally:
        torch.set_num_threads(before)


class Stamps:
    """The probe's rate around each stretch of a calibration: `around(fn)` runs fn between two probes and keeps
    their mean; `mean(names)` the mean rate of the stretches so named."""

    def __init__(self, math: str, seconds: float = STAMP_S, probe=None, clock=time.monotonic):
        self.math, self.seconds, self.probe, self.clock = math, seconds, probe or measure, clock
        self.rates: dict[str, list[float]] = {}
        self.last: tuple[float, float] | None = None  # (rate, when) of the latest probe's end

    def take(self) -> float:
        rate = self.probe(self.math, None, self.seconds)
        self.last = (rate, self.clock())
        return rate

    def around(self, name: str, fn):
        """(fn(), the probe's mean rate before and after it), the rate kept under `name`."""
        recent = self.last is not None and self.clock() - self.last[1] <= REUSE_S
        before = self.last[0] if recent else self.take()
        out = fn()
        rate = (before + self.take()) / 2
        self.rates.setdefault(name, []).append(rate)
        return out, rate

    def mean(self, *names: str) -> float:
        got = [r for n in names for r in self.rates.get(n, ())]
        return sum(got) / len(got) if got else 0.0
