"""The token mixer of each layer (its attention kind) behind one interface: "gqa" (gqa.py), "mla" (mla.py) and
"linear" (linear_attention.py) each have d1_width / d2_width (elements a token over D1 and D2) and
  pre(spec, w, h, positions, rope, call_lengths, full_norm, out) -> (payload [T, d1], what stays for post)
  attend(spec, w_host, payload, store, rows) -> [B, d2]       (next to the state, one token per row)
  post(spec, w, out, keep) -> [T, D]
  prefill(spec, w, h, positions, rope, lens, call_lengths, window, full_norm) -> ([T, D], per prompt the state parts)
`out`: the device's D1 block the payload may be written into; `full_norm`: a rank's q/k norm over all heads.
"""

from __future__ import annotations

from types import ModuleType

from core.model import gqa, linear_attention, mla
from core.model.spec import ModelSpec


def module(spec: ModelSpec, layer: int) -> ModuleType:
    if spec.layer_type(layer) == "linear":
        return linear_attention
    return mla if spec.mla is not None else gqa


def window(spec: ModelSpec, layer: int) -> int:
    return spec.sliding_window if spec.layer_type(layer) == "sliding" else 0


def d1_width(spec: ModelSpec, layer: int) -> int:
    return module(spec, layer).d1_width(spec)


def d2_width(spec: ModelSpec, layer: int) -> int:
    return module(spec, layer).d2_width(spec)


def max_widths(spec: ModelSpec) -> tuple[int, int]:
    """The widest D1 and D2 payloads over the layers (the host buffers' widths)."""
    layers = range(spec.num_layers)
    return max(d1_width(spec, i) for i in layers), max(d2_width(spec, i) for i in layers)
