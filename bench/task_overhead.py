"""Per-task host cost of the executors, and per-op dispatch cost: the figures behind core.plan.hrm's
TASK_SECONDS and OP_SECONDS (the "host" bound that keeps the planner off tiny micro-batches).

Runs a real decode-step graph (core.runtime.schedule, CGOPipe, 4 layers × 16 micro-batches) whose
tasks do nothing, through the sequential executor (the baseline: a Python call per task), the
threaded executor, and the CUDA executor (over the real GPU when there is one, else over the
emulated device, whose stream threads make it dearer than CUDA's launches). Prints seconds per task
and the ratio to the baseline; then the cost of one small torch op from Python.

    python bench/task_overhead.py [--json]
    python bench/task_overhead.py --engines [--quick]   # the threaded executor vs the sequential engine
    python bench/task_overhead.py --bound MODEL [--batches 1,8] [--threads 2]   # bound calls vs the task graph

`--engines` runs, instead, what those costs add up to: the threaded CPU executor vs the sequential CPU engine
on the same model and workload. The threaded executor runs the CGOPipe graph with the dense work and the
attention on separate worker threads (experts resident, so no weight copies); the sequential engine runs the
plain CPU chain. Prints tokens/s of both and the ratio (target: threaded ≥ 0.9 × sequential on 2 cores),
alternating the two several times so that machine noise hits both alike: a Mixtral-shaped fp32 model and 48
requests, or with `--quick` the demo model (a smoke run).

`--bound MODEL` (a GGUF file or a checkpoint folder) times what the tasks' Python costs a decode step of one
micro-batch of B requests: the step as bound kernel calls (core.runtime.one_stream) vs the same step through the
task graph, two runners of one engine stepping alternately; prints median step times, the ratio and whether
every step's logits were equal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "tests"):  # tests/: the checkpoint builder of --engines
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from bench import common  # noqa: E402
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


def _each(fn, n: int) -> float:
    """Seconds per call of `fn`, best of three rounds of `n` calls."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def breakdown(dev, n: int = 500) -> dict:
    """What one stream task's host cost is made of, call by call, on `dev` (a core.runtime.device Device):
    the CUDA executor records a start and an end event, enters the stream to launch, makes the stream
    wait on another's event per cross-stream dependency, and copies with `dev.copy`; its stream threads
    launch while other Python threads launch too (one GIL). Seconds per call."""
    import threading

    s, other = dev.stream("a", compute=True), dev.stream("b")
    ev = dev.event(timing=True)
    x = dev.zeros(16, torch.float32)
    src = torch.ones(1024)
    dev.pin(src)
    dst = dev.empty(1024, torch.float32)
    out = {
        "event_record": _each(lambda: ev.record(s), n),
        "launch_noop": _each(lambda: dev.launch(s, lambda: None), n),
        "wait_event": _each(lambda: other.wait_event(ev), n),
        "launch_op": _each(lambda: dev.launch(s, lambda: x.add_(1)), n),
        "copy_4k": _each(lambda: dev.launch(other, lambda: dev.copy(dst, src)), n),
    }
    # the same op launched by four threads at once, as the executor's gpu, h2d, d2h and cpu_attn threads
    # do: the wall time per op over all of them against one thread alone shows what the GIL adds
    go = threading.Barrier(4)

    def worker():
        go.wait()
        for _ in range(n):
            dev.launch(s, lambda: x.add_(1))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        dev.launch(s, lambda: x.add_(1))
    for t in threads:
        t.join()
    out["launch_op_4_threads"] = (time.perf_counter() - t0) / (4 * n)
    dev.synchronize()
    dev.unpin(src)
    for st in (s, other):
        dev.release_stream(st)
    return out


def engines(a) -> int:
    import statistics

    from core.io.workloads import build_prompts, target_lengths
    from core.runtime.engine import Engine, Request

    if a.quick:
        from core.model.demo import demo_model_dir

        path, n, gen = demo_model_dir(), a.requests or 16, a.gen_len or 8
    else:
        import tempfile

        from checkpoints import make_checkpoint

        path = make_checkpoint("mixtral", Path(tempfile.mkdtemp()) / "m", hidden_size=512, intermediate_size=1408,
                               num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                               num_local_experts=8, max_position_embeddings=1024)
        n, gen = a.requests or 48, a.gen_len or 32
    seq = Engine.load(path, device="cpu")  # both on the CPU, even on a machine with a GPU
    thr = Engine.load(path, device="cpu", executor="threaded", schedule="cgopipe")
    prompts = build_prompts(seq.tokenizer, target_lengths(n, max_len=min(418, seq.context_length - gen - 1)))
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=gen) for i, p in enumerate(prompts)]
    for e in (seq, thr):
        e.eos_ids = set()
    for e in (seq, thr):  # warm up: first calls pay for allocator growth and kernel selection
        list(e.generate(reqs[: a.batch], batch_size=a.batch, micro_batch_size=a.micro_batch))
    rates = {"sequential": [], "threaded": []}
    outputs = {}
    for _ in range(a.rounds):
        for name, e in (("sequential", seq), ("threaded", thr)):
            t0 = time.perf_counter()
            res = list(e.generate(reqs, batch_size=a.batch, micro_batch_size=a.micro_batch))
            rates[name].append(sum(r.output_tokens for r in res) / (time.perf_counter() - t0))
            outputs[name] = {r.id: r.output_token_ids for r in res}
    thr.close()
    s, t = statistics.median(rates["sequential"]), statistics.median(rates["threaded"])
    print(f"model {path} · {n} requests × {gen} tokens · batch {a.batch}, micro-batch {a.micro_batch}")
    print(f"sequential {s:8.1f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in rates['sequential'])})")
    print(f"threaded   {t:8.1f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in rates['threaded'])})")
    print(f"ratio threaded / sequential: {t / s:.2f}   same tokens: {outputs['sequential'] == outputs['threaded']}")
    return 0


