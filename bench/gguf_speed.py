"""GGUF Q8_0 experts on the CPU: decode tokens/s with the file's blocks computed natively vs expanded per use.

Issue 47: a quantized GGUF expert used to be expanded whole into a float buffer on every use
(core.model.quant.expand); now core.model.cpu.gguf_blocks' C kernel multiplies the file's blocks as they
are. This builds a random Mixtral-shaped checkpoint (bench.common.build_mixtral), writes it as a Q8_0 GGUF
with the `gguf` package's writer (tests/gguf_files.py: F32 norms and router, Q8_0 everything else), loads
it twice in one process and times decode of each in interleaved rounds (after, before, after, ...) at each
B, so that a shared machine's load hits both alike:
- after: the default path (the experts on the blocks kernel);
- before: the same engine with the kernel taken away from its experts (`QuantExperts.blocks` off and the
  expand threshold back to KERNEL_ROWS): the `gguf` branch's dispatch, which expanded every expert used.
Decode tokens/s per step from the engine's own StepDone events (bench/quant_cpu.decode_rate); printed: each
round's after/before ratio, their median and spread (min..max) — ratios, not absolute times, which a loaded
machine does not keep.

    python bench/gguf_speed.py                      # hidden 1024, I 2048, 4 layers, 8 experts; B = 1, 8, 32
    python bench/gguf_speed.py --threads 1 --rounds 5   # CPU-time clock: for a shared, loaded machine
    python bench/gguf_speed.py --quick              # a smoke run

`--kernel` times the blocks kernel's own two paths instead, on bench/cpu_vs_hf.py's FULL expert shapes (hidden
1024, intermediate 3840: gate/up [7680, 1024], down [1024, 3840]) in one process: "fp32" (each weight row
decoded to floats, fp32 FMAs) and "int8" (activations quantized per 32 values, integer dots: AVX-512 VNNI or
AVX2 `maddubs`; the K-quants' rows on their "int16" path, a scale a 256 values), at M activation rows and in
the fused one-token call (`moe`, another 2 of the 8 experts each call), interleaved (fp32, int8, fp32, ...);
each `linear` call takes the next expert's matrix, so that, as in a decode step, the weights come from memory
rather than cache; printed: G weights/s of each (median) and the int8/fp32 ratio per round, its median and
spread. `--paths` names other pairs: "token" is core.model.cpu.gguf_token's in-place kernel (`moe`, and
`linear` at one row, or for the K-quants with AVX-512 VNNI up to gguf_token.ROWS rows; elsewhere the format's
integer default).

    python bench/gguf_speed.py --kernel                                   # Q8_0 and Q4_K; M = 1..128; 1 and 2 threads
    python bench/gguf_speed.py --kernel --formats Q6_K --rows 1,8 --kernel-threads 1
    python bench/gguf_speed.py --kernel --formats Q4_K,Q5_K,Q6_K --paths int16,token --rows 1  # gguf_token's rows
    python bench/gguf_speed.py --kernel --formats Q4_K,Q6_K --paths main:int16,int16  # main's kernel vs this tree's
    python bench/gguf_speed.py --kernel --formats Q4_K,Q6_K --rows 1 --kernel-threads 1 --paths main:int16,token
    python bench/gguf_speed.py --kernel --formats Q4_K,Q6_K --rows 2,4,8 --kernel-threads 1 --paths main:int16,token
    python bench/gguf_speed.py --kernel --formats Q4_K --rows 1,2,4,8 --kernel-threads 1 --paths main:token,token
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.quant_cpu import decode_rate  # noqa: E402

MODEL = dict(hidden=1024, intermediate=2048, layers=4, heads=16, kv_heads=4, experts=8, top_k=2, vocab=4096)
QUICK = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, experts=8, top_k=2, vocab=1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--gen", type=int, default=None, help="tokens generated per request per round (default 16; 4 quick)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 1 quick)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="per-step seconds: this process's CPU time (default with --threads 1: a descheduled "
                        "thread's wall time is a neighbour's work) or the wall clock (default with more threads)")
    p.add_argument("--workdir", type=Path, default=None)
    k = p.add_argument_group("--kernel: the blocks kernel's int8 path against its fp32 path")
    k.add_argument("--kernel", action="store_true")
    k.add_argument("--formats", default="Q8_0,Q4_K")
    k.add_argument("--rows", default="1,8,32,64,128")
    k.add_argument("--kernel-threads", default="1,2")
    k.add_argument("--min-s", type=float, default=0.15, help="seconds each timing runs for at least")
    k.add_argument("--paths", default="fp32,int",
                   help="the two paths timed against each other, gguf_blocks.PATHS names; 'int' is `linear`'s "
                        "integer default for the format (int8, or the K-quants' own); REV:PATH takes the kernel "
                        "as git revision REV has it (built with this build's flags), e.g. main:int16,int16; "
                        "main:token,token: gguf_token's kernel as main has it against this tree's")
    return p.parse_args(argv)


D, I, E, TOP_K = 1024, 3840, 8, 2  # --kernel's shapes


def blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    from gguf_files import quantize

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(quantize(w, kind))).view(torch.uint8).reshape(n, -1)


def timed(fn, min_s: float, clock=time.perf_counter) -> float:
    """Seconds a call on `clock`, the best of batches run for at least min_s (wall) together."""
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_s:
        n, t0, w0 = 0, clock(), time.perf_counter()
        while n < 3 or time.perf_counter() - w0 < 0.02:
            fn()
            n += 1
        spent += time.perf_counter() - w0
        best = min(best, (clock() - t0) / n)
    return best


def compare(rounds: int, label: str, weights: int, run, args) -> None:
    """run(0) and run(1): --paths' first and second, interleaved; the ratio is the second's speed-up."""
    rates = ([], [])
    ratios = []
    for _ in range(rounds):
        t = [timed(lambda i=i: run(i), args.min_s, args.timer) for i in (0, 1)]
        for i in (0, 1):
            rates[i].append(weights / t[i] / 1e9)
        ratios.append(t[0] / t[1])
    print(f"| {label} | {statistics.median(rates[0]):.2f} | {statistics.median(rates[1]):.2f} | "
          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) |", flush=True)


def baseline_library(rev: str, lib):
    """The blocks kernel as git revision `rev` has it, built with `lib`'s flags (its PATHS numbered as then)."""
    from core.model.cpu import gguf_blocks, native

    src = Path(tempfile.mkdtemp()) / "gguf_matmul.c"
    src.write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:core/assets/kernels/gguf_matmul.c"],
                                   check=True, capture_output=True).stdout)
    flags = [f for f in lib.flags.split() if f != "-fopenmp"]
    built = native.compile_openmp(native._compiler(), ["-O3", "-shared", "-fPIC", *flags], src, f"gguf_matmul_{rev}")
    if isinstance(built, str):
        raise SystemExit(f"{rev}'s kernel did not build: {built}")
    return gguf_blocks._Lib(built, " ".join(flags))


