"""Dense bf16 projections on the expert kernel's panels (core/assets/kernels/moe_ffn.c, `mlight_linear`): one decode
row per projection is a read of the weight, which the panels stream at about twice oneDNN's packed GEMV. Where that
kernel runs, `pack_dense` (core.model.cpu.kernels) holds a bf16 weight with N a multiple of 64 as panels instead
(the same bytes). fp32 sums rounded once, bias before rounding, as oneDNN does (the order differs by an fp32 ulp).
"""

from __future__ import annotations

import torch

from core.model import kernels
from core.model.cpu import ffn, hugepages, native
from core.model.cpu.kernels import LinearOnlyWeight

SWITCHES = ("MLIGHT_NATIVE_DENSE",)  # the old A/B switch (core.model.kernels)
CHUNK_ROWS = 512  # rows per call: the per-thread fp32 sums stay 2 × 128 KB


def takes(w: torch.Tensor) -> bool:
    """Whether `w` [N, K] can be held in panels here."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.device.type != "cpu" or w.shape[0] % 64 or w.shape[1] % 2:
        return False
    if kernels.switched_off(SWITCHES):
        return False
    return native.runs(ffn.library())


def status(math: str = "bfloat16") -> str:
    """For `mlight hw`: what runs a bf16 checkpoint's dense projections when the CPU computes in `math`."""
    if math == "float32":
        return "torch's fp32 GEMMs (MKL on x86) over weights widened at load"
    off = kernels.switched_off(SWITCHES)
    if off:
        return f"oneDNN's packed GEMMs ({off})"
    lib = ffn.library()
    if lib is None:
        return f"oneDNN's packed GEMMs (no expert kernel: {ffn.status()})"
    return "the expert kernel's panels" + ("" if lib.openmp else "; one thread: oneDNN when torch runs more")


class PanelWeight(LinearOnlyWeight):
    """A bf16 weight [N, K] as N/64 panels [K/2][4][16][2] (core.model.cpu.ffn.pack_rows)."""

    @staticmethod
    def __new__(cls, w: torch.Tensor):
        obj = torch.Tensor._make_wrapper_subclass(cls, w.shape, dtype=w.dtype, device=w.device, requires_grad=False)
        N, K = w.shape
        obj.panels = hugepages.empty((N // 64, K // 2, 4, 16, 2), torch.bfloat16).copy_(ffn.pack_rows(w))
        obj.N, obj.K = N, K  # plain ints: a wrapper subclass's `shape` goes through __torch_function__ (µs a call)
        return obj

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        N, K = self.N, self.K
        if x.dtype != torch.bfloat16 or x.shape[-1] != K or (bias is not None and bias.dtype != torch.bfloat16):
            raise TypeError(f"PanelWeight {N}x{K} bf16 takes bf16 inputs [..., {K}] and a bf16 bias; got "
                            f"{x.dtype} {tuple(x.shape)}")
        rows = x if x.dim() == 2 else x.reshape(-1, K)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        T = rows.shape[0]
        out = torch.empty((T, N), dtype=torch.bfloat16)
        if T:
            lib = ffn.library()
            n = torch.get_num_threads() if lib.openmp else 1
            b = None if bias is None else bias.contiguous().data_ptr()
            x0, ld, o0, es = rows.data_ptr(), rows.stride(0), out.data_ptr(), 2
            for a in range(0, T, CHUNK_ROWS):  # one call at a decode step's few rows
                m = min(CHUNK_ROWS, T - a)
                s = native.scratch(lib.sized("linear_scratch", m, K, n))
                lib.linear(x0 + a * ld * es, m, ld, K, self.panels.data_ptr(), N, b, o0 + a * N * es, N,
                           s.data_ptr(), n)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], N)

    @property
    def held_bytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def __repr__(self) -> str:
        return f"PanelWeight(shape={tuple(self.shape)}, dtype={self.dtype})"
