"""`mlight plan`: the policy the HRM planner picks for a model, a machine and a workload, or the cost of
a policy you give (`--policy`), with the prediction and the memory it uses."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from core.assets import config_presets
from core.errors import BudgetError, UsageError
from core.model.quant.formats import DEFAULT_INT4_GROUP, INT4_GROUPS, QUANTIZE_CHOICES
from core.telemetry import with_gpu_keys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="choose batch sizes and placement for a model on a machine",
        description="Search the batch size, micro-batch size, expert batch and where weights, KV cache, "
                    "attention and FFN live, for the highest predicted tokens/s that fits in memory.")
    p.add_argument("--model", required=True,
                   help="checkpoint folder, Hugging Face repo id already in the local cache, or preset "
                        f"({', '.join(config_presets())})")
    p.add_argument("--hardware", default="local",
                   help="'local' (detect + probe), a file from `mlight hw --json`, or a preset: t4, l4, a10g, rtx3090, rtx4090, a100-80g, h100, "
                        "2xt4, 4xt4, ... (default: local)")
    p.add_argument("--prompt-len", type=int, required=True, metavar="S", help="average prompt length in tokens")
    p.add_argument("--gen-len", type=int, required=True, metavar="N", help="tokens to generate per request")
    p.add_argument("--max-prompt-len", type=int, metavar="S", help="longest prompt (default: --prompt-len)")
    p.add_argument("--num-requests", type=int, metavar="R", help="number of requests (caps the batch size)")
    p.add_argument("--gpu-mem", type=float, metavar="GB", help="GPU memory budget, all GPUs (default: what is there)")
    p.add_argument("--cpu-mem", type=float, metavar="GB", help="CPU memory budget (default: what is there)")
    p.add_argument("--pcie-gbps", type=float, metavar="X", help="override the host↔device link, GB/s each way")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="expert weights: none (the checkpoint's dtype), int8, int4, or auto (the least lossy "
                        "format that fits the budget); the plan also shows the speed-up over none (default: none)")
    p.add_argument("--group-size", type=int, choices=INT4_GROUPS, default=None, metavar="G",
                   help=f"int4: weights per scale, one of {', '.join(map(str, INT4_GROUPS))} (default {DEFAULT_INT4_GROUP})")
    p.add_argument("--quantize-dense", nargs="?", const=True, choices=("int8", "int4"), default=None,
                   metavar="FORMAT", help="CPU-only mode: plan the attention projections and the LM head "
                        "quantized too, in FORMAT (int8 or int4; default: --quantize's), as `mlight run` takes it; "
                        "with --quantize auto on a machine without a GPU, auto considers them by itself")
    p.add_argument("--gpus", type=int, metavar="K",
                   help="plan for K GPUs of the machine, one tensor-parallel rank each (default: all it has); "
                        "with more than one, also predict the scaling from 1 to K")
    p.add_argument("--policy", metavar="JSON",
                   help="check and cost this policy instead of searching (a .json file or inline JSON)")
    p.add_argument("--simulate", action="store_true",
                   help="also replay one decode step under CGOPipe, S4 and S3 and report each timeline's use")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _load_policy(text: str):
    from core.plan.policy import Policy

    path = Path(text)
    try:
        raw = path.read_text(encoding="utf-8") if path.suffix == ".json" or path.is_file() else text
    except OSError as e:
        raise UsageError(f"cannot read policy file {path}: {e}", "give a readable .json file or inline JSON") from e
    try:
        return Policy.from_dict(json.loads(raw))
    except json.JSONDecodeError as e:
        raise UsageError(f"--policy is not valid JSON: {e}", "give a .json file or an inline JSON object") from e
    except (TypeError, ValueError) as e:
        raise UsageError(f"--policy is not a valid policy: {e}",
                         "fields: batch_size, micro_batch_size, expert_batch_size, attention_on, ffn_on, "
                         "gpu_weight_fraction, gpu_kv_fraction, pages_per_layer") from e


def run(args) -> int:
    from core.plan import cpu_history, planner
    from core.plan.hardware import resolve
    from core.plan.presets import resolve_spec

    model = resolve_spec(args.model)
    hw = resolve(args.hardware, pcie_gbps=args.pcie_gbps)
    if args.gpus is not None:
        from core.plan.parallel import with_gpus

        hw = with_gpus(hw, args.gpus)
    workload = planner.Workload(args.prompt_len, args.gen_len, args.max_prompt_len, args.num_requests)
    budget = planner.Budget.for_hardware(hw, args.gpu_mem, args.cpu_mem)
    t0 = time.perf_counter()
    choice = None
    if args.policy:
        from core.plan.quantize import spec_in_format

        if args.quantize == "auto":
            raise UsageError("--quantize auto chooses a format by planning; it cannot cost a given --policy",
                             "give --quantize none, int8 or int4 with --policy")
        if args.quantize_dense and args.quantize == "none":
            raise UsageError("--quantize-dense needs a format", "pass --quantize int8 or --quantize int4 with it")
        dense = args.quantize if args.quantize_dense is True else args.quantize_dense
        model = spec_in_format(model, args.quantize, dense, args.group_size)
        policy = _load_policy(args.policy)
        over = planner.validate(policy, model, hw, workload, budget)
        if over:
            raise BudgetError("the policy does not fit: " + "; ".join(str(o) for o in over),
                              "lower batch_size or the GPU fractions, or raise --gpu-mem / --cpu-mem")
        prediction = planner.predict(policy, model, hw, workload)
    else:
        from core.plan.quantize import choose

        choice = choose(model, hw, workload, budget, args.quantize, args.group_size, dense=args.quantize_dense)
        model, policy, prediction = choice.spec, choice.policy, choice.prediction
    seconds = time.perf_counter() - t0
    sims = _simulate(model, hw, policy, workload) if args.simulate else None
    scaling = _scaling(model, hw, workload, args) if hw.has_gpu and hw.gpu_count > 1 else None
    host = _host(model, hw, policy, prediction, workload) if policy.ffn_on == "gpu" else None
    unused = _gpu_unused(model, hw, workload, budget) if hw.has_gpu and policy.ffn_on == "cpu" else None
    history = cpu_history.behind(hw, model) if policy.ffn_on == "cpu" else None  # what backs a CPU-only prediction
    if args.json:
        out = {"policy": policy.to_dict(), "prediction": prediction.to_dict(), "plan_seconds": seconds, **(host or {})}
        extra = {"gpu_unused": unused, "quantize": choice and choice.to_dict(), "simulation": sims, "scaling": scaling}
        out.update((k, v) for k, v in extra.items() if v is not None)
        if history is not None:
            out["history"] = history
            out["cpu_speed"] = hw.cpu_speed
        print(json.dumps(with_gpu_keys(out)))  # "gpu" beside "compute", as these keys always read
    else:
        print(_human(args, model, hw, workload, budget, policy, prediction, seconds, sims, choice, scaling, host,
                     unused, history))
    return 0


def _host(model, hw, p, pred, workload) -> dict:
    """The host's share of a decode layer beside the link's and the GPU's, what it is made of; a first run's pinning."""
    from core.plan import hrm
    from core.plan.parallel import rank_view

    model, rank_hw, _ = rank_view(model, hw, None, p.tensor_parallel)
    r = hrm.effective_rates(rank_hw, model.dtype, model)
    tasks = hrm.decode_tasks(model, r, batch=p.batch_size, micro_batch=p.micro_batch_size,
                             expert_batch=p.expert_batch_size, attention_on=p.attention_on, ffn_on=p.ffn_on,
                             gpu_weight_fraction=p.gpu_weight_fraction, gpu_kv_fraction=p.gpu_kv_fraction,
                             context=workload.decode_context, pages=p.pages_per_layer)
    ffn = hrm.ffn_ops(model, r, p.expert_batch_size)
    ls = pred.layer_seconds
    layer = max(ls.values())
    generated = (workload.num_requests if workload.num_requests and workload.num_requests > p.batch_size
                 else p.batch_size) * workload.gen_len
    run = generated / pred.tokens_per_s
    pin = hrm.pin_seconds(pred.pinned_bytes, r)
    return {"host": {"layer_seconds": ls["host"], "share": ls["host"] / layer, "layer_time_seconds": layer,
                     "pcie_seconds": ls["h2d"], "compute_seconds": ls["compute"],
                     "tasks_per_layer": sum(c.per_layer for c in tasks.values()),
                     "ops_per_layer": sum(hrm.host_ops(tasks, ffn).values()),
                     "task_seconds": r.task_seconds, "op_seconds": r.op_seconds, "measured": r.host_measured,
                     "expert_path": hrm.expert_path(model, r, p.expert_batch_size), "ffn_ops": ffn},
            "first_run": {"pin_bytes": pred.pinned_bytes, "pin_seconds": pin, "pin_gbps": r.pin_bw / 1e9,
                          "pin_measured": bool(hw.pin_bw), "tokens_per_s": generated / (run + pin)}}


def _gpu_unused(model, hw, workload, budget) -> str:
    """Why a plan leaves the GPU unused: its smallest placement overfills a memory, or the CPU alone is faster."""
    from core.plan import planner
    from core.plan.policy import Policy

    smallest = Policy(batch_size=1, micro_batch_size=1, expert_batch_size=1, attention_on="cpu", ffn_on="gpu",
                      gpu_weight_fraction=0.0, gpu_kv_fraction=0.0, pages_per_layer=1)
    over = [o for o in planner.validate(smallest, model, hw, workload, budget) if o.where == "gpu"]
    if over:
        o = over[0]
        parts = ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in o.breakdown.items() if v >= 0.05e9)
        return (f"the smallest GPU plan (one request, every expert streamed) needs {_gb(o.needed)} ({parts}), "
                f"{_gb(o.limit)} usable; it needs --gpu-mem {o.needed / planner.GPU_USABLE / 1e9:.1f} or more")
    return "the CPU alone is predicted faster than any GPU placement that fits"


def _scaling(model, hw, workload, args) -> list[dict]:
    """The best plan on 1, 2, 4, … up to all of the machine's GPUs (the same host, fewer GPUs)."""
    from core.plan import planner
    from core.plan.parallel import with_gpus

    counts = sorted({k for k in (1, 2, 4, 8, 16) if k < hw.gpu_count} | {hw.gpu_count})
    rows = []
    for k in counts:
        machine = with_gpus(hw, k)
        budget = planner.Budget.for_hardware(machine, args.gpu_mem * k / hw.gpu_count if args.gpu_mem else None,
                                             args.cpu_mem)
        try:
            p, pred = planner.plan(model, machine, workload, budget)
            rows.append({"gpus": k, "tokens_per_s": pred.tokens_per_s, "batch_size": p.batch_size,
                         "bottleneck": pred.bottleneck})
        except BudgetError:
            rows.append({"gpus": k, "tokens_per_s": 0.0, "batch_size": 0, "bottleneck": "memory"})
    return rows


