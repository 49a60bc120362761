"""core's messages in the app's words: flags become the field or key that does the same, policy field names the
Plan screen's labels, and memory overruns say what "usable" means."""

from __future__ import annotations

import re

# policy field -> its label on the Plan screen (the same words the form shows)
POLICY_LABELS = {
    "batch_size": "Batch N", "micro_batch_size": "Micro-batch μ", "expert_batch_size": "Expert batch",
    "attention_on": "Attention on", "ffn_on": "FFN on", "gpu_weight_fraction": "GPU experts %",
    "gpu_kv_fraction": "GPU KV %", "pages_per_layer": "Pages / layer",
}

# what each part of a memory overrun is, in words
MEMORY_PARTS = {
    "non_expert_weights": "dense weights", "resident_experts": "resident experts",
    "weight_double_buffer": "expert double buffer", "kv_cache": "KV cache", "activations": "activations",
    "experts": "experts", "weights": "weights", "pinned_staging": "pinned staging pages",
    "hidden_and_qkv": "hidden states and QKV",
}

# a command-line phrase -> what does the same in the app (most specific first)
_FLAG_PHRASES = [
    (r"check the path given to --prompts", "check the prompts file's path"),
    (r"omit --model for the demo", "press d for the demo model"),
    (r"or omit --model", "or press d for the demo model"),
    (r"pass --restart to replace it, or choose another --out",
     "press Ctrl+N again to replace it, or choose another results file"),
    (r"pass --restart to replace it", "press Ctrl+N again to replace it"),
    (r"rerun with --restart to discard them and start over, or choose another --out",
     "choose another results file, or delete the run file to start over"),
    (r"move it away, or pass --restart to replace it", "move it away, or choose another results file"),
    (r"end --out with \.jsonl or \.csv", "end the results file's name with .jsonl or .csv"),
    (r"raise --gpu-mem / --cpu-mem", "raise the GPU / CPU memory budget"),
    (r"give --gpu-mem and --cpu-mem in GB", "give the memory budgets in GB"),
    (r"shorten --prompt-len / --gen-len", "use shorter prompts or fewer new tokens"),
    (r"use --executor sequential or threaded", "choose the sequential or threaded executor under Advanced"),
    (r"omit --executor cuda", "choose another executor under Advanced"),
    (r"--executor cuda", "the CUDA executor"),
    (r"--out (\S+) is a folder", r"\1 is a folder"),
    (r"--model (\S+) is a file", r"\1 is a file"),
]
_FLAG_WORDS = {
    "--prompts": "the prompts file", "--out": "the results file", "--model": "the model field",
    "--gpu-mem": "the GPU memory budget", "--cpu-mem": "the CPU memory budget", "--restart": "Ctrl+N twice",
    "--revision": "the revision", "--executor": "the executor (Advanced)", "--schedule": "the schedule (Advanced)",
    "--dtype": "the compute dtype (Advanced)", "--quantize": "the quantization (Advanced)",
    "--max-new-tokens": "max_new_tokens", "--skip-bad": "skipping bad lines",
}


def for_screen(message: str) -> str:
    """A core message with its command-line flags turned into what the app offers instead."""
    for pattern, repl in _FLAG_PHRASES:
        message = re.sub(pattern, repl, message)
    return re.sub(r"--[a-z][a-z-]+", lambda m: _FLAG_WORDS.get(m.group(0), m.group(0)), message)


def policy_problem(message: str) -> str:
    """A Policy validation message with field names as the Plan screen labels them (fractions in %)."""
    def frac(m: re.Match) -> str:
        value = float(m.group(2))
        return f"{POLICY_LABELS[m.group(1)]} must be between 0 and 100, got {value * 100:g}"

    message = re.sub(r"Policy\.(gpu_weight_fraction|gpu_kv_fraction) must lie in \[0, 1\], got ([-\d.eE+]+)",
                     frac, message)
    message = re.sub(r"Policy\.(\w+)", lambda m: POLICY_LABELS.get(m.group(1), m.group(1)), message)
    names = "|".join(sorted(POLICY_LABELS, key=len, reverse=True))
    return re.sub(rf"\b({names})\b", lambda m: POLICY_LABELS[m.group(1)], message)


def overrun(o, budget: int, usable_share: float) -> str:
    """One memory a policy overfills: what it needs, part by part, against the usable share of the budget."""
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    parts = ", ".join(f"{MEMORY_PARTS.get(k, k.replace('_', ' '))} {gb(v)}" for k, v in o.breakdown.items() if v)
    return (f"{o.where.upper()} memory: needs {gb(o.needed)} ({parts}); {gb(o.limit)} usable "
            f"({usable_share:.0%} of the {gb(budget)} budget) — {gb(o.over)} over")


# what a CPU (or a torch build) that lacks a feature says when asked for a dtype it cannot compute
_MISSING_FEATURE = re.compile(r"mkldnn|onednn|\bavx|\bamx\b|bf16|bfloat16|not implemented for '(BFloat16|Half)'",
                              re.IGNORECASE)


def missing_feature(error: BaseException | None) -> bool:
    """A runtime error from a CPU or torch build that lacks a dtype's kernels (bf16 without AVX-512, …)."""
    return isinstance(error, (RuntimeError, NotImplementedError)) and bool(_MISSING_FEATURE.search(str(error)))
