"""Coordination between the ranks of a job, over the gloo group: agreeing that a phase went well,
collecting results on rank 0, and naming the rank that is gone when one dies.

Errors a user can cause are usually seen by every rank alike (a bad prompts file); `agree` makes
sure exactly one line is printed, by rank 0, and every rank exits with the same code. A rank that
dies mid-run closes its connections, so rank 0 learns which one at once (`RankLost`), however long
the others still have to work.
"""

from __future__ import annotations

import torch.distributed as dist

from core.errors import MlightError, UsageError


class Quiet(Exception):
    """Raised on ranks other than 0 when rank 0 reports the job's error: exit with `code`, print nothing."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class RankLost(MlightError):
    """Another rank of the job stopped (killed, crashed) before sending its results."""

    def __init__(self, rank: int, problem: str, hint: str = ""):
        super().__init__(problem, hint)
        self.rank = rank


def _describe(e: BaseException | None):
    if e is None:
        return None
    if isinstance(e, MlightError):
        return (e.exit_code, e.problem, e.hint, isinstance(e, UsageError))
    if isinstance(e, KeyboardInterrupt):
        return (130, "interrupted", "", False)
    return (1, f"{type(e).__name__}: {e}", "", False)


def agree(error: BaseException | None, rank: int) -> None:
    """Every rank passes what went wrong in the last phase (or None); if anything did, rank 0 raises
    the first rank's error (naming the rank) and the others raise Quiet with its exit code."""
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, _describe(error))
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
    """Rank 0: every rank's `obj`, by rank (raises RankLost naming the first rank that is gone).
    Other ranks: send `obj` to rank 0 and return None."""
    if rank != 0:
        dist.send_object_list([obj], dst=0)
        return None
    out = [obj]
    for src in range(1, dist.get_world_size()):
        box = [None]
        try:
            dist.recv_object_list(box, src=src)
        except RuntimeError as e:  # gloo: "Connection closed by peer" — the rank died
            raise RankLost(src, f"rank {src} stopped before the end of the run (killed or crashed; torchrun's "
                                "report names its exit code)",
                           "every finished result is saved in its replica's run file; rerun the same command to "
                           "resume every rank") from e
        out.append(box[0])
    return out


def broadcast(obj, rank: int):
    """Rank 0's `obj` on every rank."""
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
