"""CPU mode, quantized experts: decode tokens/s at B = 1 and B = 64, int4 vs int8 vs bf16, same run, same model.

Builds one random bf16 Mixtral-shaped checkpoint (transformers' classes), loads it several times in one
process — bf16 twice, on the fused C expert kernel (core.model.cpu.ffn, where it runs) and on oneDNN's
prepacked GEMMs (`none-onednn`: MLIGHT_NATIVE_EXPERTS=0), every ratio then against the faster of the two
in each round (bf16's best on this machine); int8 and int4 experts (int4 on mlight's C kernel, int4-torch
on torch's weight-only kernel over experts prepacked at load), and int4 experts with the dense weights (attention
projections, LM head) quantized too: int4+d8 (`--quantize int4 --quantize-dense int8`) and int4+d4
(`--quantize int4 --quantize-dense`) — and measures decode steps of each in interleaved rounds (bf16,
int8, int4, int4+d8, int4+d4, bf16, …) so that load changes on a shared machine hit all alike. Decode tokens/s = decode tokens / decode seconds from the engine's own StepDone events
(prefill excluded). Ratios: of the medians, and the median of each round's ratio to the bf16 round just
before it (which cancels slow drifts in what the machine's neighbours take).

Models (`--size`): small, hidden 1024, I 3840, 4 layers, vocab 4096 (396M parameters; the routed
experts are 86.5 % of the weights a token reads at batch 1); large, hidden 2048, I 7168, 4 layers,
vocab 4096 (1.47B; 87.5 %; Mixtral 8x7B: 88.5 %): about the same share of bytes, but each layer's work
4× larger against the per-layer cost of dispatching its ops, which in a real model is smaller still.

Also in the same run:
- the expert backends head to head: the kernel vs expanding the expert into a scratch buffer and
  multiplying in bf16, per expert, for 1..64 tokens routed to it (what KERNEL_ROWS is set from);
- the HRM's predicted decode tokens/s per format for the CPU-only policy at each B, on this machine's
  probed rates, next to the measured ones: the predicted int4/bf16 speed-up against the measured one.

    python bench/quant_cpu.py --threads 1      # hidden 1024, I 3840, 4 layers, 8 experts (≈ 400M parameters)
    python bench/quant_cpu.py --threads 2 --size large --batches 1 --skip-crossover
    python bench/quant_cpu.py --quick          # a smoke run
    python bench/quant_cpu.py --expert-kernels [--dtype bfloat16] [--tokens 1 8 64 256] [--experts 128] [--repeat 5]

`--expert-kernels` times, instead, the routed-expert kernels side by side on the new families' expert shapes
(no engine): the per-expert loop vs grouped_mm (and oneDNN-packed weights where this CPU takes them), at
several batch sizes, with what core.model.expert_choice picks when measuring on this machine; it prints
times and loop/grouped ratios. `--experts` caps the expert count (the real models have 256–512; every expert
is kept in memory).

Clocks: with one thread (`--threads 1`) the default is this process's CPU seconds (`--clock cpu`): on a
shared machine a descheduled thread's wall time is someone else's work, and its CPU time is what a quiet
machine's wall clock would show (memory stalls still count, since the thread is running through them).
With more threads the wall clock is the only honest one (`--clock wall`), and needs a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import common  # noqa: E402

FULL = dict(hidden=1024, intermediate=3840, layers=4, heads=16, kv_heads=4, experts=8, top_k=2, vocab=4096)
LARGE = dict(hidden=2048, intermediate=7168, layers=4, heads=32, kv_heads=8, experts=8, top_k=2, vocab=4096)
QUICK = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, experts=8, top_k=2, vocab=1024)
SIZES = {"small": FULL, "large": LARGE}
FORMATS = {"none": {}, "none-onednn": {}, "int8": dict(quantize="int8"),  # Engine.load's arguments
           "int4": dict(quantize="int4"), "int4-torch": dict(quantize="int4"),
           "int4+d8": dict(quantize="int4", quantize_dense="int8"), "int4+d4": dict(quantize="int4", quantize_dense=True)}
TORCH_INT4 = ("int4-torch",)  # loaded with mlight's C int4 kernel off: torch's weight-only kernel, the A/B
# bf16 both ways: on the fused C expert kernel where it runs (core.model.cpu.ffn, `none`) and on oneDNN's
# prepacked GEMMs (`none-onednn`, as MLIGHT_NATIVE_EXPERTS=0); the ratios are against the faster, per round
BF16 = ("none", "none-onednn")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--size", choices=tuple(SIZES), default="small", help="the model (see above; default small)")
    p.add_argument("--skip-crossover", action="store_true", help="leave out the per-expert backend table")
    p.add_argument("--batches", default="1,64", help="decode batch sizes (default 1,64)")
    p.add_argument("--gen", type=int, default=None, help="tokens generated per request per round (default 24; 6 quick)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 1 quick)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="time decode steps by CPU seconds (default with --threads 1) or the wall clock")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"formats to run, bf16 ('none') always among them (default {','.join(FORMATS)})")
    k = p.add_argument_group("--expert-kernels: the routed-expert kernels alone")
    k.add_argument("--expert-kernels", action="store_true", help="time the expert kernels instead (see above)")
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    k.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    k.add_argument("--experts", type=int, default=128, help="at most this many experts per shape")
    k.add_argument("--repeat", type=int, default=5)
    return p.parse_args(argv)


def load(model_dir, f: str, group: int, threads: int):
    """The engine of format `f`; int4-torch with the C int4 kernel refused, so torch's kernel runs."""
    from core.model.quant.experts import QuantExperts
    from core.runtime.engine import Engine

    from core.model.cpu import ffn

    real, takes = QuantExperts._native_ok, ffn.takes
    if f in TORCH_INT4:
        QuantExperts._native_ok = lambda self: False
    if f == "none-onednn":
        ffn.takes = lambda *a: False
    try:  # threads fixed: the engine's governor would follow the load
        return Engine.load(model_dir, dtype="bfloat16", **FORMATS[f], group_size=group, threads=threads)
    finally:
        QuantExperts._native_ok, ffn.takes = real, takes


