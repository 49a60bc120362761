"""Where a batch-1 decode step goes with quantized experts, on this CPU: what bounds int4 / bf16 at B = 1.

Three parts, each in one process (`--part`, default all), on the models of bench/quant_cpu.py (built
there: pass the same `--workdir`):
- kernels: one row through each weight-only kernel on the experts' and the dense weights' shapes of the
  small and large models, 1 and 2 threads, best of 7 repeats over 8 rotating matrices (a working set
  larger than L3, as in a decode step): bf16 oneDNN-prepacked GEMV (GB/s), torch's int4 kernel at groups
  32 / 64 / 128, the int8 weight-only kernel and `torch._int_mm` (int8 × int8; G weights/s);
- split: a decode step at B = 1 by task (the executor's own times, median over 3 × 40 steps): the
  pre-attention projections, CPU attention, post-attention (O projection, norm, router), the routed
  experts, and what runs outside the tasks (LM head, sampling, the engine's bookkeeping);
- groups: int4 experts at group 64 and 128 (alone and with int4 dense weights) against bf16, interleaved
  rounds in one process.

    python bench/quant_b1.py --workdir /tmp/qs/small [--size large] [--part kernels|split|groups] [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.quant_cpu import FORMATS, SIZES, decode_rate  # noqa: E402

PROMPT = "Compose an engaging travel blog post about a recent trip to Hawaii"
SHAPES = {"small w13": (7680, 1024), "small w2": (1024, 3840), "large w13": (14336, 2048), "large w2": (2048, 7168),
          "large qkv": (3072, 2048), "large head": (4096, 2048)}


def kernels(threads: int) -> None:
    from core.model.moe import _packed_linear
    from core.model.quant.experts import _kernel_linear, _kernel_pack
    from core.model.quant.formats import Format, quantize

    def best(fn, reps=20):
        fn()
        fn()
        out = 1e9
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            out = min(out, (time.perf_counter() - t) / reps)
        return out

    E, groups = 8, (32, 64, 128)
    print("one row; bf16 GB/s; int4 / int8 / _int_mm G weights/s; last column: int4 g64 time / bf16 time")
    print(f"{'shape':11s} thr  {'bf16 packed':>18s}   int4 g32 / g64 / g128   int8   _int_mm  int4/bf16")
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K) / K ** 0.5 for _ in range(E)]
        pk = [torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 16) for w in ws]
        q4 = {g: [_kernel_pack(Format("int4", g), quantize(Format("int4", g), w), torch.bfloat16) for w in ws]
              for g in groups}
        q8 = [_kernel_pack(Format("int8"), quantize(Format("int8"), w), torch.bfloat16) for w in ws]
        wi = [torch.randint(-127, 127, (K, N), dtype=torch.int8) for _ in range(E)]
        x, xi = torch.randn(1, K).to(torch.bfloat16), torch.randint(-127, 127, (1, K), dtype=torch.int8)
        for th in sorted({1, threads}):
            torch.set_num_threads(th)
            i = [0]

            def nxt():
                i[0] = (i[0] + 1) % E
                return i[0]

            tb = best(lambda: _packed_linear(x, pk[nxt()]))
            t4 = {g: best(lambda: _kernel_linear(Format("int4", g), x, q4[g][nxt()])) for g in groups}
            t8 = best(lambda: _kernel_linear(Format("int8"), x, q8[nxt()]))
            ti = best(lambda: torch._int_mm(xi, wi[nxt()]))
            w = N * K / 1e9
            print(f"{name:11s} {th:>3}  {tb * 1e3:6.3f} ms ({2 * w / tb:5.1f})   "
                  + " / ".join(f"{w / t4[g]:5.1f}" for g in groups) + f"   {w / t8:5.1f}   {w / ti:5.1f}   {t4[64] / tb:.2f}",
                  flush=True)


def split(model_dir: Path, threads: int, formats=("int4", "none", "int4+d4")) -> None:
    from core.runtime.engine import Engine, Request
    from core.telemetry import StepDone

    print("ms per B=1 decode step (median): step = tasks + outside; tasks by kind")
    for fmt in formats:
        e = Engine.load(model_dir, dtype="bfloat16", **FORMATS[fmt], threads=threads)
        e.eos_ids = set()
        rows = collections.defaultdict(list)

        def on(ev):
            if isinstance(ev, StepDone) and ev.kind == "decode":
                per = collections.Counter()
                for i, t in enumerate(ev.tasks):
                    per[t.kind] += ev.times[2 * i + 1] - ev.times[2 * i]
                rows["step"].append(ev.seconds)
                rows["outside"].append(ev.seconds - sum(per.values()))
                for k, v in per.items():
                    rows[k].append(v)

        for rep in range(4):  # the first is a warm-up
            for _ in e.generate([Request(id="a", prompt=PROMPT, max_new_tokens=40)], batch_size=1,
                                micro_batch_size=1, on_event=on if rep else (lambda ev: None)):
                pass
        name = "bf16" if fmt == "none" else fmt
        print(f"{name:8s} " + "  ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in rows.items()), flush=True)
        e.close()


def groups(model_dir: Path, threads: int, rounds: int, gen: int) -> None:
    from core.runtime.engine import Engine

    cfg = {"bf16": {}, "int4 g64": dict(quantize="int4", group_size=64), "int4 g128": dict(quantize="int4", group_size=128),
           "int4+d4 g64": dict(quantize="int4", quantize_dense=True, group_size=64),
           "int4+d4 g128": dict(quantize="int4", quantize_dense=True, group_size=128)}
    eng = {k: Engine.load(model_dir, dtype="bfloat16", threads=threads, **v) for k, v in cfg.items()}
    for e in eng.values():
        e.eos_ids = set()
        decode_rate(e, 1, 2, PROMPT)
    r = {k: [] for k in eng}
    for i in range(rounds):
        for k, e in eng.items():
            r[k].append(statistics.median(decode_rate(e, 1, gen, PROMPT)))
        print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in r.items()), flush=True)
    med = {k: statistics.median(v) for k, v in r.items()}
    for k in eng:
        paired = statistics.median(a / b for a, b in zip(r[k], r["bf16"]))
        print(f"{k:14s} {med[k]:7.1f} tok/s  {med[k] / med['bf16']:.2f}x bf16 (paired {paired:.2f}x)")
    pair = statistics.median(a / b for a, b in zip(r["int4 g128"], r["int4 g64"]))
    print(f"g128 / g64: int4 {med['int4 g128'] / med['int4 g64']:.3f} (paired {pair:.3f}), "
          f"int4+d4 {med['int4+d4 g128'] / med['int4+d4 g64']:.3f}")
    for e in eng.values():
        e.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True, help="bench/quant_cpu.py's --workdir (its model is built there)")
    p.add_argument("--size", choices=tuple(SIZES), default="small")
    p.add_argument("--part", choices=("all", "kernels", "split", "groups"), default="all")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--gen", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MLIGHT_CACHE_DIR", str(args.workdir / "cache"))
    model_dir = args.workdir / "model"
    if args.part != "kernels" and not (model_dir / "config.json").is_file():
        dims = SIZES[args.size]
        common.build_mixtral(model_dir, **dims, init_dtype=torch.bfloat16 if args.size == "large" else None)
    print(f"CPU {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, {args.threads} threads, "
          f"load {common.load_average()}")
    if args.part in ("all", "kernels"):
        kernels(args.threads)
    if args.part in ("all", "split"):
        split(model_dir, args.threads)
    if args.part in ("all", "groups"):
        groups(model_dir, args.threads, args.rounds, args.gen)
    print(f"load {common.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
