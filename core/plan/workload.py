"""What a run asks for, as the planner sees it: lengths, how many requests, and how the prompts spread."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from core.errors import UsageError

SPREAD_SIGMA = 0.8  # log-normal spread of prompt lengths (MT-Bench's; core.io.workloads builds the same)


@dataclass(frozen=True)
class Workload:
    prompt_len: int  # average prompt tokens (the paper's s)
    gen_len: int  # tokens generated per request (n)
    max_prompt_len: int | None = None  # longest prompt: sizes prefill activations; default prompt_len
    num_requests: int | None = None  # requests to run: no point in a batch larger than this
    prompt_sq: float | None = None  # mean squared prompt tokens where known (a part of a run: longest_first)

    def __post_init__(self):
        if self.prompt_len < 1 or self.gen_len < 1:
            raise UsageError(f"prompt and generation lengths must be at least 1, got {self.prompt_len} and "
                             f"{self.gen_len}", "give --prompt-len and --gen-len in tokens")
        if self.max_prompt_len is not None and self.max_prompt_len < self.prompt_len:
            raise UsageError(f"max prompt length {self.max_prompt_len} is below the average {self.prompt_len}",
                             "give the longest prompt's length, or leave it out")
        if self.num_requests is not None and self.num_requests < 1:
            raise UsageError(f"number of requests must be at least 1, got {self.num_requests}", "")

    @property
    def longest_prompt(self) -> int:
        return self.max_prompt_len or self.prompt_len

    @property
    def decode_context(self) -> float:  # the average over a generation
        return self.prompt_len + self.gen_len / 2

    @property
    def spread(self) -> bool:
        return self.longest_prompt > self.prompt_len

    @property
    def prompt_sq_mean(self) -> float:
        """Prefill attention grows with it. Spread prompts: MT-Bench's log-normal, E[L²] = E[L]²·e^(σ²)."""
        if self.prompt_sq is not None:
            return self.prompt_sq
        s, top = self.prompt_len, self.longest_prompt
        return float(s * s) if not self.spread else min(s * top, s * s * math.exp(SPREAD_SIGMA ** 2))

    def longest_first(self, count: int) -> tuple["Workload", "Workload"]:
        """The workloads of the `count` longest requests and of the rest (the engine admits the longest first).
        Above the log-normal z: E[L·1(L>z)] = E[L]·(1 − Φ(z − σ)), E[L²·1(L>z)] = E[L²]·(1 − Φ(z − 2σ)).
        Equal prompts, or the requests not known: this workload for both."""
        n = self.num_requests or 0
        if not (self.spread and 0 < count < n):
            return self, self
        p = count / n  # the share of the long part
        z = NormalDist().inv_cdf(1.0 - p)
        s, sq, sigma = self.prompt_len, self.prompt_sq_mean, SPREAD_SIGMA
        below, below_sq = NormalDist().cdf(z - sigma), NormalDist().cdf(z - 2 * sigma)
        edge = s * math.exp(sigma * z - sigma ** 2 / 2)  # the quantile's length: the short part's longest
        long_len = max(1, round(s * (1 - below) / p))
        short_len = max(1, min(long_len, round(s * below / (1 - p))))
        long = Workload(long_len, self.gen_len, max(long_len, self.longest_prompt), count,
                        prompt_sq=max(long_len ** 2, sq * (1 - below_sq) / p))
        short = Workload(short_len, self.gen_len, max(short_len, min(self.longest_prompt, round(edge))), n - count,
                         prompt_sq=max(short_len ** 2, sq * below_sq / (1 - p)))
        return long, short