def decode_rate(engine, batch: int, gen: int, prompt: str, clock: str = "wall") -> list[float]:
    """Decode tokens/s of each decode step of one generate() call: `batch` over the step's seconds — the
    engine's own step times (wall), or the CPU seconds this process spent from the end of one step to the
    end of the next (cpu; in CPU mode the steps run on this thread, and sampling and bookkeeping between
    steps count as the wall clock counts them). The median, not the mean: on a shared machine a few steps
    lose their caches to a neighbour, which CPU time still counts."""
    from core.runtime.engine import Request
    from core.telemetry import StepDone

    steps, cpu = [], [time.process_time()]

    def on_event(e):
        if isinstance(e, StepDone):
            now = time.process_time()
            if e.kind == "decode":
                steps.append(now - cpu[0] if clock == "cpu" else e.seconds)
            cpu[0] = now

    reqs = [Request(id=str(i), prompt=f"{prompt} {i}", max_new_tokens=gen) for i in range(batch)]
    for _ in engine.generate(reqs, batch_size=batch, micro_batch_size=batch, on_event=on_event):
        pass
    return [batch / t for t in steps]


def backend_crossover(spec, fmt_name: str, group: int, rows=(1, 4, 16, 32, 64, 96, 128, 192), reps: int = 5,
                      clock: str = "wall") -> dict:
    """Per expert: seconds of up + down for n routed tokens, on the kernel and by expanding into a scratch
    buffer then multiplying in bf16 — over one layer's worth of experts quantized like the engine's."""
    from core.model.quant.experts import ExpertScheme, QuantExperts
    from core.model.quant.formats import Format, quantize

    D, I, E = spec.hidden_size, spec.expert_intermediate, spec.num_experts
    fmt = Format(fmt_name, group if fmt_name == "int4" else 0)
    scheme = ExpertScheme.uniform(fmt, D, I)
    parts = {}
    for name, (n, k) in (("w13", (2 * I, D)), ("w2", (D, I))):
        for suffix, t in quantize(fmt, torch.randn(E, n, k) / k ** 0.5).items():
            parts[f"{name}.{suffix}"] = t
    backends = {}
    for name, native in (("kernel", True), ("torch-kernel", False)):
        kernel = QuantExperts(scheme, parts, torch.bfloat16)
        if not native:
            kernel._native_ok = lambda: False
        kernel.pack_cpu()
        kernel.kernel_rows = 10**9
        if native or fmt_name == "int4":  # int8 has one kernel, torch's
            backends[name] = kernel
    backends["expand"] = QuantExperts(scheme, parts, torch.bfloat16)
    out = {}
    for n in rows:
        x = torch.randn(n, D, dtype=torch.bfloat16)
        res = {}
        for name, q in backends.items():
            def run():
                for e in range(E):
                    h = q.up(e, x)
                    q.down(e, h[:, :I].contiguous())

            run()
            res[name] = min(_timed(run, clock) for _ in range(reps)) / E
        out[n] = res
    return out


