"""`mlight bench`: run a workload through one or all schedules and put measured next to predicted.

Measured from the engine's StepDone events, predicted by the planner for the same policy and --hardware."""

from __future__ import annotations

import json
import time

from core import platform
from core.plan.policy import SCHEDULES  # torch-free: `mlight bench --help` loads no torch
from core.telemetry import RESOURCES, ignore, with_gpu_keys


def add_parser(sub):
    from app.commands.run import EXECUTORS, _positive

    p = sub.add_parser("bench", help="measure schedules on a workload and compare with the planner's prediction",
                       description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the built-in demo model)")
    p.add_argument("--requests", type=_positive, default=32, metavar="R", help="requests in the workload (default: 32)")
    p.add_argument("--prompt-len", type=_positive, default=77, metavar="S",
                   help="average prompt length in tokens, with MT-Bench's spread (default: 77)")
    p.add_argument("--max-prompt-len", type=_positive, default=None, metavar="S",
                   help="longest prompt (default: MT-Bench's 418 scaled by --prompt-len / 77, capped by the model)")
    p.add_argument("--gen-len", type=_positive, default=32, metavar="N",
                   help="tokens to generate per request (default: 32)")
    p.add_argument("--batch", type=_positive, default=16, metavar="N", help="requests in flight (default: 16)")
    p.add_argument("--micro-batch", type=_positive, default=4, metavar="M",
                   help="requests per micro-batch (default: 4)")
    p.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="how a step's tasks run (default: cuda when a GPU is present, else sequential)")
    p.add_argument("--schedule", choices=("cpu", *SCHEDULES, "all"), default=None,
                   help="cpu: the CPU-only chain (the default without a GPU); all: cgopipe, s3 and s4 side by side "
                        "(the default with a GPU or a GPU --hardware; without a GPU the CPU stands in for the device)")
    p.add_argument("--pages", type=_positive, default=2, metavar="P",
                   help="pages per layer for streamed experts (default: 2)")
    p.add_argument("--resident-layers", type=int, default=None, metavar="L",
                   help="layers whose experts stay on the device (default: all on the CPU, none on a GPU run)")
    p.add_argument("--hardware", default="local", metavar="NAME",
                   help="hardware for the prediction: local or a preset name (default: local)")
    p.add_argument("--calibrate", action="store_true",
                   help="first measure this machine's CPU cost model on the model (about a minute) and cache it; "
                        "later plans and predictions on this machine use it")
    p.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="CPU threads (default: the cores other work leaves free)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: time by this process's CPU seconds (with --threads 1 on a shared machine: what a "
                        "quiet machine's wall clock would say) (default: wall)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--kernels", choices=("auto", "native", "torch"), default=None,
                   help="which kernels compute (as mlight run --kernels; sets MLIGHT_KERNELS)")
    return p


def run(args) -> int:
    from core.model.demo import demo_model_dir
    from core.runtime.engine import Engine, Request
    from core.io.workloads import build_prompts, target_lengths

    model = args.model or demo_model_dir()
    schedules = _schedules(args)
    load = platform.load_average()
    report = {"model": str(model), "runs": [], "load_average": " ".join(f"{x:.2f}" for x in load) if load else "n/a"}
    if args.calibrate:
        report["calibration"] = _calibrate(model, args)
    for name in schedules:
        engine = Engine.load(model, executor=args.executor, schedule=None if name == "cpu" else name,
                             pages_per_layer=args.pages, resident_layers=args.resident_layers, threads=args.threads)
        try:
            if not report["runs"]:
                longest = args.max_prompt_len or round(418 * args.prompt_len / 77)
                longest = min(longest, engine.context_length - args.gen_len - 1)
                lengths = target_lengths(args.requests, mean=min(args.prompt_len, longest), max_len=longest)
                prompts = build_prompts(engine.tokenizer, lengths)
            reqs = [Request(id=str(i), prompt=p, max_new_tokens=args.gen_len) for i, p in enumerate(prompts)]
            engine.eos_ids = set()  # random demo weights may emit EOS early; measure full generations
            report["runs"].append(_measure(engine, name, reqs, args))
        finally:
            engine.close()
    if args.json:
        print(json.dumps(with_gpu_keys(report), indent=2))  # "gpu" beside "compute", as these keys always read
    else:
        _print(report)
    return 0


