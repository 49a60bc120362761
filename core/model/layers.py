"""The norms every family uses and the final norm + LM head, as plain functions over weight views.
Legend: T = tokens, D = hidden.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from core.model.cpu import row_ops
from core.model.cpu.kernels import linear
from core.model.limits import LOGIT_CHUNK_BYTES
from core.model.spec import ModelSpec


def norm(spec: ModelSpec, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The model's norm over the last axis: RMSNorm in one of the reference's styles, or LayerNorm."""
    eps = spec.norm_eps
    if spec.norm == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if spec.norm == "rms":
        return rms_norm(x, w, eps)
    # weight applied in fp32, then cast (gpt-oss; Qwen3-Next's zero-centred weight, 1 + w, made once): one rounding
    return normed(x, derived((w,), lambda w: w.float() + 1.0) if spec.norm == "rms_offset" else w, eps)


_DERIVED: dict[tuple, tuple] = {}  # key -> (weak references to its tensors, their versions, what was made of them)


def tensor_version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: never written in place after it was made
        return 0


def derived(tensors: tuple, make, *extra):
    """make(*tensors), kept while those weight tensors live unwritten (and `extra` is the same): made once, not
    in every norm of every micro-batch (a few device ops each)."""
    key = (*map(id, tensors), *extra)
    kept, versions = _DERIVED.get(key), tuple(map(tensor_version, tensors))
    if kept is None or any(r() is not t for r, t in zip(kept[0], tensors)) or kept[1] != versions:
        gone = lambda _: _DERIVED.pop(key, None)  # noqa: E731
        kept = _DERIVED[key] = (tuple(weakref.ref(t, gone) for t in tensors), versions, make(*tensors))
    return kept[2]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    # Statistics in fp32 then back to the input dtype before the scale, as the reference models do; in one
    # C pass where it applies (bf16 or fp32 on the CPU: core.model.cpu.row_ops), the same roundings. The last op,
    # the weight's product, writes into `out` where given.
    done = row_ops.rms_norm(x, w, eps) if x.device.type == "cpu" else None
    if out is None:
        return done if done is not None else w * normed(x, None, eps)
    return out.copy_(done) if done is not None else torch.mul(w, normed(x, None, eps), out=out)


_FUSED = getattr(torch.ops.aten, "_fused_rms_norm", None)  # the kernel F.rms_norm calls on a GPU


def normed(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x·rsqrt(mean(x²) + eps) · w (None: 1) [.., D] in fp32, rounded once to x's dtype: one kernel where the
    written-out form was seven, and equal to it bit for bit (tests/test_norms.py)."""
    if _FUSED is not None:
        try:
            return _FUSED(x, [x.shape[-1]], w, eps)[0]
        except NotImplementedError:  # a backend without the fused kernel: the composite
            pass
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def final_logits(spec: ModelSpec, norm_w: torch.Tensor, lm_head: torch.Tensor, x: torch.Tensor,
                 norm_b: torch.Tensor | None = None, head_b: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits [T, V]; into `out` when given (a reused buffer: a fresh one is tens of MB of new pages a
    step). A head of out's dtype is multiplied straight into it; otherwise (oneDNN's packed linear has no out=)
    a few rows at a time, each chunk under glibc's mmap threshold so its memory is reused, not faulted in."""
    h = norm(spec, x, norm_w, norm_b)
    if out is None:
        return F.linear(h, lm_head, head_b).float()
    if type(lm_head) is torch.Tensor and lm_head.dtype == h.dtype == out.dtype:
        torch.mm(h, lm_head.t(), out=out)
        return out if head_b is None else out.add_(head_b)
    rows = max(1, LOGIT_CHUNK_BYTES // (lm_head.shape[0] * h.element_size()))
    for a in range(0, h.shape[0], rows):
        out[a:a + rows].copy_(linear(h[a:a + rows], lm_head, head_b))
    return out
