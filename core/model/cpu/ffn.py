"""A layer's routed experts in one C call (core/assets/kernels/moe_ffn.c), bf16 on AVX-512 BF16 CPUs: at a decode
step's few rows oneDNN's packed bf16 GEMM stays well below peak, and the experts are most of the step. The kernel
fuses gate/up, SiLU(gate)·up, down, the routing weights and the sum in fp32 (rounded once to bf16) on weights
packed once at load; where `takes` says no, oneDNN's packing (core.model.moe). On AMX, experts of 8 rows or more
run as AMX tiles; on AVX2 `library_avx2` (moe_ffn_avx2.c) runs the same packed weights with fp32 activations.
"""

from __future__ import annotations

import ctypes

import torch

from core.assets import MOE_FFN_AVX2_C as SOURCE_AVX2
from core.assets import MOE_FFN_C as SOURCE
from core.model import kernels
from core.model.cpu import hugepages, isa, native

CHUNK_TOKENS = 512  # tokens per call: a long prefill's intermediate stays at 2·512·I bf16
FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"]
FLAGS_AMX = ["-mamx-tile", "-mamx-bf16", "-mxsave"]  # where the usable ISA is AMX: the kernel's tile path (moe_ffn.c)
FLAGS_AVX2 = ["-mavx2", "-mfma"]
SWITCHES = ("MLIGHT_NATIVE", "MLIGHT_NATIVE_EXPERTS")  # either set to 0: no expert kernel
AMX_SWITCHES = ("MLIGHT_NATIVE_AMX", "MLIGHT_AMX")  # 0: the vector tiles alone on an AMX CPU (an A/B switch)

class _Lib(native.Library):
    def __init__(self, path, flags_amx: bool = False):
        super().__init__(path, "", "mlight_moe_openmp")
        P, I, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.ffn = native.bind(self.dll, "mlight_moe_ffn", [P, I, I, P, P, C, I, I, I, P, I, P, I, P, P, C], C)
        self.scratch = native.bind(self.dll, "mlight_moe_scratch", [I, I, I, I, I, I], I)
        self.linear = native.bind(self.dll, "mlight_linear", [P, I, I, I, P, I, P, P, I, P, C], None)  # panel_linear
        self.linear_scratch = native.bind(self.dll, "mlight_linear_scratch", [I, I, I], I)
        self.dll.mlight_moe_amx.restype = C
        # Linux grants the tile state on request, once per process; refused, the vector tiles run
        self.amx = flags_amx and self.dll.mlight_moe_amx_init() == 0 and bool(self.dll.mlight_moe_amx())
        self.flags = " ".join(FLAGS + (FLAGS_AMX if self.amx else [])) + (" -fopenmp" if self.openmp else "")


class _LibAvx2(native.Library):
    """moe_ffn_avx2.c: fp32 activations over the same packed bf16 weights."""

    def __init__(self, path):
        super().__init__(path, " ".join(FLAGS_AVX2), "mlight_moe_avx2_openmp")
        P, I, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.ffn = native.bind(self.dll, "mlight_moe_avx2", [P, I, I, P, P, I, I, I, P, I, P, I, P, P, C], C)
        self.scratch = native.bind(self.dll, "mlight_moe_avx2_scratch", [I, I, I, I, I], I)


def _build(level: str):
    if not kernels.switched_off(SWITCHES) and isa.rank(level) < isa.rank("avx512_bf16"):
        return None, f"the CPU's usable ISA ({isa.cpu_isa().label}) has no AVX-512 BF16 dot product"
    amx = level == "amx" and not kernels.switched_off(AMX_SWITCHES)
    lib, why = native.build_kernel(SOURCE, "moe_ffn", FLAGS + (FLAGS_AMX if amx else []), 16,
                                   lambda path: _Lib(path, amx), SWITCHES)
    if lib is None and amx:  # a compiler without the AMX flags: the vector tiles alone
        return native.build_kernel(SOURCE, "moe_ffn", FLAGS, 16, _Lib, SWITCHES)
    return lib, why


def _build_avx2(level: str):
    if not kernels.switched_off(SWITCHES) and (not isa.X86 or isa.rank(level) < isa.rank("avx2")):
        return None, f"the CPU's usable ISA ({isa.cpu_isa().label}) has no AVX2"
    return native.build_kernel(SOURCE_AVX2, "moe_ffn_avx2", FLAGS_AVX2, 8, _LibAvx2, SWITCHES)


KERNEL = native.Kernel("building the CPU expert kernel (once per machine)", _build)
# the fp32-math kernel over packed bf16 experts: AVX2 CPUs, where bf16 matmuls are slow
KERNEL_AVX2 = native.Kernel(KERNEL.what, _build_avx2)
library, library_avx2 = KERNEL.library, KERNEL_AVX2.library


