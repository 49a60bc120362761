"""A few tokens' GGUF experts and dense rows with Q8_0 and K-quant rows dotted where they lie
(core/assets/kernels/gguf_token.c), with gguf_matmul.c compiled in (its hash in the flags rebuilds this).

`gguf_blocks.moe` decodes each row before its dot, which for Q8_0 costs what the dot does at one row. This kernel
dots the blocks themselves: Q8_0 with gguf_matmul.c's integers and lane order (`gguf_blocks`' default path bit for
bit), the K-quants with AVX-512 VNNI on int8 activations (a step k D a 32: fewer instructions than gguf_blocks'
int16 a 256, within the same reference bound). `moe` reads each expert once for all of up to TOKENS bf16 tokens,
`linear` takes one row in any IN_PLACE format or up to ROWS of a K-quant; None/False elsewhere, and the caller goes
to gguf_blocks. Legend: D = hidden, I = expert intermediate, k = experts of the token, E = experts.
"""

from __future__ import annotations

import ctypes
import hashlib

import torch

from core.assets import GGUF_MATMUL_C, GGUF_TOKEN_C as SOURCE
from core.model.cpu import gguf_blocks, native

# formats whose rows this kernel dots where they lie (the K-quants with AVX-512 VNNI; elsewhere decoded first)
IN_PLACE = frozenset(("Q8_0", "Q4_K", "Q5_K", "Q6_K"))

ROWS = 8  # activation rows `linear` takes: an expert's rows at a small batch, where it beat gguf_blocks' tiles
# tokens up to which a layer's experts take one `moe` call: it gained at B = 8 and lost at 32 (0.8-0.9x)
TOKENS = 8
MAX_SLOTS = 512  # (token, expert) pairs `moe` takes a call (gguf_token.c's MAX_SLOTS)

class _Lib(native.Library):
    def __init__(self, path, flags: str):
        super().__init__(path, flags, "mlight_gguf_openmp")
        P, I, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.tokens = native.bind(self.dll, "mlight_gguf_tokens_moe",
                                  [C, C, P, C, I, I, I, I, C, P, P, C, P, I, I, P, I, I, P, C, I, P, C, C], C)
        self.tokens_scratch = native.bind(self.dll, "mlight_gguf_tokens_moe_scratch", [I, I, I, C, C], I)
        self.linear = native.bind(self.dll, "mlight_gguf_token_linear",
                                  [C, P, C, I, I, I, P, I, I, P, C, I, P, C, C], C)
        self.linear_scratch = native.bind(self.dll, "mlight_gguf_token_linear_scratch", [I, I, C], I)
        self.simd = gguf_blocks.SIMD[self.dll.mlight_gguf_simd()]


def _build(level: str):
    flags, vw = gguf_blocks.build_flags()  # the same instructions, the same floats
    included = hashlib.sha256(GGUF_MATMUL_C.read_bytes()).hexdigest()[:16]
    return native.build_kernel(SOURCE, "gguf_token", [*flags, f"-DGGUF_MATMUL_HASH={included}"], vw,
                               lambda path: _Lib(path, " ".join(flags) or "baseline"))


KERNEL = native.Kernel("building the CPU GGUF token kernel (once per machine)", _build)
library = KERNEL.library


def status() -> str:
    lib = library()
    return f"C kernel ({lib.flags}; int8 dots: {lib.simd})" if lib is not None else f"gguf_blocks.moe ({KERNEL.reason})"


def takes_tokens(k13: str, k2: str, M: int, k: int) -> bool:
    """Whether `moe` takes M bf16 tokens' k experts each with gate/up rows in format k13 and down rows in k2."""
    lib = library()
    return (bool(IN_PLACE.intersection((k13, k2))) and k <= gguf_blocks.MAX_EXPERTS and M * k <= MAX_SLOTS
            and k13 in gguf_blocks.KINDS and k2 in gguf_blocks.KINDS and native.runs(lib))


