"""Which dtype the CPU computes in, and whether experts are prepacked: one decision per engine. Where the CPU runs
the weights' dtype natively (bf16 on AVX-512 BF16 / AMX) the math is in it and oneDNN may prepack experts; where
not (AVX2: bf16 `mm` at 1–19 GFLOP/s against 100+ in fp32) it is fp32, weights widened as read. The ISA decides
where it is clear, so a noisy probe cannot flip it; AVX-512 without BF16 goes by the probe's measured rates.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import UsageError
from core.model.cpu import isa as isa_mod

# A low-precision dtype computes natively when its measured matmul rate is at least this share of
# fp32's: it also reads half the bytes, so near-parity compute already wins on memory-bound decode.
NATIVE_SHARE = 0.8
# Rows up to which a low-precision weight is used directly even where its GEMMs are slow: torch's
# bf16 GEMV is bandwidth-bound and fast on AVX2 too, while from M ≈ 4 widening wins.
DIRECT_ROWS = 2
MATH_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CpuCompute:
    storage: str  # dtype of the weights and KV cache in RAM
    math: str  # dtype of the CPU's matmuls and attention
    pack: bool  # experts prepacked for oneDNN (bf16 math on a CPU that accepts it)
    direct_rows: int  # up to this many rows, storage-dtype weights are used without widening
    reason: str  # one line for the user: why this choice
    fused: bool = False  # widened math: the experts widen in registers in mlight's C kernel (core.model.cpu.ffn)

    @property
    def widens(self) -> bool:
        return self.math != self.storage

    def describe(self) -> str:
        how = f"{self.storage} weights, {self.math} math"
        if self.pack:
            how += ", experts prepacked for oneDNN"
        elif self.widens and self.fused:
            how += " (experts widened in registers by mlight's C kernel, dense weights once at load)"
        elif self.widens:
            how += f" (widened tile by tile; {self.direct_rows}-row GEMVs direct)"
        return f"{how}: {self.reason}"


def choose(storage: str, *, rates: dict[str, float] | None = None, math: str | None = None,
           cpu=None, can_pack=None) -> CpuCompute:
    """The CPU compute for weights stored in `storage` (a dtype name). `rates`: measured matmul
    FLOP/s by dtype name (HardwareSpec.cpu_matmul); `cpu`: a CpuIsa (default: this process's);
    `can_pack()`: whether oneDNN accepts bf16 prepacking (default: tried once, core.model.moe)."""
    cpu = cpu or isa_mod.cpu_isa()
    if math is not None:
        if math not in MATH_DTYPES:
            raise UsageError(f"unknown CPU math dtype {math!r}", f"use one of {', '.join(MATH_DTYPES)}")
        reason = "as asked"
    else:
        math, reason = math_for(storage, rates or {}, native(storage, cpu), cpu.label)
    if math != "float32" and math != storage:
        raise UsageError(f"CPU math in {math} over {storage} weights is not supported",
                         "compute in float32 or in the weights' own dtype")
    pack = False
    if math == storage == "bfloat16":
        from core.model.moe import packing_supported

        pack = bool((can_pack or packing_supported)())
    return CpuCompute(storage=storage, math=math, pack=pack, direct_rows=DIRECT_ROWS if math != storage else 0,
                      reason=reason)


def native(storage: str, cpu) -> bool | None:
    """Whether a CpuIsa computes `storage` natively: True, False, or None where only a measurement can say."""
    if storage == "bfloat16":
        if cpu.bf16_native:
            return True
        return None if cpu.at_least("avx512") else False
    return bool(cpu.fp16_native) if storage == "float16" else True


def math_for(storage: str, rates: dict[str, float], is_native: bool | None, label: str) -> tuple[str, str]:
    """(math dtype, why) for weights in `storage`: the ISA where it is clear (`is_native` not None), else the
    measured rates, else fp32; the engine's and the planner's."""
    if storage == "float32":
        return "float32", "fp32 weights"
    if is_native:
        return storage, f"{label} runs {storage} matmuls natively"
    if is_native is False:
        return "float32", f"{label} has no native {storage} matmul"
    low, fp32 = rates.get(storage), rates.get("float32")
    if low and fp32:
        share = low / fp32
        if share >= NATIVE_SHARE:
            return storage, f"{storage} matmul measured at {share:.1f}× fp32 on {label}"
        return "float32", f"{storage} matmul measured at only {share:.2f}× fp32 on {label}"
    return "float32", f"{label} may emulate {storage}; not measured, so fp32"
