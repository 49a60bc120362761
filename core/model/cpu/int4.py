"""The int4 weight-only matmul in C (core/assets/kernels/int4_matmul.c): torch's int4 CPU kernel widens every
weight to float, which makes it compute-bound; this one quantizes the few activation rows instead (two int8 digits
an input, a scale per 8) and dots integers (AVX512_VNNI, else vpmaddubsw) on mlight's own int4 layout as stored.
`linear` is one matrix, `moe` one token's experts with SwiGLU in one call, where `runs` says.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from core.assets import INT4_MATMUL_C as SOURCE
from core.model.cpu import isa, native

GROUPS = (32, 64, 128)
MAX_EXPERTS = 64  # routed experts of one token the fused call takes

class _Lib(native.Library):
    def __init__(self, path, flags: str):
        super().__init__(path, flags, "mlight_int4_openmp")
        P, I, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.linear = native.bind(self.dll, "mlight_int4_linear", [P, C, I, I, I, P, I, P, I, I, I, P, C, I, P, C], C)
        self.moe = native.bind(self.dll, "mlight_int4_moe", [P, C, I, I, I, C, P, P, C, P, I, P, I, P, I, P, I, P, C, P, C], C)
        self.scratch = native.bind(self.dll, "mlight_int4_scratch", [I, I, I, I, I], I)
        self.vw = self.dll.mlight_int4_vw()


@functools.lru_cache(maxsize=1)
def _vnni() -> bool:
    """Whether the CPU has AVX512_VNNI (its int8 dot product); a module attribute so tests can say no."""
    return bool(isa._features().get("avx512_vnni"))


def _build(level: str, vnni: bool):
    flags, vw = native._flags()
    if vw == 16 and vnni:
        flags = [*flags, "-mavx512vnni"]
    return native.build_kernel(SOURCE, "int4_matmul", [f"-DVW={vw}", *flags], vw,
                               lambda path: _Lib(path, " ".join(flags) or "baseline"), vw_of=lambda lib: lib.vw)


KERNEL = native.Kernel("building the CPU int4 kernel (once per machine)", _build,
                       key=lambda: (isa.cpu_isa().usable, _vnni()))
library, prepare = KERNEL.library, KERNEL.prepare


def status() -> str:
    """One line for `mlight hw`: which int4 matmul runs at small batches, and why."""
    lib = library()
    if lib is None:
        return f"torch's weight-only kernel ({KERNEL.reason})"
    return f"C kernel ({lib.flags})" + ("" if lib.openmp else "; one thread: torch's kernel when torch runs more")


def runs(dtype: torch.dtype, *ks: int, group: int) -> bool:
    """Whether the kernel takes inputs of these sizes at this group, computing in `dtype`, here."""
    if dtype not in (torch.bfloat16, torch.float32) or group not in GROUPS or any(k % 32 or k % group for k in ks):
        return False
    return native.runs(library())


def _is_bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def linear(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] (bf16/fp32, rows contiguous) · Wᵀ -> [M, N] in x's dtype; W [N, K] as q uint8 [N, K/2] and
    sz bf16 [N, K/group, 2], each with contiguous rows. The caller checked `runs`."""
    lib = library()
    M, K = x.shape
    N = q.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype)
    s = native.scratch(lib.sized("scratch", M, K, 0, 0, 0))
    if lib.linear(x.data_ptr(), _is_bf16(x), x.stride(0), M, K, q.data_ptr(), q.stride(0), sz.data_ptr(), sz.stride(0),
                  N, group, y.data_ptr(), _is_bf16(y), N, s.data_ptr(), torch.get_num_threads()):
        raise RuntimeError(f"the int4 kernel refused K={K}, group {group}")
    return y


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: tuple, w2: tuple, group: int) -> torch.Tensor:
    """One token's routed experts: x [1, D]; ids, weights [1, k] on the host; w13 = (q [E, 2I, D/2], sz [E, 2I,
    D/g, 2]) gate then up rows, w2 = (q, sz) likewise -> Σ weight · down(silu(gate) · up) [1, D] in x's dtype."""
    lib = library()
    D = x.shape[-1]
    I = w2[0].shape[-1] * 2
    k = ids.shape[-1]
    ids, weights, x = native.moe_inputs(ids, weights, x)
    out = torch.empty((1, D), dtype=x.dtype)
    s = native.scratch(lib.sized("scratch", 0, 0, k, D, I))
    (q13, s13), (q2, s2) = w13, w2
    if lib.moe(x.data_ptr(), _is_bf16(x), D, I, group, k, ids.data_ptr(), weights.data_ptr(), _is_bf16(weights),
               q13.data_ptr(), q13.stride(0), s13.data_ptr(), s13.stride(0), q2.data_ptr(), q2.stride(0),
               s2.data_ptr(), s2.stride(0), out.data_ptr(), _is_bf16(out), s.data_ptr(), torch.get_num_threads()):
        raise RuntimeError(f"the int4 kernel refused D={D}, I={I}, group {group}, {k} experts")
    return out
