"""Threads with a busy neighbour: the default thread count (the free cores, re-checked between steps)
against `--threads 1` and against all cores, each with and without a process spinning on one core.

One process, one model, one workload; each setting alternated over `--rounds` rounds and the median
kept, so the ratios compare like with like on a shared machine. The neighbour is a child process
that spins on the last core of our affinity mask (psutil pins it). Prints tokens/s, the ratios, the
thread count each run settled on, and the load average before and after.

    python bench/cpu_threads.py                         # the 784M-style model of cpu_vs_hf.py, small workload
    python bench/cpu_threads.py --quick                 # tiny model, seconds
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


class Neighbour:
    """A process spinning on one core (the last of ours) until closed."""

    def __init__(self, core: int):
        import psutil

        self.stop = mp.Event()
        self.proc = mp.Process(target=_spin, args=(self.stop,), daemon=True)
        self.proc.start()
        try:
            psutil.Process(self.proc.pid).cpu_affinity([core])
        except (AttributeError, OSError):  # no affinity here (macOS): it spins wherever it lands
            pass

    def close(self) -> None:
        self.stop.set()
        self.proc.join(5)


def run_once(engine, reqs, threads: int | None) -> tuple[float, int]:
    from core.model.cpu.threads import Governor

    engine.threads = Governor(fixed=threads)
    engine.threads.start()  # the first load reading, outside the timing
    t = time.perf_counter()
    tokens = sum(r.output_tokens for r in engine.generate(reqs, batch_size=len(reqs)))
    return tokens / (time.perf_counter() - t), engine.threads.threads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    import torch

    from core.model.cpu.threads import allowed_cores
    from core.runtime.engine import Engine, Request

    from bench.cpu_vs_hf import FULL, QUICK

    shape = dict(QUICK if a.quick else FULL)
    tmp = tempfile.TemporaryDirectory(prefix="mlight-threads-") if a.workdir is None else None
    work = Path(tmp.name) if tmp else a.workdir
    model = work / ("mixtral-quick" if a.quick else "mixtral-800m")
    if not (model / "config.json").is_file():
        common.build_mixtral(model, **shape)
    cores = allowed_cores()
    print(f"cpu_threads: torch {torch.__version__}, cores {cores}, load average {common.load_average()}", flush=True)
    if len(cores) < 2:
        print("needs at least two cores")
        return 1
    engine = Engine.load(model)
    engine.eos_ids = set()
    prompts = common.build_prompts(engine.tokenizer, common.target_lengths(a.requests, mean=40, max_len=120))
    reqs = [Request(id=str(i), prompt=t, max_new_tokens=a.new_tokens) for i, t in enumerate(prompts)]
    run_once(engine, reqs[:2], 1)  # warm-up
    settings = {"default": None, "threads 1": 1, f"threads {len(cores)}": len(cores)}
    results = {}
    for neighbour in (False, True):
        n = Neighbour(cores[-1]) if neighbour else None
        try:
            if n:
                time.sleep(2.5)  # let the governor's load reading see it
            runs = {k: [] for k in settings}
            chosen = {}
            for _ in range(a.rounds):
                for name, threads in settings.items():
                    tps, used = run_once(engine, reqs, threads)
                    runs[name].append(tps)
                    chosen[name] = used
            for name in settings:
                results[(neighbour, name)] = (statistics.median(runs[name]), chosen[name])
        finally:
            if n:
                n.close()
    for neighbour in (False, True):
        print(f"\n{'with' if neighbour else 'without'} a neighbour spinning on core {cores[-1]}:")
        base = results[(neighbour, "threads 1")][0]
        for name in settings:
            tps, used = results[(neighbour, name)]
            print(f"  {name:12} {tps:8.1f} tok/s  ({used} thread{'s' if used != 1 else ''})  {tps / base:5.2f}× threads 1")
    print(f"\nload average at the end: {common.load_average()}")
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
