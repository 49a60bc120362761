"""References for quantized runs: transformers' model with its experts replaced by our dequantized weights."""

from __future__ import annotations

import torch

from checkpoints import hf_model
from core.model.quant.formats import dequantize, quantize


def dequantized_hf(path, fmt, dtype=torch.float64):
    """transformers' model of `path` whose routed experts hold dequantize(quantize(w)) — what a quantized
    engine computes with, so the two must agree to rounding."""
    model = hf_model(path, dtype=torch.float32)
    for layer in model.model.layers:
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(ex, name)
            p.data = dequantize(fmt, quantize(fmt, p.data)).to(torch.float32)
    return model.to(dtype)
