"""How much of the last-level cache a run can count on, measured: the calibration's `cache_bytes`.

The cost model prices a decode step's weights as read from the cache while they and the step's KV rows fit in it
(core.plan.cpu_cost.CpuCosts.for_step), so the size it is told decides when a long context starts costing weight
reads from RAM. The OS's figure can be far from what a process gets: a 2-core Xeon VM reports its host's 480 MB L3,
yet re-reading a buffer there ran at 50-54 GB/s from 8 to 64 MB, 33 at 96 MB and 23-27 from 128 MB (RAM). Priced
with 480 MB, the demo model's decode at 308-token prompts (84 MB of KV a step) kept its weights "cached" and ran
21-23 % under its predicted speed; its tasks took what the cold weights cost (bench/RESULTS.md, issue 11,
twenty-first session).
"""

from __future__ import annotations

import time
from typing import Callable

CACHED = 1.5  # a buffer re-read at least this much faster than one from RAM is (mostly) in the cache
STEP = 2 ** 0.5  # sizes tried: 1 MiB, then up by this factor
SMALLEST = 1 << 20
REPEATS = 4
SWEEPS = 3  # the median of this many: near the knee one sweep read 45 MB and the next 90 (the VM above)


def effective_cache_bytes(reported: int, rate: Callable[[int], float] | None = None,
                          top: int | None = None) -> int:
    """The largest buffer, at most `reported`, that re-reads at least CACHED times as fast as a buffer of `top`
    bytes (by default core.plan.hardware.bandwidth_probe_bytes: twice the reported cache, from RAM), every smaller
    size doing so as well; SMALLEST where even that does not; the median of SWEEPS sweeps. `rate(nbytes)`: bytes
    a second re-reading that many (default: a torch sum over a prefix of one buffer, the best of REPEATS, on
    torch's threads)."""
    if top is None:
        from core.plan.hardware import bandwidth_probe_bytes

        top = bandwidth_probe_bytes(reported)
    if rate is None:
        rate = _reader(top)
    return sorted(_sweep(reported, rate, top) for _ in range(SWEEPS))[SWEEPS // 2]


def _sweep(reported: int, rate: Callable[[int], float], top: int) -> int:
    ram = rate(top)
    best, size = SMALLEST, float(SMALLEST)
    while size <= min(reported, top / 2):
        n = int(size) // 4096 * 4096
        if rate(n) < CACHED * ram:
            break
        best = n
        size *= STEP
    return best


def _reader(top: int) -> Callable[[int], float]:
    """rate(nbytes) over prefixes of one fp32 buffer of `top` bytes (made once: a fresh one's page faults would be
    timed too)."""
    import torch

    buf = torch.ones(top // 4)

    def rate(nbytes: int) -> float:
        x = buf[:nbytes // 4]
        x.sum()  # brings it in (or as much as stays)
        best = float("inf")
        for _ in range(REPEATS):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return nbytes / max(best, 1e-9)

    return rate
