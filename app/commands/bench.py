"""`mlight bench`: run a workload through one or all schedules and put measured next to predicted.

Measured: tokens/s end to end and in decode, and each resource's busy seconds per decode layer,
from the engine's StepDone events. Predicted: the planner's HRM for the same policy on this
machine (`--hardware local`: detected and probed) or a preset, and the simulated step time.
"""

from __future__ import annotations

import json
import time

from core.telemetry import RESOURCES, StepDone

EXECUTORS = ("sequential", "threaded", "cuda")
SCHEDULES = ("cgopipe", "s3", "s4")  # core.runtime.engine.SCHEDULES, without importing torch for --help


def add_parser(sub):
    p = sub.add_parser("bench", help="measure schedules on a workload and compare with the planner's prediction")
    p.add_argument("--model", help="checkpoint folder (default: the built-in demo model)")
    p.add_argument("--requests", type=int, default=32, metavar="N", help="requests in the workload (default 32)")
    p.add_argument("--prompt-len", type=int, default=77, help="average prompt tokens (MT-Bench-like spread) (default: 77)")
    p.add_argument("--max-prompt-len", type=int, default=None, help="longest prompt (default: 418 capped by the model)")
    p.add_argument("--gen-len", type=int, default=32, help="tokens generated per request (default: 32)")
    p.add_argument("--batch", type=int, default=16, help="requests in flight (default: 16)")
    p.add_argument("--micro-batch", type=int, default=4, help="requests per micro-batch (default: 4)")
    p.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="how a step's tasks run (default: cuda when a GPU is present, else sequential)")
    p.add_argument("--schedule", choices=(*SCHEDULES, "all"), default="all",
                   help="one schedule, or all three side by side (default: all)")
    p.add_argument("--pages", type=int, default=2, help="pages per layer for streamed experts (default: 2)")
    p.add_argument("--resident-layers", type=int, default=None,
                   help="layers whose experts stay on the device (default: all on the CPU, none on a GPU run)")
    p.add_argument("--hardware", default="local", help="hardware for the prediction: local or a preset name (default: local)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def run(args) -> int:
    from core.model.demo import demo_model_dir
    from core.runtime.engine import Engine, Request
    from core.io.workloads import build_prompts, target_lengths

    model = args.model or demo_model_dir()
    schedules = SCHEDULES if args.schedule == "all" else (args.schedule,)
    report = {"model": str(model), "runs": []}
    for name in schedules:
        engine = Engine.load(model, executor=args.executor, schedule=name, pages_per_layer=args.pages,
                             resident_layers=args.resident_layers)
        try:
            if not report["runs"]:
                longest = min(args.max_prompt_len or 418, engine.context_length - args.gen_len - 1)
                lengths = target_lengths(args.requests, mean=min(args.prompt_len, longest), max_len=longest)
                prompts = build_prompts(engine.tokenizer, lengths)
            reqs = [Request(id=str(i), prompt=p, max_new_tokens=args.gen_len) for i, p in enumerate(prompts)]
            engine.eos_ids = set()  # random demo weights may emit EOS early; measure full generations
            report["runs"].append(_measure(engine, name, reqs, args))
        finally:
            engine.close()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


def _measure(engine: Engine, name: str, reqs, args) -> dict:
    events: list[StepDone] = []
    sink = lambda e: events.append(e) if isinstance(e, StepDone) else None  # noqa: E731
    t0 = time.perf_counter()
    results = list(engine.generate(reqs, batch_size=args.batch, micro_batch_size=args.micro_batch, on_event=sink))
    wall = time.perf_counter() - t0
    decode = [e for e in events if e.kind == "decode"]
    L = engine.spec.num_layers
    steps = max(1, len(decode))
    measured = {r: sum(e.busy.get(r, 0.0) for e in decode) / steps / L for r in RESOURCES}
    out = {
        "schedule": name, "executor": engine.config.executor, "device": engine.config.device,
        "tokens": sum(r.output_tokens for r in results), "seconds": wall,
        "tokens_per_s": sum(r.output_tokens for r in results) / wall,
        "decode_tokens_per_s": sum(e.tokens for e in decode) / max(1e-9, sum(e.seconds for e in decode)),
        "layer_seconds": measured,
        "bytes_h2d_per_step": sum(e.bytes_h2d for e in decode) / steps,
        "bytes_d2h_per_step": sum(e.bytes_d2h for e in decode) / steps,
    }
    out["predicted"] = _predict(engine, name, args, reqs)
    return out


def _predict(engine: Engine, name: str, args, reqs) -> dict | None:
    """The planner's view of the same policy on this machine (None when it cannot say)."""
    from core.plan.hardware import resolve
    from core.plan.planner import Workload, predict
    from core.plan.policy import Policy
    from core.runtime.simulate import simulate_decode

    c = engine.config
    mu = min(args.micro_batch, args.batch)
    n = max(mu, args.batch // mu * mu)
    on_gpu = c.device == "cuda"
    L = engine.spec.num_layers
    resident = L if c.resident_layers is None else c.resident_layers
    policy = Policy(batch_size=n, micro_batch_size=mu, expert_batch_size=mu * c.expert_group,
                    attention_on=c.attention_on if on_gpu else "cpu", ffn_on="gpu" if on_gpu else "cpu",
                    gpu_weight_fraction=resident / L if on_gpu else 0.0,
                    pages_per_layer=args.pages)
    hw = resolve(args.hardware)
    prompt_tokens = [len(engine.prompt_token_ids(r)) for r in reqs]
    work = Workload(prompt_len=round(sum(prompt_tokens) / len(prompt_tokens)), gen_len=args.gen_len,
                    max_prompt_len=max(prompt_tokens), num_requests=len(reqs))
    pred = predict(policy, engine.spec, hw, work)
    sim = simulate_decode(engine.spec, hw, policy, work.decode_context, name if on_gpu else "cgopipe")
    return {"hardware": hw.name, "tokens_per_s": pred.tokens_per_s, "decode_tokens_per_s": pred.decode_tokens_per_s,
            "layer_seconds": {r: pred.layer_seconds.get(r, 0.0) for r in RESOURCES},
            "simulated_step_seconds": sim.makespan, "bottleneck": pred.bottleneck}


def _print(report: dict) -> None:
    print(f"model: {report['model']}")
    for r in report["runs"]:
        p = r["predicted"] or {}
        print(f"\nschedule {r['schedule']} ({r['executor']} on {r['device']}): {r['tokens']} tokens in "
              f"{r['seconds']:.2f} s")
        print(f"  {'':22}{'measured':>12}{'predicted':>12}")
        print(f"  {'tokens/s end to end':22}{r['tokens_per_s']:12.1f}{p.get('tokens_per_s', float('nan')):12.1f}")
        print(f"  {'tokens/s decode':22}{r['decode_tokens_per_s']:12.1f}{p.get('decode_tokens_per_s', float('nan')):12.1f}")
        for res in RESOURCES:
            m, q = r["layer_seconds"][res] * 1e3, p.get("layer_seconds", {}).get(res, float("nan")) * 1e3
            print(f"  {res + ' ms/layer':22}{m:12.3f}{q:12.3f}")
        print(f"  h2d / d2h per step: {r['bytes_h2d_per_step'] / 1e6:.2f} / {r['bytes_d2h_per_step'] / 1e6:.2f} MB;"
              f" predicted bottleneck: {p.get('bottleneck', '?')} on {p.get('hardware', '?')}")
