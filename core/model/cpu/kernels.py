"""CPU kernels for weights stored narrower than the math: `Widen.linear(x, w)` is `F.linear` for fp32 `x` and
bf16/fp16 `w` without an fp32 copy of `w`, one cache-sized tile at a time through one reused buffer; a GEMV (rows ≤
`direct_rows`, bandwidth-bound) reads `w` directly. One Widen per thread. Legend: M = rows, N = outputs, K = inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_BYTES = 1 << 20  # one fp32 tile: ≈ a core's L2, so the widened tile is read back from cache


class Widen:
    def __init__(self, math: torch.dtype = torch.float32, direct_rows: int = 2, tile_bytes: int = TILE_BYTES):
        self.math, self.direct_rows, self.tile_bytes = math, direct_rows, tile_bytes
        self._buf = torch.empty(0, dtype=math)

    def scratch(self, numel: int) -> torch.Tensor:
        """A reused buffer of at least `numel` elements (grows once, then never allocates)."""
        if self._buf.numel() < numel:
            self._buf = torch.empty(numel, dtype=self.math)
        return self._buf[:numel]

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] (math dtype), w [N, K] (any dtype) -> x @ wᵀ [M, N] in the math dtype."""
        if w.dtype == self.math:
            return F.linear(x, w)
        M, (N, K) = x.shape[0], w.shape
        if M <= self.direct_rows:
            return F.linear(x.to(w.dtype), w).to(self.math)
        rows = max(16, self.tile_bytes // (K * self.math.itemsize))
        if rows >= N:
            return F.linear(x, self.scratch(N * K).view(N, K).copy_(w))
        out_t = torch.empty((N, M), dtype=self.math)  # (w x^T) tile by tile: each tile's rows are contiguous
        xt = x.t()
        for n0 in range(0, N, rows):
            r = min(rows, N - n0)
            torch.mm(self.scratch(r * K).view(r, K).copy_(w[n0:n0 + r]), xt, out=out_t[n0:n0 + r])
        return out_t.t()


class LinearOnlyWeight(torch.Tensor):
    """A weight held only in some kernel's own layout that `F.linear` takes like the weight it replaces (same
    shape and dtype, through __torch_function__); anything else is refused."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return args[1].linear(args[0], args[2] if len(args) > 2 else kwargs.get("bias"))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{cls.__name__}: a weight in a kernel's layout is only for F.linear, not {func}")


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, calling a kernel-layout weight's `linear` straight, without torch's dispatch (≈ 17 µs a call,
    cold, between a decode step's projections)."""
    if isinstance(w, LinearOnlyWeight):
        return w.linear(x, bias)
    return F.linear(x, w, bias)


class PackedWeight(LinearOnlyWeight):
    """A bf16 weight prepacked into oneDNN's blocked layout, which oneDNN reads at about twice torch's bf16
    GEMV speed (most of a batch-1 decode step's dense work). No row-major copy is kept."""

    @staticmethod
    def __new__(cls, w: torch.Tensor, rows_hint: int = 1):
        obj = torch.Tensor._make_wrapper_subclass(cls, w.shape, dtype=w.dtype, device=w.device, requires_grad=False)
        obj.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows_hint)
        return obj

    def linear(self, x, bias):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    @property
    def held_bytes(self) -> int:
        """The weight's own bytes: oneDNN's blocked layout of these shapes adds no padding worth counting."""
        return self.numel() * self.element_size()

    def __repr__(self) -> str:
        return f"PackedWeight(shape={tuple(self.shape)}, dtype={self.dtype})"


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """`w` in the expert kernel's panels where it runs (panel_linear), else oneDNN-prepacked where it can, else `w`."""
    from core.model.cpu import panel_linear

    if panel_linear.takes(w):
        return panel_linear.PanelWeight(w)
    try:
        return PackedWeight(w)
    except RuntimeError:  # e.g. "bf16 path needs the cpu support avx512bw ..."
        return w
