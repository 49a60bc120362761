"""Keep Python's cyclic garbage collector off the objects that existed before a run, while it runs.

A process that has imported torch and transformers and loaded a model tracks ~216,000 objects (the demo
model; mostly the libraries' functions, tuples and dicts). The steps of a run make short-lived objects,
and once enough of them outlive the young generations the collector walks every tracked object: a full
collection took 72-83 ms in a `mlight bench` run of the demo at 256 × 77-token prompts under the AVX2
limits, 8 % of that ~1 s run, at whatever step the threshold happened to cross (bench/RESULTS.md, issue 11).

`gc.freeze()` moves every tracked object into a permanent generation that collections skip, in constant
time; `gc.unfreeze()` puts them back into the oldest. A run freezes the heap it starts with and thaws it when
it ends, so objects made during the run are collected as usual (an out-of-memory retry's abandoned runner
included) and nothing frozen outlives the run: garbage among the old objects waits for the first collection
after it. Runs that overlap in one process (the app's worker beside another) share one freeze, thawed when
the last of them ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_runs = 0


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """While inside: objects that existed on entry (of the first of overlapping entries) are not collected."""
    global _runs
    with _lock:
        if _runs == 0:
            gc.freeze()
        _runs += 1
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0:
                gc.unfreeze()
