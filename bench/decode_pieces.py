"""Where a CPU-mode decode step goes, piece by piece: per task kind, the expert kernel, the dense projections
by shape, the attention kernel, the row ops, the router, the logits, and the step's page faults.

Runs `Engine.generate` on MT-Bench prompts (first turn of one question + second turn of another, so
routing is spread as in real text: repeated prompts route every token to the same experts and flatter
the experts), `--skip` decode steps untimed (to reach a context length), then times `--steps` steps with
time.perf_counter wrappers around each piece (torch.profiler charged small ops 10-100x their cost on a
2-core VM: bench/RESULTS.md, issue 11, sixteenth session). Means per decode step; pieces nest (a task
holds its kernels), so they do not add up to the step.

    python bench/decode_pieces.py --model /path/to/mixtral-800m --batch 256 --skip 40 --steps 8
    python bench/decode_pieces.py --model /path/to/mixtral-800m --batch 1 --skip 10 --steps 48
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


class Pieces:
    """Seconds and calls per named piece, counted only while `on`."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()
        self.on = False

    def _charge(self, name, f, *a, **k):
        """f(*a, **k), its seconds charged to `name` (a callable: named from the call's arguments) while `on`."""
        if not self.on:
            return f(*a, **k)
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            key = name(*a) if callable(name) else name
            self.seconds[key] += time.perf_counter() - t
            self.calls[key] += 1

    def wrap(self, owner, attr: str, name: str) -> None:
        f = getattr(owner, attr)
        setattr(owner, attr, functools.wraps(f)(lambda *a, **k: self._charge(name, f, *a, **k)))

    def wrap_linear(self, cls, label: str) -> None:
        """A weight class's `linear(self, x, bias)`, keyed by the call's shapes."""
        f = cls.linear
        cls.linear = lambda w, x, bias: self._charge(lambda w, x, b: f"{label} {tuple(x.shape)} x {tuple(w.shape)}",
                                                     f, w, x, bias)


def prompts(n: int) -> list[str]:
    from core.assets import MT_BENCH

    qs = [json.loads(line)["turns"] for line in MT_BENCH.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [qs[i % len(qs)][0] + " " + qs[(i * 7 + 3) % len(qs)][-1] for i in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--batch", type=int, default=64, help="requests decoding together (one micro-batch)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed")
    p.add_argument("--skip", type=int, default=0, help="decode steps run first, untimed (context length)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    from core.model import decoder
    from core.model.cpu import ffn, kernels, native, panel_linear, row_ops
    from core.runtime import pipeline
    from core.runtime.engine import Engine, Request

    pieces = Pieces()
    R = pipeline.PipelineRunner
    for kind in ("_pre_attn", "_cpu_attn", "_post_attn", "_ffn"):
        pieces.wrap(R, kind, "task " + kind.lstrip("_"))
    pieces.wrap(R, "_logits", "logits (norm + LM head)")
    pieces.wrap(ffn.NativeExperts, "__call__", "expert kernel")
    pieces.wrap(native, "decode_attention", "attention kernel")
    for name in ("kv_write", "rms_norm", "rope_join"):
        pieces.wrap(row_ops, name, "row op " + name)
    pieces.wrap(decoder, "route", "router")
    pieces.wrap_linear(kernels.PackedWeight, "oneDNN linear")
    pieces.wrap_linear(panel_linear.PanelWeight, "panel linear")

    engine = Engine.load(a.model, threads=a.threads)
    engine.eos_ids = set()  # every request decodes all its tokens
    reqs = [Request(f"r{i}", prompt=t, max_new_tokens=a.skip + a.steps + 1) for i, t in enumerate(prompts(a.batch))]
    list(engine.generate(reqs[:min(4, a.batch)], batch_size=a.batch))  # warm-up: kernels built, buffers grown

    step = {"n": 0, "timed": 0, "seconds": 0.0, "faults": 0}
    decode = R.decode

    def timed_decode(self, *args):
        step["n"] += 1
        if step["n"] <= a.skip:
            return decode(self, *args)
        f0 = _faults()
        pieces.on = True
        t = time.perf_counter()
        try:
            return decode(self, *args)
        finally:
            step["seconds"] += time.perf_counter() - t
            pieces.on = False
            step["timed"] += 1
            step["faults"] += _faults() - f0

    R.decode = timed_decode
    list(engine.generate(reqs, batch_size=a.batch))
    n = max(1, step["timed"])
    print(f"{Path(a.model).name}: B = {a.batch}, {a.threads} threads, {step['timed']} steps after {a.skip}: "
          f"{step['seconds'] / n * 1e3:.1f} ms a step, {step['faults'] / n:.0f} page faults a step")
    for name, s in sorted(pieces.seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {name:58s} {s / n * 1e3:8.2f} ms  ({pieces.calls[name] / n:.0f} calls)")
    return 0


def _faults() -> int:
    try:
        import resource
    except ImportError:  # Windows: no count
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


if __name__ == "__main__":
    raise SystemExit(main())
