"""Predicted vs measured tokens/s of CPU-only runs after one `mlight bench --calibrate` (issue 11 item 6).

For each model: a fresh cache, one `mlight bench --calibrate` (its own run is reported too, but a run in
the calibrating process is warmer than a user's), then `--repeats` rounds of `mlight bench` in their own
processes, the workloads interleaved round by round (default prompts, then `--prompt-len 308`). Prints
each run's error (measured / predicted − 1) and per workload the median and spread, with the load average.

    python bench/prediction_error.py --threads 2 --repeats 3 --model demo --model /path/to/mixtral-800m

`--checkout before=/path/to/old/checkout --checkout after=` compares two checkouts on the same box: each
calibrates in its own fresh cache, then their runs alternate round by round.

Robustness (issue 11 item 6, fifth session): `--cache DIR` keeps one cache across invocations, so that K jobs
spread over time each add a calibration (and their runs) to this machine's history, as a user's machine
accumulates them; each job appends its calibrations to `--json`. `--summary FILE...` then prints, for every
calibration, the prediction right after it (history-backed, and what that calibration alone would have
said) against the median of the M runs that followed, and the spread of those runs themselves:

    python bench/prediction_error.py --threads 2 --repeats 3 --cache /tmp/c --json /tmp/k1.json --model demo --model M
    python bench/prediction_error.py --summary /tmp/k1.json /tmp/k2.json ...
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

MLIGHT = "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=None, help="checkpoint folder, or 'demo' (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-lens", default="77,308", help="workloads' mean prompt tokens (default 77,308)")
    p.add_argument("--checkout", action="append", default=None, metavar="NAME=DIR",
                   help="run mlight from DIR (PYTHONPATH; empty: this checkout) as NAME; several: A/B, interleaved")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here (with --cache: append)")
    p.add_argument("--cache", type=Path, default=None,
                   help="one cache kept across invocations (the machine's history accumulates) instead of a fresh one")
    p.add_argument("--summary", type=Path, nargs="+", default=None, metavar="JSON",
                   help="print the per-calibration table of earlier --cache runs' --json files, and stop")
    return p.parse_args(argv)


def mlight(args, extra: list[str], env: dict) -> dict:
    cmd = [sys.executable, "-c", MLIGHT, "bench", *extra, "--threads", str(args.threads), "--json"]
    # from a neutral folder: `python -c` puts the working folder first on sys.path, ahead of PYTHONPATH
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()).stdout
    return json.loads(out)


def bandwidth(threads: int) -> float:
    """Read bandwidth now (GB/s, median of 5 sums over 512 MB): on a VM it moves by tens of percent from
    minute to minute, and a memory-bound model's tokens/s with it."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(1 << 28, dtype=torch.bfloat16)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 2 / statistics.median(times[1:]) / 1e9


