"""Data parallelism's bookkeeping: replica d of D runs every D-th entry from d (once bad lines are set aside, the
same on every rank) into its own run file `OUT.dp{d}of{D}.run.jsonl`; one replica keeps the plain
`OUT.run.jsonl`, which either kind of run can resume. Rank 0 merges the records in input order.
"""

from __future__ import annotations

import glob
from pathlib import Path

from core.io.prompts import PromptEntry


def part_name(dp_rank: int, dp_size: int) -> str:
    return "" if dp_size == 1 else f"dp{dp_rank}of{dp_size}"


def shard_entries(entries: list[PromptEntry], dp_rank: int, dp_size: int) -> list[PromptEntry]:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"replica {dp_rank} outside {dp_size}")
    return entries[dp_rank::dp_size]


def merge(entries: list[PromptEntry], parts: list[dict[str, dict]]) -> tuple[dict[str, dict], list[str]]:
    done = {k: v for p in parts for k, v in p.items()}
    return done, [e.id for e in entries if e.id not in done]


def other_parts(out: Path, dp_size: int) -> list[Path]:
    """Run files next to `out` left by a run with another number of replicas, which only that many resume."""
    mine = f"of{dp_size}.run.jsonl"
    return sorted(p for p in out.parent.glob(glob.escape(out.name) + ".dp*of*.run.jsonl")
                  if dp_size == 1 or not p.name.endswith(mine))