def bound(a) -> int:
    import statistics

    from core.runtime import one_stream
    from core.runtime.engine import Engine, Request

    engine = Engine.load(a.bound, threads=a.threads)
    print(f"model {a.bound} · {a.threads} threads · {a.steps_bound} steps each · {common.cpu_name()}")
    for B in (int(b) for b in a.batches.split(",")):
        ids = [engine.prompt_token_ids(Request(id=str(m), prompt="The quick brown fox jumps over the lazy dog"
                                               + " again" * m)) for m in range(B)]
        runs = []
        for on in (True, False):
            r = engine.runner(B, B, 512)
            if not on:
                r._one = {m: False for m in range(1, one_stream.MAX_ROWS + 1)}
            logits, _ = r.prefill(ids, list(range(B)), [list(range(B))])
            runs.append([r, logits.argmax(-1).tolist(), [len(x) for x in ids], [], []])
        why = one_stream.why_not(runs[0][0], B)
        for i in range(a.steps_bound):
            for run in (runs if i % 2 else runs[::-1]):
                r, toks, pos, times, outs = run
                t0 = time.perf_counter()
                logits, _ = r.decode([toks], [list(range(B))], [pos])
                times.append(time.perf_counter() - t0)
                outs.append(logits.clone())
                run[1:3] = [logits.argmax(-1).tolist(), [p + 1 for p in pos]]
        on, off = (statistics.median(run[3]) for run in runs)
        same = all(torch.equal(x, y) for x, y in zip(runs[0][4], runs[1][4]))
        print(f"B = {B}: bound {on * 1e3:.2f} ms, task graph {off * 1e3:.2f} ms a step: **{off / on:.3f}x**; "
              f"same logits: {same}" + (f" (bound calls not taken: {why})" if why else ""))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    e = p.add_argument_group("--engines: the threaded executor vs the sequential engine, end to end")
    e.add_argument("--engines", action="store_true", help="compare the two engines instead (see above)")
    e.add_argument("--quick", action="store_true", help="the demo model, a smoke run")
    e.add_argument("--requests", type=int, default=None)
    e.add_argument("--gen-len", type=int, default=None)
    e.add_argument("--batch", type=int, default=16)
    e.add_argument("--micro-batch", type=int, default=4)
    e.add_argument("--rounds", type=int, default=3)
    b = p.add_argument_group("--bound: a decode step as bound kernel calls vs through the task graph")
    b.add_argument("--bound", metavar="MODEL", help="a GGUF file or checkpoint folder (see above)")
    b.add_argument("--batches", default="1,8", help="requests a step, comma list")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--steps-bound", type=int, default=100, help="steps each way")
    args = p.parse_args(argv)
    if args.engines:
        return engines(args)
    if args.bound:
        return bound(args)
    tasks = sched.decode_step("cgopipe", num_layers=4, num_micro_batches=16, pages_per_layer=16)
    out = {"cpu": common.cpu_name(), "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
           "tasks_per_step": len(tasks)}
    out["sequential"] = per_task(SequentialExecutor(), tasks, args.steps)
    threaded = ThreadedExecutor(("compute", "cpu_attn", "h2d", "d2h"))
    out["threaded"] = per_task(threaded, tasks, args.steps)
    threaded.close()
    from core.runtime.cuda_executor import CudaExecutor
    from core.runtime.device import resolve_device

    dev = resolve_device("cuda" if torch.cuda.is_available() else "emulated")
    cuda = CudaExecutor(dev)
    out["cuda_executor_on"] = dev.name
    out["cuda"] = per_task(cuda, tasks, args.steps)
    cuda.close()
    out["breakdown"] = breakdown(dev)
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
    print(f"  per call on {dev.name}: " + ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in out["breakdown"].items()))
    print(f"  one small torch op from Python: {out['op_cpu'] * 1e6:.1f} µs on the CPU"
          + (f", {out['op_cuda'] * 1e6:.1f} µs on CUDA" if "op_cuda" in out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
