"""The MoE FFN: router, then the routed experts with tokens grouped by expert, plus a shared expert.

Two backends for the routed experts, tested against each other: `grouped` uses
`torch.nn.functional.grouped_mm` (one call per projection over all experts) where this torch has it
and the shapes meet its layout rules; `loop` runs one matmul per expert that got tokens.
Legend: T = tokens, k = experts per token, E = experts, D = hidden, I = expert intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.spec import ModelSpec

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def route(spec: ModelSpec, h: torch.Tensor, router: torch.Tensor):
    """h [T, D] -> (weights [T, k] in h's dtype, expert ids [T, k])."""
    logits = F.linear(h, router)
    probs = torch.softmax(logits.float() if spec.router_softmax_fp32 else logits, dim=-1)
    top, idx = torch.topk(probs, spec.top_k, dim=-1)
    if spec.router_norm == "sum":
        top = top / top.sum(dim=-1, keepdim=True)
    elif spec.router_norm == "pnorm":
        top = top / torch.norm(top, p=spec.router_pnorm, dim=-1, keepdim=True)
    return top.to(h.dtype), idx


def _grouped_ok(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    # grouped_mm wants fp32/bf16/fp16 and 16-byte aligned strides on every operand.
    if not HAS_GROUPED_MM or h.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if h.is_cuda and (torch.cuda.get_device_capability(h.device) < (8, 0) or h.dtype != torch.bfloat16):
        return False  # the CUDA kernel wants bf16 on SM80+ (a T4 takes the loop)
    es = h.element_size()
    return all((n * es) % 16 == 0 for n in (w13.shape[-1], w13.shape[-2], w2.shape[-1], w2.shape[-2]))


def experts(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
            grouped: bool | None = None) -> torch.Tensor:
    """Routed experts. h [T, D], w13 [E, 2I, D], w2 [E, D, I], weights/idx [T, k] -> [T, D]."""
    T, k = idx.shape
    E = w13.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token_of = order // k
    xs = h.index_select(0, token_of)  # [T·k, D] tokens in expert order
    # scatter, not bincount: bincount reads its max back to the host, a sync on the GPU
    counts = torch.zeros(E, dtype=torch.int64, device=h.device).index_add_(0, flat, torch.ones_like(flat))
    if grouped is None:
        grouped = _grouped_ok(h, w13, w2)
    if grouped:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gu = F.grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
        a = _swiglu(gu)
        ys = F.grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    else:
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                a = _swiglu(F.linear(xs[start:start + n], w13[e]))
                ys[start:start + n] = F.linear(a, w2[e])
                start += n
    ys = ys * weights.reshape(-1).index_select(0, order)[:, None]
    out = torch.zeros_like(h)
    out.index_add_(0, token_of, ys)
    return out


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def moe_ffn(spec: ModelSpec, w: dict, h: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
    weights, idx = route(spec, h, w["router"])
    out = experts(h, w["w13"], w["w2"], weights, idx, grouped=grouped)
    if spec.shared_intermediate:
        out = out + shared_expert(spec, w, h)
    return out


def shared_expert(spec: ModelSpec, w: dict, h: torch.Tensor) -> torch.Tensor:
    """The always-on shared expert, behind a sigmoid gate where the family has one (Qwen2-MoE)."""
    s = F.linear(_swiglu(F.linear(h, w["shared_w13"])), w["shared_w2"])
    if spec.shared_gate:
        s = torch.sigmoid(F.linear(h, w["shared_gate"])) * s
    return s
