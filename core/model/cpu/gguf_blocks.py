"""GGUF block formats multiplied as the file stores them (core/assets/kernels/gguf_matmul.c): each weight row is
decoded into a cache-resident buffer and dotted with every activation row, so weights are read once, at the
file's bits. PATHS: "int8" (bf16 activations up to INT8_MAX_ROWS, quantized per 32 values as llama.cpp does;
"int8_c" plain C, the same numbers); "int16" (the K-quants: int16 activations a 256 values, finer than int8 and
faster; llama.cpp's coarser Q8_K was past the Qwen3-MoE Q4_K reference test's bound); "fp32"
(`gguf.quants.dequantize`'s floats bit for bit: more rows, and float32 engines, within 1e-4 of transformers'
float64 reading). `moe`: one token's experts with SwiGLU in one call; `runs` says where these run.
"""

from __future__ import annotations

import ctypes

import torch

from core.assets import GGUF_MATMUL_C as SOURCE
from core.model import kernels
from core.model.cpu import isa, native
from core.model.quant.formats import GGUF_BLOCKS

KINDS = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4, "MXFP4": 5}
PATHS = {"fp32": 0, "int8_c": 1, "int8": 2, "int16_c": 3, "int16": 4}
SIMD = {0: "plain C", 1: "AVX2 maddubs", 2: "AVX-512 VNNI"}  # the int8 dots a build has
# rows up to which `linear` takes an integer path, per format: where it beat fp32 (bench/gguf_speed.py
# --kernel). Q4_0's per-32 float work falls behind above 64; the K-quants' "int16" (a float FMA or two a
# super-block) stays ahead to 128 rows (NATIVE_GGUF_ROWS: the kernel's end).
INT8_MAX_ROWS = {"Q8_0": 128, "Q4_0": 64, "Q4_K": 128, "Q5_K": 128, "Q6_K": 128, "MXFP4": 128}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # `linear`'s integer path for them is "int16"

class _Lib(native.Library):
    def __init__(self, path, flags: str):
        super().__init__(path, flags, "mlight_gguf_openmp")
        P, I, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.linear = native.bind(self.dll, "mlight_gguf_linear", [C, P, C, I, I, I, P, I, I, P, C, I, P, C, C], C)
        self.scratch = native.bind(self.dll, "mlight_gguf_scratch", [I, I, C], I)
        self.moe = native.bind(self.dll, "mlight_gguf_moe",
                               [C, C, P, C, I, I, C, P, P, C, P, I, I, P, I, I, P, C, P, C, C], C)
        self.moe_scratch = native.bind(self.dll, "mlight_gguf_moe_scratch", [I, I, C, C], I)
        self.dequantize = native.bind(self.dll, "mlight_gguf_dequantize", [C, P, I, I, I, P, C, I, P, C], C)
        self.simd = SIMD[self.dll.mlight_gguf_simd()]


def build_flags() -> tuple[list[str], int]:
    """native's flags with F16C (the blocks' half scales in one instruction) and VNNI where the CPU has them."""
    flags, vw = native._flags()
    has = isa._features()
    if "-mavx2" in flags and has.get("f16c"):
        flags = [*flags, "-mf16c"]
    if "-mavx512vl" in flags and has.get("avx512_vnni"):
        flags = [*flags, "-mavx512vnni"]
    return flags, vw


def _build(level: str):
    flags, vw = build_flags()
    return native.build_kernel(SOURCE, "gguf_matmul", flags, vw, lambda path: _Lib(path, " ".join(flags) or "baseline"))


KERNEL = native.Kernel("building the CPU GGUF kernel (once per machine)", _build)
library = KERNEL.library


def status() -> str:
    lib = library()
    return (f"C kernel ({lib.flags}; int8 dots: {lib.simd})" if lib is not None
            else f"expanded per use ({KERNEL.reason})")


def runs(name: str, dtype: torch.dtype, *ks: int) -> bool:
    """Whether the kernel takes GGUF format `name` with inputs of these sizes, computing in `dtype`, here."""
    if name not in KINDS or dtype not in (torch.bfloat16, torch.float32) or kernels.switched_off():
        return False
    if any(k % GGUF_BLOCKS[name][0] for k in ks):
        return False
    return native.runs(library())


