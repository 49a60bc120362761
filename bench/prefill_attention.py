"""The engine's prefill attention timed alone, as the calibration's piece times it
(core.runtime.calibrate_pieces.prefill_attention_terms), against the same kernel timed inside real prefills of one
prompt: whether the piece stands for the engine's kernel, and how far one cost a FLOP follows its lengths.

    python bench/prefill_attention.py MODEL_DIR [THREADS]   # the 784M of bench/cpu_vs_hf.py, or the demo's folder

Prints per prompt length: the kernel alone (median of 5), inside the engine (the median layer of the median of
3 prefills after one warm-up), their ratio, and the piece's linear fit (seconds a FLOP + a call's) over the
lengths against the time alone.
"""

from __future__ import annotations

import sys
import time

import torch

from core.model import attention, gqa
from core.plan import cpu_cost, hrm
from core.runtime import calibrate_pieces as pieces
from core.runtime.engine import Engine

LENGTHS = (16, 64, 128, 256, 512, 1024)


def main(argv: list[str]) -> int:
    engine = Engine.load(argv[0], threads=int(argv[1]) if len(argv) > 1 else 2)
    spec, d, math = engine.spec, hrm.dims(engine.spec), engine.weights.math_dtype
    print(f"{argv[0]}: {torch.get_num_threads()} threads, {math} math, heads {spec.num_heads}/{spec.num_kv_heads} "
          f"of {spec.head_dim}")
    flop_s, call_s = pieces.prefill_attention_terms(spec, math, LENGTHS)
    print(f"the piece's fit: {1 / flop_s / 1e9:.1f} GFLOP/s, {call_s * 1e6:.1f} µs a call")
    real, calls = attention.prefill_attention, []

    def timed(*a, **kw):
        t = time.perf_counter()
        out = real(*a, **kw)
        calls.append(time.perf_counter() - t)
        return out

    gqa.prefill_attention = timed  # the name gqa.prefill calls
    g = torch.Generator().manual_seed(0)
    for n in LENGTHS:
        if n > spec.max_position:
            continue
        q = torch.randn(n, spec.num_heads, spec.head_dim, generator=g).to(math)
        k, v = (torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=g).to(math) for _ in range(2))
        alone = pieces._typical(lambda q=q, k=k, v=v: real(q, k, v, spec.scale), reps=5)
        runner = engine.runner(slots=1, micro_batch_size=1, max_tokens=n + 1)
        prompt = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist()]
        inside = []
        for _ in range(4):
            calls.clear()
            runner.prefill(prompt, [0], [[0]])
            inside.append(sorted(calls)[len(calls) // 2])
        engine_s = sorted(inside[1:])[1]
        fitted = flop_s * cpu_cost.prefill_attention_flops(d, 1, n) + call_s
        print(f"{n:5d} tokens: alone {alone * 1e6:9.1f} µs, in the engine {engine_s * 1e6:9.1f} µs "
              f"({engine_s / alone:.2f}x); the piece's fit {fitted / alone:.2f}x alone")
        del runner
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