def takes_rows(name: str, M: int, K: int, plain_c: bool = False) -> bool:
    """Whether `linear` takes M bf16 rows of K through a matrix in format `name` (on its default path, or its
    plain-C dots): one row in every in-place format, up to ROWS for the K-quants on AVX-512 VNNI."""
    lib = library()
    return (name in IN_PLACE and 1 <= M <= ROWS and K % gguf_blocks.GGUF_BLOCKS[name][0] == 0 and native.runs(lib)
            and (M == 1 or plain_c or (name != "Q8_0" and lib.simd == gguf_blocks.SIMD[2])))


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up: tuple[str, torch.Tensor],
        down: tuple[str, torch.Tensor], path: str = "int8") -> torch.Tensor | None:
    """`gguf_blocks.moe` for bf16 tokens x [M, D] on this kernel's integers ("int8", or "int8_c": plain C), each
    token's row bit for bit that token alone through it, each expert read once for all; None where this kernel
    does not take the call (`takes_tokens`)."""
    (k13, w13), (k2, w2) = up, down
    (M, D), k = x.shape, ids.shape[-1]
    if x.dtype != torch.bfloat16 or not takes_tokens(k13, k2, M, k):
        return None
    lib = library()
    I = w13.shape[1] // 2
    ids, weights, x = native.moe_inputs(ids, weights, x)
    threads = torch.get_num_threads() if lib.openmp else 1
    out = torch.empty((M, D), dtype=x.dtype)
    kinds, bf = (gguf_blocks.KINDS[k13], gguf_blocks.KINDS[k2]), int(weights.dtype == torch.bfloat16)
    experts = (w13.data_ptr(), w13.stride(0), w13.stride(1), w2.data_ptr(), w2.stride(0), w2.stride(1))
    s = native.scratch(4 * lib.sized("tokens_scratch", M, D, I, k, threads))  # float32s
    refused = lib.tokens(*kinds, x.data_ptr(), 1, D, M, D, I, k, ids.data_ptr(), weights.data_ptr(), bf, *experts,
                         out.data_ptr(), 1, D, s.data_ptr(), threads, gguf_blocks.PATHS[path])
    if refused:
        raise RuntimeError(f"the GGUF token kernel refused M={M}, D={D}, I={I}, {k} experts")
    return out


def linear(name: str, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor, path: str | None = None) -> bool:
    """`gguf_blocks.linear(name, x, raw, out=out)` for bf16 rows x [M, K] of an IN_PLACE matrix on its default
    path (or that path's "_c", plain C), the rows dotted in place (Q8_0 to the same values; the K-quants on this
    kernel's int8 activations); False, with nothing written, where this kernel does not take it (`takes_rows`)."""
    default = gguf_blocks.integer_path(name)
    path = path or default
    if (name not in IN_PLACE or path not in (default, default + "_c") or x.dtype != torch.bfloat16 or x.dim() != 2
            or out.dtype != x.dtype or out.shape != (x.shape[0], raw.shape[0])
            or (raw.shape[0] > 1 and out.stride(1) != 1) or x.stride(-1) != 1 or raw.stride(1) != 1
            or not takes_rows(name, *x.shape, plain_c=path.endswith("_c"))):
        return False
    lib = library()
    M, K = x.shape
    threads = torch.get_num_threads() if lib.openmp else 1
    s = native.scratch(4 * lib.sized("linear_scratch", M, K, threads))
    if lib.linear(gguf_blocks.KINDS[name], x.data_ptr(), 1, x.stride(0), M, K, raw.data_ptr(), raw.stride(0),
                  raw.shape[0], out.data_ptr(), 1, out.stride(0), s.data_ptr(), threads,
                  1 if path.endswith("_c") else 2):
        raise RuntimeError(f"the GGUF token kernel refused {name} with M={M}, K={K}")
    return True
