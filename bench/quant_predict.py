"""The planner's CPU-only decode prediction at batch 1, term by term, against a measured run: quantized formats.

Builds bench/quant_cpu.py's model (`--size small|large`), loads it as bf16, int4, int4 with int8 dense
weights and int4 with int4 dense weights (`--quantize-dense`), and measures decode steps at batch 1 in
interleaved rounds, twice per round: as they run, and with the routed experts' compute stubbed out (a
zero output; routing, attention, norms, dense projections and the LM head still run), so that a step
splits into experts = step − rest. Beside each figure: what the HRM predicts for the same policy on
this machine's probed rates (`mlight hw`'s probe, run fresh in the work folder's cache) — the whole
step, the routed experts (layers × the ffn task) and the rest — and the int4/bf16 speed-up, predicted
and measured. Wall clock, median step of each round, median over rounds; run it on a quiet machine.

    python bench/quant_predict.py --threads 2 [--size small] [--rounds 5] [--gen 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.quant_cpu import SIZES  # noqa: E402

FORMATS = {"bf16": {}, "int4": dict(quantize="int4"), "int4+d8": dict(quantize="int4", quantize_dense="int8"),
           "int4+d4": dict(quantize="int4", quantize_dense=True)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="small")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def steps(engine, gen: int, prompt: str, stub: bool) -> list[float]:
    """Seconds of each decode step of one request (the engine's own step times)."""
    from core.runtime.engine import Request
    from core.telemetry import StepDone

    out = []
    real = engine.runner

    def runner(*a, **kw):
        r = real(*a, **kw)
        if stub:
            r._experts = lambda parts, h, *rest, **kw2: torch.zeros_like(h)
        return r

    engine.runner = runner
    try:
        for _ in engine.generate([Request(id="0", prompt=prompt, max_new_tokens=gen)], batch_size=1, micro_batch_size=1,
                                 on_event=lambda e: out.append(e.seconds) if isinstance(e, StepDone) and e.kind == "decode"
                                 else None):
            pass
    finally:
        engine.runner = real
    return out


def predicted(spec, prompt_len: int, gen: int) -> dict:
    """The HRM's step at batch 1 (CPU-only), and its split: the routed experts, and the rest."""
    from core.plan import hrm, planner
    from core.plan.hardware import resolve
    from core.plan.policy import Policy

    hw = resolve("local")
    w = planner.Workload(prompt_len, gen)
    pol = Policy(1, 1, 1, attention_on="cpu", ffn_on="cpu")
    pred = planner.predict(pol, spec, hw, w)
    r = planner._rates(hw, 1, spec)
    tasks = hrm.decode_tasks(spec, r, batch=1, micro_batch=1, expert_batch=1, attention_on="cpu", ffn_on="cpu",
                             gpu_weight_fraction=0.0, gpu_kv_fraction=0.0, context=w.decode_context,
                             row_tokens=w.longest_prompt + w.gen_len, longest=w.micro_batch_context(1))
    experts = spec.num_layers * (tasks["ffn"].seconds - r.cpu_costs.task_s)  # the stub keeps the task itself
    return {"step": pred.step_seconds, "experts": experts, "rest": pred.step_seconds - experts,
            "kernel_rates": dict(r.cpu_kernel_flops), "cpu_bw": r.cpu_bw}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mlight-quant-predict-"))
    os.environ.setdefault("MLIGHT_CACHE_DIR", str(work / "cache"))
    model_dir = work / f"model-{args.size}"
    dims = SIZES[args.size]
    if not (model_dir / "config.json").is_file():
        common.build_mixtral(model_dir, **dims, init_dtype=torch.bfloat16 if args.size == "large" else None)
    print(f"load {common.load_average()}; torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads", flush=True)
    from core.runtime.engine import Engine, Request

    engines = {f: Engine.load(model_dir, dtype="bfloat16", threads=args.threads, **kw) for f, kw in FORMATS.items()}
    for e in engines.values():
        e.eos_ids = set()
    prompt = "Compose an engaging travel blog post about a recent trip to Hawaii"
    prompt_len = len(engines["bf16"].prompt_token_ids(Request(id="p", prompt=prompt)))
    t0 = time.perf_counter()
    pred = {f: predicted(e.spec, prompt_len, args.gen) for f, e in engines.items()}  # probes on first use
    print(f"probe and predictions: {time.perf_counter() - t0:.1f} s; kernel rates (GFLOP/s) "
          + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in pred["int4"]["kernel_rates"].items())
          + f"; bandwidth {pred['int4']['cpu_bw'] / 1e9:.1f} GB/s", flush=True)
    for e in engines.values():  # warm-up
        steps(e, 4, prompt, False)
    runs = {f: {"step": [], "rest": []} for f in FORMATS}
    for r in range(args.rounds):
        for f, e in engines.items():
            runs[f]["step"].append(statistics.median(steps(e, args.gen, prompt, False)))
            runs[f]["rest"].append(statistics.median(steps(e, args.gen, prompt, True)))
        print(f"round {r + 1}: " + ", ".join(f"{f} {runs[f]['step'][-1] * 1e3:.2f}/{runs[f]['rest'][-1] * 1e3:.2f} ms"
                                              for f in FORMATS), flush=True)
    meas = {f: {"step": statistics.median(v["step"]), "rest": statistics.median(v["rest"])} for f, v in runs.items()}
    for m in meas.values():
        m["experts"] = m["step"] - m["rest"]
    print(f"\nload {common.load_average()}; ms per decode step at batch 1 (measured | predicted | predicted/measured)")
    print(f"{'format':>8} {'step':>24} {'experts':>24} {'rest':>24}   speed-up vs bf16 (measured, predicted)")
    for f in FORMATS:
        cells = [f"{meas[f][k] * 1e3:6.2f} | {pred[f][k] * 1e3:6.2f} | {pred[f][k] / meas[f][k]:4.2f}"
                 for k in ("step", "experts", "rest")]
        up = (meas["bf16"]["step"] / meas[f]["step"], pred["bf16"]["step"] / pred[f]["step"])
        print(f"{f:>8} " + " ".join(f"{c:>24}" for c in cells) + f"   {up[0]:.2f}x, {up[1]:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"measured": meas, "predicted": pred, "rounds": runs}, indent=1, default=str))
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
