"""How much of one speed-probe reading is the machine? (issue 11 item 6)

Every CPU-only prediction scales its calibrated seconds by the probe's reading just before it
(core.plan.cpu_speed.measure, `PROBE_S` of a fixed GEMM; CpuCosts.at_speed). That helps where the box's
speed moves in stretches longer than a run and hurts where it swings within seconds. This runs the probe's GEMM
back to back for `--seconds` and asks the trace: a probe's reading (the median call over `--probe` seconds)
against the mean rate over the next R seconds (a run of that length) — their correlation and the least-squares
slope in logs (1: scale a prediction by the reading in full; 0: the reading says nothing about the run).

    python bench/probe_noise.py --threads 2 --seconds 60 [--math bfloat16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RUNS = (2.0, 5.0, 10.0, 30.0)  # run lengths the reading is held against


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--math", default="float32", help="the probe's dtype (the CPU math of the model: float32, bfloat16)")
    p.add_argument("--probe", type=float, default=None, help="a reading's seconds (default cpu_speed.PROBE_S)")
    return p.parse_args(argv)


def trace(math_: str, threads: int, seconds: float) -> list[tuple[float, float]]:
    """(start, seconds) of each call of the probe's GEMM, back to back for `seconds`."""
    import torch
    import torch.nn.functional as F

    from core.plan.cpu_speed import SHAPE

    torch.set_num_threads(threads)
    dt = getattr(torch, math_)
    m, k, n = SHAPE
    a, w = torch.randn(m, k).to(dt), torch.randn(n, k).to(dt)
    out = torch.empty(m, n, dtype=dt)
    for _ in range(5):
        F.linear(a, w, out=out)
    calls, t0 = [], time.perf_counter()
    while (now := time.perf_counter()) - t0 < seconds:
        F.linear(a, w, out=out)
        calls.append((now - t0, time.perf_counter() - now))
    return calls


def follow(calls: list[tuple[float, float]], probe: float, run: float, gap: float = 0.5) -> dict:
    """A reading (median call over `probe` s) against the mean rate of the `run` s that start `gap` s after it,
    at every half-second: correlation and slope in logs, and each side's spread (log sd)."""
    def within(a, b):
        return [x for t, x in calls if a <= t < b]

    xs, ys, start, end = [], [], 0.0, calls[-1][0] if calls else 0.0
    while start + probe + gap + run <= end:
        p, r = within(start, start + probe), within(start + probe + gap, start + probe + gap + run)
        if p and r:
            xs.append(-math.log(statistics.median(p)))
            ys.append(-math.log(sum(r) / len(r)))
        start += 0.5
    if len(xs) < 3 or statistics.pvariance(xs) == 0 or statistics.pvariance(ys) == 0:
        return {"n": len(xs)}
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    cov = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / len(xs)
    return {"n": len(xs), "corr": cov / (statistics.pstdev(xs) * statistics.pstdev(ys)),
            "slope": cov / statistics.pvariance(xs), "probe_sd": statistics.pstdev(xs), "run_sd": statistics.pstdev(ys)}


def main(argv=None) -> int:
    import common
    from core.plan import cpu_speed

    args = parse_args(argv)
    probe = args.probe or cpu_speed.PROBE_S
    print(f"bench probe_noise: {args.threads} threads, {args.math}, {args.seconds:.0f} s, readings of {probe} s, "
          f"load average {common.load_average()}", flush=True)
    calls = trace(args.math, args.threads, args.seconds)
    m, k, n = cpu_speed.SHAPE
    flop = 2 * m * k * n
    per_s: dict[int, list[float]] = {}
    for t, x in calls:
        per_s.setdefault(int(t), []).append(x)
    print(f"{len(calls)} calls; per-second median GFLOP/s: "
          + " ".join(f"{flop / statistics.median(v) / 1e9:.0f}" for _, v in sorted(per_s.items())))
    for run in RUNS:
        f = follow(calls, probe, run)
        if "slope" not in f:
            print(f"  next {run:4.0f} s: too short a trace ({f['n']} pairs)")
            continue
        print(f"  next {run:4.0f} s: correlation {f['corr']:.2f}, slope {f['slope']:.2f} (reading ±{f['probe_sd']:.1%}, "
              f"run ±{f['run_sd']:.1%}; {f['n']} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
