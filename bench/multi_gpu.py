"""The multi-GPU stage of bench/gpu_check.py (`--multi-gpu`): tensor-parallel scaling over this
machine's GPUs, measured beside the planner's prediction, and the all-reduce cost the planner assumes.

For K = 1, 2, 4 (up to the GPUs present) it runs `mlight run --tensor-parallel K` on the stage-(b)
model under a per-GPU memory cap, through the real launcher, and reads tokens/s from the results;
the planner predicts the same runs with `plan(..., ranks=K)`. It also times one NCCL all-reduce of a
decode micro-batch's hidden states (the planner's ALLREDUCE_LATENCY). On one GPU it says so and
skips; `--dry-run` runs K = 1, 2 as gloo ranks on the CPU with tiny sizes, to prove the stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def _all_reduce_probe(rank: int, size: int, store: str, hidden: int, out) -> None:
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    dev = "cuda" if cuda else "cpu"
    rows = {}
    for tokens in (32, 256, 2048):
        t = torch.ones(tokens, hidden, dtype=torch.bfloat16 if cuda else torch.float32, device=dev)
        for _ in range(3):
            dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize()
        rows[tokens] = (time.perf_counter() - t0) / 20
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def all_reduce_seconds(size: int, hidden: int, work: Path) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    store = work / f"ar-store-{size}"
    store.unlink(missing_ok=True)
    procs = [ctx.Process(target=_all_reduce_probe, args=(r, size, str(store), hidden, q)) for r in range(size)]
    for p in procs:
        p.start()
    rows = q.get()
    for p in procs:
        p.join(timeout=60)
    return {str(k): v for k, v in rows.items()}


def _prompts(path: Path, tokenizer_dir: Path, n: int) -> Path:
    from transformers import AutoTokenizer

    from core.io.workloads import build_prompts, target_lengths

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    prompts = build_prompts(tok, target_lengths(n, max_len=418))
    path.write_text("\n".join(json.dumps({"id": str(i), "prompt": p}) for i, p in enumerate(prompts)) + "\n",
                    encoding="utf-8")
    return path


def multi_gpu(args, work: Path, model: Path, log) -> dict:
    gpus = torch.cuda.device_count() if not args.dry_run else 2
    if gpus < 2:
        log("multi-GPU: this machine has one GPU; the tensor-parallel scaling needs two or more — skipped")
        return {"skipped": f"{gpus} GPU"}
    from core.model.families import load_spec
    from core.plan import planner
    from core.plan.hardware import resolve
    from core.plan.parallel import with_gpus

    spec = load_spec(model)
    prompts = _prompts(work / "tp_prompts.jsonl", model, args.requests)
    hw = resolve("local")
    cap = args.caps[0]
    rows = []
    for k in [k for k in (1, 2, 4, 8) if k <= gpus]:
        row = {"gpus": k}
        if hw.has_gpu:
            machine = with_gpus(hw, k)
            budget = planner.Budget.for_hardware(machine, cap * k, None)
            try:
                _, pred = planner.plan(spec, machine, planner.Workload(77, args.gen_len, 418, args.requests), budget)
                row["predicted_tokens_per_s"] = pred.tokens_per_s
            except Exception as e:  # a prediction that cannot be made is reported, not fatal
                row["predicted_error"] = str(e)[:200]
        out = work / f"tp{k}.jsonl"
        cmd = [sys.executable, "-m", "app.cli", "run", "--model", str(model), "--prompts", str(prompts), "--out",
               str(out), "--max-new-tokens", str(args.gen_len), "--restart", "--tensor-parallel", str(k)]
        if not args.dry_run:
            cmd += ["--gpu-mem", str(cap)]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=1800)
        secs = time.perf_counter() - t0
        if p.returncode:
            row["error"] = p.stderr.strip().splitlines()[-1][:300] if p.stderr.strip() else f"exit {p.returncode}"
        else:
            recs = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
            row["tokens_per_s"] = sum(r["output_tokens"] for r in recs) / secs  # start-up included: end to end
            row["tokens"] = [r["output_token_ids"] for r in recs]
        if k > 1:
            row["all_reduce_s"] = all_reduce_seconds(k, spec.hidden_size, work)
        log(f"multi-GPU: {k} rank{'s' if k > 1 else ''}: {row.get('tokens_per_s', float('nan')):.1f} tok/s "
            f"(predicted {row.get('predicted_tokens_per_s', float('nan')):.1f}) {row.get('error', '')}")
        rows.append(row)
    same = [r for r in rows if "tokens" in r]
    base = same[0]["tokens"] if same else None
    for r in same:
        r["same_tokens_as_1"] = r.pop("tokens") == base
    return {"rows": rows}


def table_lines(stage: dict) -> list[str]:
    if "skipped" in stage:
        return [f"(d) multi-GPU: skipped ({stage['skipped']})"]
    lines = ["(d) GPUs    tok/s  predicted  same tokens as 1  all-reduce of 32 tokens"]
    for r in stage["rows"]:
        ar = r.get("all_reduce_s", {}).get("32")
        tail = f"  error: {r['error'][:50]}" if "error" in r else (f"  {ar * 1e6:.0f} µs" if ar else "")
        lines.append(f"    {r['gpus']:4d} {r.get('tokens_per_s', float('nan')):8.1f} "
                     f"{r.get('predicted_tokens_per_s', float('nan')):10.1f} {str(r.get('same_tokens_as_1', '-')):>17}{tail}")
    return lines
