"""The GGUF blocks kernel's int8 path against its fp32 path on the 784M Mixtral's expert shapes, in one process.

core.model.cpu.gguf_blocks has two paths over the same blocks: "fp32" (each weight row decoded to floats, fp32
FMAs with the activations) and "int8" (activations quantized per 32 values, integer dots: AVX-512 VNNI or
AVX2 `maddubs`). This times both on bench/cpu_vs_hf.py's FULL shapes (hidden 1024, intermediate 3840: gate/up
[7680, 1024], down [1024, 3840]) at M activation rows, and the fused one-token call (`moe`, 2 of 8 experts),
interleaved (fp32, int8, fp32, ...) so a shared machine's load hits both alike; printed: G weights/s of each
(median) and the int8/fp32 ratio per round, its median and spread. The ratios, not the rates, are the result
on a loaded machine.

    python bench/gguf_int8.py                          # Q8_0 and Q4_K; M = 1, 8, 32, 64, 128; both thread counts
    python bench/gguf_int8.py --formats Q6_K --rows 1,8 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from core.model.cpu import gguf_blocks  # noqa: E402

D, I, E, TOP_K = 1024, 3840, 8, 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="Q8_0,Q4_K")
    p.add_argument("--rows", default="1,8,32,64,128")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-s", type=float, default=0.15, help="seconds each timing runs for at least")
    return p.parse_args(argv)


def blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    from gguf_files import quantize

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(quantize(w, kind))).view(torch.uint8).reshape(n, -1)


def timed(fn, min_s: float) -> float:
    """Seconds a call, the best of batches run for at least min_s together."""
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_s:
        n, t0 = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < 0.02:
            fn()
            n += 1
        dt = time.perf_counter() - t0
        spent += dt
        best = min(best, dt / n)
    return best


def compare(label: str, weights: int, run, args) -> None:
    rates = {"fp32": [], "int8": []}
    ratios = []
    for _ in range(args.rounds):
        t = {p: timed(lambda p=p: run(p), args.min_s) for p in ("fp32", "int8")}
        for p in t:
            rates[p].append(weights / t[p] / 1e9)
        ratios.append(t["fp32"] / t["int8"])
    print(f"| {label} | {statistics.median(rates['fp32']):.2f} | {statistics.median(rates['int8']):.2f} | "
          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) |", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    lib = gguf_blocks.library()
    if lib is None:
        print(f"no kernel: {gguf_blocks.status()}")
        return 1
    print(f"# {gguf_blocks.status()}; D {D}, I {I}; {args.rounds} interleaved rounds")
    print("| format, threads, call | fp32 G weights/s | int8 G weights/s | int8 speed-up: median (min..max) |")
    print("|---|---|---|---|")
    for kind in args.formats.split(","):
        w13 = torch.stack([blocks(kind, 2 * I, D, e) for e in range(E)])
        w2 = torch.stack([blocks(kind, D, I, 10 + e) for e in range(E)])
        g = torch.Generator().manual_seed(0)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            x1 = torch.randn(1, D, generator=g).bfloat16()
            ids, wts = torch.tensor([[5, 2]]), torch.tensor([[0.6, 0.4]])
            compare(f"{kind}, {threads}, moe B=1", TOP_K * 3 * D * I,
                    lambda p: gguf_blocks.moe(x1, ids, wts, (kind, w13), (kind, w2), path=p), args)
            for m in (int(r) for r in args.rows.split(",")):
                xu = torch.randn(m, D, generator=g).bfloat16()
                xd = torch.randn(m, I, generator=g).bfloat16()
                compare(f"{kind}, {threads}, gate/up M={m}", 2 * I * D,
                        lambda p: gguf_blocks.linear(kind, xu, w13[0], path=p), args)
                compare(f"{kind}, {threads}, down M={m}", D * I,
                        lambda p: gguf_blocks.linear(kind, xd, w2[0], path=p), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
