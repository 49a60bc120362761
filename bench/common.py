"""Shared benchmark helpers: a random Mixtral-shaped checkpoint, an MT-Bench-like workload, and the
machine's roofline (bf16 matmul FLOP/s and memory read bandwidth) measured in the same process.

Only the bench scripts import this; nothing in `core` or `app` does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


# ---- model ------------------------------------------------------------------------------------------
def build_mixtral(out_dir: Path, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                  experts: int = 8, top_k: int = 2, vocab: int = 4096, seed: int = 0,
                  initializer_range: float = 0.02, init_dtype: torch.dtype | None = None) -> dict:
    """A random-weight bf16 Mixtral checkpoint made by transformers' own classes, plus a BPE tokenizer.

    The lm_head rows of EOS and PAD are zeroed: their logit is exactly 0 while the max over thousands of
    random logits is positive, so greedy decoding never stops early and both systems generate exactly
    `max_new_tokens` per request (the workload is the same for both by construction). `init_dtype`
    (bf16 for models of billions of parameters): build the model in that dtype, not fp32 then bf16,
    which halves the peak memory (other random weights than the default's)."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    from core.model.demo import build_tokenizer

    hf_logging.disable_progress_bar()
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir, vocab_size=vocab)
    tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    V = len(tok)
    cfg = MixtralConfig(
        vocab_size=V, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
        initializer_range=initializer_range, dtype="bfloat16",
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(init_dtype or default)
    try:
        with torch.device("cpu"):
            model = MixtralForCausalLM(cfg).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for t in (tok.eos_token_id, tok.pad_token_id):
            model.lm_head.weight[t].zero_()
    model.save_pretrained(str(out_dir))
    n = sum(p.numel() for p in model.parameters())
    del model
    return {"params": n, "vocab": V}


# ---- workload: MT-Bench-like prompt mixes, shared with `mlight bench` -------------------------------
from core.io.workloads import build_prompts, first_turns, target_lengths  # noqa: E402,F401


# ---- roofline -----------------------------------------------------------------------------------------
@dataclass
class Roofline:
    flops: float  # bf16 matmul FLOP/s
    bandwidth: float  # bytes/s, read
    gemm_detail: dict
    bw_detail: dict

    def at_best(self, other: "Roofline") -> "Roofline":
        """The higher of two measurements of the same machine (before and after a run): a peak taken
        once moved 781 vs 928 GFLOP/s between runs, which alone moved a roofline fraction by 9 points."""
        return Roofline(max(self.flops, other.flops), max(self.bandwidth, other.bandwidth),
                        {k: max(v, other.gemm_detail.get(k, 0.0)) for k, v in self.gemm_detail.items()},
                        {k: max(v, other.bw_detail.get(k, 0.0)) for k, v in self.bw_detail.items()})

    def time(self, flops: float, bytes_: float) -> float:
        """Lower bound on time: attainable = min(peak, BW × intensity) <=> t = max(F/peak, B/BW)."""
        return max(flops / self.flops, bytes_ / self.bandwidth)


# What the scripts time with: the wall clock, or (`use_cpu_clock`, for one thread on a shared machine)
# this process's CPU seconds — what a quiet machine's wall clock would say.
clock = time.perf_counter


def use_cpu_clock() -> None:
    global clock
    clock = time.process_time


def _best(fn, reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def measure_roofline(sizes=(2048, 4096), bw_bytes: int = 1 << 30, reps: int = 3) -> Roofline:
    """The machine's peak GEMM FLOP/s in whichever dtype it runs fastest (bf16 where native, fp32 on an
    AVX2 CPU; best over square sizes) and read bandwidth (sum over a tensor far beyond L3). A dtype far
    slower than the best at 1024³ is not timed at the large sizes (bf16 on AVX2 would take minutes)."""
    gemm, first = {}, {}
    for dt in (torch.bfloat16, torch.float32):
        a, b = torch.randn(1024, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
        first[dt] = 2 * 1024 ** 3 / _best(lambda: torch.mm(a, b), 1)  # noqa: B023
    for dt, rate in first.items():
        if rate < 0.5 * max(first.values()):
            gemm[f"{str(dt).replace('torch.', '')} 1024"] = rate
            continue
        for n in sizes:
            a = torch.randn(n, n, dtype=dt)
            b = torch.randn(n, n, dtype=dt)
            gemm[f"{str(dt).replace('torch.', '')} {n}"] = 2 * n ** 3 / _best(lambda: torch.mm(a, b), reps)  # noqa: B023
    bw = {}
    for dt in (torch.bfloat16, torch.float32):
        x = torch.ones(bw_bytes // torch.tensor([], dtype=dt).element_size(), dtype=dt)
        bw[str(dt).replace("torch.", "")] = bw_bytes / _best(lambda: x.sum(), reps)  # noqa: B023
    return Roofline(max(gemm.values()), max(bw.values()), gemm, bw)


def expected_distinct(E: int, k: int, tokens: int) -> float:
    """Expected number of distinct experts hit when `tokens` tokens each pick k of E uniformly."""
    return E * (1.0 - (1.0 - k / E) ** tokens)


def decode_step_cost(spec, batch: int, ctx_total: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step over `batch` requests whose cached lengths sum to ctx_total."""
    L = spec.num_layers
    d = spec.dtype_bytes
    hit = expected_distinct(spec.num_experts, spec.top_k, batch)
    lm = spec.vocab_size * spec.hidden_size * d
    weight_bytes = L * (spec.layer_nonexpert_bytes + hit * spec.expert_bytes) + lm + spec.hidden_size * d
    weight_bytes += batch * spec.hidden_size * d  # embedding rows
    kv_bytes = ctx_total * spec.kv_bytes_per_token + batch * spec.kv_bytes_per_token  # read + the write
    dense = spec.active_params - spec.vocab_size * spec.hidden_size  # no embedding matmul
    attn = 4 * spec.num_heads * spec.head_dim * ctx_total * L
    return 2.0 * batch * dense + attn, weight_bytes + kv_bytes


def prefill_cost(spec, lengths: list[int]) -> tuple[float, float]:
    """(FLOPs, bytes) of prefilling prompts of these lengths in one wave (weights read once)."""
    L = spec.num_layers
    T = sum(lengths)
    dense = spec.active_params - spec.vocab_size * spec.hidden_size
    lm = spec.vocab_size * spec.hidden_size
    flops = 2.0 * T * (dense - lm) + 2.0 * len(lengths) * lm  # logits only for the last token
    flops += sum(2 * spec.num_heads * spec.head_dim * n * n for n in lengths) * L  # causal QK^T + PV
    hit = expected_distinct(spec.num_experts, spec.top_k, T)
    bytes_ = L * (spec.layer_nonexpert_bytes + hit * spec.expert_bytes) + lm * spec.dtype_bytes
    bytes_ += T * spec.kv_bytes_per_token
    return flops, bytes_


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads): with wall time, shows how much of the
    cores the run actually got on a shared machine."""
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system


def load_average() -> str:
    from core import platform

    load = platform.load_average()
    return " ".join(f"{x:.2f}" for x in load) if load else "n/a"


def cpu_name() -> str:
    """The CPU's model name, for a result's header: ratios are only comparable on the same CPU."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine() or "unknown"
