"""Dense weights (attention projections, shared experts, the LM head) quantized on the CPU, behind F.linear.

The routed experts are most of a MoE model's bytes, not all: at batch 1 a decode step also reads every
layer's attention projections and the LM head, and those cost the same in bf16 and in an int4-expert
model. `--quantize-dense` stores them in the experts' format too (int8 per channel or int4 group-wise),
for the CPU-only mode, where torch's weight-only kernels read a half or a quarter of bf16's bytes.

`QuantWeight` stands where the bf16 weight stood: same shape and dtype, taken by `F.linear` (through
__torch_function__, like core.model.cpu.kernels.PackedWeight), anything else refused. Its numbers are
`formats.quantize`'s, in the kernel's prepacked layout (core.model.quant.experts): the experts' format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.model.quant.experts import _kernel_linear, _kernel_pack, cpu_kernel_ok
from core.model.quant.formats import Format, quantize


class QuantWeight(torch.Tensor):
    """A [N, K] weight held only as int8/int4 in the CPU kernel's prepacked layout."""

    @staticmethod
    def __new__(cls, w: torch.Tensor, fmt: Format):
        obj = torch.Tensor._make_wrapper_subclass(cls, w.shape, dtype=w.dtype, device=w.device, requires_grad=False)
        obj.fmt = fmt
        obj.kernel = _kernel_pack(fmt, quantize(fmt, w), w.dtype)
        return obj

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            y = _kernel_linear(w.fmt, x.reshape(-1, x.shape[-1]), w.kernel).view(*x.shape[:-1], w.shape[0])
            return y if b is None else y.add_(b)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a quantized dense weight is only for F.linear, not {func}")

    def __repr__(self) -> str:
        return f"QuantWeight(shape={tuple(self.shape)}, dtype={self.dtype}, {self.fmt.label})"


def quantize_dense(w: torch.Tensor, fmt: Format) -> torch.Tensor:
    """`w` as a QuantWeight where the CPU kernel takes its format, shape and dtype, else `w` itself."""
    n, k = w.shape
    if (fmt.name == "int4" and k % fmt.group) or not cpu_kernel_ok(fmt, n, k, w.dtype):
        return w
    return QuantWeight(w.contiguous(), fmt)