def linear(name: str, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None = None,
           path: str | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp32) · Wᵀ -> [M, N] in x's dtype (into `out`: unit stride in N, rows anywhere, such as a
    column slice); W [N, K] as the file's blocks, raw uint8 rows. `path`: one of PATHS (default: `int8_group`'s).
    The caller checked `runs`."""
    lib = library()
    M, K = x.shape
    N = raw.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    threads = torch.get_num_threads() if lib.openmp else 1
    y = torch.empty((M, N), dtype=x.dtype) if out is None else out
    if y.shape != (M, N) or y.dtype != x.dtype or (N > 1 and y.stride(1) != 1):
        raise ValueError(f"out must be [{M}, {N}] {x.dtype} with unit stride in N, not {tuple(y.shape)} {y.dtype}")
    s = native.scratch(4 * lib.sized("scratch", M, K, threads))  # float32s
    bf = int(x.dtype == torch.bfloat16)
    p = PATHS[path or {None: "fp32", 32: "int8", 256: "int16"}[int8_group(name, x.dtype, M)]]
    if lib.linear(KINDS[name], x.data_ptr(), bf, x.stride(0), M, K, raw.data_ptr(), raw.stride(0), N, y.data_ptr(), bf,
                  y.stride(0), s.data_ptr(), threads, p):
        raise RuntimeError(f"the GGUF kernel refused {name} with K={K}")
    return y


def dequantize(name: str, raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """W [N, K] from the file's blocks raw uint8 [N, bytes] into `out` [N, K] (bf16 or float32): bit for bit
    core.model.quant.expand's result. The caller checked `runs`."""
    lib = library()
    N, K = out.shape
    if raw.shape[0] != N or raw.stride(-1) != 1 or out.stride(-1) != 1 or out.dtype not in (torch.bfloat16,
                                                                                         torch.float32):
        raise ValueError(f"raw {tuple(raw.shape)} and out {tuple(out.shape)} {out.dtype} do not match")
    threads = torch.get_num_threads() if lib.openmp else 1
    s = native.scratch(4 * threads * K)
    if lib.dequantize(KINDS[name], raw.data_ptr(), raw.stride(0), N, K, out.data_ptr(),
                      int(out.dtype == torch.bfloat16), out.stride(0), s.data_ptr(), threads):
        raise RuntimeError(f"the GGUF kernel refused {name} with K={K}")
    return out


def integer_path(name: str) -> str:
    """`linear`'s integer path for format `name` (one of PATHS)."""
    return "int16" if name in K_QUANTS else "int8"


def int8_group(name: str, dtype: torch.dtype, rows: int) -> int | None:
    """Values one activation scale covers on `linear`'s default path for `rows` rows of `dtype` in format
    `name`: 32 (int8) or 256 (int16, the K-quants), None where it computes in float32."""
    if dtype != torch.bfloat16 or rows > INT8_MAX_ROWS[name]:
        return None
    return 256 if name in K_QUANTS else 32


MAX_EXPERTS = 64  # routed experts of one token the fused call takes


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up: tuple[str, torch.Tensor],
        down: tuple[str, torch.Tensor], path: str | None = None) -> torch.Tensor | None:
    """One token's routed experts: x [1, D]; ids, weights [1, k] on the host; up = (format, raw uint8 [E, 2I,
    bytes]) gate rows then up rows, down = (format, raw [E, D, bytes]) -> Σ weight · down(silu(gate) · up)
    [1, D] in x's dtype; None where it does not take the call. `path`: one of PATHS (default int8 for bf16 x)."""
    lib = library()
    D = x.shape[-1]
    (k13, w13), (k2, w2) = up, down
    I = w13.shape[1] // 2
    k = ids.shape[-1]
    if k > MAX_EXPERTS or x.shape[0] != 1:
        return None
    ids, weights, x = native.moe_inputs(ids, weights, x)
    threads = torch.get_num_threads() if lib.openmp else 1
    out = torch.empty((1, D), dtype=x.dtype)
    s = native.scratch(4 * lib.sized("moe_scratch", D, I, k, threads))
    bf = int(x.dtype == torch.bfloat16)
    if lib.moe(KINDS[k13], KINDS[k2], x.data_ptr(), bf, D, I, k, ids.data_ptr(), weights.data_ptr(),
               int(weights.dtype == torch.bfloat16), w13.data_ptr(), w13.stride(0), w13.stride(1), w2.data_ptr(),
               w2.stride(0), w2.stride(1), out.data_ptr(), bf, s.data_ptr(), threads,
               PATHS[path or ("int8" if bf else "fp32")]):
        raise RuntimeError(f"the GGUF kernel refused D={D}, I={I}, {k} experts")
    return out
