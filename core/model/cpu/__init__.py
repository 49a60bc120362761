"""The CPU as a compute device: what its instruction set allows, and the kernels chosen from that.

`isa` reads the CPU's features and the limits torch and oneDNN run under (ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA); `compute` decides, from that and from measured per-dtype matmul rates, which
dtype the CPU computes in and whether experts are prepacked; `kernels` holds the CPU kernels that
decision needs (low-precision weights widened tile by tile into fp32). Nothing here assumes a
feature is there: every fast path has a fallback with the same numbers, tested by faking the answer.
Imports: torch, `core.errors` and `core.model` only (it is part of `core.model`).
"""