def baseline_token(rev: str, lib):
    """core.model.cpu.gguf_token's kernel as git revision `rev` has it (gguf_token.c with that revision's
    gguf_matmul.c), built with `lib`'s flags."""
    from core.model.cpu import gguf_token, native

    where = Path(tempfile.mkdtemp())
    for name in ("gguf_token.c", "gguf_matmul.c"):
        (where / name).write_bytes(subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:core/assets/kernels/{name}"], check=True,
            capture_output=True).stdout)
    flags = [f for f in lib.flags.split() if f != "-fopenmp"]
    built = native.compile_openmp(native._compiler(), ["-O3", "-shared", "-fPIC", *flags], where / "gguf_token.c",
                                  f"gguf_token_{rev}")
    if isinstance(built, str):
        raise SystemExit(f"{rev}'s token kernel did not build: {built}")
    return gguf_token._Lib(built, " ".join(flags))


def kernel_paths(args) -> int:
    import itertools

    from core.model.cpu import gguf_blocks, gguf_token

    rounds = args.rounds or 5
    turn = itertools.count()
    lib = gguf_blocks.library()
    if lib is None:
        print(f"no kernel: {gguf_blocks.status()}")
        return 1
    first, second = args.paths.split(",")
    libs = [baseline_library(p.split(":")[0], lib) if ":" in p else lib for p in (first, second)]
    names = [p.split(":")[-1] for p in (first, second)]
    tlib = gguf_token.library()
    tlibs = [baseline_token(p.split(":")[0], tlib) if ":" in p and p.endswith(":token") and tlib is not None
             else tlib for p in (first, second)]

    def on(i: int):  # gguf_blocks' and gguf_token's calls on path i's libraries
        gguf_blocks.library = lambda: libs[i]
        gguf_token.library = lambda: tlibs[i]
        return i

    print(f"# {gguf_blocks.status()}; D {D}, I {I}; {rounds} interleaved rounds; clock: {args.clock or 'cpu at 1 thread, wall at more'}")
    print(f"| format, threads, call | {first} G weights/s | {second} G weights/s | "
          f"{second}/{first} speed-up: median (min..max) |")
    print("|---|---|---|---|")
    for kind in args.formats.split(","):
        w13 = torch.stack([blocks(kind, 2 * I, D, e) for e in range(E)])
        w2 = torch.stack([blocks(kind, D, I, 10 + e) for e in range(E)])
        g = torch.Generator().manual_seed(0)
        for threads in (int(t) for t in args.kernel_threads.split(",")):
            torch.set_num_threads(threads)
            # CPU time of the calling thread at one thread: on a shared box a descheduled thread's wall time is a
            # neighbour's work; with more threads the wall clock (their CPU time counts OpenMP's spinning)
            args.timer = time.thread_time if (args.clock or ("cpu" if threads == 1 else "wall")) == "cpu" and \
                threads == 1 else time.perf_counter
            x1 = torch.randn(1, D, generator=g).bfloat16()
            wts = torch.tensor([[0.6, 0.4]])
            integer = gguf_blocks.integer_path(kind)  # `linear`'s default for the format
            linear = [integer if p in ("int", "token") else p for p in names]
            # `moe` takes fp32 and int8 (the K-quants on int16)
            fused = [{"int": "int8", "int16": "int8", "int16_c": "int8_c"}.get(p, p) for p in linear]

            pairs = [torch.tensor([[e, (e + 3) % E]]) for e in range(E)]

            def moe(i):  # another pair of experts each call, as a decode step's tokens route
                ids = pairs[next(turn) % E]
                if names[on(i)] == "token":
                    return gguf_token.moe(x1, ids, wts, (kind, w13), (kind, w2))
                return gguf_blocks.moe(x1, ids, wts, (kind, w13), (kind, w2), path=fused[i])

            def dense(i, x, raw, y):
                if names[on(i)] == "token" and gguf_token.linear(kind, x, raw, y):
                    return y
                return gguf_blocks.linear(kind, x, raw, out=y, path=linear[i])

            compare(rounds, f"{kind}, {threads}, moe B=1", TOP_K * 3 * D * I, moe, args)
            for m in (int(r) for r in args.rows.split(",")):
                xu = torch.randn(m, D, generator=g).bfloat16()
                xd = torch.randn(m, I, generator=g).bfloat16()
                yu, yd = torch.empty(m, 2 * I, dtype=torch.bfloat16), torch.empty(m, D, dtype=torch.bfloat16)
                # the rows of every expert in turn: a decode step reads each matrix once, from memory, not cache
                compare(rounds, f"{kind}, {threads}, gate/up M={m}", 2 * I * D,
                        lambda i: dense(i, xu, w13[next(turn) % E], yu), args)
                compare(rounds, f"{kind}, {threads}, down M={m}", D * I,
                        lambda i: dense(i, xd, w2[next(turn) % E], yd), args)
    return 0


