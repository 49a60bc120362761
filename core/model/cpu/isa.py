"""The CPU's instruction set as our kernels see it: what the silicon has (`hardware`, shown), and what torch,
oneDNN and MKL may use under their limits (`usable`, acted on: CI's AVX2 lane sets them). Tests fake it with
`monkeypatch.setattr(isa, "cpu_isa", ...)`: every caller goes through this module attribute.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import dataclass

LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")  # x86's; elsewhere torch's name, no bf16 fast path
LABELS = {"baseline": "SSE/baseline", "avx2": "AVX2", "avx512": "AVX-512", "avx512_bf16": "AVX-512 BF16",
          "amx": "AMX"}
ENV_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
X86 = platform.machine().lower() in ("x86_64", "amd64", "x86-64")


@dataclass(frozen=True)
class CpuIsa:
    hardware: str  # best level the CPU itself has
    usable: str  # best level torch's kernels and oneDNN will actually use here
    bf16_native: bool  # oneDNN runs bf16 matmuls natively (and can prepack bf16 weights)
    fp16_native: bool  # hardware fp16 matmul (AMX-FP16 / AVX-512 FP16) that torch uses
    limited_by: tuple[str, ...] = ()  # "NAME=value" of the environment settings that lower `usable`
    name: str = ""  # the CPU's marketing name, when known

    @property
    def label(self) -> str:
        """e.g. "AVX2 (CPU has AVX-512 BF16; limited by ONEDNN_MAX_CPU_ISA=AVX2)"."""
        return self.describe()

    def describe(self, name_up_to: int | None = None) -> str:
        """`label`, with more than `name_up_to` limits counted rather than named (their NAME=value words do not fit
        the app's Machine panel at 80 columns: they broke mid-word)."""
        text = LABELS.get(self.usable, self.usable.upper())
        if self.hardware != self.usable:
            named = name_up_to is None or len(self.limited_by) <= name_up_to
            why = ("" if not self.limited_by else f"; limited by {', '.join(self.limited_by)}" if named
                   else f"; limited by {len(self.limited_by)} settings in the environment")
            text += f" (CPU has {LABELS.get(self.hardware, self.hardware.upper())}{why})"
        return text

    def at_least(self, level: str) -> bool:
        return self.usable in LEVELS and LEVELS.index(self.usable) >= LEVELS.index(level)


def _features() -> dict:
    """The CPU's feature flags from torch's cpuinfo (x86 names; empty elsewhere)."""
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        with contextlib.suppress(Exception):  # an older torch or an unusual platform: the probes below
            return dict(get())
    out = {}
    for key, fn in (("avx2", "_is_avx2_supported"), ("avx512_f", "_is_avx512_supported"),
                    ("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_tile", "_is_amx_tile_supported"),
                    ("amx_fp16", "_is_amx_fp16_supported")):
        f = getattr(torch.cpu, fn, None)
        out[key] = bool(f()) if f is not None else False
    return out


# (level, features that imply it), best first
_HW_LEVELS = (("amx", ("amx_bf16", "amx_tile")), ("avx512_bf16", ("avx512_bf16",)), ("avx512", ("avx512_f",)),
              ("avx2", ("avx2",)))


def _aten_level() -> str | None:
    """ATen's vectorised kernels: "AVX512" / "AVX2" / "DEFAULT" on x86, other names elsewhere."""
    import torch

    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:
        return None
    return {"AVX512": "avx512", "AVX2": "avx2", "DEFAULT": "baseline", "NO AVX": "baseline"}.get(cap.upper(), cap.lower())


def _onednn_bf16() -> bool:
    """oneDNN's own answer (it honours ONEDNN_MAX_CPU_ISA): bf16 matmul without emulation."""
    import torch

    fn = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if fn is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(fn())
    except Exception:
        return False


def rank(level: str) -> int:
    """`level`'s place in LEVELS; an unknown one (another architecture's) as baseline."""
    return LEVELS.index(level) if level in LEVELS else 0


# ONEDNN_MAX_CPU_ISA values (prefixes, most specific first) as our levels
_ONEDNN_CAPS = (("AVX512_CORE_AMX", "amx"), ("AVX512_CORE_BF16", "avx512_bf16"), ("AVX10", "avx512_bf16"),
                ("AVX512", "avx512"), ("AVX2", "avx2"), ("SSE", "baseline"), ("DEFAULT", "baseline"))


# MKL_ENABLE_INSTRUCTIONS values below AVX-512 as our levels (MKL's AVX-512 paths do no bf16 math torch uses)
_MKL_CAPS = (("AVX512", None), ("AVX2", "avx2"), ("AVX", "baseline"), ("SSE", "baseline"))


def _cap(table, name: str | None) -> str | None:
    """A limit's value as one of our levels by `table`'s prefixes (None when unset, ALL or unknown)."""
    n = (name or "").strip().upper()
    return next((level for prefix, level in table if n.startswith(prefix)), None) if n else None


def detect(features: dict | None = None, aten: str | None = None, onednn_bf16: bool | None = None,
           env: dict | None = None) -> CpuIsa:
    """The CpuIsa of this process; the arguments stand in for the machine in tests."""
    f = _features() if features is None else features
    env = os.environ if env is None else env
    hw = next((level for level, flags in _HW_LEVELS if any(f.get(x) for x in flags)), "baseline")
    limited = []
    # oneDNN (matmuls, prepacking) honours ONEDNN_MAX_CPU_ISA; ATen's vector kernels (elementwise,
    # softmax, the bf16 conversions) honour ATEN_CPU_CAPABILITY and top out at AVX-512
    onednn = hw
    cap = _cap(_ONEDNN_CAPS, env.get("ONEDNN_MAX_CPU_ISA"))
    if cap is not None and rank(cap) < rank(hw):
        onednn = cap
        limited.append(f"ONEDNN_MAX_CPU_ISA={env['ONEDNN_MAX_CPU_ISA']}")
    aten = _aten_level() if aten is None else aten
    usable = onednn
    if aten in LEVELS and rank(aten) < min(rank(hw), rank("avx512")):
        usable = aten if rank(aten) < rank(usable) else usable
        if env.get("ATEN_CPU_CAPABILITY"):
            limited.append(f"ATEN_CPU_CAPABILITY={env['ATEN_CPU_CAPABILITY']}")
    # MKL reads the CPU itself: without this an AVX2 lane on an AVX-512 box ran its fp32 GEMMs on AVX-512 code
    mkl = _cap(_MKL_CAPS, env.get("MKL_ENABLE_INSTRUCTIONS"))
    if mkl is not None and rank(mkl) < rank(hw):
        usable = mkl if rank(mkl) < rank(usable) else usable
        limited.append(f"MKL_ENABLE_INSTRUCTIONS={env['MKL_ENABLE_INSTRUCTIONS']}")
    bf16 = _onednn_bf16() if onednn_bf16 is None else onednn_bf16
    # oneDNN's bf16 is native from AVX-512 BF16 up; below that it emulates (slowly) or refuses
    bf16_native = bf16 and rank(onednn) >= rank("avx512_bf16")
    fp16_native = bool(f.get("amx_fp16") or f.get("avx512_fp16")) and rank(onednn) >= rank("avx512_bf16")
    return CpuIsa(hardware=hw, usable=usable, bf16_native=bf16_native, fp16_native=fp16_native,
                  limited_by=tuple(dict.fromkeys(limited)), name=str(f.get("cpu_name") or ""))


@functools.lru_cache(maxsize=1)
def cpu_isa() -> CpuIsa:
    """This process's CPU, read once (env limits are read by torch and oneDNN at start-up too)."""
    return detect()
