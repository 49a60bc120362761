"""`mlight::route`, the MoE router after its matmul as one torch.library op (one op to a launch count, a CUDA graph
and the emulated device): the Triton kernel on a CUDA GPU with triton, else routing's torch form.
Legend: T = tokens, E = experts, k = experts per token.
"""

from __future__ import annotations

import types

import torch

from core.model.kernels import triton_module
from core.model.spec import ModelSpec

_KINDS = ("softmax", "softmax_group", "sigmoid_group")


def takes(spec: ModelSpec) -> bool:
    """Whether `mlight::route` computes this router (else routing.py's ops run)."""
    return (spec.router in _KINDS and spec.router_norm in ("sum", "none")
            and (spec.router != "softmax" or spec.router_softmax_fp32))


def route(spec: ModelSpec, logits: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """logits [T, E] -> (weights [T, k] in `dtype`, expert ids [T, k] int64), one op."""
    groups = spec.router_groups if spec.router != "softmax" else 1
    return torch.ops.mlight.route(logits, bias if spec.router == "sigmoid_group" and spec.router_correction else None,
                                  spec.router, spec.top_k, groups, spec.router_topk_groups if groups > 1 else 1,
                                  spec.router_norm == "sum", float(spec.routed_scale), dtype)


@torch.library.custom_op("mlight::route", mutates_args=())
def _route(logits: torch.Tensor, bias: torch.Tensor | None, kind: str, top_k: int, groups: int, topk_groups: int,
           renorm: bool, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = triton_module("router_triton") if logits.is_cuda else None
    if kernel is not None:
        return kernel.route(logits, bias, dtype, kind=kind, top_k=top_k, groups=groups, topk_groups=topk_groups,
                               renorm=renorm, scale=scale)
    return torch_form(logits, bias, kind, top_k, groups, topk_groups, renorm, scale, dtype)


@_route.register_fake
def _(logits, bias, kind, top_k, groups, topk_groups, renorm, scale, dtype):
    T = logits.shape[0]
    return logits.new_empty((T, top_k), dtype=dtype), logits.new_empty((T, top_k), dtype=torch.int64)


def torch_form(logits, bias, kind, top_k, groups, topk_groups, renorm, scale, dtype):
    """routing.choose on the op's arguments: the reference's ops, as the engine runs them without the op."""
    from core.model import routing

    spec = types.SimpleNamespace(router=kind, top_k=top_k, router_groups=groups, router_topk_groups=topk_groups,
                                 num_experts=logits.shape[-1], router_correction=bias is not None,
                                 router_norm="sum" if renorm else "none", routed_scale=scale, router_softmax_fp32=True)
    return routing.choose(spec, logits, {"e_bias": bias}, dtype)
