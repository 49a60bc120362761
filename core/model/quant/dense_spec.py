"""Which dense weights `--quantize-dense` holds quantized (`DENSE_NAMES` and an untied LM head, where torch's CPU
kernel takes the shape) and their bytes: torch-free, for the planner. `ModelSpec.dense_format` names the format.
"""

from __future__ import annotations

import dataclasses

from core.model.quant.formats import Format

DENSE_NAMES = ("qkv", "o", "shared_w13", "shared_w2")  # used through F.linear only
INT4_ROWS = 16  # torch's int4 CPU kernel packs output rows in tiles of 16


def kernel_takes(fmt: Format, n: int, k: int) -> bool:
    """Whether torch's weight-only CPU kernel for `fmt` takes an [n, k] weight."""
    if fmt.name == "int8":
        return True
    return fmt.name == "int4" and k % fmt.group == 0 and n % INT4_ROWS == 0


def kernel_nbytes(fmt: Format, n: int, k: int, dtype_bytes: int) -> int:
    """Bytes of an [n, k] weight in the CPU kernel's layout: integers, scales (int4: and zeros) in the compute dtype."""
    if fmt.name == "int8":
        return n * k + n * dtype_bytes
    return n * k // 2 + k // fmt.group * n * 2 * dtype_bytes


def with_dense(spec, fmt: Format | None):
    """The ModelSpec whose CPU-only mode holds its dense weights in `fmt` (None: in the checkpoint's dtype)."""
    return dataclasses.replace(spec, dense_format=fmt.label if fmt is not None else "none")


def quantized_matrices(spec) -> list[tuple[int, str, int, int]]:
    """(layer, name, n, k) of every weight the CPU-only mode holds quantized; layer -1 is the LM head."""
    fmt = Format.from_label(spec.dense_format)
    if fmt is None:
        return []
    out = []
    for i in range(spec.num_layers):
        shapes = spec.layer_shapes(i)
        out += [(i, name, *shapes[name]) for name in DENSE_NAMES if name in shapes and kernel_takes(fmt, *shapes[name])]
    if not spec.tie_word_embeddings and kernel_takes(fmt, spec.vocab_size, spec.hidden_size):
        out.append((-1, "lm_head", spec.vocab_size, spec.hidden_size))
    return out


def cpu_nonexpert_bytes(spec) -> int:
    """The non-expert weights as the CPU-only mode holds them: quantized where `quantized_matrices` says."""
    fmt = Format.from_label(spec.dense_format)
    mats = quantized_matrices(spec)
    plain = sum(n * k for _, _, n, k in mats) * spec.dtype_bytes
    return spec.nonexpert_bytes - plain + sum(kernel_nbytes(fmt, n, k, spec.dtype_bytes) for _, _, n, k in mats)


def layer_shares(spec) -> dict[str, float]:
    """Per matrix kind, the share of layers where it is quantized ("lm_head": 1.0 or 0.0)."""
    counts = dict.fromkeys((*DENSE_NAMES, "lm_head"), 0)
    for layer, name, _, _ in quantized_matrices(spec):
        counts[name] += 1
    return {name: (c if name == "lm_head" else c / spec.num_layers) for name, c in counts.items()}


def bits_per_weight(spec) -> float:
    """The quantized dense weights' bits per weight, scales included (0 when none)."""
    fmt, mats = Format.from_label(spec.dense_format), quantized_matrices(spec)
    weights = sum(n * k for _, _, n, k in mats)
    return 8 * sum(kernel_nbytes(fmt, n, k, spec.dtype_bytes) for _, _, n, k in mats) / weights if weights else 0.0
