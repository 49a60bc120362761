"""The agreement that ends each phase of a multi-rank run (core.runtime.distributed.coord.agree) waits a
bounded time for a rank that is alive but stuck, and names it. Two real gloo ranks, started as the
launchers start them (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment, core.runtime.distributed.world.init)."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest

from core.errors import UsageError
from core.runtime.distributed import world as world_mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out, stuck: float) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MLIGHT_PHASE_TIMEOUT_S="2")
    from core.runtime.distributed import coord
    from core.runtime.distributed.world import World, init

    try:
        groups = init(World(rank, 2, rank, 2))
        coord.agree(None, rank, groups.phase)  # both arrive: nothing happens
        if rank == 1:  # alive, but stuck short of the next phase's end
            time.sleep(stuck)
            out.put((rank, "woke"))
            return
        t0 = time.perf_counter()
        try:
            coord.agree(None, rank, groups.phase)
            out.put((rank, "agreed"))
        except coord.PhaseTimeout as e:
            out.put((rank, (str(e), e.ranks, time.perf_counter() - t0)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(e)))


@pytest.mark.slow
def test_a_stuck_rank_fails_the_phase_agreement_within_its_timeout():
    """Rank 1 is alive but never reaches the second agreement. Rank 0 used to wait there for the coordination
    group's 7 days; now it raises PhaseTimeout naming rank 1 after the phase timeout (2 s here)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out, 60), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, got = out.get(timeout=60)  # rank 0's answer comes long before rank 1 wakes
        assert rank == 0, got
        message, ranks, seconds = got
        assert ranks == [1] and message.startswith("rank 1 did not reach the end of this phase within 2 s")
        assert "MLIGHT_PHASE_TIMEOUT_S" in message and 1.5 < seconds < 15
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)


def test_the_phase_timeout_is_configurable_and_checked():
    assert world_mod.phase_timeout({}) == world_mod.PHASE_TIMEOUT == timedelta(minutes=30)
    assert world_mod.phase_timeout({"MLIGHT_PHASE_TIMEOUT_S": "90"}) == timedelta(seconds=90)
    for bad in ("0", "-3", "soon"):
        with pytest.raises(UsageError, match="MLIGHT_PHASE_TIMEOUT_S"):
            world_mod.phase_timeout({"MLIGHT_PHASE_TIMEOUT_S": bad})
