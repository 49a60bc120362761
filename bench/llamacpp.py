"""mlight vs llama.cpp on the same GGUF file: decode, prefill and end-to-end tokens/s at B sequences.

Issue 47's side-by-side as a script anyone can rerun. It
1. finds llama.cpp: `--llama-dir` or $LLAMA_CPP_DIR (a source tree with `convert_hf_to_gguf.py` and a build
   holding `llama-batched-bench` and `llama-quantize`), else builds the tree vendored in the
   `llama-cpp-python` sdist (pip's cache or `pip download --no-binary :all: --no-deps llama-cpp-python`) with
   cmake and GGML_NATIVE=ON into `--cache` — about 15 minutes on 2 busy cores; without cmake, a C++ compiler
   or the sdist it says how to get them and exits 2;
2. builds the random Mixtral-shaped checkpoint of bench/cpu_vs_hf.py (784M; `--size quick`: 8M) and converts
   it with llama.cpp's own tools: `convert_hf_to_gguf.py` (bf16), then `llama-quantize` (Q8_0, Q4_K_M);
3. per repetition and format, interleaved: `llama-batched-bench -npp P -ntg G -npl B...` and mlight
   (`Engine.generate` on the same file, B requests of exactly P prompt tokens and G new tokens, batch B),
   the same threads for both, each loaded afresh every repetition;
4. prints per format and B: each system's median decode / prefill / end-to-end tokens/s and mlight's ratio
   to llama.cpp, median (min..max) over the repetitions.

Rates are llama-batched-bench's own definitions: prefill B·P / prefill seconds, decode B·G / decode seconds
(mlight: its decode steps, the first token coming from the prefill), end-to-end B·(P + G) / wall seconds.
Not part of CI (it builds a C++ project).

    python bench/llamacpp.py                        # 784M; bf16, Q8_0, Q4_K_M; B = 1, 8, 32, 64; 2 reps
    python bench/llamacpp.py --size quick --batches 1,8 --reps 1    # a smoke run
    LLAMA_CPP_DIR=~/llama.cpp python bench/llamacpp.py --threads 4
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOOLS = ("llama-batched-bench", "llama-quantize")
FORMATS = ("bf16", "Q8_0", "Q4_K_M")
SDIST = "llama-cpp-python"
HOW = ("llama.cpp not found. Either point LLAMA_CPP_DIR (or --llama-dir) at a llama.cpp source tree built with\n"
       "  cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-batched-bench llama-quantize\n"
       "or install cmake and a C++ compiler (e.g. `apt-get install cmake g++`) and let this script build the tree\n"
       "vendored in the llama-cpp-python sdist (`pip download --no-binary :all: --no-deps llama-cpp-python`).")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("full", "quick"), default="full",
                   help="full: the 784M checkpoint of bench/cpu_vs_hf.py; quick: an 8M one (a smoke run)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    p.add_argument("--batches", default="1,8,32,64", help="sequences B, comma list")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens a sequence (P)")
    p.add_argument("--gen", type=int, default=64, help="new tokens a sequence (G)")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions (at least 2 for a spread)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both systems")
    p.add_argument("--llama-dir", type=Path, default=None, help="llama.cpp source tree (default $LLAMA_CPP_DIR)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "mlight-bench" / "llamacpp",
                   help="where the sdist is built and the checkpoints kept between runs")
    a = p.parse_args(argv)
    a.formats = [f for f in a.formats.split(",") if f]
    bad = [f for f in a.formats if f not in FORMATS]
    if bad:
        p.error(f"unknown format {bad[0]!r}: choose from {', '.join(FORMATS)}")
    a.batches = [int(b) for b in a.batches.split(",") if b]
    if a.reps < 1 or a.prompt < 1 or a.gen < 2 or any(b < 1 for b in a.batches):
        p.error("need --reps >= 1, --prompt >= 1, --gen >= 2 and every B >= 1")
    return a


# ---- llama.cpp: find or build ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    src: Path  # the source tree: convert_hf_to_gguf.py, gguf-py
    bin: Path  # the built tools

    def tool(self, name: str) -> str:
        return str(self.bin / name)


def find_tools(tree: Path) -> Path | None:
    """The folder under `tree` holding every tool of TOOLS (build/bin, or the tree itself), else None."""
    for d in (tree / "build" / "bin", tree / "bin", tree):
        if all((d / t).is_file() and os.access(d / t, os.X_OK) for t in TOOLS):
            return d
    return None


def find_llama(args) -> LlamaCpp | str:
    """The llama.cpp to run, or why there is none (with how to get one)."""
    tree = args.llama_dir or (Path(os.environ["LLAMA_CPP_DIR"]) if os.environ.get("LLAMA_CPP_DIR") else None)
    if tree is not None:
        tools = find_tools(tree)
        if tools is None or not (tree / "convert_hf_to_gguf.py").is_file():
            return f"{tree} has no convert_hf_to_gguf.py or no built {', '.join(TOOLS)}\n{HOW}"
        return LlamaCpp(tree, tools)
    return build_vendored(args.cache)


def build_vendored(cache: Path) -> LlamaCpp | str:
    """llama.cpp from the llama-cpp-python sdist, built once into `cache`."""
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler")
    if missing:
        return f"no {' or '.join(missing)}\n{HOW}"
    cache.mkdir(parents=True, exist_ok=True)
    trees = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not trees:
        sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            print(f"# downloading the {SDIST} sdist into {cache}", flush=True)
            # pip builds the sdist's metadata: in an isolated env first (fetches scikit-build-core), else
            # in this one (offline machines that have it installed)
            for isolation in ([], ["--no-build-isolation"]):
                r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                                    *isolation, SDIST, "-d", str(cache)], capture_output=True, text=True)
                if r.returncode == 0:
                    break
            sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
            if not sdists:
                return f"pip could not download the {SDIST} sdist: {r.stderr.strip()[-400:]}\n{HOW}"
        subprocess.run(["tar", "xzf", str(sdists[-1]), "-C", str(cache)], check=True)
        trees = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
        if not trees:
            return f"{sdists[-1].name} has no vendor/llama.cpp\n{HOW}"
    tree = trees[-1]
    if find_tools(tree) is None:
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        cfg = ["cmake", "-S", str(tree), "-B", str(tree / "build"), *gen, "-DCMAKE_BUILD_TYPE=Release",
               "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
        build = ["cmake", "--build", str(tree / "build"), "-j", str(os.cpu_count() or 1), "--target", *TOOLS]
        print(f"# building llama.cpp ({tree}); minutes", flush=True)
        for cmd in (cfg, build):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                return f"`{' '.join(cmd)}` failed:\n{(r.stdout + r.stderr)[-1500:]}\n{HOW}"
    tools = find_tools(tree)
    return LlamaCpp(tree, tools) if tools else f"the build of {tree} made no {', '.join(TOOLS)}\n{HOW}"


def llama_commit(output: str) -> str:
    """The commit a llama.cpp tool's log names ("build: 1 (0c1e570)" or "commit: 0c1e570"), else "?"."""
    m = re.search(r"build: \d+ \((\w+)\)|commit\W+(\w{7,})", output)
    return (m.group(1) or m.group(2)) if m else "?"


