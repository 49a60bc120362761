"""The launch budget side by side (issue 42): today's expert path and graph against the new, in one run, on the
emulated device — GPU-stream ops per micro-batch per layer, device copies and event waits per layer, host syncs
per step and host milliseconds per layer of a steady CGOPipe decode step — for Mixtral-, Qwen3-30B-A3B- and
DeepSeek-V3-shaped layers (hidden sizes scaled down; E and k the real ones). Prints the ratios today / new
(t/new) and main / new (m/new).

    python bench/launch_budget.py [--formats bf16 int4] [--cap 9.0] [--micro-batches 4] [--pages 4] [--repeat 3]

"today": main at 9839921 — the expert form device_experts took there (grouped_mm for bf16 on SM80+, else the
padded table; quantized experts one by one), its graph's waits (every post-attention on every weight page of its
layer, every page on the layer two back). "main": main at de986f2 — the same expert form (its device_experts,
read from git) over this tree's graph: the expert path's share alone. "new": what the runner picks now (the fused
expert path, core.model.fused_moe) and the schedule's graph. All run this tree's pre- and post-attention (RoPE
gathered once a step, in four ops an apply; against main's, see test_rope_tables). Counted by
tests/op_count.py; host time is the emulated step's wall clock per layer, on this CPU (its launches and its
arithmetic together: tiny shapes keep it mostly the former).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from checkpoints import make_checkpoint  # noqa: E402
from core.runtime.device_emulated import EmulatedCuda  # noqa: E402
from core.runtime.engine import Engine  # noqa: E402
from op_count import steady_step  # noqa: E402

SHAPES = {  # name: (family, overrides): E and k as the real model's, hidden sizes scaled down
    "Mixtral-8x7B": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=128,
                                          num_hidden_layers=4)),
    "Qwen3-30B-A3B": ("qwen3_moe", dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=64,
                                        num_hidden_layers=4)),
    "DeepSeek-V3": ("deepseek_v3", dict(n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                                        moe_intermediate_size=64)),
}
MiB = 1 << 20


def todays_graph(tasks):
    """main's dependencies (9839921), put back on the new graph: each post-attention of a layer past the first
    on every page of that layer, and every page on what the first page of its layer waits for."""
    pages = collections.defaultdict(list)
    for t in tasks:
        if t.kind == "weight_page":
            pages[t.layer].append(t)
    out = []
    for t in tasks:
        deps = set(t.deps)
        if t.kind == "post_attn" and t.layer > 0:
            deps |= {p.id for p in pages[t.layer] if p.id < t.id}
        elif t.kind == "weight_page":
            deps |= set(pages[t.layer][0].deps)
        out.append(dataclasses.replace(t, deps=tuple(sorted(deps))))
    return out


MAIN = "de986f2"  # main before the fused expert path


def mains_experts():
    """main's device_experts (at MAIN), read from git into a module of its own: its slot table's token limit was
    a shared number this tree no longer has, so it is given here."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{MAIN}:core/model/moe.py"], check=True,
                         capture_output=True, text=True).stdout
    src = src.replace("from core.model.limits import PADDED_MAX_TOKENS", "PADDED_MAX_TOKENS = 128  #")
    mod = type(sys)("mains_moe")
    exec(compile(src, f"{MAIN}:core/model/moe.py", "exec"), mod.__dict__)
    old = mod.device_experts

    def device_experts(h, parts, weights, idx, *, grouped=None, grouped_mm=True, act=None, backend=None):
        return old(h, parts, weights, idx, grouped=grouped_mm if grouped is None else grouped, act=act)

    return device_experts


def measure(path: Path, fmt: str, cap: tuple[int, int], form: str, n: int, pages: int, repeat: int):
    """form: today | main | new (the module's docstring)."""
    from core.runtime import pipeline

    dev = EmulatedCuda(1024 * MiB, capability=cap)
    quant = {} if fmt == "bf16" else dict(quantize=fmt, group_size=32)
    engine = Engine.load(path, device=dev, executor="cuda", schedule="cgopipe", dtype="bfloat16",
                         pages_per_layer=pages, resident_experts=(0,) * 8, use_cache=False, **quant)

    def old_graph(runner):
        tasks, current = runner._graph("decode", n)
        runner._graphs[("decode", n)] = (todays_graph(tasks), current)

    new_experts = pipeline.device_experts
    if form != "new":
        pipeline.device_experts = mains_experts()
    try:
        return steady_step(engine, micro_batches=n, micro_batch_size=2, prompt=6, repeat=repeat,
                           prepare=old_graph if form == "today" else None)
    finally:
        pipeline.device_experts = new_experts
        engine.close()


def row(c) -> dict:
    """Means over the layers with streamed experts (a dense first layer left out)."""
    moe = [i for i, lc in enumerate(c.layers) if lc.copies.get("weight_page")]
    n = c.micro_batches

    def mean(f):
        return sum(f(c.layers[i]) for i in moe) / len(moe)

    return {"ops": mean(lambda lc: lc.total_ops) / n, "ffn": mean(lambda lc: lc.ops.get("ffn", 0)) / n,
            "copies": mean(lambda lc: sum(lc.copies.values())), "waits": max(c.waits(i) for i in range(len(c.layers))),
            "syncs": c.host_syncs, "ms": 1e3 * c.seconds_per_layer()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "int4"], choices=["bf16", "int8", "int4"])
    ap.add_argument("--cap", default="9.0", help="the emulated device's compute capability (7.5, 8.0, 9.0)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--pages", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="counted steps; host time is the least")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    cap = tuple(int(x) for x in args.cap.split("."))
    n, p = args.micro_batches, args.pages
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, load {load:.1f}; emulated SM{cap[0]}{cap[1]}, CGOPipe, n = {n} micro-batches of 2, "
          f"p = {p} pages, every expert streamed")
    head = (f"{'shape':14s} {'E':>4s} {'k':>2s} {'fmt':5s} {'path':6s} {'ops/mb':>8s} {'ffn/mb':>8s} {'copies':>7s} "
            f"{'waits':>6s} {'syncs':>5s} {'host ms/layer':>14s}")
    print(head)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            family, over = SHAPES[name]
            path = make_checkpoint(family, Path(tmp) / name, **over)
            E = over.get("num_local_experts") or over.get("num_experts") or over.get("n_routed_experts")
            for fmt in args.formats:
                rows = {}
                for label in ("today", "main", "new"):
                    r = rows[label] = row(measure(path, fmt, cap, label, n, p, args.repeat))
                    print(f"{name:14s} {E:4d} {over['num_experts_per_tok']:2d} {fmt:5s} {label:6s} {r['ops']:8.1f} "
                          f"{r['ffn']:8.1f} {r['copies']:7.1f} {r['waits']:6d} {r['syncs']:5d} {r['ms']:14.2f}")
                w = rows["new"]
                for label in ("today", "main"):
                    t = rows[label]
                    print(f"{'':14s} {'':4s} {'':2s} {fmt:5s} {label[0] + '/new':6s} {t['ops'] / w['ops']:8.2f} "
                          f"{t['ffn'] / max(w['ffn'], 1e-9):8.2f} {t['copies'] / max(w['copies'], 1):7.2f} "
                          f"{t['waits'] / max(w['waits'], 1):6.2f} {t['syncs'] / max(w['syncs'], 1):5.2f} "
                          f"{t['ms'] / w['ms']:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
