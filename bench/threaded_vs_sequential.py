"""Threaded CPU executor vs the sequential CPU engine on the same model and workload, in one run.

The threaded executor runs the CGOPipe graph with the dense work and the attention on separate
worker threads (experts resident, so no weight copies); the sequential engine runs the plain CPU
chain. Prints tokens/s of both and the ratio (target: threaded ≥ 0.9 × sequential on 2 cores),
alternating the two several times so that machine noise hits both alike.

    python bench/threaded_vs_sequential.py                 # a Mixtral-shaped fp32 model, 48 requests
    python bench/threaded_vs_sequential.py --quick         # the demo model, a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from core.runtime.engine import Engine, Request  # noqa: E402
from core.io.workloads import build_prompts, target_lengths  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--gen-len", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    if a.quick:
        from core.model.demo import demo_model_dir

        path, n, gen = demo_model_dir(), a.requests or 16, a.gen_len or 8
    else:
        from checkpoints import make_checkpoint

        path = make_checkpoint("mixtral", Path(tempfile.mkdtemp()) / "m", hidden_size=512, intermediate_size=1408,
                               num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                               num_local_experts=8, max_position_embeddings=1024)
        n, gen = a.requests or 48, a.gen_len or 32
    seq = Engine.load(path, device="cpu")  # both on the CPU, even on a machine with a GPU
    thr = Engine.load(path, device="cpu", executor="threaded", schedule="cgopipe")
    prompts = build_prompts(seq.tokenizer, target_lengths(n, max_len=min(418, seq.context_length - gen - 1)))
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=gen) for i, p in enumerate(prompts)]
    for e in (seq, thr):
        e.eos_ids = set()
    for e in (seq, thr):  # warm up: first calls pay for allocator growth and kernel selection
        list(e.generate(reqs[: a.batch], batch_size=a.batch, micro_batch_size=a.micro_batch))
    rates = {"sequential": [], "threaded": []}
    outputs = {}
    for _ in range(a.rounds):
        for name, e in (("sequential", seq), ("threaded", thr)):
            t0 = time.perf_counter()
            res = list(e.generate(reqs, batch_size=a.batch, micro_batch_size=a.micro_batch))
            rates[name].append(sum(r.output_tokens for r in res) / (time.perf_counter() - t0))
            outputs[name] = {r.id: r.output_token_ids for r in res}
    thr.close()
    s, t = statistics.median(rates["sequential"]), statistics.median(rates["threaded"])
    print(f"model {path} · {n} requests × {gen} tokens · batch {a.batch}, micro-batch {a.micro_batch}")
    print(f"sequential {s:8.1f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in rates['sequential'])})")
    print(f"threaded   {t:8.1f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in rates['threaded'])})")
    print(f"ratio threaded / sequential: {t / s:.2f}   same tokens: {outputs['sequential'] == outputs['threaded']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
