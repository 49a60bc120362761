"""Peak RAM of a GGUF model in the CPU-only mode against the file's tensor bytes plus the KV cache (issue 47).

Loads the file in this process and generates (`--batch` requests of `--gen` tokens), then prints the peak
resident set above what the process held before the load (Python, torch, the C kernels and the tokenizer,
made first)
beside the sum of the file's tensor bytes and the KV cache of the run's slots (max tokens × KV bytes a
token): the criterion is peak ≤ 1.1 × tensor bytes + KV. Linux (ru_maxrss in KiB).

    python bench/gguf_memory.py model-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", type=Path)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    import torch

    from core.model.cpu import gguf_blocks, int4, native
    from core.model.gguf.load import load_tokenizer, open_gguf
    from core.runtime.engine import Engine, Request

    torch.set_num_threads(args.threads)
    for lib in (gguf_blocks.library, int4.library, native.library):  # built before the baseline is taken
        try:
            lib()
        except Exception:  # noqa: BLE001 (a kernel that does not build here is not the question)
            pass
    torch.zeros(1 << 20).sum()  # torch's own first-use allocations inside the baseline too
    g = open_gguf(args.gguf)
    load_tokenizer(g)  # transformers and the tokenizer: the process's fixed cost, whatever the weights
    base = current_bytes()
    tensors = sum(t.nbytes for t in g.tensors.values())
    engine = Engine.load(args.gguf, threads=args.threads)
    loaded = current_bytes()
    prompts = [Request(id=str(i), prompt=f"Tell me about {i}", max_new_tokens=args.gen) for i in range(args.batch)]
    n = len(list(engine.generate(prompts, batch_size=args.batch)))
    max_tokens = max(len(engine.prompt_token_ids(r)) for r in prompts) + args.gen
    kv = engine.spec.kv_bytes_per_token * max_tokens * args.batch
    peak = peak_bytes() - base
    print(f"# {args.gguf.name}: {tensors / 1e6:.1f} MB of tensors; {n} requests of {args.gen} tokens; "
          f"KV {kv / 1e6:.2f} MB")
    print(f"resident after load (above the baseline): {(loaded - base) / 1e6:.1f} MB = {(loaded - base) / tensors:.3f}x "
          f"the tensors")
    print(f"peak (above the baseline of {base / 1e6:.0f} MB): {peak / 1e6:.1f} MB = {peak / (tensors + kv):.3f}x "
          f"(tensors + KV); criterion <= 1.1x: {'met' if peak <= 1.1 * tensors + kv else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