def without_kernel(engine):
    """`engine` with its GGUF experts expanded per use again (the `gguf` branch's path)."""
    from core.model.quant.formats import KERNEL_ROWS

    for lw in engine.weights.layers:
        if lw.quant is not None:
            lw.quant.blocks, lw.quant.kernel_rows = False, KERNEL_ROWS
    return engine


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.kernel:
        return kernel_paths(args)
    from core.runtime.engine import Engine
    from gguf_files import uniform, write_gguf

    shape = QUICK if args.quick else MODEL
    gen = args.gen or (4 if args.quick else 16)
    rounds = args.rounds or (1 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",")]
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        ckpt = work / "ckpt"
        common.build_mixtral(ckpt, **shape)
        path = write_gguf("mixtral", ckpt, work / "q8_0.gguf", uniform("Q8_0"))
        after = Engine.load(path, dtype="bfloat16", threads=args.threads)
        before = without_kernel(Engine.load(path, dtype="bfloat16", threads=args.threads))
        assert all(lw.quant.blocks for lw in after.weights.layers if lw.quant is not None), "kernel not in use"
        print(f"# {shape}, Q8_0 GGUF, {args.threads} threads ({clock} clock), {gen} tokens a request, {rounds} rounds; "
              f"load {common.load_average()}; {common.cpu_name()}")
        print("| B | before tok/s (median) | after tok/s (median) | after/before per round | median (min..max) |")
        print("|---|---|---|---|---|")
        for b in batches:
            rates = {"before": [], "after": []}
            ratios = []
            decode_rate(after, b, 2, "warm up")
            decode_rate(before, b, 2, "warm up")
            for _ in range(rounds):
                a = statistics.median(decode_rate(after, b, gen, "Tell me about", clock))
                z = statistics.median(decode_rate(before, b, gen, "Tell me about", clock))
                rates["after"].append(a)
                rates["before"].append(z)
                ratios.append(a / z)
            print(f"| {b} | {statistics.median(rates['before']):.1f} | {statistics.median(rates['after']):.1f} | "
                  f"{', '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}..{max(ratios):.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