def _simulate(model, hw, policy, workload) -> dict:
    from core.plan.parallel import rank_view
    from core.runtime.schedule import SCHEDULES
    from core.runtime.simulate import simulate_decode

    model, hw, _ = rank_view(model, hw, None, policy.tensor_parallel)  # one rank's timeline
    tls = {name: simulate_decode(model, hw, policy, workload.decode_context, name) for name in SCHEDULES}
    return {name: {"step_seconds": tl.makespan, "decode_tokens_per_s": policy.batch_size / tl.makespan,
                   "utilization": tl.utilization} for name, tl in tls.items()}


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _format_lines(model, choice, asked: str) -> list[str]:
    """What the experts are stored as, why, and what it buys over the unquantized model."""
    if choice is None or (asked == "none" and model.expert_format == "none"):
        return []
    lines = [f"format    experts in {model.dtype} (not quantized)" if model.expert_format == "none"
             else f"format    experts in {model.expert_format}, {model.expert_bits:.2f} bits per weight"]
    if choice.dense:
        from core.model.quant.dense_spec import bits_per_weight

        lines.append(f"          dense weights in {model.dense_format}, {bits_per_weight(model):.2f} bits per weight "
                     "(attention projections and LM head, CPU-only mode)")
    lines.append(f"  why             {choice.why}")
    if choice.quantize != "none":
        lines.append(f"  vs {model.dtype:13s} " + (
            f"{choice.speedup:.2f}× the predicted tokens/s ({choice.baseline.tokens_per_s:,.1f} tokens/s unquantized)"
            if choice.baseline is not None else f"unquantized, the model does not fit this budget ({_short(choice.tried['none'])})"))
    return lines + [""]


