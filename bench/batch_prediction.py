"""Predicted vs measured tokens/s of CPU-only runs at the planner's own batch, after one calibration (issue 11 item 6).

`mlight bench --calibrate` measures the machine at the calibration's batch (16 requests, micro-batches of 4),
but a user's CPU-only `mlight run` runs at the batch the planner picks for the workload — micro-batches
16-100x larger, prefill calls of tens of thousands of tokens. For each model and checkout: a fresh cache, one
`mlight bench --calibrate`; then each run (`mlight bench --batch B --micro-batch M`, its own process) starts
from a copy of that calibrated cache, so every prediction is exactly "after one calibration" (no run folds
into the next one's). Prints each run's error (measured / predicted − 1) end to end and in decode, and the
run's tasks against the prediction per kind (`folded_back.ratios`: compute, attention, prefill — the model's
shape, apart from the machine's speed, which moves all of them at once).

    python bench/batch_prediction.py --threads 2 --model /path/to/mixtral-800m --requests 256 --shape plan --shape 256/64
    python bench/batch_prediction.py ... --checkout before=/path/to/old/checkout --checkout after=

`--shape plan`: the batch and micro-batch `mlight plan` picks for that workload on this machine (after the
calibration, with --num-requests = --requests); `B/M`: given. `--checkout`: as in bench/prediction_error.py,
the sides interleaved run by run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402
from prediction_error import MLIGHT, bandwidth  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=None, help="checkpoint folder, or 'demo' (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", default="256",
                   help="requests of each workload, one for all or one per --prompt-lens entry (default 256)")
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--prompt-lens", default="77,308", help="workloads' mean prompt tokens (default 77,308)")
    p.add_argument("--shape", action="append", default=None, metavar="B/M|plan",
                   help="batch/micro-batch of the runs, or 'plan' (mlight plan's choice) (repeatable; default plan)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--checkout", action="append", default=None, metavar="NAME=DIR",
                   help="run mlight from DIR (PYTHONPATH; empty: this checkout) as NAME; several: A/B, interleaved")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    return p.parse_args(argv)


def mlight(args, command: str, extra: list[str], env: dict) -> dict:
    cmd = [sys.executable, "-c", MLIGHT, command, *extra, "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()).stdout
    return json.loads(out)


def longest(prompt_len: int) -> int:
    return round(418 * prompt_len / 77)  # as `mlight bench` spreads its prompts


def requests(args, n: int) -> int:
    """The requests of the workload of mean prompt `n`."""
    lens = [int(x) for x in args.prompt_lens.split(",")]
    got = [int(x) for x in str(args.requests).split(",")]
    return got[lens.index(n)] if len(got) == len(lens) else got[0]


def planned(args, model_args: list[str], n: int, env: dict) -> tuple[int, int]:
    """(batch, micro-batch) `mlight plan` picks for the workload on this machine."""
    if not model_args:  # the demo: plan has no default model
        from core.model.demo import demo_model_dir

        model_args = ["--model", str(demo_model_dir())]
    p = mlight(args, "plan", [*model_args, "--prompt-len", str(n), "--max-prompt-len", str(longest(n)),
                              "--gen-len", str(args.gen_len), "--num-requests", str(requests(args, n))], env)["policy"]
    return p["batch_size"], p["micro_batch_size"]


def run_once(args, model_args, n: int, shape: tuple[int, int], side: dict) -> dict:
    """One `mlight bench` at `shape` from a copy of the side's calibrated cache (its fold-back lands in the copy)."""
    cache = Path(tempfile.mkdtemp(prefix="mlight-batch-"))
    shutil.copytree(side["cache"], cache, dirs_exist_ok=True)
    env = {**side["env"], "MLIGHT_CACHE_DIR": str(cache)}
    try:
        r = mlight(args, "bench", [*model_args, "--prompt-len", str(n), "--requests", str(requests(args, n)),
                                   "--gen-len", str(args.gen_len), "--batch", str(shape[0]), "--micro-batch",
                                   str(shape[1]), "--threads", str(args.threads)], env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    (run,) = r["runs"]
    p = run["predicted"]
    return {"measured": run["tokens_per_s"], "predicted": p["tokens_per_s"], "error": run["error"]["tokens_per_s"],
            "cpu_speed": p.get("cpu_speed"),
            "decode_measured": run["decode_tokens_per_s"], "decode_predicted": p["decode_tokens_per_s"],
            "decode_error": run["error"]["decode_tokens_per_s"], "seconds": run["seconds"],
            "ratios": (run.get("folded_back") or {}).get("ratios", {}), "load": r["load_average"], "time": time.time()}


def probe_words(f: dict) -> str:
    """The speed probe's reading before the run against the calibration's, and the run's error had the prediction
    not been scaled by it (CpuCosts.at_speed): which of the two the probe helped."""
    sp = f.get("cpu_speed") or {}
    if not (sp.get("now") and sp.get("calibrated")):
        return ""
    r = sp["now"] / sp["calibrated"]
    return f"probe {r:.2f}x the calibration's (unscaled {f['measured'] * r / f['predicted'] - 1:+.1%}); "


def main(argv=None) -> int:
    args = parse_args(argv)
    models = args.model or ["demo"]
    lens = [int(x) for x in args.prompt_lens.split(",")]
    shapes = args.shape or ["plan"]
    sides = dict(x.split("=", 1) for x in args.checkout) if args.checkout else {"this checkout": ""}
    print(f"bench batch_prediction: {args.threads} threads, requests {args.requests} of {args.gen_len} tokens, "
          f"load average {common.load_average()}, mlight from {sides}", flush=True)
    out = {"command": "python bench/batch_prediction.py " + " ".join(sys.argv[1:] if argv is None else argv), "models": {}}
    for model in models:
        margs = [] if model == "demo" else ["--model", model]
        rows = {}
        for side, path in sides.items():  # one calibration each, in its own cache
            cache = Path(tempfile.mkdtemp(prefix="mlight-batchcal-"))
            env = {**os.environ, "MLIGHT_CACHE_DIR": str(cache), **({"PYTHONPATH": path} if path else {})}
            t = time.perf_counter()
            cal = mlight(args, "bench", [*margs, "--calibrate", "--threads", str(args.threads)], env)
            c = cal["calibration"]
            run = cal["runs"][0]
            rows[side] = {"env": env, "cache": cache, "calibration_seconds": time.perf_counter() - t,
                          "factors": c["run"].get("factors", {}), "costs": c["costs"],
                          "large": c["run"].get("large", {}), "mid": c["run"].get("mid", {}),
                          "speed": c["run"].get("speed"), "prefill_attention": c["run"].get("prefill_attention"),
                          "at_calibration_batch": run["error"]["tokens_per_s"],
                          "shapes": {(s, n): (planned(args, margs, n, env) if s == "plan" else
                                              tuple(min(int(x), requests(args, n)) for x in s.split("/")))
                                     for s in shapes for n in lens},
                          "runs": {}}
            r = rows[side]
            print(f"\n{model} [{side}]: calibrated in {r['calibration_seconds']:.0f} s; factors "
                  + " ".join(f"{k[:-4]} {v:.2f}" for k, v in r["factors"].items())
                  + ("; at micro-batch {}: ".format(r["large"]["batch"][1]) + " ".join(
                      f"{k[:-10]} {v:.2f}" for k, v in r["large"]["factors"].items())
                      + f", once a run {r['large']['fresh_s'] * 1e6:.1f} µs a call's token"
                      + f" and {r['large'].get('kv_alloc_s', 0.0) * 1e9:.2f} s a GB of cache" if r["large"] else "")
                  + ("; at micro-batch {}: ".format(r["mid"]["batch"][1]) + " ".join(
                      f"{k[:-8]} {v:.2f}" for k, v in r["mid"]["factors"].items()) if r.get("mid") else "")
                  + f"; its own run at batch 16/4: {r['at_calibration_batch']:+.1%}; shapes "
                  + ", ".join(f"{s} (prompts {n}) = {b}/{m}" for (s, n), (b, m) in r["shapes"].items()), flush=True)
        for rnd in range(args.repeats):  # the sides interleaved, run by run
            for n in lens:
                for s in shapes:
                    for side, r in rows.items():
                        shape = r["shapes"][(s, n)]
                        if any(r["shapes"][(s0, n)] == shape for s0 in shapes[:shapes.index(s)]):
                            continue  # the plan's choice is a shape given too: run it once
                        bw = bandwidth(args.threads)
                        f = {**run_once(args, margs, n, shape, r), "bandwidth": bw, "shape": list(shape)}
                        r["runs"].setdefault(f"{s} prompts {n}", []).append(f)
                        q = f["ratios"]
                        print(f"  round {rnd + 1}, prompts {n}, batch {shape[0]}/{shape[1]} [{side}]: measured "
                              f"{f['measured']:8.1f} tok/s, predicted {f['predicted']:8.1f}: {f['error']:+6.1%} "
                              f"(decode {f['decode_error']:+6.1%}); tasks / predicted: compute "
                              f"{q.get('compute', float('nan')):.2f}, attention {q.get('attention', float('nan')):.2f}, "
                              f"prefill {q.get('prefill', float('nan')):.2f}; {probe_words(f)}{f['seconds']:.0f} s, bandwidth "
                              f"{bw:.1f} GB/s, load {f['load']}", flush=True)
        for side, r in rows.items():
            for key, fs in r["runs"].items():
                errs = [f["error"] for f in fs]
                dec = [f["decode_error"] for f in fs]
                pre = [f["ratios"].get("prefill", float("nan")) for f in fs]
                print(f"  {Path(model).name} [{side}] {key} at {fs[0]['shape'][0]}/{fs[0]['shape'][1]}: median error "
                      f"{statistics.median(errs):+.1%} ({min(errs):+.1%} … {max(errs):+.1%}), decode "
                      f"{statistics.median(dec):+.1%}, prefill tasks / predicted {statistics.median(pre):.2f}", flush=True)
            shutil.rmtree(r.pop("cache"), ignore_errors=True)
            r.pop("env")
            r["shapes"] = {f"{s} prompts {n}": list(v) for (s, n), v in r["shapes"].items()}
        out["models"][model] = rows
    print(f"\nload average at the end {common.load_average()}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
