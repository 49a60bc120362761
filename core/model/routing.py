"""MoE routers (ModelSpec.router), each the inference form of its reference, then × `routed_scale`. softmax: over
all experts, top-k, optionally renormalised (Mixtral, Qwen, OLMoE, DBRX); topk_softmax: softmax over the top-k
(biased) logits (gpt-oss); softmax_group: only the experts of the `topk_group` best groups (DeepSeek-V2);
sigmoid_group: `e_score_correction_bias` added to choose (groups ranked by the sum of their two best), the plain
scores as weights (DeepSeek-V3, GLM-4.5); sparsemixer: Phi-3.5-MoE's top-2, each weighted by a softmax over the
experts within a relative `jitter_eps` of it (no sampling at inference). Legend: T = tokens, E = experts, k = top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.model import fused_router
from core.model.spec import ModelSpec


def route(spec: ModelSpec, h: torch.Tensor, w: dict, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D] -> (weights [T, k] in h's dtype, expert ids [T, k]); `fused`: the post-matmul part as one op."""
    if spec.router_fp32:
        logits = F.linear(h.float(), w["router"].float())
    else:
        logits = F.linear(h, w["router"], w.get("router_bias"))
    if fused and fused_router.takes(spec):
        return fused_router.route(spec, logits, w.get("e_bias"), h.dtype)
    return choose(spec, logits, w, h.dtype)


def choose(spec: ModelSpec, logits: torch.Tensor, w: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its matmul: logits [T, E] -> (weights [T, k] in `dtype`, expert ids [T, k])."""
    kind = spec.router
    if kind == "softmax":
        probs = torch.softmax(logits.float() if spec.router_softmax_fp32 else logits, dim=-1)
        top, idx = torch.topk(probs, spec.top_k, dim=-1)
        if spec.router_norm == "sum" and spec.routed_scale == 1.0:  # the quotient rounded straight to h's dtype
            return torch.div(top, top.sum(dim=-1, keepdim=True), out=_empty(top, dtype)), idx
        top = _renormalise(spec, top)
    elif kind == "topk_softmax":
        top, idx = torch.topk(logits, spec.top_k, dim=-1)
        top = torch.softmax(top, dim=-1)
    elif kind == "softmax_group":
        scores = torch.softmax(logits.float(), dim=-1)
        if spec.router_groups > 1:
            grouped = scores.view(-1, spec.router_groups, spec.num_experts // spec.router_groups)
            _drop_groups(spec, grouped, grouped.amax(dim=-1), 0.0)  # the others' scores: 0
        top, idx = torch.topk(scores, spec.top_k, dim=-1)
        top = _renormalise(spec, top)
    elif kind == "sigmoid_group":
        scores = logits.float().sigmoid()
        choice = scores + w["e_bias"] if spec.router_correction else scores  # in fp32 (promoted), one op
        if choice is scores and spec.router_groups > 1:  # its groups are dropped in place; the weights are these
            choice = scores.clone()
        if spec.router_groups > 1:
            per_group = choice.view(-1, spec.router_groups, spec.num_experts // spec.router_groups)
            best = per_group.topk(2, dim=-1).values.sum(dim=-1)
            _drop_groups(spec, per_group, best, float("-inf"))  # the others: -inf
        idx = torch.topk(choice, spec.top_k, dim=-1).indices
        top = scores.gather(1, idx)
        if spec.router_norm == "sum":
            denom = top.sum(dim=-1, keepdim=True) + 1e-20
            if spec.routed_scale == 1.0:
                return torch.div(top, denom, out=_empty(top, dtype)), idx
            top = top / denom
    elif kind == "sparsemixer":
        top, idx = _sparsemixer(logits, spec.router_jitter)
    else:
        raise ValueError(f"unknown router {kind!r}")
    if spec.routed_scale != 1.0:  # the product rounded straight to h's dtype: the same value as after a cast
        return torch.mul(top, spec.routed_scale, out=_empty(top, dtype)), idx
    return top.to(dtype), idx


def _empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The routing weights' tensor in h's dtype, for their last op to round into (one op, not two)."""
    return torch.empty(like.shape, dtype=dtype, device=like.device)


def _renormalise(spec: ModelSpec, top: torch.Tensor) -> torch.Tensor:
    if spec.router_norm == "sum":
        return top / top.sum(dim=-1, keepdim=True)
    if spec.router_norm == "pnorm":
        return top / torch.norm(top, p=spec.router_pnorm, dim=-1, keepdim=True)
    return top


def _drop_groups(spec: ModelSpec, grouped: torch.Tensor, group_scores: torch.Tensor, other: float) -> None:
    """Set the experts of all but the `topk_group` best groups to `other`, in place (scattered over the worst)."""
    drop = spec.router_groups - spec.router_topk_groups
    if drop > 0:
        worst = torch.topk(group_scores, drop, dim=-1, largest=False).indices  # [T, G − topk_group]
        grouped.scatter_(1, worst[..., None].expand(-1, -1, grouped.shape[-1]), other)


def _sparsemixer(scores: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    first_val, first = scores.max(dim=-1, keepdim=True)
    w1 = _within_threshold_softmax(scores, scores, first_val, eps).gather(-1, first)
    rest = scores.scatter(-1, first, float("-inf"))
    second_val, second = rest.max(dim=-1, keepdim=True)
    w2 = _within_threshold_softmax(rest, scores, second_val, eps).gather(-1, second)
    return torch.cat((w1, w2), dim=-1), torch.cat((first, second), dim=-1)


def _within_threshold_softmax(candidates, scores, best, eps):
    """softmax over the candidates whose score is within a relative 2·eps of `best` (the others −inf)."""
    factor = scores.abs().clamp(min=best)
    far = (best - scores) / factor > 2 * eps
    return torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1)