# ---- checkpoint and conversions -------------------------------------------------------------------------
def checkpoint(size: str, cache: Path) -> Path:
    from bench import common
    from bench.cpu_vs_hf import FULL, QUICK

    out = cache / f"mixtral-{size}"
    if not (out / "config.json").is_file():
        print(f"# building the {size} checkpoint in {out}", flush=True)
        common.build_mixtral(out, **(FULL if size == "full" else QUICK))
    return out


# llama.cpp's converter as it is, with two stand-ins for what the random checkpoint lacks: its BPE tokenizer
# (core.model.demo) has a pre-tokenizer hash llama.cpp does not list, so it gets llama.cpp's "default" one
# (llama-batched-bench feeds token ids, never text: speed is unaffected); and the converter imports
# sentencepiece before it looks for a tokenizer.model this checkpoint does not have.
CONVERT = """
import importlib.machinery, importlib.util, runpy, sys, types
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
if importlib.util.find_spec("sentencepiece") is None:
    sp = sys.modules["sentencepiece"] = types.ModuleType("sentencepiece")
    sp.__spec__, sp.SentencePieceProcessor = importlib.machinery.ModuleSpec("sentencepiece", None), None
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(ll: LlamaCpp, ckpt: Path, fmt: str) -> Path:
    """The checkpoint as a GGUF file in `fmt`, made by llama.cpp's own converter and quantizer (kept)."""
    bf16 = ckpt / "model-bf16.gguf"
    if not bf16.is_file():
        _run([sys.executable, "-c", CONVERT, str(ll.src), str(ckpt), "--outtype", "bf16", "--outfile", str(bf16)])
    if fmt == "bf16":
        return bf16
    out = ckpt / f"model-{fmt}.gguf"
    if not out.is_file():
        _run([ll.tool("llama-quantize"), str(bf16), str(out), fmt])
    return out