def status(math: str = "bfloat16") -> str:
    """One line for `mlight hw`: what runs the bf16 routed experts when the CPU computes in `math`, and why."""
    if math == "float32":
        wide = library_avx2()
        if wide is None:
            return f"torch's GEMMs on tiles widened to fp32 ({KERNEL_AVX2.reason})"
        return f"fused C kernel in fp32 math ({wide.flags})" + ("" if wide.openmp else "; one thread")
    lib = library()
    if lib is None:
        return f"oneDNN's packed GEMMs ({KERNEL.reason})"
    tiles = "; AMX tiles from 8 rows an expert" if lib.amx else ""
    return f"fused C kernel ({lib.flags}){tiles}" + ("" if lib.openmp else "; one thread: oneDNN when torch runs more")


def prepare(progress=None, widened: bool = False) -> None:
    (KERNEL_AVX2 if widened else KERNEL).prepare(progress)


def _fits(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """bf16 experts w13 [E, 2I, D], w2 [E, D, I] on the CPU with D a multiple of 64 and I of 32."""
    if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16 or w13.dim() != 3 or w13.device.type != "cpu":
        return False
    E, two_i, D = w13.shape
    return not (two_i % 64 or D % 64) and tuple(w2.shape) == (E, D, two_i // 2)


def takes(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the kernel runs experts w13 [E, 2I, D], w2 [E, D, I] here (SwiGLU, no biases: the caller's part)."""
    return _fits(w13, w2) and native.runs(library())


def takes_widened(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """`takes` for the fp32-math kernel: the CPU computes in fp32 because its bf16 matmuls are slow (AVX2)."""
    return _fits(w13, w2) and native.runs(library_avx2())


class NativeExperts:
    """A layer's experts in moe_ffn.c's layout, held instead of the row-major weights (the same bytes): w13
    [E, I/32, D/2, 4, 16, 2] (gate and up columns interleaved per panel), w2 [E, D/64, I/2, 4, 16, 2], bf16."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        E, two_i, D = w13.shape
        I = two_i // 2
        self.E, self.D, self.I = E, D, I
        self.w13 = hugepages.empty((E, I // 32, D // 2, 4, 16, 2), torch.bfloat16)  # streamed every step
        self.w2 = hugepages.empty((E, D // 64, I // 2, 4, 16, 2), torch.bfloat16)
        for e in range(E):  # one expert at a time: no whole-layer temporary
            self.w13[e].copy_(pack_gate_up(w13[e]))
            self.w2[e].copy_(pack_rows(w2[e]))

    fused_swiglu = True  # what core.model.moe.experts recognises this layout by

    def __len__(self) -> int:
        return self.E

    @property
    def held_bytes(self) -> int:
        return 2 * (self.w13.numel() + self.w2.numel())

    def __call__(self, h: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, D] bf16 (fp32: fp32 math), routing weights and ids [T, k] -> [T, D] in h's dtype (into `out`)."""
        wide = h.dtype == torch.float32
        lib = library_avx2() if wide else library()
        if lib is None:
            why = (KERNEL_AVX2 if wide else KERNEL).reason
            raise RuntimeError(f"no expert kernel for {h.dtype} activations here ({why})")
        T, k = idx.shape
        if wide or weights.dtype not in (torch.bfloat16, torch.float32):
            weights = weights.float()
        h, idx, weights = h.contiguous(), idx.contiguous(), weights.contiguous()
        out = torch.empty((T, self.D), dtype=h.dtype) if out is None else out
        n = torch.get_num_threads() if lib.openmp else 1
        x0, i0, w0, o0 = h.data_ptr(), idx.data_ptr(), weights.data_ptr(), out.data_ptr()
        xs, is_, ws, os_ = (t.stride(0) * t.element_size() for t in (h, idx, weights, out))  # bytes a row
        experts = (self.w13.data_ptr(), self.w13.stride(0), self.w2.data_ptr(), self.w2.stride(0))
        for a in range(0, T, CHUNK_TOKENS):  # one call at a decode step's rows
            b = min(T, a + CHUNK_TOKENS)
            rows = (x0 + a * xs, b - a, k, i0 + a * is_, w0 + a * ws)
            if wide:
                s = native.scratch(lib.sized("scratch", b - a, k, self.E, self.I, n))
                bad = lib.ffn(*rows, self.E, self.D, self.I, *experts, o0 + a * os_, s.data_ptr(), n)
            else:
                s = native.scratch(lib.sized("scratch", b - a, k, self.E, self.D, self.I, n))
                bad = lib.ffn(*rows, int(weights.dtype == torch.bfloat16), self.E, self.D, self.I, *experts,
                              o0 + a * os_, s.data_ptr(), n)
            if bad:
                raise ValueError(f"expert ids outside 0..{self.E - 1}")
        return out


def pack_rows(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (output rows) -> [N/64, K/2, 4, 16, 2]: 64-column panels, bf16 pairs along K."""
    N, K = w.shape
    return w.view(N // 64, 4, 16, K // 2, 2).permute(0, 3, 1, 2, 4)


def pack_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """w13 [2I, D] (gate rows, then up rows) -> [I/32, D/2, 4, 16, 2]: each panel 32 gate then 32 up columns."""
    two_i, D = w13.shape
    I = two_i // 2
    return pack_rows(w13.view(2, I // 32, 32, D).transpose(0, 1).reshape(two_i, D))
