"""Measured against predicted, side by side: the CPU cost model's accuracy, and the machine's own noise first.

For each prompt length, the same `mlight bench --schedule cpu` run `--repeats` times, each in a fresh process:
measured tokens/s end to end, the prediction with its band ("≈ 596 tok/s ± 12 %"), their ratio, and whether the
run fell inside the band. The spread of the measured runs is the machine's run-to-run noise; an error inside it
says nothing about the model. `--calibrate` fits the cost model first (`mlight bench --calibrate`, timed).

    python bench/prediction.py                                   # the demo model, prompts of 77 and 231 tokens
    python bench/prediction.py --model 784m --requests 64        # the Mixtral-shaped 784M of bench/cpu_vs_hf.py
    python bench/prediction.py --repeats 5 --prompt-lens 77      # the noise of one run, five times
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder, or 784m (built once under --workdir); "
                                                 "default: the demo model")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "mlight-bench"))
    p.add_argument("--prompt-lens", default="77,231", help="mean prompt tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--calibrate", action="store_true", help="fit the CPU cost model first")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def model_dir(args) -> str | None:
    if args.model != "784m":
        return args.model
    from bench import common
    from bench.cpu_vs_hf import FULL

    out = Path(args.workdir) / "mixtral-784m"
    if not (out / "config.json").exists():
        common.build_mixtral(out, **FULL)
    return str(out)


def bench(args, model: str | None, prompt_len: int, calibrate: bool = False) -> dict:
    cmd = [sys.executable, "-m", "app.cli", "bench", "--schedule", "cpu", "--json", "--requests", str(args.requests),
           "--batch", str(args.batch), "--micro-batch", str(args.micro_batch), "--gen-len", str(args.gen_len),
           "--prompt-len", str(prompt_len), "--clock", args.clock]
    cmd += (["--model", model] if model else []) + (["--threads", str(args.threads)] if args.threads else [])
    cmd += ["--calibrate"] if calibrate else []
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = model_dir(args)
    report: dict = {"model": model or "demo", "rows": []}
    if args.calibrate:
        t = time.perf_counter()
        cal = bench(args, model, 77, calibrate=True)["calibration"]
        report["calibration"] = {"seconds": cal["seconds"], "wall_s": time.perf_counter() - t,
                                 "band": cal["costs"]["band"], "shapes": cal["run"].get("shapes")}
    for n in (int(x) for x in args.prompt_lens.split(",")):
        for i in range(args.repeats):
            run = bench(args, model, n)["runs"][0]
            p = run["predicted"]
            err = run["tokens_per_s"] / p["tokens_per_s"] - 1
            report["rows"].append({"prompt_len": n, "repeat": i, "measured": run["tokens_per_s"],
                                   "predicted": p["tokens_per_s"], "band": p.get("band", 0.0), "error": err,
                                   "inside": abs(err) <= p.get("band", 0.0)})
    rows = report["rows"]
    for n in sorted({r["prompt_len"] for r in rows}):
        got = [r["measured"] for r in rows if r["prompt_len"] == n]
        report.setdefault("noise", {})[n] = (max(got) - min(got)) / statistics.median(got) if len(got) > 1 else 0.0
    report["median_abs_error"] = statistics.median(abs(r["error"]) for r in rows)
    report["all_inside"] = all(r["inside"] for r in rows)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if "calibration" in report:
        c = report["calibration"]
        print(f"calibration: {c['seconds']:.0f} s, band ± {c['band']:.0%}")
    print(f"{'prompt':>6} {'run':>3} {'measured':>10} {'predicted':>18} {'ratio':>6}  inside")
    for r in rows:
        print(f"{r['prompt_len']:6d} {r['repeat']:3d} {r['measured']:10.1f} {r['predicted']:10.1f} ± {r['band']:4.0%}"
              f" {r['measured'] / r['predicted']:6.2f}  {'yes' if r['inside'] else 'NO'}")
    for n, v in report["noise"].items():
        print(f"noise at {n} tokens: the measured runs spread {v:.1%} of their median")
    print(f"median |error| {report['median_abs_error']:.1%}; every run inside its band: {report['all_inside']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
