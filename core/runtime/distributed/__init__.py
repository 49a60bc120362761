"""Beyond one process: tensor parallelism over a machine's GPUs, data parallelism over ranks, Ray Data actors.

Built on torch.distributed (NCCL between GPUs, gloo on the CPU) and torch's elastic launcher; mlight adds no
transport or scheduler of its own.
Imports: like the rest of `core.runtime` — `core.model`, `core.plan`, `core.errors`, `core.telemetry`.
"""
