"""Routed-expert kernels side by side on the new families' expert shapes: the per-expert loop vs
grouped_mm (and oneDNN-packed weights where this CPU takes them), at several batch sizes, with what
core.model.expert_choice picks when measuring on this machine. Prints times and loop/grouped ratios.

    python bench/expert_kernels.py [--dtype bfloat16] [--tokens 1 8 64 256] [--experts 128] [--repeat 5]

--experts caps the expert count (the real models have 256–512; every expert is kept in memory).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.model import expert_choice  # noqa: E402
from core.model.moe import HAS_GROUPED_MM, can_pack, experts, pack_experts  # noqa: E402

SHAPES = {  # experts, top-k, hidden, expert intermediate
    "Qwen3-Next-80B-A3B": (512, 10, 2048, 512),
    "Qwen3.5-35B-A3B": (256, 8, 2048, 512),
    "DeepSeek-V2-Lite": (64, 6, 2048, 1408),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}


def best_of(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--experts", type=int, default=128, help="at most this many experts per shape")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), load {load:.1f}, {args.dtype}, "
          f"grouped_mm {'yes' if HAS_GROUPED_MM else 'no'}, packing {'yes' if can_pack(dtype) else 'no'}")
    print(f"{'shape':20s} {'E':>4s} {'T':>5s} {'loop ms':>9s} {'grouped ms':>11s} {'packed ms':>10s} "
          f"{'loop/grouped':>13s} {'measured pick':>14s}")
    g = torch.Generator().manual_seed(0)
    for name, (E, k, D, I) in SHAPES.items():
        E = min(E, args.experts)
        w13 = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).to(dtype)
        w2 = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(dtype)
        packed = pack_experts(w13, w2) if can_pack(dtype) else None
        for T in args.tokens:
            h = torch.randn(T, D, generator=g).to(dtype)
            idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            wts = torch.softmax(torch.randn(T, k, generator=g), -1).to(dtype)
            loop = best_of(lambda: experts(h, w13, w2, wts, idx, grouped=False), args.repeat)
            grouped = best_of(lambda: experts(h, w13, w2, wts, idx, grouped=True), args.repeat) if HAS_GROUPED_MM \
                else float("nan")
            pk = best_of(lambda: experts(h, None, None, wts, idx, packed=packed), args.repeat) if packed \
                else float("nan")
            experts(h, w13, w2, wts, idx)  # what the engine would run: measured once for this shape
            pick = [c for key, c in expert_choice.chosen().items() if key[2:5] == (E, 2 * I, D)
                    and key[-1] == expert_choice.bucket(T)]
            print(f"{name:20s} {E:4d} {T:5d} {loop * 1e3:9.2f} {grouped * 1e3:11.2f} {pk * 1e3:10.2f} "
                  f"{loop / grouped:12.2f}x {pick[0] if pick else '-':>14s}")
        del w13, w2, packed
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
