"""gpt-oss's MXFP4 experts read as they are: 4-bit blocks and their exponents into a quantized layer.

The released gpt-oss checkpoints keep each expert projection as `<name>_blocks` [E, N, K/32, 16] (two
e2m1 values a byte, even k in the low nibble) and `<name>_scales` [E, N, K/32] (e8m0 exponents, bias
127), with gate and up interleaved on the rows of `gate_up_proj` (gate = even rows). Rows are
independent, so de-interleaving them into our gate-then-up `w13` moves bytes, never values: the
experts stay 4-bit in RAM, in pages and on the wire (`Format("mxfp4")`, decoded by
core.model.quant.blocks.decode_mxfp4 where they run).
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
