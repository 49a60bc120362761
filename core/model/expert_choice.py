"""Which routed-expert kernel runs (grouped_mm over all experts, or a matmul pair per expert with tokens), timed on
the real inputs at a shape's first call. The CPU's choices are kept on disk per machine, torch build, threads and
experts' code (`_path`): measuring costs a fresh run a seventh of its time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

_CHOICE: dict[tuple, str] = {}
TRIALS = 3
_lock = threading.Lock()
_saved: dict[Path, dict[str, str]] = {}  # each context's choices on disk, read at its first CPU choice


def bucket(tokens: int) -> int:
    """The token count rounded up to a power of two: choices are shared by batches of similar size."""
    return 1 << max(0, tokens - 1).bit_length()


def choose(key: tuple, candidates: dict[str, Callable[[], object]], sync: Callable[[], None] = lambda: None,
           clock: Callable[[], float] = time.perf_counter) -> str:
    """The fastest candidate for `key`, timed on first use (on the CPU, first use on this machine: kept on disk)."""
    if key in _CHOICE:
        return _CHOICE[key]
    cpu = key[:1] == ("cpu",)
    name = _saved_choice(key) if cpu else None
    if name not in candidates:
        name = _measure(candidates, sync, clock)
        if cpu:
            _save(key, name)
    _CHOICE[key] = name
    return name


def chosen() -> dict[tuple, str]:
    """What this process uses so far, measured or read back (for `mlight bench` and tests)."""
    return dict(_CHOICE)


def _measure(candidates, sync, clock) -> str:
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
    return min(best, key=best.get)


def _entry(key: tuple) -> str:
    import torch

    # the thread count is read at each choice: the engine follows the free cores between steps
    return f"{torch.get_num_threads()}|{key!r}"


@functools.lru_cache(maxsize=1)
def _code() -> str:
    from importlib.util import find_spec

    return hashlib.sha256(b"".join(Path(find_spec(m).origin).read_bytes()
                                   for m in ("core.model.expert_choice", "core.model.moe"))).hexdigest()


def _path() -> Path:
    """The file of this machine's, torch build's and experts' code's choices."""
    import platform

    import torch

    from core.model.cpu.isa import ENV_LIMITS
    from core.platform import cache_dir

    ident = "|".join([platform.node(), platform.processor(), platform.machine(), str(os.cpu_count()),
                      torch.__version__, _code(), *(f"{k}={os.environ.get(k, '')}" for k in ENV_LIMITS)])
    return cache_dir() / "expert_choice" / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def _read(path: Path) -> dict[str, str]:
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or a torn or foreign file: measured again
        return {}
    return {k: v for k, v in got.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(got, dict) else {}


def _saved_choice(key: tuple) -> str | None:
    with _lock:
        path = _path()
        if path not in _saved:
            _saved[path] = _read(path)
        return _saved[path].get(_entry(key))


def _save(key: tuple, name: str) -> None:
    """Add the choice to this context's file (merged, written whole, renamed over); a failed write costs a rerun."""
    from core.platform import write_whole

    with _lock:
        path = _path()
        _saved[path] = merged = {**_read(path), **_saved.get(path, {}), _entry(key): name}
        with contextlib.suppress(OSError):
            write_whole(path, json.dumps(merged, indent=0, sort_keys=True))
