"""Issue 14's families on the emulated GPU: the runtime's peak device bytes and page-locked bytes next
to the plan's, for three policies (attention and half the state on the GPU; attention on the CPU with a
quarter of the experts resident; attention on the GPU with the state in the ring).

Tiny models (tests/checkpoints.py: hidden 64, 2–4 layers), so activations are a large share of the
peak: the ratio shows where the planner's activation term misses a layer kind's temporaries.

    python bench/family_memory.py [--workdir DIR] [--families gpt_oss qwen3_next ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    sys.path.insert(0, str(p))

from checkpoints import NEW_FAMILIES, make_checkpoint  # noqa: E402
from core.io.workloads import build_prompts  # noqa: E402
from core.model.families import load_spec  # noqa: E402
from core.plan.hardware import preset  # noqa: E402
from core.plan.planner import Workload, predict  # noqa: E402
from core.plan.policy import Policy  # noqa: E402
from core.runtime.engine import Engine  # noqa: E402
from emulated_memory import run  # noqa: E402  (bench/: one line per policy, peak and page-locked bytes vs plan)

POLICIES = [Policy(16, 4, 8, "gpu", "gpu", 0.5, 0.5, 2), Policy(16, 4, 16, "cpu", "gpu", 0.25, 0.0, 2),
            Policy(16, 8, 16, "gpu", "gpu", 0.0, 0.0, 2)]
GEN = 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--families", nargs="*", default=list(NEW_FAMILIES))
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mlight-fam-mem-"))
    for fam in args.families:
        path = work / fam
        if not (path / "config.json").is_file():
            make_checkpoint(fam, path)
        spec = load_spec(path)
        tok = Engine.load(path, device="cpu").tokenizer
        for policy in POLICIES:
            prompts = build_prompts(tok, [16] * policy.batch_size)
            longest = max(len(tok(p).input_ids) for p in prompts)
            w = Workload(prompt_len=longest, gen_len=GEN, max_prompt_len=longest, num_requests=policy.batch_size)
            pred = predict(policy, spec, preset("t4"), w)
            print(f"{fam:12} " + run(path, policy, pred, prompts, GEN, 1 << 30), flush=True)


if __name__ == "__main__":
    main()