def _short(reason: str) -> str:
    """'CPU memory: needs 89.16 GB but 51.20 GB is usable' out of a BudgetError's full text."""
    m = re.search(r"(\w+ memory): needs ([\d.]+ GB).*?but ([\d.]+ GB) is usable", reason)
    return f"{m.group(1)} needs {m.group(2)}, {m.group(3)} usable" if m else reason


def _cpu_math_line(hw, model) -> str:
    """What the CPU computes in for this model on this machine, at which rate (the one the HRM used)."""
    flops, math, measured = hw.cpu_flops_for(model.dtype)
    return (f"  CPU math          {math} for {model.dtype} weights at {flops / 1e9:,.0f} GFLOP/s "
            f"({'measured' if measured else 'estimate'})")


def _layer_line(p, pred) -> str:
    """One decode layer's time by resource; CPU-only, the "compute" resource's work runs on the CPU, nothing copied."""
    items = list(pred.layer_seconds.items())
    if p.ffn_on == "cpu":
        names = {"compute": "CPU dense layers + experts", "cpu_attn": "CPU attention"}
        items = [(names[k], v) for k, v in items if k in names]
    return "  decode layer      " + " | ".join(f"{'gpu' if k == 'compute' else k} {_ms(v)}" for k, v in items)


def _host_lines(host: dict | None) -> list[str]:
    if host is None:
        return []
    h, f = host["host"], host["first_run"]
    whose = "measured here" if h["measured"] else "the H200's, not measured here"
    lines = [f"  host share        {_ms(h['layer_seconds'])} of a {_ms(h['layer_time_seconds'])} layer "
             f"({h['share']:.0%}) beside PCIe {_ms(h['pcie_seconds'])} and GPU compute {_ms(h['compute_seconds'])}",
             f"{'':20}{h['tasks_per_layer']:,.0f} tasks and {h['ops_per_layer']:,.0f} torch ops a layer at "
             f"{h['task_seconds'] * 1e6:.0f} µs a task, {h['op_seconds'] * 1e6:.0f} µs an op ({whose}); experts on "
             f"the {h['expert_path']} path, {h['ffn_ops']:,.0f} ops an FFN task"]
    if f["pin_bytes"]:
        lines.append(f"  first run         {f['tokens_per_s']:,.1f} tokens/s: page-locking {_gb(f['pin_bytes'])} first "
                     f"takes {f['pin_seconds']:.1f} s at {f['pin_gbps']:.1f} GB/s "
                     f"({'measured here' if f['pin_measured'] else 'the H200'}'s); later runs of the loaded model "
                     "pay none")
    return lines


