"""gpt-oss's MXFP4 experts read as they are. `gate_up_proj` interleaves gate and up on its rows (gate = even);
rows are independent, so de-interleaving them into our gate-then-up `w13` moves bytes, never values.
"""

from __future__ import annotations

from core.model.quant.experts import ExpertScheme
from core.model.quant.formats import Format

EVERY, EVEN, ODD = slice(None), slice(0, None, 2), slice(1, None, 2)


def scheme(spec) -> ExpertScheme:
    return ExpertScheme.uniform(Format("mxfp4"), spec.hidden_size, spec.expert_intermediate)


def fill(ckpt, spec, i: int, tensors: dict) -> None:
    """Layer i's expert blocks and scales from the checkpoint into the layer's parts, gate rows first."""
    I, m = spec.expert_intermediate, f"model.layers.{i}.mlp.experts."
    for part in ("blocks", "scales"):
        w13 = tensors[f"w13.{part}"]
        ckpt.copy_into(f"{m}gate_up_proj_{part}", w13[:, :I], select=(EVERY, EVEN))
        ckpt.copy_into(f"{m}gate_up_proj_{part}", w13[:, I:], select=(EVERY, ODD))
        ckpt.copy_into(f"{m}down_proj_{part}", tensors[f"w2.{part}"])
