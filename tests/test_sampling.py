"""Sampling against fixed logits: the exact top-k set, the exact top-p nucleus, and temperature.

`core.model.sampling.sample` draws one token from one seeded generator, so each check draws many
tokens from fixed logits and compares what comes out with what the definition says:
- top-k keeps exactly the k largest logits (every one of them appears, no other ever does);
- top-p keeps the smallest set of most likely tokens whose probability reaches p (HF's rule);
- temperature T samples from softmax(logits / T): frequencies over N seeded draws lie within
  5 standard deviations (sqrt(p(1 - p) / N)) + 0.002 of the float64 probabilities.
The draws are seeded, so these are exact, repeatable checks, not flaky statistics.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from core.model.sampling import greedy, sample

# distinct values (no ties at a top-k boundary), largest first: 2, 4, 0, 6, 1, 3, 7, 5
LOGITS = torch.tensor([2.0, 1.0, 3.0, 0.5, 2.5, -1.0, 1.5, 0.0])
BY_RANK = [2, 4, 0, 6, 1, 3, 7, 5]
# probabilities for top-p with cumulative sums far from every threshold used below
PROBS = torch.tensor([0.06, 0.40, 0.10, 0.25, 0.04, 0.15], dtype=torch.float64)
PROB_RANK = [1, 3, 5, 2, 0, 4]  # 0.40, 0.25, 0.15, 0.10, 0.06, 0.04 (cumulative .40 .65 .80 .90 .96 1)


def draws(logits, n, temperature=1.0, top_k=0, top_p=1.0, seed=0) -> Counter:
    g = torch.Generator().manual_seed(seed)
    return Counter(sample(logits, temperature, top_k, top_p, g) for _ in range(n))


def assert_frequencies(counts: Counter, probs: dict[int, float]) -> None:
    """Observed frequencies within 5 sigma (+0.002) of `probs`; tokens outside `probs` never drawn."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), f"drawn outside the allowed set: {set(counts) - set(probs)}"
    for tok, p in probs.items():
        f = counts[tok] / n
        tol = 5 * math.sqrt(p * (1 - p) / n) + 0.002
        assert abs(f - p) <= tol, f"token {tok}: frequency {f:.4f}, expected {p:.4f} ± {tol:.4f}"


def softmax64(x: torch.Tensor) -> list[float]:
    return torch.softmax(x.double(), dim=-1).tolist()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_top_k_draws_exactly_the_k_largest_logits(k):
    counts = draws(LOGITS, 3000, top_k=k)
    assert set(counts) == set(BY_RANK[:k])
    # renormalised over the k kept logits
    kept = softmax64(LOGITS[BY_RANK[:k]])
    assert_frequencies(counts, dict(zip(BY_RANK[:k], kept)))


def test_top_k_zero_or_the_whole_vocabulary_keeps_everything():
    for k in (0, len(LOGITS), len(LOGITS) + 5):
        counts = draws(LOGITS, 4000, top_k=k)
        assert set(counts) == set(range(len(LOGITS))), k


@pytest.mark.parametrize("top_p,size", [(0.3, 1), (0.5, 2), (0.7, 3), (0.85, 4), (0.93, 5), (0.99, 6)])
def test_top_p_draws_exactly_the_smallest_nucleus_reaching_p(top_p, size):
    logits = PROBS.log().float()
    counts = draws(logits, 4000, top_p=top_p)
    nucleus = PROB_RANK[:size]
    assert set(counts) == set(nucleus), f"top_p={top_p}: drew {sorted(counts)}, nucleus is {sorted(nucleus)}"
    mass = float(PROBS[nucleus].sum())
    assert_frequencies(counts, {t: float(PROBS[t]) / mass for t in nucleus})


def test_a_nucleus_whose_mass_reaches_p_exactly_stops_there():
    # four equal logits: each probability is exactly 0.25 in float32, so two tokens reach 0.5 exactly
    # and the smallest nucleus is those two (a third would be one too many)
    counts = draws(torch.zeros(4), 2000, top_p=0.5)
    assert len(counts) == 2, f"drew {sorted(counts)}"
    assert_frequencies(counts, {t: 0.5 for t in counts})


def test_top_k_applies_before_top_p():
    # top-3 renormalised: 0.506, 0.307, 0.186, so a nucleus of 0.8 keeps two; over the whole
    # distribution (0.403, 0.244, 0.148, ...) it would keep three of the top three
    counts = draws(LOGITS, 3000, top_k=3, top_p=0.8)
    assert set(counts) == {2, 4}


@pytest.mark.parametrize("temperature", [0.5, 2.0, 0.25])
def test_temperature_frequencies_follow_softmax_of_logits_over_t(temperature):
    n = 20000
    counts = draws(LOGITS, n, temperature=temperature, seed=11)
    want = softmax64(LOGITS / temperature)
    assert_frequencies(counts, dict(enumerate(want)))


def test_temperature_applies_before_top_p():
    # at T=0.5 the top token has 0.635 of the mass, at T=1 only 0.403; a nucleus of 0.6 tells them apart
    logits = LOGITS
    assert set(draws(logits, 2000, temperature=0.5, top_p=0.6)) == {2}
    assert set(draws(logits, 2000, temperature=1.0, top_p=0.6)) == {2, 4}


def test_zero_temperature_is_greedy_and_greedy_is_argmax_per_row():
    g = torch.Generator().manual_seed(0)
    assert all(sample(LOGITS, 0.0, 0, 1.0, g) == 2 for _ in range(5))
    rows = torch.stack([LOGITS, LOGITS.flip(0), -LOGITS])
    assert greedy(rows).tolist() == [2, 5, 5]


def test_a_seed_fixes_the_draws_and_another_seed_changes_them():
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample(LOGITS, 1.0, 0, 1.0, g) for _ in range(50)]

    assert run(3) == run(3) and run(3) != run(4)
