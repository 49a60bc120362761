"""Coordination between a job's ranks over gloo: agreeing that a phase went well, collecting results on rank 0, a
dead rank named at once (its connection closes) and a stuck one past the phase timeout."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from core.errors import MlightError, UsageError


@dataclass(frozen=True)
class Phase:
    """A gloo group of every rank, and its wait: torch's monitored barrier does not read the group's own timeout."""

    group: object
    timeout: timedelta


class PhaseTimeout(MlightError):
    def __init__(self, ranks: list[int] | None, timeout: timedelta):
        who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks
               else "rank 0 (or a rank it waits for)")
        super().__init__(f"{who} did not reach the end of this phase within {timeout.total_seconds():g} s "
                         "(stuck, or far slower than the others)",
                         "stop the job and rerun it (finished results are kept); if a rank is merely slow "
                         "(downloading the model, a slow disk), set MLIGHT_PHASE_TIMEOUT_S to more seconds")
        self.ranks = ranks or []


class Quiet(Exception):
    """Raised on ranks other than 0 when rank 0 reports the job's error: exit with `code`, print nothing."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class RankLost(MlightError):
    """Another rank stopped (killed, crashed) before sending its results."""


def _describe(e: BaseException | None):
    if e is None:
        return None
    if isinstance(e, MlightError):
        return (e.exit_code, e.problem, e.hint, isinstance(e, UsageError))
    if isinstance(e, KeyboardInterrupt):
        return (130, "interrupted", "", False)
    return (1, f"{type(e).__name__}: {e}", "", False)


def arrive(phase: Phase, rank: int) -> None:
    try:
        dist.monitored_barrier(group=phase.group, timeout=phase.timeout, wait_all_ranks=True)
    except RuntimeError as e:  # rank 0: "Ranks 1, 2 failed to pass monitoredBarrier"; others: rank 0 never answered
        found = re.search(r"Ranks? ([\d, ]+) failed to pass", str(e)) if rank == 0 else None
        raise PhaseTimeout([int(r) for r in found.group(1).replace(",", " ").split()] if found else None,
                           phase.timeout) from e


def agree(error: BaseException | None, rank: int, phase: Phase | None = None) -> None:
    """An error on any rank: rank 0 raises the first (naming its rank), the others Quiet with its exit code."""
    if phase is not None:
        arrive(phase, rank)
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, _describe(error), group=phase.group if phase is not None else None)
    failed = [(r, d) for r, d in enumerate(got) if d is not None]
    if not failed:
        return
    r, (code, problem, hint, usage) = failed[0]
    if rank != 0:
        raise Quiet(code)
    where = "" if r == 0 else f"rank {r}: "
    if code == 130:
        raise KeyboardInterrupt
    err = (UsageError if usage else MlightError)(where + problem, hint)
    err.exit_code = code
    raise err


def collect(obj, rank: int) -> list | None:
    """Rank 0: every rank's `obj`, by rank (RankLost names the first rank gone); other ranks: None."""
    if rank != 0:
        dist.send_object_list([obj], dst=0)
        return None
    out = [obj]
    for src in range(1, dist.get_world_size()):
        box = [None]
        try:
            dist.recv_object_list(box, src=src)
        except RuntimeError as e:  # gloo: "Connection closed by peer" — the rank died
            raise RankLost(f"rank {src} stopped before the end of the run (killed or crashed; torchrun's report "
                           "names its exit code)", "every finished result is saved in its replica's run file; rerun "
                           "the same command to resume every rank") from e
        out.append(box[0])
    return out


def broadcast(obj, rank: int, phase: Phase | None = None):
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=phase.group if phase is not None else None)
    return box[0]