def figures(report: dict) -> dict:
    (run,) = report["runs"]
    p = run["predicted"]
    return {"measured": run["tokens_per_s"], "predicted": p["tokens_per_s"], "error": run["error"]["tokens_per_s"],
            "decode_measured": run["decode_tokens_per_s"], "decode_predicted": p["decode_tokens_per_s"],
            "decode_error": run["error"]["decode_tokens_per_s"], "calibrated": p["calibrated"],
            "load": report["load_average"], "history": p.get("history", {}),
            "predicted_alone": p.get("tokens_per_s_last_calibration_alone"), "time": time.time(),
            # per resource (CPU compute, CPU attention), a layer's decode seconds measured and predicted, and what
            # the run folded back: the model's error by task kind, apart from the machine's speed as a whole
            "layer_seconds": run.get("layer_seconds", {}), "layer_seconds_predicted": p.get("layer_seconds", {}),
            "ratios": (run.get("folded_back") or {}).get("ratios", {})}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summary:
        return summary(args.summary)
    if args.cache:
        return kept_cache(args)
    models = args.model or ["demo"]
    lens = [int(x) for x in args.prompt_lens.split(",")]
    sides = dict(x.split("=", 1) for x in args.checkout) if args.checkout else {"this checkout": ""}
    print(f"bench prediction_error: {args.threads} threads, load average {common.load_average()}, "
          f"mlight from {sides}", flush=True)
    out = {"command": "python bench/prediction_error.py " + " ".join(sys.argv[1:] if argv is None else argv), "models": {}}
    for model in models:
        base = [] if model == "demo" else ["--model", model]
        rows, envs = {}, {}
        for side, path in sides.items():  # one calibration each, in its own cache
            cache = Path(tempfile.mkdtemp(prefix="mlight-pred-"))
            envs[side] = {**os.environ, "MLIGHT_CACHE_DIR": str(cache), **({"PYTHONPATH": path} if path else {})}
            t = time.perf_counter()
            bw0 = bandwidth(args.threads)
            cal = mlight(args, [*base, "--calibrate"], envs[side])
            rows[side] = {"calibration_seconds": time.perf_counter() - t, "in_calibrating_process": figures(cal),
                          "run": cal.get("calibration", {}).get("run", {}),
                          "costs": cal.get("calibration", {}).get("costs", {}),
                          "bandwidth_around_calibration": (bw0, bandwidth(args.threads)),
                          "workloads": {n: [] for n in lens}, "cache": str(cache)}
            r = rows[side]
            print(f"\n{model} [{side}]: calibrated in {r['calibration_seconds']:.0f} s (read bandwidth before / after: "
                  f"{bw0:.1f} / {r['bandwidth_around_calibration'][1]:.1f} GB/s); the calibrating process's own run: "
                  f"{r['in_calibrating_process']['error']:+.1%}; its short run's windows: "
                  + ", ".join(f"{w['tokens_per_s']:.1f} ({w.get('decode_task_seconds', 0):.2f} s decode tasks)"
                              for w in r["run"].get("windows", [])) + " tok/s; factors "
                  + " ".join(f"{k[:-4]} {v:.2f}" for k, v in r["run"].get("factors", {}).items()), flush=True)
        for rnd in range(args.repeats):  # the sides interleaved, round by round
            for n in lens:
                for side in sides:
                    bw = bandwidth(args.threads)
                    f = {**figures(mlight(args, [*base, "--prompt-len", str(n)], envs[side])), "bandwidth": bw}
                    rows[side]["workloads"][n].append(f)
                    print(f"  round {rnd + 1}, prompts {n} [{side}]: measured {f['measured']:8.1f} tok/s, predicted "
                          f"{f['predicted']:8.1f}: {f['error']:+6.1%} (decode {f['decode_error']:+6.1%}; {by_kind(f)}), "
                          f"bandwidth before {bw:.1f} GB/s, load {f['load']}", flush=True)
        for side, row in rows.items():
            for n, fs in row["workloads"].items():
                errs, meas = [f["error"] for f in fs], [f["measured"] for f in fs]
                attn = [f["layer_seconds"]["cpu_attn"] / f["layer_seconds_predicted"]["cpu_attn"] for f in fs
                        if f["layer_seconds"].get("cpu_attn") and f["layer_seconds_predicted"].get("cpu_attn")]
                print(f"  {model} [{side}] prompts {n}: median error {statistics.median(errs):+.1%} (runs {min(errs):+.1%} "
                      f"… {max(errs):+.1%}); measured {min(meas):.1f} … {max(meas):.1f} tok/s (median "
                      f"{statistics.median(meas):.1f}), predicted {fs[0]['predicted']:.1f}"
                      + (f"; attention measured / predicted x{statistics.median(attn):.2f}" if attn else ""), flush=True)
            shutil.rmtree(row.pop("cache"), ignore_errors=True)
        out["models"][model] = rows
    print(f"\nload average at the end {common.load_average()}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def by_kind(f: dict) -> str:
    """A run's decode seconds per layer over the prediction, CPU compute and attention apart: the model's shape
    (one kind wrong for one workload) shows here, where the machine's speed moves both alike."""
    m, p = f.get("layer_seconds", {}), f.get("layer_seconds_predicted", {})
    return " ".join(f"{name} x{m[k] / p[k]:.2f}" for k, name in (("gpu", "compute"), ("cpu_attn", "attention"))
                    if m.get(k) and p.get(k))


def kept_cache(args) -> int:
    """One calibration per model in the kept cache, then `--repeats` rounds of each workload; appended to --json."""
    models = args.model or ["demo"]
    lens = [int(x) for x in args.prompt_lens.split(",")]
    env = {**os.environ, "MLIGHT_CACHE_DIR": str(args.cache)}
    print(f"bench prediction_error (kept cache {args.cache}): {args.threads} threads, load average "
          f"{common.load_average()}", flush=True)
    done = json.loads(args.json.read_text()) if args.json and args.json.is_file() else []
    for model in models:
        base = [] if model == "demo" else ["--model", model]
        t = time.perf_counter()
        cal = mlight(args, [*base, "--calibrate"], env)["calibration"]
        row = {"model": model, "time": time.time(), "calibration_seconds": time.perf_counter() - t,
               "windows": [w["tokens_per_s"] for w in cal["run"].get("windows", [])], "history": cal["history"],
               "factors": {n: cal["costs"][n] for n in ("pre_eff", "attn_eff", "post_eff", "ffn_eff", "prefill_eff")},
               "factors_alone": {n: cal["this_calibration"][n] for n in ("pre_eff", "attn_eff", "post_eff", "ffn_eff",
                                                                         "prefill_eff")},
               "workloads": {str(n): [] for n in lens}}
        h = row["history"]
        print(f"\n{model}: calibrated in {row['calibration_seconds']:.0f} s, windows "
              + ", ".join(f"{w:.1f}" for w in row["windows"]) + f" tok/s; history {h['entries']} entries "
              f"({h['calibration_windows']} calibration windows, {h['runs']} runs), speed {h['low']:+.1%} … {h['high']:+.1%}",
              flush=True)
        for rnd in range(args.repeats):
            for n in lens:
                bw = bandwidth(args.threads)
                f = {**figures(mlight(args, [*base, "--prompt-len", str(n)], env)), "bandwidth": bw}
                row["workloads"][str(n)].append(f)
                print(f"  round {rnd + 1}, prompts {n}: measured {f['measured']:8.1f} tok/s, predicted {f['predicted']:8.1f} "
                      f"({f['error']:+6.1%}; the last calibration alone: {f['predicted_alone'] or float('nan'):8.1f}), "
                      f"bandwidth {bw:.1f} GB/s, load {f['load']}; {by_kind(f)}", flush=True)
        done.append(row)
        print_rows([row])
        if args.json:
            args.json.write_text(json.dumps(done, indent=1))
    print(f"\nload average at the end {common.load_average()}")
    return 0


def print_rows(rows: list[dict]) -> None:
    """Per calibration and workload: the prediction right after it (its first run's), and what the calibration
    alone would have predicted, against the median of the runs after it; the spread of those runs."""
    print("| time (UTC) | model | prompts | history behind it | predicted (history) | error | predicted (this "
          "calibration alone) | error | runs' median tok/s | runs' spread |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for n, fs in r["workloads"].items():
            if not fs:
                continue
            meas = [f["measured"] for f in fs]
            mid = statistics.median(meas)
            first = fs[0]
            alone = first.get("predicted_alone")
            h = first.get("history") or r["history"]
            print(f"| {time.strftime('%H:%M', time.gmtime(r['time']))} | {Path(r['model']).name} | {n} | "
                  f"{h.get('calibration_windows', 0)} windows, {h.get('runs', 0)} runs | {first['predicted']:.1f} | "
                  f"**{mid / first['predicted'] - 1:+.1%}** | "
                  + (f"{alone:.1f} | {mid / alone - 1:+.1%}" if alone else "— | —")
                  + f" | {mid:.1f} ({len(meas)}) | {min(meas) / mid - 1:+.1%} … {max(meas) / mid - 1:+.1%} |")


def summary(paths: list[Path]) -> int:
    rows = [r for p in paths for r in json.loads(p.read_text())]
    print_rows(sorted(rows, key=lambda r: (r["model"], r["time"])))
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        pairs = [(statistics.median(f["measured"] for f in fs), fs[0]) for r in mine for fs in r["workloads"].values() if fs]
        errs = [m / f["predicted"] - 1 for m, f in pairs]
        alone = [m / f["predicted_alone"] - 1 for m, f in pairs if f.get("predicted_alone")]
        print(f"{Path(model).name}: {sum(abs(e) <= 0.10 for e in errs)} of {len(errs)} calibration-workloads within 10 % "
              f"of their runs' median (the last calibration alone: {sum(abs(e) <= 0.10 for e in alone)} of {len(alone)})")
        # against the machine's typical state: the median of every run of the workload, all jobs together
        for n in sorted({n for r in mine for n in r["workloads"]}, key=int):
            every = [f["measured"] for r in mine for f in r["workloads"].get(n, [])]
            if not every:
                continue
            mid = statistics.median(every)
            firsts = [r["workloads"][n][0] for r in mine if r["workloads"].get(n)]
            print(f"  prompts {n}: all {len(every)} runs {min(every):.1f} … {max(every):.1f} tok/s (median {mid:.1f}, "
                  f"{min(every) / mid - 1:+.1%} … {max(every) / mid - 1:+.1%}); each calibration's prediction against "
                  "that median: " + ", ".join(f"{mid / f['predicted'] - 1:+.1%}" for f in firsts)
                  + " (alone: " + ", ".join(f"{mid / f['predicted_alone'] - 1:+.1%}" for f in firsts if f.get("predicted_alone"))
                  + ")")
            kinds = [by_kind(f) for r in mine for f in r["workloads"].get(n, [])]
            if any(kinds):  # recorded since the sixth session
                print(f"    each run's decode seconds over the prediction: " + "; ".join(k for k in kinds if k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
