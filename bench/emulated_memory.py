"""Memory as planned, on the emulated GPU: the runtime's peak device bytes next to the plan's figure.

A Mixtral-shaped model (hidden 128, 4 layers, 8 experts; fp32 and bf16) runs each policy on an
`EmulatedCuda` that counts everything the runtime allocates — weights, buffers and every activation
its tasks create — with the plan's budget as the device's memory. Policies: the planner's own for
several GPU budgets (a slow CPU, so the GPU placements win), and hand-picked ones the search rarely
picks (attention and KV on the GPU, expert batches over micro-batches, many pages). Prints peak, plan,
their ratio (the target: 1.0 ≤ plan/peak ≤ 1.1), what was running at the peak, the transient part
against the plan's activation term, and the page-locked bytes against the plan's. `--quantize int8,int4`
runs the same with the experts stored in those formats (int4 at group 32), planned as quantized.

    python bench/emulated_memory.py [--workdir DIR] [--quantize none,int8,int4]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    sys.path.insert(0, str(p))

import torch  # noqa: E402

from core.io.workloads import build_prompts  # noqa: E402
from core.model.families import load_spec  # noqa: E402
from core.model.quant.formats import parse_choice, quantized_spec  # noqa: E402
from core.plan.hardware import preset  # noqa: E402
from core.plan.planner import Budget, Workload, plan, predict  # noqa: E402
from core.plan.policy import Policy  # noqa: E402
from core.runtime.device_emulated import EmulatedCuda  # noqa: E402
from core.runtime.engine import Engine, Request  # noqa: E402

MiB = 1 << 20
PLANNED = [(12, 16, 24, 6), (16, 24, 40, 5), (24, 32, 16, 4), (40, 16, 32, 4)]  # GPU MiB, requests, prompt, new
GIVEN = [Policy(64, 4, 64, "cpu", "gpu", 0.25, 0.0, 16), Policy(16, 4, 8, "gpu", "gpu", 0.5, 0.5, 4),
         Policy(16, 8, 16, "gpu", "gpu", 0.0, 0.0, 2), Policy(24, 8, 24, "gpu", "gpu", 1.0, 1.0, 1),
         Policy(32, 2, 8, "cpu", "gpu", 0.1, 0.0, 3)]


def model(work: Path, dtype: str) -> Path:
    from checkpoints import make_checkpoint

    path = work / f"mem-{dtype}"
    if not (path / "config.json").is_file():
        make_checkpoint("mixtral", path, dtype=getattr(torch, dtype), hidden_size=128, intermediate_size=256,
                        num_hidden_layers=4, num_local_experts=8, num_attention_heads=8, num_key_value_heads=2)
    return path


def run(path: Path, policy: Policy, pred, prompts, gen: int, memory: int, quantize: str = "none") -> str:
    dev = EmulatedCuda(memory)
    engine = Engine.load(path, device=dev, policy=policy, quantize=quantize, group_size=32, use_cache=False)
    engine.eos_ids = set()
    pinned, real = [], engine.runner

    def runner(*a, **kw):  # page-locked bytes while the runner lives (closing the engine unpins them)
        r = real(*a, **kw)
        pinned.append(dev.pinned_bytes)
        return r

    engine.runner = runner
    list(engine.generate([Request(id=str(i), prompt=p, max_new_tokens=gen) for i, p in enumerate(prompts)]))
    engine.close()
    peak = dev.max_memory_allocated()
    during = dev.peak_during.kind if dev.peak_during is not None else "-"
    return (f"N={policy.batch_size:3} mu={policy.micro_batch_size:3} beta={policy.expert_batch_size:3} "
            f"att={policy.attention_on} r_w={policy.gpu_weight_fraction:.3f} r_c={policy.gpu_kv_fraction:.2f} "
            f"pages={policy.pages_per_layer:2} | peak {peak / 1e6:7.3f} MB  plan {pred.gpu_bytes / 1e6:7.3f} MB  "
            f"plan/peak {pred.gpu_bytes / peak:5.3f} | at the peak: {during:8} transient {dev.peak_transient / 1e6:.3f}"
            f" vs planned {pred.gpu_breakdown['activations'] / 1e6:.3f} | pinned {max(pinned):,} vs "
            f"{pred.pinned_bytes:,}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--quantize", default="none", help="formats to run, comma-separated (none, int8, int4)")
    args = p.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mlight-mem-"))
    for dtype, quantize in [(d, q) for q in args.quantize.split(",") for d in ("float32", "bfloat16")]:
        path = model(work, dtype)
        spec = quantized_spec(load_spec(path), parse_choice(quantize, 32))
        tok = Engine.load(path, device="cpu").tokenizer
        print(f"\n{dtype}, experts {spec.expert_format if quantize != 'none' else dtype}: "
              f"{spec.total_bytes / 1e6:.1f} MB of weights")

        def workload(n, length, gen):
            prompts = build_prompts(tok, [length] * n)
            longest = max(len(tok(x).input_ids) for x in prompts)
            return prompts, Workload(prompt_len=longest, gen_len=gen, max_prompt_len=longest, num_requests=n)

        for gpu_mib, n, length, gen in PLANNED:
            prompts, w = workload(n, length, gen)
            hw = dataclasses.replace(preset("t4"), gpu_mem_bytes=gpu_mib * MiB, cpu_flops=2e10, cpu_bw=2e10)
            policy, pred = plan(spec, hw, w, Budget(gpu_mib * MiB, 1 << 30))
            print(f"  planned for {gpu_mib:2} MiB: " + run(path, policy, pred, prompts, gen, gpu_mib * MiB, quantize))
        for policy in GIVEN:
            prompts, w = workload(policy.batch_size, 16, 6)
            print("  given:              " + run(path, policy, predict(policy, spec, preset("t4"), w), prompts, 6,
                                                 1 << 30, quantize))
    return 0


if __name__ == "__main__":
    sys.exit(main())
