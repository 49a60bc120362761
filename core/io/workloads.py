"""Benchmark workloads like the paper's: log-normal prompt lengths (mean ≈ 77 tokens, tail to 418), each prompt
the bundled MT-Bench first turns concatenated to its length in the model's tokens.
"""

from __future__ import annotations

import json
import math
import random
from statistics import NormalDist

from core.assets import MT_BENCH


def first_turns() -> list[str]:
    with open(MT_BENCH, encoding="utf-8") as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def target_lengths(n: int, mean: float = 77.0, max_len: int = 418, min_len: int = 8, sigma: float = 0.8) -> list[int]:
    """n prompt lengths, log-normal, clipped to [min_len, max_len], one at max_len, mean ≈ `mean`."""
    nd = NormalDist()
    z = [nd.inv_cdf((i + 0.5) / n) for i in range(n)]
    mu = math.log(mean) - sigma ** 2 / 2
    for _ in range(30):  # re-centre after clipping
        ls = [min(max_len, max(min_len, round(math.exp(mu + sigma * x)))) for x in z]
        if n > 1:
            ls[-1] = max_len
        m = sum(ls) / n
        if abs(m - mean) < 0.5:
            break
        mu += math.log(mean / m)
    random.Random(1).shuffle(ls)
    return ls


def build_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[str]:
    turns = first_turns()
    rng = random.Random(seed)
    out = []
    for target in lengths:
        order = turns[:]
        rng.shuffle(order)
        ids: list[int] = []
        i = 0
        while len(ids) < target:
            ids += tokenizer((("\n\n" if ids else "") + order[i % len(order)])).input_ids
            i += 1
        out.append(tokenizer.decode(ids[:target]))
    return out
