"""How to split the MoE FFN over tensor-parallel ranks: every expert's intermediate dimension, or
whole experts per rank? Measures each rank's expert time on this CPU (the ranks run one after
another here; the step waits for the slowest, so the max over ranks is what counts) and the bytes
each rank streams per layer, for uniform and skewed routing.

    python bench/tp_split.py [--hidden 1024 --inter 3584 --experts 8 --top-k 2 --ranks 2 4]

Prints, per token count, the slowest rank's time under each split relative to one unsplit rank,
and the largest per-rank share of a layer's expert bytes.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from core.model.moe import experts


def best_times(fns: dict, reps: int = 9) -> dict:
    """Fastest of `reps` runs of each function, interleaved so that a busy spell of the machine
    hits every variant alike (the machines here are shared and noisy)."""
    best = {k: float("inf") for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def routing(tokens: int, E: int, k: int, skew: float, gen: torch.Generator):
    """Top-k routing with expert popularity ∝ 1/(e+1)^skew (0 = uniform)."""
    bias = -skew * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    logits = torch.randn(tokens, E, generator=gen) + bias
    w, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return w / w.sum(-1, keepdim=True), idx


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=3584)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    args = ap.parse_args(argv)
    D, I, E, k = args.hidden, args.inter, args.experts, args.top_k
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, generator=gen) * 0.02
    w2 = torch.randn(E, D, I, generator=gen) * 0.02
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load: {os.getloadavg()[0]:.2f}")
    print(f"layer: D={D} I={I} E={E} top-{k}, fp32\n")
    print("ranks skew tokens | unsplit ms | slowest rank / unsplit: intermediate  whole-experts | max bytes share: inter  whole")
    for K in args.ranks:
        inter = [(r * I // K, (r + 1) * I // K) for r in range(K)]
        owned = [list(range(r * E // K, (r + 1) * E // K)) for r in range(K)]
        for skew in (0.0, 1.0):
            for T in args.tokens:
                h = torch.randn(T, D, generator=gen)
                rw, idx = routing(T, E, k, skew, gen)
                fns = {"base": lambda: experts(h, w13, w2, rw, idx, grouped=False)}
                for r, (a, b) in enumerate(inter):
                    w13_r = torch.cat([w13[:, a:b], w13[:, I + a:I + b]], 1).contiguous()
                    w2_r = w2[:, :, a:b].contiguous()
                    fns[("inter", r)] = lambda w13_r=w13_r, w2_r=w2_r: experts(h, w13_r, w2_r, rw, idx, grouped=False)
                for r, ex in enumerate(owned):
                    mine = torch.isin(idx, torch.tensor(ex))
                    rows = mine.any(-1).nonzero().flatten()
                    if not len(rows):
                        continue
                    # a rank runs only its experts, for the tokens routed to them (others weigh 0)
                    local = {e: i for i, e in enumerate(ex)}
                    lidx = idx[rows].clone().apply_(lambda e: local.get(e, 0))
                    lw = torch.where(mine[rows], rw[rows], torch.zeros_like(rw[rows]))
                    w13_r, w2_r = w13[ex].contiguous(), w2[ex].contiguous()
                    fns[("whole", r)] = lambda rows=rows, lidx=lidx, lw=lw, w13_r=w13_r, w2_r=w2_r: experts(
                        h[rows], w13_r, w2_r, lw, lidx, grouped=False)
                t = best_times(fns)
                base = t["base"]
                t_inter = max(v for key, v in t.items() if key[0] == "inter")
                t_whole = max((v for key, v in t.items() if key[0] == "whole"), default=0.0)
                share_whole = max(len(ex) for ex in owned) / E
                share_inter = max(b - a for a, b in inter) / I
                print(f"{K:5d} {skew:4.1f} {T:6d} | {base * 1e3:10.2f} | {t_inter / base:33.2f} {t_whole / base:14.2f}"
                      f" | {share_inter:22.2f} {share_whole:6.2f}")
        print()


if __name__ == "__main__":
    main()
