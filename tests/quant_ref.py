"""References for quantized runs: transformers' model with its experts replaced by our dequantized weights."""

from __future__ import annotations

import torch

from checkpoints import hf_model
from core.model.quant.formats import dequantize, quantize


def dequantized_hf(path, fmt, dtype=torch.float64, dense=(), dense_fmt=None):
    """transformers' model of `path` whose routed experts hold dequantize(quantize(w)) — what a quantized
    engine computes with, so the two must agree to rounding. `dense`: also these attention projections
    (q_proj, k_proj, v_proj, o_proj) and "lm_head" (every format quantizes rows independently, so q, k
    and v one by one equal our fused qkv), in `dense_fmt` (default: `fmt`)."""
    model = hf_model(path, dtype=torch.float32)

    def requant(p, f=fmt):
        p.data = dequantize(f, quantize(f, p.data)).to(torch.float32)

    for layer in model.model.layers:
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            requant(getattr(ex, name))
        for name in dense:
            if name != "lm_head":
                requant(getattr(layer.self_attn, name).weight, dense_fmt or fmt)
    if "lm_head" in dense:
        requant(model.lm_head.weight, dense_fmt or fmt)
    return model.to(dtype)