def _bottleneck_line(p, pred) -> str:
    """The bottleneck in words, with the figures it comes from (the layer's busy time on it, of the layer's)."""
    ls = pred.layer_seconds
    if p.ffn_on != "gpu" or pred.bottleneck not in ls:
        return f"  bottleneck        {pred.bottleneck_text}"
    layer = max(ls.values())
    if pred.bottleneck == "pipeline":
        idle = ls["pipeline"] - ls["h2d"]
        return (f"  bottleneck        {pred.bottleneck_text}: the link idles {_ms(idle)} of a {_ms(layer)} layer")
    return (f"  bottleneck        {pred.bottleneck_text}: busy {_ms(ls[pred.bottleneck])} of a {_ms(layer)} layer "
            f"({ls[pred.bottleneck] / layer:.0%})")


def _human(args, model, hw, workload, budget, p, pred, seconds, sims, choice=None, scaling=None, host=None,
           unused=None, history=None) -> str:
    from core.plan.cpu_history import spread_words
    from core.plan.planner import CPU_USABLE, GPU_USABLE

    gpu = f"{hw.gpu_count}× {hw.gpu_name} {hw.gpu_mem_bytes / 2**30:.0f} GiB" if hw.has_gpu else "no GPU"
    lines = [
        f"model     {args.model}: {model.architecture}, {model.num_params / 1e9:.1f}B parameters, "
        f"{_gb(model.total_bytes)} in {model.dtype}"
        + (f" with {model.expert_format} experts" if model.expert_format != "none" else ""),
        f"hardware  {hw.name}: {gpu}, {hw.cpu_cores} cores, {_gb(hw.cpu_mem_bytes)} RAM"
        + (f", link {hw.h2d_bw / 1e9:.1f} GB/s" + (f" ({hw.pcie})" if hw.pcie else "") if hw.has_gpu else ""),
        f"workload  prompts of {workload.prompt_len} tokens, {workload.gen_len} generated",
        "",
        *_format_lines(model, choice, args.quantize),
        "policy",
        f"  batch size        {p.batch_size} requests = {p.num_micro_batches} micro-batch"
        f"{'es' if p.num_micro_batches > 1 else ''} of {p.micro_batch_size}",
        f"  expert batch      {p.expert_batch_size} tokens"
        + (f" ({p.micro_batches_per_expert_batch} micro-batches meet at the experts)" if p.micro_batches_per_expert_batch > 1 else ""),
        f"  attention         {p.attention_on.upper()}" + (" (next to the KV cache)" if p.attention_on == "cpu" else
                                                          f", {p.gpu_kv_fraction:.0%} of the KV cache on the GPU"),
        *([f"  tensor parallel   {p.tensor_parallel} ranks, one per GPU; each holds 1/{p.tensor_parallel} of the heads "
           "and of every expert; sizes below are per rank"] if p.tensor_parallel > 1 else []),
        f"  MoE FFN           {p.ffn_on.upper()}" + (
            f", {p.gpu_weight_fraction:.1%} of expert weights resident, the rest streamed in "
            f"{p.pages_per_layer} pages per layer" if p.ffn_on == "gpu" else ""),
        _cpu_math_line(hw, model),
        "",
        "prediction",
        f"  end to end        {pred.tokens_per_s:,.1f} tokens/s" + (f" ± {pred.band:.0%}" if pred.band else "")
        + (f" ({words})" if (words := spread_words(history or {})) else ""),
        f"  decode            {pred.decode_tokens_per_s:,.1f} tokens/s ({pred.step_seconds:.2f} s per step)",
        f"  prefill           {pred.prefill_tokens_per_s:,.1f} prompt tokens/s ({pred.prefill_seconds:.1f} s per batch)",
        _bottleneck_line(p, pred),
        _layer_line(p, pred),
        *_host_lines(host),
        "",
        "memory",
        (f"  GPU  {_gb(pred.gpu_bytes)} of {_gb(budget.gpu_bytes * GPU_USABLE)} usable: "
         + ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in pred.gpu_breakdown.items() if v))
        if p.ffn_on == "gpu" else "  GPU  unused" + (f": {unused}" if unused else ""),
        f"  CPU  {_gb(pred.cpu_bytes)} of {_gb(budget.cpu_bytes * CPU_USABLE)} usable: "
        + ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in pred.cpu_breakdown.items() if v),
    ]
    if sims:
        lines += ["", "simulated decode step"]
        for name, s in sims.items():
            use = ", ".join(f"{k} {v:.0%}" for k, v in s["utilization"].items())
            lines.append(f"  {name:8s} {s['step_seconds']:.2f} s ({s['decode_tokens_per_s']:,.0f} tokens/s); busy: {use}")
    if scaling:
        base = scaling[0]["tokens_per_s"]
        lines += ["", "scaling (same host, tensor parallel over 1 … K GPUs)"]
        for row in scaling:
            ratio = f" ({row['tokens_per_s'] / base:.2f}× one GPU)" if base and row["tokens_per_s"] else ""
            lines.append(f"  {row['gpus']} GPU{'s' if row['gpus'] > 1 else ' '}  " + (
                f"{row['tokens_per_s']:,.1f} tokens/s, batch {row['batch_size']}{ratio}" if row["tokens_per_s"]
                else "does not fit"))
    lines += ["", f"planned in {seconds:.2f} s"]
    return "\n".join(lines)
