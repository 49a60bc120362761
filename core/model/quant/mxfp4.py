"""gpt-oss's MXFP4 experts read as they are: 4-bit blocks and their exponents into a quantized layer.

gpt-oss keeps gate and up interleaved on the rows of `gate_up_proj` (gate = even rows); rows are
independent, so de-interleaving them into our gate-then-up `w13` moves bytes, never values.
"""

from __future__ import annotations

from core.model.quant.experts import ExpertScheme
from core.model.quant.formats import Format

EVERY, EVEN, ODD = slice(None), slice(0, None, 2), slice(1, None, 2)


def scheme(spec) -> ExpertScheme:
    return ExpertScheme.uniform(Format("mxfp4"), spec.hidden_size, spec.expert_intermediate)


def expert_sources(i: int) -> dict[str, str]:
    m = f"model.layers.{i}.mlp.experts."
    return {f"{w}.{part}": f"{m}{name}_{part}" for w, name in (("w13", "gate_up_proj"), ("w2", "down_proj"))
            for part in ("blocks", "scales")}


def fill(ckpt, spec, i: int, tensors: dict) -> None:
    """Layer i's expert blocks and scales from the checkpoint into the layer's parts, gate rows first."""
    I = spec.expert_intermediate
    for dest, src in expert_sources(i).items():
        if dest.startswith("w13"):
            ckpt.copy_into(src, tensors[dest][:, :I], select=(EVERY, EVEN))
            ckpt.copy_into(src, tensors[dest][:, I:], select=(EVERY, ODD))
        else:
            ckpt.copy_into(src, tensors[dest])
