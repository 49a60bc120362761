"""A decode step's small per-row operations in C (core/assets/kernels/row_ops.c), bf16 and fp32: the KV cache
write, RMSNorm, RoPE joined with v into the attention payload, and the softmax router. Each was 4-7 torch ops,
every one a fresh tensor and a pass over lines the experts' weights had just evicted; each C function rounds as
its torch expression does, and its wrapper says False (or None) where it does not apply: then torch's ops run.
"""

from __future__ import annotations

import ctypes

import torch

from core.assets import ROW_OPS_C as SOURCE
from core.model.cpu import native

class _Lib(native.Library):
    def __init__(self, path, flags: str):
        super().__init__(path, flags, "mlight_row_ops_openmp")
        P, I, F, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self.kv_write = native.bind(self.dll, "mlight_kv_write", [P, P, P, P, P, I, I, I, I, C], None)
        self.rms_norm = native.bind(self.dll, "mlight_rms_norm", [P, I, I, I, P, F, P, I, C], None)
        self.rope_join = native.bind(self.dll, "mlight_rope_join", [P, I, I, I, I, P, P, I, I, P, I, C], None)
        self.kv_write_narrow = native.bind(self.dll, "mlight_kv_write_narrow", [P, P, P, P, P, I, I, I, I, C], None)
        self.rms_norm_f32 = native.bind(self.dll, "mlight_rms_norm_f32", [P, I, I, I, P, F, P, I, C], None)
        self.rope_join_f32 = native.bind(self.dll, "mlight_rope_join_f32", [P, I, I, I, I, P, P, I, I, P, I, C], None)
        self.softmax_route = native.bind(self.dll, "mlight_softmax_route", [P, C, I, I, I, P, I, C, C, F, P, P], C)
        self.add_bf16 = native.bind(self.dll, "mlight_add_bf16", [P, P, I], None)
        self.run_calls = native.bind(self.dll, "mlight_run_calls", [P, I, P], C)
        self.call_sigs = native.bind(self.dll, "mlight_call_sigs", [], ctypes.c_char_p)().decode().split()
        self.vw = self.dll.mlight_row_ops_vw()


def _build(level: str):
    flags, vw = native._flags()
    return native.build_kernel(SOURCE, "row_ops", ["-ffp-contract=off", f"-DVW={vw}", *flags], vw,
                               lambda path: _Lib(path, " ".join(flags) or "baseline"), vw_of=lambda lib: lib.vw)


KERNEL = native.Kernel("building the CPU row kernels (once per machine)", _build)
library, prepare = KERNEL.library, KERNEL.prepare


def status() -> str:
    lib = library()
    return f"C kernels ({lib.flags})" if lib is not None else f"torch ops ({KERNEL.reason})"


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> bool:
    """A decode step's new rows k, v [B, heads, hd] (a payload's slices) into rows `at` [B·heads] of contiguous
    caches viewed as [rows, hd], fp32 narrowed to a bf16 cache; False, nothing written, where it does not apply."""
    lib = library()
    narrow = k.dtype == torch.float32 and k_cache.dtype == torch.bfloat16
    if (lib is None or not (k.dtype == k_cache.dtype or narrow) or v.dtype != k.dtype or v_cache.dtype != k_cache.dtype
            or k.device.type != "cpu" or k.dim() != 3 or k.shape != v.shape or k.stride() != v.stride()
            or k.stride(2) != 1 or k.stride(1) != k.shape[2] or at.dtype != torch.int64 or not at.is_contiguous()
            or at.numel() != k.shape[0] * k.shape[1] or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return False
    es, hd = k.element_size(), k.shape[2]
    write = lib.kv_write_narrow if narrow else lib.kv_write
    write(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), at.data_ptr(), at.numel(), k.shape[1],
          k.stride(0) * es, hd if narrow else hd * es, torch.get_num_threads())
    return True


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """core.model.layers.rms_norm for x [..., D] and weight [D], both bf16 or both fp32, or None."""
    lib = library()
    if (lib is None or x.dtype not in (torch.bfloat16, torch.float32) or w.dtype != x.dtype or x.device.type != "cpu"
            or x.dim() < 1 or w.dim() != 1 or x.shape[-1] != w.shape[0] or x.stride(-1) != 1 or not w.is_contiguous()):
        return None
    D, flat = x.shape[-1], x.dim() == 2
    rows = x if flat else x.view(-1, D) if x.is_contiguous() else None
    if rows is None:
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    norm = lib.rms_norm if x.dtype == torch.bfloat16 else lib.rms_norm_f32
    norm(rows.data_ptr(), rows.shape[0], D, rows.stride(0), w.data_ptr(), eps, out.data_ptr(), D,
         torch.get_num_threads())
    return out if flat else out.view(x.shape)


def rope_join(qkv: torch.Tensor, heads: int, hd: int, cos: torch.Tensor, sin: torch.Tensor,
              rest: int) -> torch.Tensor | None:
    """[RoPE (halves) of qkv's first `heads` heads | its next `rest` elements] as one new [T, heads·hd + rest]
    tensor, cos/sin [T, 1, hd] (Rope.tables'), all bf16 or all fp32, or None."""
    lib = library()
    T = qkv.shape[0]
    if (lib is None or qkv.dtype not in (torch.bfloat16, torch.float32) or cos.dtype != qkv.dtype
            or sin.dtype != qkv.dtype or qkv.device.type != "cpu" or qkv.dim() != 2 or qkv.stride(1) != 1 or hd % 2
            or qkv.shape[1] < heads * hd + rest or cos.shape != (T, 1, hd) or sin.shape != cos.shape
            or not (cos.is_contiguous() and sin.is_contiguous())):
        return None
    out = torch.empty((T, heads * hd + rest), dtype=qkv.dtype)
    join = lib.rope_join if qkv.dtype == torch.bfloat16 else lib.rope_join_f32
    join(qkv.data_ptr(), T, qkv.stride(0), heads, hd, cos.data_ptr(), sin.data_ptr(), hd, rest, out.data_ptr(),
         out.shape[1], torch.get_num_threads())
    return out


ROUTE_MAX_EXPERTS = 512  # row_ops.c's ROUTE_MAX


def softmax_route(h: torch.Tensor, w: torch.Tensor, k: int, norm: bool, scale: float):
    """core.model.routing's "softmax" router (top-k, weights over their sum if `norm`, times `scale`) for h [T, D]
    and router w [E, D], both bf16 or both fp32 -> (weights [T, k], ids [T, k] int64), or None: the weights
    equal torch's to a unit in their last place (see row_ops.c)."""
    lib = library()
    if (lib is None or h.dtype not in (torch.bfloat16, torch.float32) or type(w) is not torch.Tensor
            or w.dtype != h.dtype or h.device.type != "cpu" or h.dim() != 2 or w.dim() != 2 or h.stride(1) != 1
            or w.shape[1] != h.shape[1] or not w.is_contiguous() or not 1 <= k <= w.shape[0] <= ROUTE_MAX_EXPERTS):
        return None
    T = h.shape[0]
    weights, ids = torch.empty((T, k), dtype=h.dtype), torch.empty((T, k), dtype=torch.int64)
    lib.softmax_route(h.data_ptr(), int(h.dtype == torch.bfloat16), T, h.shape[1], h.stride(0), w.data_ptr(),
                      w.shape[0], k, int(norm), scale, weights.data_ptr(), ids.data_ptr())
    return weights, ids
