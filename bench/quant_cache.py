"""The quantized cache: peak RSS while the first load quantizes, and the second (memory-mapped) load's time.

Builds a random bf16 Mixtral-shaped checkpoint, then in fresh processes (so each peak is its own):
1. `load_weights(..., quant=int4)` with an empty cache: quantizes layer by layer and writes the cache;
   peak RSS growth (VmHWM − RSS after imports) against the bound 1.1 × quantized model + one bf16 layer;
2. the same call again: reads the cache; its time and peak against the first;
3. int8, the same two.

    python bench/quant_cache.py              # ≈ 800 MB bf16 checkpoint
    python bench/quant_cache.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

FULL = dict(hidden=1024, intermediate=3840, layers=8, heads=16, kv_heads=4, experts=8, top_k=2, vocab=4096)
QUICK = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, experts=8, top_k=2, vocab=1024)

PROBE = """
import json, sys, time, psutil
sys.path.insert(0, {root!r})
import torch
from core.model.families import load_spec
from core.model.weights import load_weights, LayerLayout
from core.model.quant.formats import Format, quantize
quantize(Format("int4", 64), torch.randn(64, 256))  # imports and first-call set-up before the baseline
spec = load_spec({path!r})
before = psutil.Process().memory_info().rss
t = time.perf_counter()
w = load_weights({path!r}, spec, dtype=torch.bfloat16, quant=Format({fmt!r}, {group}))
seconds = time.perf_counter() - t
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
layer = LayerLayout.for_spec(spec).numel * 2
print(json.dumps(dict(grown=peak - before, model=w.nbytes, bf16_layer=layer, seconds=seconds)))
"""


def probe(path: Path, fmt: str, group: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), path=str(path), fmt=fmt, group=group)],
                         capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mlight-quant-cache-"))
    model = work / "model"
    if not (model / "config.json").is_file():
        info = common.build_mixtral(model, **(QUICK if args.quick else FULL))
        print(f"built a {info['params'] / 1e6:.0f}M-parameter bf16 checkpoint", flush=True)
    env = dict(os.environ, MLIGHT_CACHE_DIR=str(work / "cache"))
    rows = {}
    load = common.load_average()
    for fmt, group in (("int4", 64), ("int8", 0)):
        first, second = probe(model, fmt, group, env), probe(model, fmt, group, env)
        bound = 1.1 * first["model"] + first["bf16_layer"]
        rows[fmt] = {"first": first, "cached": second, "bound": bound, "within": first["grown"] <= bound}
        print(f"{fmt}: quantized model {first['model'] / 1e6:.0f} MB, one bf16 layer {first['bf16_layer'] / 1e6:.0f} MB; "
              f"first load {first['seconds']:.1f} s, peak RSS growth {first['grown'] / 1e6:.0f} MB = "
              f"{first['grown'] / bound:.2f} x the bound (1.1 x model + layer = {bound / 1e6:.0f} MB); "
              f"cached load {second['seconds']:.1f} s ({first['seconds'] / second['seconds']:.1f}x faster), "
              f"peak growth {second['grown'] / 1e6:.0f} MB", flush=True)
    print(f"load average {load} -> {common.load_average()}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["within"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