def _run(cmd, **kw) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
    return r.stdout + r.stderr


# ---- the runs -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rates:
    """tokens/s of one run at one B."""
    prefill: float
    decode: float
    total: float


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                  r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*$")


def parse_batched_bench(text: str) -> dict[int, Rates]:
    """llama-batched-bench's table ("| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |")
    -> {B: Rates(S_PP, S_TG, S)}."""
    out = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m:
            out[int(m.group(3))] = Rates(float(m.group(6)), float(m.group(8)), float(m.group(10)))
    return out


def run_llama(ll: LlamaCpp, gguf: Path, args) -> dict[int, Rates]:
    ctx = (args.prompt + args.gen) * max(args.batches) + 64
    cmd = [ll.tool("llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(args.prompt), "-ntg", str(args.gen), "-npl", ",".join(map(str, args.batches)),
           "-t", str(args.threads), "-tb", str(args.threads)]
    for _ in range(2):  # on a loaded VM it has exited 0 once without its table: one more try before giving up
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode or parse_batched_bench(r.stdout + r.stderr):
            break
    if r.returncode == -signal.SIGILL:
        raise SystemExit(f"llama-batched-bench died of an illegal instruction: a GGML_NATIVE build uses what the CPU "
                         f"advertises, and a VM may advertise AMX without granting its state. Rebuild {ll.src} with "
                         f"GGML_NATIVE=OFF and the ISA named (-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON "
                         f"-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON ..., AMX off) and pass it as --llama-dir")
    if r.returncode:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
    got = parse_batched_bench(r.stdout + r.stderr)
    if set(got) != set(args.batches):
        raise SystemExit(f"llama-batched-bench printed rows for B = {sorted(got)}, not {args.batches}")
    run_llama.commit = llama_commit(r.stdout + r.stderr)
    if run_llama.commit == "?":  # recent builds name their commit only when asked
        v = subprocess.run([cmd[0], "--version"], capture_output=True, text=True)
        run_llama.commit = llama_commit(v.stdout + v.stderr)
    return got


def prompts(engine, n: int, length: int) -> list[str]:
    """n distinct prompts of exactly `length` tokens for this tokenizer (BOS included where it adds one)."""
    words = ["the", "a", "model", "of", "experts", "runs", "on", "every", "core", "and", "token", "fast", "file"]
    out = []
    for i in range(n):
        text, j = f"{i}", 0
        while len(engine.tokenizer(text).input_ids) < length:
            cand = f"{text} {words[(i + j) % len(words)]}"
            j += 1
            if len(engine.tokenizer(cand).input_ids) <= length:
                text = cand
            elif j > 10 * length:
                raise SystemExit(f"cannot make a {length}-token prompt with this tokenizer")
        out.append(text)
    return out


def run_mlight(engine, b: int, args) -> Rates:
    from core.runtime.engine import Request
    from core.telemetry import StepDone

    texts = engine._bench_prompts[:b]
    secs = {"prefill": 0.0, "decode": 0.0}
    steps = {"prefill": 0, "decode": 0}

    def on_event(e):
        if isinstance(e, StepDone):
            secs[e.kind] += e.seconds
            steps[e.kind] += 1

    reqs = [Request(id=str(i), prompt=t, max_new_tokens=args.gen) for i, t in enumerate(texts)]
    t0 = time.perf_counter()
    made = sum(len(r.output_token_ids) for r in engine.generate(reqs, batch_size=b, micro_batch_size=b,
                                                                on_event=on_event))
    wall = time.perf_counter() - t0
    if made != b * args.gen:
        raise SystemExit(f"mlight made {made} tokens, not {b * args.gen} (stopped early?)")
    return Rates(b * args.prompt / secs["prefill"], b * steps["decode"] / secs["decode"],
                 b * (args.prompt + args.gen) / wall)


def load_mlight(path: Path, args):
    from core.runtime.engine import Engine

    engine = Engine.load(path, threads=args.threads)
    engine._bench_prompts = prompts(engine, max(args.batches), args.prompt)
    warm = argparse.Namespace(**{**vars(args), "gen": 2})
    run_mlight(engine, 1, warm)  # the kernels built and the buffers made before any timing
    return engine


# ---- report ---------------------------------------------------------------------------------------------
def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"


def table(fmt: str, batches, ours: dict[int, list[Rates]], theirs: dict[int, list[Rates]]) -> str:
    lines = [f"### {fmt}", "",
             "| B | decode mlight / llama.cpp tok/s | decode ratio | prefill mlight / llama.cpp | prefill ratio | "
             "end-to-end mlight / llama.cpp | e2e ratio |", "|---|---|---|---|---|---|---|"]
    for b in batches:
        cells = [str(b)]
        for field in ("decode", "prefill", "total"):
            o = [getattr(r, field) for r in ours[b]]
            t = [getattr(r, field) for r in theirs[b]]
            cells.append(f"{statistics.median(o):.1f} / {statistics.median(t):.1f}")
            cells.append(spread([x / y for x, y in zip(o, t)]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    ll = find_llama(args)
    if isinstance(ll, str):
        print(ll, file=sys.stderr)
        return 2
    import torch

    from bench import common

    torch.set_num_threads(args.threads)
    ckpt = checkpoint(args.size, args.cache)
    files = {f: convert(ll, ckpt, f) for f in args.formats}
    print(f"# mlight vs llama.cpp ({ll.bin}); {args.size} checkpoint; {args.threads} threads both; "
          f"P = {args.prompt}, G = {args.gen}; {args.reps} interleaved reps, medians (min..max of the per-rep "
          f"ratios); {common.cpu_name()}; load {common.load_average()}", flush=True)
    ours = {f: {b: [] for b in args.batches} for f in args.formats}
    theirs = {f: {b: [] for b in args.batches} for f in args.formats}
    for rep in range(args.reps):
        for f in args.formats:
            got = run_llama(ll, files[f], args)
            for b in args.batches:
                theirs[f][b].append(got[b])
            # loaded afresh each rep, as llama.cpp starts afresh: one process's luck (whether this box's two vCPUs
            # share a core or sit apart changes between processes) then weighs on one rep, not on all
            engine = load_mlight(files[f], args)
            for b in args.batches:
                ours[f][b].append(run_mlight(engine, b, args))
            del engine
            gc.collect()
            print(f"# rep {rep + 1} {f}: " + ", ".join(
                f"B={b} decode {ours[f][b][-1].decode:.1f}/{theirs[f][b][-1].decode:.1f}" for b in args.batches),
                flush=True)
    print(f"\n# llama.cpp commit {getattr(run_llama, 'commit', '?')}")
    for f in args.formats:
        print()
        print(table(f"{f} ({files[f].stat().st_size / 1e6:.0f} MB)", args.batches, ours[f], theirs[f]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
