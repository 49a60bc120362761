"""Per-task host cost of the executors, and per-op dispatch cost: the figures behind core.plan.hrm's
TASK_SECONDS and OP_SECONDS (the "host" bound that keeps the planner off tiny micro-batches).

Runs a real decode-step graph (core.runtime.schedule, CGOPipe, 4 layers × 16 micro-batches) whose
tasks do nothing, through the sequential executor (the baseline: a Python call per task), the
threaded executor, and the CUDA executor (over the real GPU when there is one, else over the
emulated device, whose stream threads make it dearer than CUDA's launches). Prints seconds per task
and the ratio to the baseline; then the cost of one small torch op from Python.

    python bench/task_overhead.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from core.runtime import schedule as sched  # noqa: E402
from core.runtime.executors import SequentialExecutor, ThreadedExecutor  # noqa: E402


def per_task(ex, tasks, steps: int) -> float:
    ex.run(tasks, lambda t: None)  # warm-up: threads started, events pooled
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        ex.run(tasks, lambda t: None)
        best = min(best, (time.perf_counter() - t0) / len(tasks))
    return best


def per_op(device: str, n: int = 2000) -> float:
    x = torch.ones(16, device=device)
    for _ in range(100):
        x.add_(1)
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    if device != "cpu":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    tasks = sched.decode_step("cgopipe", num_layers=4, num_micro_batches=16, pages_per_layer=16)
    out = {"cpu": _cpu_name(), "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
           "tasks_per_step": len(tasks)}
    out["sequential"] = per_task(SequentialExecutor(), tasks, args.steps)
    threaded = ThreadedExecutor(("gpu", "cpu_attn", "h2d", "d2h"))
    out["threaded"] = per_task(threaded, tasks, args.steps)
    threaded.close()
    from core.runtime.cuda_executor import CudaExecutor
    from core.runtime.device import resolve_device

    dev = resolve_device("cuda" if torch.cuda.is_available() else "emulated")
    cuda = CudaExecutor(dev)
    out["cuda_executor_on"] = dev.name
    out["cuda"] = per_task(cuda, tasks, args.steps)
    cuda.close()
    out["op_cpu"] = per_op("cpu")
    if torch.cuda.is_available():
        out["op_cuda"] = per_op("cuda")
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"CPU: {out['cpu']}; load {out['load']}; {len(tasks)} tasks per step")
    base = out["sequential"]
    for k in ("sequential", "threaded", "cuda"):
        extra = f" ({out['cuda_executor_on']})" if k == "cuda" else ""
        print(f"  {k:10} {out[k] * 1e6:8.1f} µs per empty task  {out[k] / base:6.1f}x sequential{extra}")
    print(f"  one small torch op from Python: {out['op_cpu'] * 1e6:.1f} µs on the CPU"
          + (f", {out['op_cuda'] * 1e6:.1f} µs on CUDA" if "op_cuda" in out else ""))
    return 0


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
