"""A torch.distributed job's ranks and groups: `tp` consecutive ranks of a node form a tensor-parallel replica."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from core.errors import UsageError

# replicas may finish hours apart; a dead peer is noticed at once (its connection closes), not after this
COORDINATION_TIMEOUT = timedelta(days=7)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # one all-reduce inside a step; a stuck peer ends the job
# how far a rank may lag behind the first to end a phase: generous, for a slow disk loading a 90 GB model
PHASE_TIMEOUT = timedelta(minutes=30)


def phase_timeout(env=None) -> timedelta:
    raw = (os.environ if env is None else env).get("MLIGHT_PHASE_TIMEOUT_S", "").strip()
    if not raw:
        return PHASE_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise UsageError(f"MLIGHT_PHASE_TIMEOUT_S={raw!r} is not a positive number of seconds",
                         "set it to how long a rank may lag behind the others at the end of a phase, e.g. 3600")
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    tp: int = 1  # ranks per tensor-parallel group

    def __post_init__(self):
        if self.tp < 1 or self.size % self.tp:
            raise UsageError(f"--tensor-parallel {self.tp} does not divide the {self.size} ranks of this job",
                             "start a multiple of --tensor-parallel ranks (torchrun --nproc-per-node)")
        if self.local_size % self.tp:
            raise UsageError(f"--tensor-parallel {self.tp} does not divide the {self.local_size} ranks on this node",
                             "a tensor-parallel group lives on one machine: give --nproc-per-node a multiple of it")

    @property
    def dp_size(self) -> int:
        return self.size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_leader(self) -> bool:  # the rank of its group that samples tokens and writes results
        return self.rank % self.tp == 0

    def tp_ranks(self, replica: int | None = None) -> list[int]:
        r = self.dp_rank if replica is None else replica
        return list(range(r * self.tp, (r + 1) * self.tp))


def from_env(tp: int = 1, env=None) -> World | None:
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    try:
        size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local_rank, local_size = int(env.get("LOCAL_RANK", rank)), int(env.get("LOCAL_WORLD_SIZE", size))
    except ValueError:
        raise UsageError("RANK / WORLD_SIZE / LOCAL_RANK in the environment are not numbers",
                         "start mlight with torchrun, or unset those variables") from None
    return None if size == 1 and tp == 1 else World(rank, size, local_rank, local_size, tp)  # one process: a plain run


@dataclass
class Groups:
    tp: object  # this rank's tensor-parallel group
    tp_backend: str
    phase: object  # gloo, every rank: agreeing on each phase (core.runtime.distributed.coord.Phase)


def init(world: World) -> Groups:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()  # then one GPU for each local rank
    if cuda and (n := torch.cuda.device_count()) < world.local_size:
        raise UsageError(f"{world.local_size} ranks on this node but torch sees {n} GPU{'s' if n != 1 else ''}",
                         "start one rank per GPU (--nproc-per-node), or hide the GPUs (CUDA_VISIBLE_DEVICES=) "
                         "to run on the CPU")
    if cuda:
        torch.cuda.set_device(world.local_rank)
    from core.runtime.distributed.coord import Phase

    wait = phase_timeout()
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", timeout=COORDINATION_TIMEOUT)  # the default group: results gather
    phase = Phase(dist.new_group(backend="gloo", timeout=wait), wait)
    backend = "nccl" if cuda else "gloo"
    # every rank creates every group, in the same order
    tp = [dist.new_group(world.tp_ranks(r), backend=backend, timeout=COLLECTIVE_TIMEOUT) for r in range(world.dp_size)]
    return Groups(tp[world.dp_rank], backend, phase)


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
