"""Dense weights (attention projections, shared experts, the LM head) quantized on the CPU, behind F.linear.

The routed experts are most of a MoE model's bytes, not all: at batch 1 a decode step also reads every
layer's attention projections and the LM head, and those cost the same in bf16 and in an int4-expert
model. `--quantize-dense` stores them in the experts' format too (int8 per channel or int4 group-wise),
for the CPU-only mode, where torch's weight-only kernels read a half or a quarter of bf16's bytes.

`QuantWeight` stands where the bf16 weight stood: same shape and dtype, taken by `F.linear` and nothing
else (a core.model.cpu.kernels.LinearOnlyWeight, like oneDNN's PackedWeight). Its numbers are
`formats.quantize`'s, in the kernel's prepacked layout (core.model.quant.experts): the experts' format.
"""

from __future__ import annotations

import torch

from core.model.cpu.kernels import LinearOnlyWeight
from core.model.quant.experts import _kernel_linear, _kernel_pack, cpu_kernel_ok
from core.model.quant.formats import Format, quantize


class QuantWeight(LinearOnlyWeight):
    """A [N, K] weight held only as int8/int4 in the CPU kernel's prepacked layout."""

    @staticmethod
    def __new__(cls, w: torch.Tensor, fmt: Format):
        obj = torch.Tensor._make_wrapper_subclass(cls, w.shape, dtype=w.dtype, device=w.device, requires_grad=False)
        obj.fmt = fmt
        obj.kernel = _kernel_pack(fmt, quantize(fmt, w), w.dtype)
        return obj

    def linear(self, x, bias):
        y = _kernel_linear(self.fmt, x.reshape(-1, x.shape[-1]), self.kernel).view(*x.shape[:-1], self.shape[0])
        return y if bias is None else y.add_(bias)

    def __repr__(self) -> str:
        return f"QuantWeight(shape={tuple(self.shape)}, dtype={self.dtype}, {self.fmt.label})"


def quantize_dense(w: torch.Tensor, fmt: Format) -> torch.Tensor:
    """`w` as a QuantWeight where the CPU kernel takes its format, shape and dtype, else `w` itself."""
    n, k = w.shape
    if (fmt.name == "int4" and k % fmt.group) or not cpu_kernel_ok(fmt, n, k, w.dtype):
        return w
    return QuantWeight(w.contiguous(), fmt)
