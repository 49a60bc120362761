"""What a fresh process pays for its first large prefill call (CpuCosts.fresh_s), measured in a fresh process.

A user's `mlight run` or `mlight bench` is a fresh process, and its first large prefill may fault in memory that
its later calls reuse: the demo model's first call of 256 prompts (19,700 tokens) took 2.1 s against 0.9 s again
before its FFN ran in chunks (seventh session), and 0.92-1.08 s against 0.73-0.96 s after (two Zen 4 threads,
four fresh processes: from nothing to a third more; bench/RESULTS.md, issue 11, ninth session) — how much depends
on the machine's allocator and page faults. The calibrating process is not fresh by the time its large window runs
(the pieces and the small run came first), so what it measured of this stood for nothing a user's run pays. So
a child process loads the model as the calibration's engine was loaded, runs one short request (imports and
set-up, which wave_s covers), then the large window's prompts as one wave, and again, and reports the first
wave's prefill seconds and the later ones', and every wave's steps: the calibration takes them as more windows of
its run at the large micro-batch, the only ones run in a process as fresh as a user's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

# The child holds a second copy of the model beside the calibrating process's: only where memory has room for it
# with this margin (a model near the machine's memory measures nothing here; its fresh_s stays the in-process one)
ROOM = 2.0
TIMEOUT_S = 600.0
# The first wave is one sample; the warm reference the median of this many more (one alone moved fresh_s by
# 0-13 µs a token between three calibrations of the demo: a wave's prefill jitters ±0.2 s on a 2-core VM)
AGAIN = 2


def fresh_first_wave(engine, prompts: list[str], *, gen: int = 1, wall: bool = True,
                     timeout: float = TIMEOUT_S) -> dict | None:
    """{"first", "again": a wave's prefill seconds, "tokens": its prompt tokens, "waves": each wave's steps
    (calibrate.RunStep as dicts)} of `prompts`, each to `gen` tokens, as the first large wave of a fresh process
    running `engine`'s model and AGAIN more; None where the child cannot run (no room, it failed or ran past
    `timeout`: the calibration goes on without it)."""
    import psutil

    import core

    if not prompts or psutil.virtual_memory().available < ROOM * engine.spec.total_bytes:
        return None
    job = {"model": str(engine.model_dir), "threads": engine.threads.threads, "device": engine.config.device,
           "cpu_math": engine.cpu.math, "prompts": prompts, "wall": wall, "gen": gen}
    root = str(Path(core.__path__[0]).resolve().parent)  # the folder holding `core`: the child imports this copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    try:
        out = subprocess.run([sys.executable, "-m", "core.runtime.calibrate_fresh"], input=json.dumps(job),
                             capture_output=True, text=True, encoding="utf-8", timeout=timeout, env=env,
                             check=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None
    return got if got.get("tokens") else None


def _child(job: dict) -> dict:
    from core.runtime.calibrate import run_steps
    from core.runtime.engine import Engine

    engine = Engine.load(job["model"], device=job["device"], threads=job["threads"], cpu_math=job["cpu_math"])
    try:
        clock = time.perf_counter if job["wall"] else time.process_time
        prompts = job["prompts"]
        run_steps(engine, prompts[:1], batch=1, micro_batch=1, gen=2, clock=clock)  # set-up, not size: wave_s's
        waves, runs = [], []
        for _ in range(1 + AGAIN):
            steps = run_steps(engine, prompts, batch=len(prompts), micro_batch=len(prompts), gen=job.get("gen", 1),
                              clock=clock)
            pre = [s for s in steps if s.kind == "prefill"]
            waves.append((sum(s.tasks.get("prefill", 0.0) for s in pre), sum(sum(g) for s in pre for g in s.groups)))
            runs.append([dataclasses.asdict(s) for s in steps])
        return {"first": waves[0][0], "again": median(w for w, _ in waves[1:]), "tokens": waves[0][1], "waves": runs}
    finally:
        engine.close()


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.stdin.buffer.read().decode("utf-8")))))  # the parent writes UTF-8
