"""A CPU-only decode step's tasks, measured beside what the planner prices them at (item 6 of issue 11).

Runs `mlight bench`'s workload (MT-Bench-like prompts of mean `--prompt-len`, `--requests`, `--gen-len`) in this
process at `--batch`/`--micro-batch` on this machine's calibrated costs (`mlight bench --calibrate` first, or the
uncalibrated model), takes every decode step of a full wave from the engine's step timeline, and prints per task
kind the median milliseconds a task against the HRM's price for the same policy (core.plan.hrm.decode_tasks, as
the planner calls it), then the step and the decode speed against the planner's, and each wave's prefill and decode
step beside the planner's (the full waves hold the longest prompts, a smaller last wave the shortest). `--cache-mib`
prices the same run again with the cost model's cache (CpuCosts.cache_bytes) at that size: what the weights'
cached/cold blend moves.

    python bench/task_prices.py --prompt-len 308 --batch 252 --micro-batch 36 --cache-mib 480 --cache-mib 64
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the built-in demo model)")
    p.add_argument("--prompt-len", type=int, default=77)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-mib", type=float, action="append", default=[],
                   help="also price the run with the cost model's cache at this many MiB (repeatable)")
    return p.parse_args(argv)


def measure(engine, reqs, batch: int, micro_batch: int) -> tuple[dict, float, float, list]:
    """({task kind: (tasks a step, median seconds a task)}, median seconds of a full-wave decode step, decode tokens/s
    over every decode step, and each wave's (requests, prefill seconds, decode steps, median seconds a decode step))
    of one run."""
    from core.runtime.calibrate_pieces import StepClock
    from core.telemetry import StepDone, task_spans

    per_kind = defaultdict(list)

    def each(e):
        if isinstance(e, StepDone) and e.kind == "decode" and e.active == min(batch, len(reqs)):
            secs, count = defaultdict(float), defaultdict(int)
            for t in task_spans(e):  # a copy: the executor refills its timing buffer next step
                secs[t.kind] += t.end - t.start
                count[t.kind] += 1
            for k in secs:
                per_kind[k].append((count[k], secs[k] / count[k]))

    sink = StepClock(engine, time.perf_counter, forward=each)
    list(engine.generate(reqs, batch_size=batch, micro_batch_size=micro_batch, on_event=sink))
    decode = [e for e in sink.steps if e.kind == "decode"]
    steps = [e.seconds for e in decode if e.active == min(batch, len(reqs))]
    kinds = {k: (xs[0][0], statistics.median(s for _, s in xs)) for k, xs in per_kind.items()}
    speed = sum(e.tokens for e in decode) / max(1e-9, sum(e.seconds for e in decode))
    waves = []  # a wave: its prefill step, then its decode steps (all its requests generate alike here)
    for e in sink.steps:
        if e.kind == "prefill":
            waves.append((e.active, e.seconds, []))
        elif waves:
            waves[-1][2].append(e.seconds)
    waves = [(n, pre, len(xs), statistics.median(xs) if xs else 0.0) for n, pre, xs in waves]
    return kinds, statistics.median(steps) if steps else 0.0, speed, waves


def priced(spec, hw, policy, work, cache_bytes: int | None = None):
    """(the planner's Prediction, {task kind: seconds a task of a full wave}) for `policy`, the cost model's cache at
    `cache_bytes` where given."""
    from core.plan import hrm
    from core.plan.planner import predict, waves_of

    real = hrm.effective_rates

    def rates(*a, **kw):
        r = real(*a, **kw)
        if cache_bytes is None or r.cpu_costs is None:
            return r
        return dataclasses.replace(r, cpu_costs=dataclasses.replace(r.cpu_costs, cache_bytes=cache_bytes))

    hrm.effective_rates = rates
    try:
        pred = predict(policy, spec, hw, work)
        _, work, _ = waves_of(policy, work)  # the full waves hold the longest prompts (the engine's order)
        tasks = hrm.decode_tasks(spec, rates(hw, spec.dtype, spec), batch=policy.batch_size,
                                 micro_batch=policy.micro_batch_size, expert_batch=policy.expert_batch_size,
                                 attention_on="cpu", ffn_on="cpu", gpu_weight_fraction=0.0, gpu_kv_fraction=0.0,
                                 context=work.decode_context, row_tokens=work.longest_prompt + work.gen_len,
                                 longest=work.micro_batch_context(policy.micro_batch_size))
    finally:
        hrm.effective_rates = real
    return pred, {k: t.seconds for k, t in tasks.items()}


def last_wave(spec, hw, policy, work):
    """The planner's prediction for the run's smaller last wave (its shortest prompts), None where it has none."""
    from core.plan import planner

    _, _, tail = planner.waves_of(policy, work)
    return planner.last_wave(policy, spec, hw, tail) if tail else None


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from core.io.workloads import build_prompts, target_lengths
    from core.model.demo import demo_model_dir
    from core.plan import hrm
    from app.commands.bench import policy_and_workload  # the policy and workload `mlight bench` predicts
    from core.plan.hardware import resolve
    from core.runtime.engine import Engine, Request

    engine = Engine.load(a.model or demo_model_dir(), threads=a.threads)
    try:
        longest = min(round(418 * a.prompt_len / 77), engine.context_length - a.gen_len - 1)
        prompts = build_prompts(engine.tokenizer, target_lengths(a.requests, mean=min(a.prompt_len, longest),
                                                                 max_len=longest))
        reqs = [Request(id=str(i), prompt=p, max_new_tokens=a.gen_len) for i, p in enumerate(prompts)]
        engine.eos_ids = set()  # full generations, as `mlight bench` measures
        kinds, step, speed, waves = measure(engine, reqs, a.batch, a.micro_batch)
        policy, work = policy_and_workload(engine, reqs, batch=a.batch, micro_batch=a.micro_batch, gen_len=a.gen_len)
        hw = resolve("local")
        costs = hrm.effective_rates(hw, engine.spec.dtype, engine.spec).cpu_costs
        pred, price = priced(engine.spec, hw, policy, work)
        last = last_wave(engine.spec, hw, policy, work)
    finally:
        engine.close()
    calibrated = bool(costs is not None and costs.measured)
    cache_mib = (costs.cache_bytes if costs else 0) / 2**20
    print(f"{Path(a.model).name if a.model else 'demo'}: {a.requests} requests, prompts {a.prompt_len}, "
          f"{policy.batch_size}/{policy.micro_batch_size}, {a.threads} threads; costs "
          f"{'calibrated' if calibrated else 'uncalibrated'}, cache {cache_mib:.0f} MiB")
    print(f"  {'task':10s} {'a step':>6s} {'measured ms':>12s} {'priced ms':>10s} {'ratio':>6s}")
    for k, (n, s) in sorted(kinds.items()):
        p = price.get(k, 0.0)
        print(f"  {k:10s} {n:6d} {s * 1e3:12.3f} {p * 1e3:10.3f} {s / p if p else float('nan'):6.2f}")
    print(f"  step {step * 1e3:.2f} ms measured, {pred.step_seconds * 1e3:.2f} priced; decode {speed:,.0f} tok/s "
          f"measured, {pred.decode_tokens_per_s:,.0f} predicted ({speed / pred.decode_tokens_per_s - 1:+.1%})")
    for i, (n, pre, count, dec) in enumerate(waves):
        p = pred if n == policy.batch_size else last if i == len(waves) - 1 else None
        priced_words = f" (priced {p.prefill_seconds:.3f} s and {p.step_seconds * 1e3:.2f} ms)" if p else ""
        print(f"  wave {i + 1}, {n} requests: prefill {pre:.3f} s, {count} decode steps of {dec * 1e3:.2f} ms"
              + priced_words)
    for mib in a.cache_mib:
        p2, _ = priced(engine.spec, hw, policy, work, int(mib * 2**20))
        print(f"  with the cache at {mib:g} MiB: step {p2.step_seconds * 1e3:.2f} ms priced, decode "
              f"{p2.decode_tokens_per_s:,.0f} tok/s predicted ({speed / p2.decode_tokens_per_s - 1:+.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
