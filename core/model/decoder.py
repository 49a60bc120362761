"""One decoder layer, in the steps CGOPipe schedules (any family, any layer kind).

Decode, one token per request:
  pre_attn  (accelerator): norm + the mixer's projections -> a payload for the CPU, and what stays
  attend    (CPU, next to the layer's state): write the new token's state, attend -> output
  post_attn (accelerator): the mixer's output projection + residual, norm -> h for the FFN, and the
            FFN's dense part (router + shared expert, or the whole dense MLP of a dense layer)
  routed experts (accelerator, per expert batch): core.model.moe.experts
Prefill: `prefill_layer` runs a whole layer for packed prompts and returns their state parts.
The token mixer of each kind lives in core.model.mixer. Legend: T = tokens, D = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from core.model import mixer
from core.model.layers import norm
from core.model.moe import dense_mlp, route, shared_expert
from core.model.spec import ModelSpec


def pre_attn(spec: ModelSpec, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor, rope,
             call_lengths: torch.Tensor | None = None):
    """x [T, D] -> (payload [T, d1] for the CPU, what stays for post_attn)."""
    h = norm(spec, x, w["ln1"], w.get("ln1_b"))
    return mixer.module(spec, layer).pre(spec, w, h, positions, rope, call_lengths)


def attend(spec: ModelSpec, layer: int, w: dict, payload: torch.Tensor, store, rows) -> torch.Tensor:
    """Next to the state: payload [B, d1] -> [B, d2]. `w` holds the layer's tensors on this side."""
    return mixer.module(spec, layer).attend(spec, w, payload, store, rows)


@dataclass
class FfnInput:
    """What the routed experts (and the residual) need after post_attn."""

    x: torch.Tensor  # residual stream after attention [T, D]
    h: torch.Tensor  # normed input of the FFN [T, D]
    weights: torch.Tensor | None = None  # routing [T, k]; None in a dense layer
    idx: torch.Tensor | None = None
    dense: torch.Tensor | None = None  # shared expert (MoE) or the dense MLP's output [T, D]


def post_attn(spec: ModelSpec, layer: int, w: dict, x: torch.Tensor, out: torch.Tensor, keep) -> FfnInput:
    """out [T, d2] from attend -> residual, norm, and the FFN's dense part."""
    x = x + mixer.module(spec, layer).post(spec, w, out, keep)
    h = norm(spec, x, w["ln2"], w.get("ln2_b"))
    if not spec.is_moe(layer):
        return FfnInput(x, h, dense=dense_mlp(w, h))
    weights, idx = route(spec, h, w)
    return FfnInput(x, h, weights, idx, shared_expert(spec, w, h) if spec.shared_intermediate else None)


def finish(f: FfnInput, routed: torch.Tensor | None) -> torch.Tensor:
    """The layer's output: residual + routed experts (+ shared expert), or + the dense MLP."""
    y = f.dense if routed is None else (routed if f.dense is None else routed + f.dense)
    return f.x + y


Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (h, weights, idx) -> [T, D]


def prefill_layer(spec: ModelSpec, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor, rope,
                  lens: list[int], experts: Experts, call_lengths: torch.Tensor | None = None):
    """Whole prompts packed in x [T, D] -> (layer output [T, D], per prompt its state parts)."""
    m = mixer.module(spec, layer)
    h = norm(spec, x, w["ln1"], w.get("ln1_b"))
    out, parts = m.prefill(spec, w, h, positions, rope, lens, call_lengths, mixer.window(spec, layer))
    x = x + out
    h = norm(spec, x, w["ln2"], w.get("ln2_b"))
    if not spec.is_moe(layer):
        return x + dense_mlp(w, h), parts
    weights, idx = route(spec, h, w)
    y = experts(h, weights, idx)
    if spec.shared_intermediate:
        y = y + shared_expert(spec, w, h)
    return x + y, parts
