"""One decoder layer, in the steps CGOPipe schedules (any family, any layer kind; its token mixer: core.model.mixer).
Decode: `pre_attn` on the accelerator, `attend` on the CPU next to the layer's state, `post_attn` on the accelerator,
then the routed experts (core.model.moe.experts). Prefill: `prefill_mix`, then `prefill_ffn`, for packed prompts.
Legend: T = tokens, D = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from core.model import mixer, routing
from core.model.cpu import row_ops
from core.model.layers import norm
from core.model.moe import dense_mlp, shared_expert
from core.model.spec import ModelSpec


def pre_attn(spec: ModelSpec, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor, rope,
             call_lengths: torch.Tensor | None = None, full_norm=None, out: torch.Tensor | None = None):
    """x [T, D] -> (payload [T, d1] for the CPU, what stays for post_attn); `full_norm`, `out`: core.model.mixer's."""
    h = norm(spec, x, w["ln1"], w.get("ln1_b"))
    return mixer.module(spec, layer).pre(spec, w, h, positions, rope, call_lengths, full_norm=full_norm, out=out)


def attend(spec: ModelSpec, layer: int, w: dict, payload: torch.Tensor, store, rows, widen=None) -> torch.Tensor:
    """Next to the state: payload [B, d1] -> [B, d2]. `w` holds the layer's tensors on this side; `widen`
    (core.model.cpu.kernels.Widen) computes in a wider dtype than the stored state where the CPU is slow in it."""
    return mixer.module(spec, layer).attend(spec, w, payload, store, rows, widen)


@dataclass
class FfnInput:
    """What the routed experts (and the residual) need after post_attn."""

    x: torch.Tensor  # residual stream after attention [T, D]
    h: torch.Tensor  # normed input of the FFN [T, D]
    weights: torch.Tensor | None = None  # routing [T, k]; None in a dense layer
    idx: torch.Tensor | None = None
    dense: torch.Tensor | None = None  # shared expert (MoE) or the dense MLP's output [T, D]


def post_attn(spec: ModelSpec, layer: int, w: dict, x: torch.Tensor, out: torch.Tensor, keep,
              attention_out=None, fused_route: bool = False) -> FfnInput:
    """out [T, d2] from attend -> residual, norm, and the FFN's dense part. `attention_out` sums a tensor-parallel
    rank's partial output; `fused_route`: routing.route's `fused`, as on an accelerator."""
    y = mixer.module(spec, layer).post(spec, w, out, keep)
    x = x + (y if attention_out is None else attention_out(y))
    h = norm(spec, x, w["ln2"], w.get("ln2_b"))
    if not spec.is_moe(layer):
        return FfnInput(x, h, dense=dense_mlp(w, h))
    routed = None if fused_route else _c_route(spec, h, w)
    weights, idx = routed if routed is not None else routing.route(spec, h, w, fused_route)
    return FfnInput(x, h, weights, idx, shared_expert(spec, w, h) if spec.shared_intermediate else None)


C_ROUTE_LOGITS = 1024  # T·E up to which the host's router is one C call: small batches, where each op's start costs


def _c_route(spec: ModelSpec, h: torch.Tensor, w: dict):
    """The plain softmax router on the host in one C call (row_ops), or None: at a small batch it replaces six cold
    ops; the C loop is one thread's, so larger batches keep torch's threaded matmul."""
    if (h.device.type != "cpu" or spec.router != "softmax" or not spec.router_softmax_fp32 or spec.router_fp32
            or spec.router_norm not in ("sum", "none") or "router_bias" in w
            or h.shape[0] * spec.num_experts > C_ROUTE_LOGITS):
        return None
    return row_ops.softmax_route(h, w["router"], spec.top_k, spec.router_norm == "sum", spec.routed_scale)


def ffn_output(f: FfnInput, routed: torch.Tensor | None) -> torch.Tensor:
    """The FFN's output: routed experts (+ shared expert), or the dense MLP."""
    return f.dense if routed is None else (routed if f.dense is None else routed + f.dense)


Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (h, weights, idx) -> [T, D]


def prefill_mix(spec: ModelSpec, layer: int, w: dict, x: torch.Tensor, positions: torch.Tensor, rope, lens: list[int],
                call_lengths: torch.Tensor | None = None, full_norm=None, attention_out=None, chunk: int = 0):
    """Whole prompts packed in x [T, D] -> (residual stream after the token mixer, per prompt its state parts);
    `full_norm`, `attention_out` as in pre_attn and post_attn. `chunk` > 0: prompts of at most that many tokens
    at a time, written back over x, so that no intermediate spans the whole call (limits.prefill_chunk)."""
    if 0 < chunk < x.shape[0]:
        parts, a = [], 0
        for group in prompt_groups(lens, chunk):
            b = a + sum(group)
            got, more = prefill_mix(spec, layer, w, x[a:b], positions[a:b], rope, group,
                                    None if call_lengths is None else call_lengths[a:b], full_norm, attention_out)
            x[a:b] = got
            parts += more
            a = b
        return x, parts
    m = mixer.module(spec, layer)
    h = norm(spec, x, w["ln1"], w.get("ln1_b"))
    out, parts = m.prefill(spec, w, h, positions, rope, lens, call_lengths, mixer.window(spec, layer),
                           full_norm=full_norm)
    return x + (out if attention_out is None else attention_out(out)), parts


def prompt_groups(lens: list[int], most: int) -> list[list[int]]:
    """`lens` in order, cut into runs of at most `most` tokens (a longer prompt alone)."""
    groups, n = [], most + 1
    for L in lens:
        if n + L > most:
            groups.append([])
            n = 0
        groups[-1].append(L)
        n += L
    return groups


def prefill_ffn(spec: ModelSpec, layer: int, w: dict, x: torch.Tensor, experts: Experts, ffn_out=None,
                chunk: int = 0) -> torch.Tensor:
    """x [T, D] after the mixer -> the layer's output; the FFN's intermediates are a prefill's peak (the planner
    counts it so). `ffn_out` sums a tensor-parallel rank's partial output. `chunk` > 0: at most that many tokens
    at a time, written back over x (the FFN is per token)."""
    if 0 < chunk < x.shape[0]:
        for a in range(0, x.shape[0], chunk):
            x[a:a + chunk] = prefill_ffn(spec, layer, w, x[a:a + chunk], experts, ffn_out)
        return x
    h = norm(spec, x, w["ln2"], w.get("ln2_b"))
    if not spec.is_moe(layer):
        y = dense_mlp(w, h)
    else:
        weights, idx = routing.route(spec, h, w)
        y = experts(h, weights, idx)
        if spec.shared_intermediate:
            y = y + shared_expert(spec, w, h)
    return x + (y if ffn_out is None else ffn_out(y))
