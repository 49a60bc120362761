"""Beyond one process: tensor parallelism over a machine's GPUs and data parallelism over ranks.

Built on torch.distributed (NCCL between GPUs, gloo on the CPU) and torch's elastic launcher (the
engine behind `torchrun`); mlight adds no transport or scheduler of its own.
- `world`: who this process is (rank, tensor-parallel group, data-parallel replica) from the launcher's
  environment, and the process groups.
- `tensor_parallel`: the collectives the pipeline calls (all-reduce after the O projection and after
  the MoE FFN, the sampled tokens from the group's first rank, agreeing to stop).
- `launch`: `mlight run --tensor-parallel K` starting K local ranks through the elastic launcher.
- `ray_data`: the callable class Ray Data's `map_batches` runs on each actor (optional `mlight[ray]`).
Imports: like the rest of `core.runtime` — `core.model`, `core.plan`, `core.errors`, `core.telemetry`.
"""
