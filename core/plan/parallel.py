"""Tensor parallelism: the model one of K ranks runs (1/K of the heads and of every expert's width) and the
machine it sees. The host (memory, bandwidth, cores, a shared PCIe root) is shared, so CPU attention does not
speed up with more GPUs. core.plan.hrm costs the all-reduces.
"""

from __future__ import annotations

import dataclasses

from core.errors import UsageError
from core.model.spec import ModelSpec
from core.plan.hardware import HardwareSpec


def with_gpus(hw: HardwareSpec, gpus: int) -> HardwareSpec:
    """`--gpus K`: the same host with K of its GPU."""
    if gpus < 1:
        raise UsageError(f"--gpus must be at least 1, got {gpus}", "give the number of GPUs to use")
    if not hw.has_gpu:
        raise UsageError(f"--gpus {gpus} on a machine without a GPU", "use a GPU preset, e.g. --hardware t4")
    return dataclasses.replace(hw, gpu_count=gpus)


def rank_model(model: ModelSpec, ranks: int) -> ModelSpec:
    """The largest rank's part of the model (rank 0 takes the extra head or column of an uneven split)."""
    if ranks == 1:
        return model
    from core.model.shard import local_spec, plan_shard

    return local_spec(model, plan_shard(model, 0, ranks))


def rank_hardware(hw: HardwareSpec, ranks: int) -> HardwareSpec:
    """One GPU of `hw` with a `ranks`-th of its host (one process on a 4-GPU machine: one GPU, the whole host)."""
    if ranks == 1 and hw.gpu_count <= 1:
        return hw
    if hw.has_gpu and ranks > hw.gpu_count:
        raise UsageError(f"{ranks} tensor-parallel ranks need {ranks} GPUs; {hw.name} has {hw.gpu_count}",
                         "use at most one rank per GPU")
    link = min(hw.h2d_bw, hw.host_link_bw / ranks) if hw.host_link_bw else hw.h2d_bw  # a shared root complex
    return dataclasses.replace(
        hw, gpu_count=1 if hw.has_gpu else 0, h2d_bw=link, d2h_bw=min(hw.d2h_bw, link),
        cpu_flops=hw.cpu_flops / ranks, cpu_bw=hw.cpu_bw / ranks, cpu_cores=max(1, hw.cpu_cores // ranks),
        cpu_mem_bytes=hw.cpu_mem_bytes // ranks,
        cpu_mem_available_bytes=None if hw.cpu_mem_available_bytes is None else hw.cpu_mem_available_bytes // ranks)


def rank_view(model: ModelSpec, hw: HardwareSpec, budget, ranks: int):
    """(model, hardware, budget) as one of `ranks` ranks sees them; each gets one GPU's share of the GPU budget,
    a `ranks`-th of the CPU's. `budget` may be None."""
    if ranks == 1 and hw.gpu_count <= 1:
        return model, hw, budget
    if budget is not None:
        budget = dataclasses.replace(budget, gpu_bytes=budget.gpu_bytes // max(1, hw.gpu_count),
                                     cpu_bytes=budget.cpu_bytes // ranks)
    return rank_model(model, ranks), rank_hardware(hw, ranks), budget

