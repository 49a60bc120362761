"""Does the CPU's speed probe (core.plan.cpu_speed) follow the engine's speed as the machine drifts? (issue 11 item 6)

For `--minutes`, over and over: the probe, a prefill of 32 prompts of 128 tokens and 8 decode steps at 64 requests
(one process, the same buffers each time), the probe again. Then, over windows of `--window` samples, how much the
engine's seconds spread alone and times the probe's rate (what the calibration and the prediction divide out), and
the slope of log seconds on log probe-time (1: the engine moves as the probe does).

    python bench/cpu_speed_drift.py --model /path/to/mixtral-800m --threads 2 --minutes 10
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--window", type=int, default=5, help="samples a window (default 5: ~20 s on the 784M)")
    p.add_argument("--probe-seconds", type=float, default=0.3, help="each probe's length (two a sample)")
    return p.parse_args(argv)


def samples(args):
    import torch

    from core.plan import cpu_speed
    from core.runtime.engine import Engine

    eng = Engine.load(args.model, threads=args.threads)
    spec, g = eng.spec, torch.Generator().manual_seed(0)
    P, N, B, C = 32, 128, 64, 128
    prompts = [torch.randint(0, spec.vocab_size, (N,), generator=g).tolist() for _ in range(P)]
    pre = eng.runner(slots=P, micro_batch_size=P, max_tokens=N + 1)
    dec = eng.runner(slots=B, micro_batch_size=B, max_tokens=C + 12)
    for store in dec.cache.layers:  # a filled cache without a prefill: timing only
        for t, axis in zip(store.tensors, store.token_axes):
            (t if axis is None else t.narrow(axis, 0, store.kept(C))).normal_(generator=g)
    tokens = [torch.randint(0, spec.vocab_size, (B,), generator=g).tolist()]
    pre.prefill(prompts[:1], [0], [[0]])
    dec.decode(tokens, [list(range(B))], [[C] * B])
    probe = lambda: cpu_speed.measure(eng.cpu.math, args.threads, args.probe_seconds)  # noqa: E731
    end = time.time() + 60 * args.minutes
    while time.time() < end:
        before = probe()
        t = time.perf_counter()
        pre.prefill(prompts, list(range(P)), [list(range(P))])
        t_pre = time.perf_counter() - t
        t = time.perf_counter()
        for s in range(8):
            dec.decode(tokens, [list(range(B))], [[C + s] * B])
        t_dec = time.perf_counter() - t
        row = {"time": round(time.time(), 1), "probe": (before + probe()) / 2, "prefill": t_pre, "decode": t_dec}
        print(json.dumps(row), flush=True)
        yield row


def summary(rows: list[dict], window: int) -> list[str]:
    wins = [rows[i:i + window] for i in range(0, len(rows) - window + 1, window)]
    lp = [-math.log(statistics.mean(r["probe"] for r in w)) for w in wins]
    out = [f"{len(rows)} samples, {len(wins)} windows of {window}; probe "
           f"{min(r['probe'] for r in rows) / 1e9:.0f}-{max(r['probe'] for r in rows) / 1e9:.0f} GFLOP/s"]
    for k in ("prefill", "decode"):
        y = [math.log(statistics.mean(r[k] for r in w)) for w in wins]
        my, mp = statistics.mean(y), statistics.mean(lp)
        slope = sum((a - mp) * (b - my) for a, b in zip(lp, y)) / max(1e-30, sum((a - mp) ** 2 for a in lp))
        out.append(f"{k}: windows' seconds spread ±{statistics.pstdev(y):.1%} alone, ±{statistics.pstdev([b - a for a, b in zip(lp, y)]):.1%} "
                   f"times the probe's rate; slope on the probe {slope:.2f}")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = list(samples(args))
    print("\n".join(summary(rows, args.window)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
