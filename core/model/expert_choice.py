"""Which routed-expert kernel runs — grouped_mm over all experts, or one matmul pair per expert that got
tokens — chosen by timing both on this machine.

Neither wins everywhere. The loop pays a fixed cost per expert that got tokens, which with 256–512
small experts (Qwen3-Next, Qwen3.5, DeepSeek-V3) dominates small batches; grouped_mm pays for its
layout and, on some CPUs and dtypes, a slower inner kernel. So the first call for a shape — device,
dtype, experts, sizes, biases, and the token count rounded up to a power of two — times both on the
real inputs (interleaved, best of a few), and the faster is used for that shape from then on in this
process. A measurement costs a few kernel calls once per shape; later calls only look the choice up.
"""

from __future__ import annotations

import time
from typing import Callable

_CHOICE: dict[tuple, str] = {}
TRIALS = 3


def bucket(tokens: int) -> int:
    """The token count rounded up to a power of two: choices are shared by batches of similar size."""
    return 1 << max(0, tokens - 1).bit_length()


def choose(key: tuple, candidates: dict[str, Callable[[], object]], sync: Callable[[], None] = lambda: None,
           clock: Callable[[], float] = time.perf_counter) -> str:
    """The name of the fastest candidate for `key`, timing each (after a warm-up call) on first use."""
    if key not in _CHOICE:
        for fn in candidates.values():
            fn()
        sync()
        best = {name: float("inf") for name in candidates}
        for _ in range(TRIALS):
            for name, fn in candidates.items():
                t0 = clock()
                fn()
                sync()
                best[name] = min(best[name], clock() - t0)
        _CHOICE[key] = min(best, key=best.get)
    return _CHOICE[key]


def chosen() -> dict[tuple, str]:
    """What has been measured so far (for `mlight bench` and tests)."""
    return dict(_CHOICE)