def _timed(fn, clock: str = "wall") -> float:
    now = time.process_time if clock == "cpu" else time.perf_counter
    t = now()
    fn()
    return now() - t


SHAPES = {  # experts, top-k, hidden, expert intermediate
    "Qwen3-Next-80B-A3B": (512, 10, 2048, 512),
    "Qwen3.5-35B-A3B": (256, 8, 2048, 512),
    "DeepSeek-V2-Lite": (64, 6, 2048, 1408),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}


def expert_kernels(args) -> int:
    from core.model import expert_choice
    from core.model.moe import HAS_GROUPED_MM, can_pack, experts, pack_experts

    def best_of(fn) -> float:
        fn()
        return min(_timed(fn) for _ in range(args.repeat))

    dtype = getattr(torch, args.dtype)
    print(f"CPU: {common.cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), load {common.load_average()}, {args.dtype}, "
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
            loop = best_of(lambda: experts(h, w13, w2, wts, idx, grouped=False))
            grouped = best_of(lambda: experts(h, w13, w2, wts, idx, grouped=True)) if HAS_GROUPED_MM else float("nan")
            pk = best_of(lambda: experts(h, None, None, wts, idx, packed=packed)) if packed else float("nan")
            experts(h, w13, w2, wts, idx)  # what the engine would run: measured once for this shape
            pick = [c for key, c in expert_choice.chosen().items() if key[2:5] == (E, 2 * I, D)
                    and key[-1] == expert_choice.bucket(T)]
            print(f"{name:20s} {E:4d} {T:5d} {loop * 1e3:9.2f} {grouped * 1e3:11.2f} {pk * 1e3:10.2f} "
                  f"{loop / grouped:12.2f}x {pick[0] if pick else '-':>14s}")
        del w13, w2, packed
    return 0


def predicted(spec, batch: int, gen: int, prompt_len: int) -> float:
    from core.plan import planner
    from core.plan.hardware import resolve
    from core.plan.policy import Policy

    hw = resolve("local")
    pol = Policy(batch, batch, batch, attention_on="cpu", ffn_on="cpu")
    return planner.predict(pol, spec, hw, planner.Workload(prompt_len, gen)).decode_tokens_per_s


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.expert_kernels:
        return expert_kernels(args)
    torch.set_num_threads(args.threads)
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    dims = QUICK if args.quick else SIZES[args.size]
    gen = args.gen or (6 if args.quick else 24)
    rounds = args.rounds or (1 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",")]
    load_before = common.load_average()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mlight-quant-bench-"))
    os.environ.setdefault("MLIGHT_CACHE_DIR", str(work / "cache"))
    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        info = common.build_mixtral(model_dir, **dims, init_dtype=torch.bfloat16 if dims is LARGE else None)
        print(f"built {info['params'] / 1e6:.0f}M-parameter bf16 Mixtral-shaped checkpoint in {model_dir}", flush=True)
    from core.model.cpu import ffn, int4

    formats = ["none", *(f for f in args.formats.split(",") if f != "none")]
    engines, loads = {}, {}
    for f in formats:
        t = time.perf_counter()
        engines[f] = load(model_dir, f, args.group_size, args.threads)
        engines[f].eos_ids = set()
        loads[f] = time.perf_counter() - t
        gc.collect()
    prompt = "Compose an engaging travel blog post about a recent trip to Hawaii"
    prompt_len = len(engines["none"].prompt_token_ids(__import__("core.runtime.engine", fromlist=["Request"]).Request(
        id="p", prompt=prompt)))
    for f in formats:  # warm-up: first calls pay for page faults and kernel dispatch
        decode_rate(engines[f], 1, 2, prompt, clock)
    rates = {f: {b: [] for b in batches} for f in formats}  # per round: the median step's tokens/s
    best = {f: {b: 0.0 for b in batches} for f in formats}  # the fastest step of all rounds
    for r in range(rounds):
        for b in batches:
            for f in formats:
                steps = decode_rate(engines[f], b, gen, prompt, clock)
                rates[f][b].append(statistics.median(steps))
                best[f][b] = max(best[f][b], max(steps))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{f} B={b} {rates[f][b][-1]:.1f}" for b in batches for f in formats),
              flush=True)
    med = {f: {b: statistics.median(v) for b, v in bs.items()} for f, bs in rates.items()}
    bf16s = [f for f in BF16 if f in formats]
    # bf16's best here: per round the faster of its paths (paired), of the medians, of the best steps
    base_rounds = {b: [max(rs) for rs in zip(*(rates[f][b] for f in bf16s))] for b in batches}
    base_med = {b: max(med[f][b] for f in bf16s) for b in batches}
    base_best = {b: max(best[f][b] for f in bf16s) for b in batches}
    faster = {b: max(bf16s, key=lambda f: med[f][b]) for b in batches}
    paired = {f: {b: statistics.median(x / y for x, y in zip(rates[f][b], base_rounds[b])) for b in batches}
              for f in formats}
    cross = {} if args.skip_crossover else {
        f: backend_crossover(engines["none"].spec, f, args.group_size, clock=clock) for f in ("int8", "int4")}
    # the planner does not model --quantize-dense: its bf16 dense bytes (int4's prediction) bound it below
    pred = {f: {b: predicted(engines[f].spec, b, gen, prompt_len) for b in batches} for f in formats}
    report = {
        "cpu": platform.processor() or platform.machine(), "threads": args.threads, "clock": clock, "capability":
        torch.backends.cpu.get_cpu_capability(), "load_before": load_before, "load_after": common.load_average(),
        "model": dims, "params": engines["none"].spec.num_params, "group_size": args.group_size, "gen": gen,
        "rounds": rounds, "decode_tokens_per_s": rates, "median": med, "paired_ratio": paired, "best_step": best,
        "bf16_faster_path": faster, "bf16_best_median": base_med,
        "load_seconds": loads, "size": "quick" if args.quick else args.size,
        "backend_seconds_per_expert": cross, "predicted_decode_tokens_per_s": pred,
        "bf16_packed": engines["none"].weights.packed, "int4_kernel": int4.status(), "bf16_kernel": ffn.status(),
    }
    print()
    print(f"CPU {report['cpu']} ({report['capability']}), {args.threads} threads, {clock} clock, load {load_before} -> {report['load_after']}")
    print(f"model {dims} = {report['params'] / 1e6:.0f}M parameters; bf16 experts "
          f"{'prepacked' if report['bf16_packed'] else 'plain'} (fused kernel: {report['bf16_kernel']}); "
          f"int4 group {args.group_size}")
    print(f"int4 experts: {report['int4_kernel']}; int4-torch: torch's weight-only kernel")
    print("decode tok/s: the median of the rounds' median steps; best: the fastest step of all rounds")
    named = {b: faster[b].replace("none", "bf16") for b in batches}
    print(f"vs bf16: against bf16's faster path ({', '.join(f'B={b}: {named[b]}' for b in batches)}; "
          f"bf16 = the fused C expert kernel, bf16-onednn = oneDNN's GEMMs)")
    print("paired: the median over rounds of a round's tok/s over the bf16 round's (per round, the faster path)")
    print(f"{'B':>4} {'format':>10} {'decode tok/s':>13} {'vs bf16':>8} {'paired':>7} {'best step':>10} {'vs bf16':>8} "
          f"{'predicted':>10} {'pred. vs bf16':>14}")
    for b in batches:
        for f in formats:
            print(f"{b:>4} {f.replace('none', 'bf16'):>10} {med[f][b]:>13.2f} {med[f][b] / base_med[b]:>7.2f}x "
                  f"{paired[f][b]:>6.2f}x {best[f][b]:>10.2f} {best[f][b] / base_best[b]:>7.2f}x "
                  f"{pred[f][b]:>10.2f} {pred[f][b] / pred['none'][b]:>13.2f}x")
    print("(int4+d8's and int4+d4's predictions are int4's: the planner counts the dense weights in bf16)")
    print("\nper expert, up + down (ms): tokens  kernel (int4: mlight's C kernel where it runs)  torch's kernel  expand")
    for f, c in cross.items():
        for n, r in c.items():
            print(f"  {f:5s} {n:>5}  {r['kernel'] * 1e3:7.3f} {r.get('torch-kernel', r['kernel']) * 1e3:7.3f} "
                  f"{r['expand'] * 1e3:7.3f}")
    print(f"\nload seconds (first load quantizes and writes the cache): {json.dumps({k: round(v, 1) for k, v in loads.items()})}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