def _calibrate(model, args) -> dict:
    """Fit the CPU cost model with a CPU-only engine of `model`; cache it for this machine."""
    from app.commands.run import _ProgressLine
    from core.plan import cpu_cost, cpu_history
    from core.plan.hardware import detect
    from core.runtime.calibrate import calibrate
    from core.runtime.engine import Engine

    engine = Engine.load(model, threads=args.threads)
    t0 = time.perf_counter()
    notes: dict = {}
    try:
        costs = calibrate(engine, lambda n, mean: _prompts(engine, n, mean), clock=_clock(args), notes=notes,
                          progress=ignore if args.json else _ProgressLine("bench"))
    finally:
        engine.close()
    hw = detect()
    path = cpu_cost.save(hw, costs)
    out = {"path": str(path), "seconds": time.perf_counter() - t0, "costs": costs.to_dict(), "run": notes,
           "this_calibration": costs.to_dict(), "history": cpu_history.behind(hw, engine.spec)}
    if not args.json:
        print(f"calibrated the CPU cost model ({costs.math} math, {costs.threads} thread"
              f"{'s' if costs.threads != 1 else ''}) in {out['seconds']:.0f} s, band ± {costs.band:.0%}: {path}")
    return out


def _prompts(engine, n: int, mean: int) -> list[str]:
    """n MT-Bench-like prompts of `mean` tokens on average for the calibration (another seed than the bench's)."""
    from core.io.workloads import build_prompts, target_lengths
    from core.runtime.calibrate import GEN

    cap = engine.context_length - GEN - 1
    return build_prompts(engine.tokenizer, target_lengths(n, mean=min(mean, cap), max_len=min(cap, mean * 418 // 77)),
                         seed=1)


def _clock(args):
    return time.process_time if args.clock == "cpu" else time.perf_counter


def _schedules(args) -> tuple[str, ...]:
    if args.schedule == "all":
        return SCHEDULES
    if args.schedule is not None:
        return (args.schedule,)
    import torch

    gpu_hw = args.hardware not in ("local",) and not args.hardware.lower().endswith(".json")
    return SCHEDULES if torch.cuda.is_available() or gpu_hw else ("cpu",)


def _measure(engine, name: str, reqs, args) -> dict:
    from core.runtime.calibrate import StepClock
    from core.runtime.fold_back import RunSums

    clock = _clock(args)
    meter = RunSums()
    sink = StepClock(engine, clock, forward=meter)
    t0 = clock()
    results = list(engine.generate(reqs, batch_size=args.batch, micro_batch_size=args.micro_batch, on_event=sink))
    wall = clock() - t0
    decode = [e for e in sink.steps if e.kind == "decode"]
    steps = max(1, len(decode))
    measured = {r: sum(e.busy.get(r, 0.0) for e in decode) / steps / engine.spec.num_layers for r in RESOURCES}
    out = {
        "schedule": name, "executor": engine.config.executor, "device": engine.config.device,
        "tokens": sum(r.output_tokens for r in results), "seconds": wall,
        "tokens_per_s": sum(r.output_tokens for r in results) / wall,
        "decode_tokens_per_s": sum(e.tokens for e in decode) / max(1e-9, sum(e.seconds for e in decode)),
        "layer_seconds": measured,
        "bytes_h2d_per_step": sum(e.bytes_h2d for e in decode) / steps,
        "bytes_d2h_per_step": sum(e.bytes_d2h for e in decode) / steps,
        "threads": engine.threads.threads, "cpu_math": engine.cpu.math, "clock": args.clock,
    }
    out["predicted"] = p = _predict(engine, name, args, reqs)
    if p:
        out["error"] = {"tokens_per_s": out["tokens_per_s"] / p["tokens_per_s"] - 1,
                        "decode_tokens_per_s": out["decode_tokens_per_s"] / p["decode_tokens_per_s"] - 1}
    if name == "cpu":  # this run joins the machine's history: the next prediction stands on it too
        from core.runtime.fold_back import fold_back

        out["folded_back"] = fold_back(engine, meter, min(args.micro_batch, args.batch))
    return out


def _predict(engine, name: str, args, reqs) -> dict | None:
    """The planner's prediction for the policy `engine` runs `reqs` with at --batch / --micro-batch."""
    from core.plan import cpu_history, hrm
    from core.plan.hardware import resolve
    from core.plan.planner import Workload, predict
    from core.plan.policy import Policy
    from core.runtime.simulate import simulate_decode

    c, L = engine.config, engine.spec.num_layers
    mu = min(args.micro_batch, args.batch)
    on_gpu = c.device == "cuda"
    resident = L if c.resident_layers is None else c.resident_layers
    policy = Policy(batch_size=max(mu, args.batch // mu * mu), micro_batch_size=mu,
                    expert_batch_size=mu * c.expert_group, attention_on=c.attention_on if on_gpu else "cpu",
                    ffn_on="gpu" if on_gpu else "cpu", gpu_weight_fraction=resident / L if on_gpu else 0.0,
                    pages_per_layer=args.pages)
    prompt_tokens = [len(engine.prompt_token_ids(r)) for r in reqs]
    work = Workload(prompt_len=round(sum(prompt_tokens) / len(prompt_tokens)), gen_len=args.gen_len,
                    max_prompt_len=max(prompt_tokens), num_requests=len(reqs))
    hw = resolve(args.hardware)
    pred = predict(policy, engine.spec, hw, work)
    sim = simulate_decode(engine.spec, hw, policy, work.decode_context, name if on_gpu else "cgopipe")
    out = {"hardware": hw.name, "calibrated": getattr(hrm.effective_rates(hw, engine.spec.dtype, engine.spec).cpu_costs, "measured", False),
           "tokens_per_s": pred.tokens_per_s, "decode_tokens_per_s": pred.decode_tokens_per_s,
           "layer_seconds": {r: pred.layer_seconds.get(r, 0.0) for r in RESOURCES},
           "simulated_step_seconds": sim.makespan, "bottleneck": pred.bottleneck,
           "bottleneck_text": pred.bottleneck_text}
    if not on_gpu:
        out.update(band=pred.band, history=cpu_history.behind(hw, engine.spec),
                   tokens_per_s_last_calibration_alone=pred.tokens_per_s)  # no history moves the model any more
    return out


def _labels(run: dict) -> dict[str, str]:
    """Row names for the resources: a CPU-only run has no GPU and no copies; a GPU schedule without one, the CPU's."""
    if run["device"] == "cuda":
        return {"compute": "gpu ms/layer", "cpu_attn": "cpu_attn ms/layer", "h2d": "h2d ms/layer", "d2h": "d2h ms/layer"}
    if run["schedule"] == "cpu":
        return {"compute": "CPU compute ms/layer", "cpu_attn": "CPU attention ms/layer"}
    return {"compute": "device (CPU) ms/layer", "cpu_attn": "CPU attention ms/layer", "h2d": "copy in ms/layer",
            "d2h": "copy out ms/layer"}


def _print(report: dict) -> None:
    from core.plan import cpu_history

    print(f"model: {report['model']}; load average {report['load_average']}")
    for r in report["runs"]:
        p = r["predicted"] or {}
        where = ("the CPU-only chain" if r["schedule"] == "cpu" else
                 f"schedule {r['schedule']}" + ("" if r["device"] == "cuda" else ", the CPU standing in for the GPU"))
        print(f"\n{r['schedule']} ({where}; {r['executor']} executor on {r['device']}, {r['threads']} CPU thread"
              f"{'s' if r['threads'] != 1 else ''}, {r['cpu_math']} math): {r['tokens']} tokens in {r['seconds']:.2f} s")
        print(f"  {'':24}{'measured':>12}{'predicted':>12}")
        print(f"  {'tokens/s end to end':24}{r['tokens_per_s']:12.1f}{p.get('tokens_per_s', float('nan')):12.1f}"
              + (f" ± {p['band']:.0%}" if p.get("band") else ""))
        print(f"  {'tokens/s decode':24}{r['decode_tokens_per_s']:12.1f}{p.get('decode_tokens_per_s', float('nan')):12.1f}")
        for res, label in _labels(r).items():
            m, q = r["layer_seconds"][res] * 1e3, p.get("layer_seconds", {}).get(res, float("nan")) * 1e3
            print(f"  {label:24}{m:12.3f}{q:12.3f}")
        if r["device"] == "cuda" or r["schedule"] != "cpu":
            what = "h2d / d2h" if r["device"] == "cuda" else "copied in / out"
            print(f"  {what} per step: {r['bytes_h2d_per_step'] / 1e6:.2f} / {r['bytes_d2h_per_step'] / 1e6:.2f} MB")
        print(f"  predicted bottleneck on {p.get('hardware', '?')}: {p.get('bottleneck_text') or p.get('bottleneck', '?')}")
        if "error" in r:
            e = r["error"]
            how = "calibrated" if p.get("calibrated") else "not calibrated: run `mlight bench --calibrate`"
            print(f"  prediction error: {e['tokens_per_s']:+.1%} end to end, {e['decode_tokens_per_s']:+.1%} in decode "
                  f"(measured vs predicted; {how})")
        words = cpu_history.spread_words(p.get("history") or {})
        if words:
            print(f"  predicted {p['tokens_per_s']:,.1f} tokens/s: {words}")
        if r.get("folded_back"):
            print(f"  this run joined the machine's history ({r['folded_back']['entries']} runs)")
