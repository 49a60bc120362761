"""The MoE FFN: router, then the routed experts with tokens grouped by expert (`experts`: BACKENDS' first row that
applies), plus a shared expert. Legend: T = tokens, k = experts per token, E = experts, D = hidden, I = expert
intermediate.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F

from core.model import expert_choice, fused_moe
from core.model.device_wait import synchronize  # bounded: a hung probe kernel raises DeviceStalled
from core.model.spec import ModelSpec

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def _grouped_ok(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    # grouped_mm wants fp32/bf16/fp16 and 16-byte aligned strides on every operand.
    if not HAS_GROUPED_MM or h.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w13.dtype != h.dtype:
        return False
    if h.is_cuda and not cuda_grouped_mm_works(h.device.index or 0, h.dtype):
        return False
    return all((n * h.element_size()) % 16 == 0 for n in (*w13.shape[-2:], *w2.shape[-2:]))


@functools.lru_cache(maxsize=None)
def cuda_grouped_mm_works(index: int, dtype: torch.dtype) -> bool:
    """Whether grouped_mm runs on this GPU and dtype, by trying it: a capability list would go stale."""
    if not HAS_GROUPED_MM:
        return False
    try:
        a = torch.zeros(16, 16, dtype=dtype, device=f"cuda:{index}")
        b = torch.zeros(2, 16, 16, dtype=dtype, device=f"cuda:{index}")
        F.grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([8, 16], dtype=torch.int32, device=a.device))
        synchronize("the grouped_mm probe", index)
    except RuntimeError:
        return False
    return True


def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN prepacking: bf16 only (fp32 packing changes rounding), on a CPU whose ISA oneDNN's bf16 path takes."""
    return dtype == torch.bfloat16 and packing_supported()


@functools.lru_cache(maxsize=None)
def packing_supported() -> bool:
    """Whether this CPU and torch prepack bf16 weights, by trying it: oneDNN decides from features torch hides."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return try_pack(torch.ops.mkldnn._reorder_linear_weight)


def try_pack(reorder) -> bool:
    try:
        reorder(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
    except RuntimeError:  # "mkldnn_reorder_linear_weight: bf16 path needs the cpu support ..."
        return False
    return True


def pack_experts(w13: torch.Tensor, w2: torch.Tensor, rows_hint: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each expert's two matrices in oneDNN's blocked layout; RuntimeError where oneDNN refuses."""
    reorder = torch.ops.mkldnn._reorder_linear_weight
    return [(reorder(w13[e], rows_hint), reorder(w2[e], rows_hint)) for e in range(w13.shape[0])]


def pack_cpu_experts(w13: torch.Tensor, w2: torch.Tensor, fused: bool):
    """The experts in the fused C kernel's layout where it runs them (`fused`: plain SwiGLU), else oneDNN's."""
    from core.model.cpu import ffn

    if fused and ffn.takes(w13, w2):
        return ffn.NativeExperts(w13, w2)
    return pack_experts(w13, w2)


def experts(h: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None, weights: torch.Tensor,
            idx: torch.Tensor, grouped: bool | None = None, packed: list | None = None,
            b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, act: Activation | None = None,
            quant=None, widen=None, scratch: "Scratch | None" = None) -> torch.Tensor:
    """Routed experts. h [T, D], w13 [E, 2I, D], w2 [E, D, I] (or `packed`, or `quant` QuantExperts),
    weights/idx [T, k] -> [T, D]. `act`: [n, 2I] gate|up -> [n, I]; `scratch`: reused buffers (the result lives
    until the next call with it). BACKENDS' first row whose condition holds and that does not decline (None)."""
    act = act or _swiglu
    widened = widen is not None and packed is None and quant is None and w13.dtype != h.dtype
    if packed is None and quant is None and grouped is None and not widened:
        grouped = _grouped_ok(h, w13, w2) and _grouped_is_faster(h, w13, w2, weights, idx, b13, b2, act)
    looped = quant is not None or widened or not grouped  # a matmul pair per expert with tokens
    linear = (widen.linear if widened else F.linear if packed is None  # oneDNN's packed layout:
              else lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    up_down = (None if not looped else (quant.up, quant.down) if quant is not None else  # expert e's two products
               (lambda e, x: linear(x, packed[e][0]), lambda e, y: linear(y, packed[e][1])) if packed is not None
               else (lambda e, x: linear(x, w13[e]), lambda e, y: linear(y, w2[e])))
    c = Call(h, w13, w2, weights, idx, packed, b13, b2, act, quant, scratch, idx.shape[0], looped, up_down)
    for _, when, run in BACKENDS:
        if when(c) and (out := run(c)) is not None:
            return out


# One `experts` call, its defaults resolved: what the backends' conditions read.
Call = collections.namedtuple("Call", "h w13 w2 weights idx packed b13 b2 act quant scratch T looped up_down")


def _fused(c: Call) -> torch.Tensor:
    """The fused C kernel's layout: nothing else can read it."""
    if c.act is not _swiglu or c.b13 is not None or c.b2 is not None:
        raise ValueError("experts in the fused kernel's layout are plain SwiGLU without biases")
    return c.packed(c.h, c.weights, c.idx, None if c.scratch is None else c.scratch.get("out", c.h.shape, c.h.dtype))


def _one_token(c: Call) -> torch.Tensor:
    """Batch 1, no sort or scatter: bit for bit the loop (same products, same order) in a third of its ops."""
    (up, down), out = c.up_down, None
    for e, w in sorted(zip(c.idx.tolist()[0], c.weights.tolist()[0])):
        y = _expert(e, c.h, up, down, c.b13, c.b2, c.act).mul_(w)  # a fresh output: scaled in place
        out = y if out is None else out.add_(y)
    return out


def _sorted(c: Call, grouped: bool) -> torch.Tensor:
    """Tokens sorted by expert, then a matmul pair per expert with tokens (or two grouped_mm), weighed, scattered."""
    h, (T, k), scratch, b13, b2 = c.h, c.idx.shape, c.scratch, c.b13, c.b2
    E = len(c.quant) if c.quant is not None else len(c.packed) if c.packed is not None else c.w13.shape[0]
    flat = c.idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token_of = order // k
    xs = h.index_select(0, token_of) if scratch is None else torch.index_select(
        h, 0, token_of, out=scratch.get("xs", (T * k, h.shape[1]), h.dtype))  # [T·k, D] tokens in expert order
    # scatter, not bincount: bincount reads its max back to the host, a sync on the GPU
    counts = torch.zeros(E, dtype=torch.int64, device=h.device).index_add_(0, flat, torch.ones_like(flat))
    if not grouped:
        ys = torch.empty_like(xs) if scratch is None or c.quant is not None else scratch.get("ys", xs.shape, xs.dtype)
        (up, down), start = c.up_down, 0
        for e, n in enumerate(counts.tolist()):
            if n:
                ys[start:start + n] = _expert(e, xs[start:start + n], up, down, b13, b2, c.act)
                start += n
    else:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gu = F.grouped_mm(xs, c.w13.transpose(-2, -1), offs=offs)
        if b13 is not None:
            gu = gu + b13.index_select(0, flat.index_select(0, order))
        ys = F.grouped_mm(c.act(gu), c.w2.transpose(-2, -1), offs=offs)
        if b2 is not None:
            ys = ys + b2.index_select(0, flat.index_select(0, order))
    ys.mul_(c.weights.reshape(-1).index_select(0, order)[:, None])  # every path's ys is its own: weigh in place
    out = torch.zeros_like(h) if scratch is None else scratch.get("out", h.shape, h.dtype).zero_()
    out.index_add_(0, token_of, ys)
    return out


# (name, condition, backend), read top to bottom. Order matters where conditions overlap: the fused layout
# before anything (nothing else reads it), batch-1 forms before the general ones, grouped_mm as the rest.
BACKENDS: list[tuple[str, Callable[[Call], bool], Callable[[Call], torch.Tensor | None]]] = [
    ("fused", lambda c: hasattr(c.packed, "fused_swiglu"), _fused),
    ("quant_in_one_call", lambda c: c.quant is not None and c.b13 is None and c.b2 is None and c.act is _swiglu,
     lambda c: c.quant.in_one_call(c.h, c.weights, c.idx)),  # int4 at one token, GGUF blocks at a few, in C
    ("one_token", lambda c: c.T == 1 and c.looped, _one_token),
    ("loop", lambda c: c.looped, functools.partial(_sorted, grouped=False)),
    ("grouped", lambda c: True, functools.partial(_sorted, grouped=True)),
]


class Scratch:
    """Host buffers grown to the largest size asked and reused, so a decode step faults in no fresh pages."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        t = self._bufs.get(name)
        if t is None or t.numel() < n or t.dtype != dtype:
            t = self._bufs[name] = torch.empty(max(n, 1), dtype=dtype)
        return t[:n].view(shape)


Activation = Callable[[torch.Tensor], torch.Tensor]


def _expert(e: int, x, up, down, b13, b2, act) -> torch.Tensor:
    gu = up(e, x)
    if b13 is not None:
        gu = gu + b13[e]
    y = down(e, act(gu))
    return y if b2 is None else y + b2[e]


def _grouped_is_faster(h, w13, w2, weights, idx, b13, b2, act) -> bool:
    """F.grouped_mm or a matmul pair per expert, whichever is faster: timed once per shape on this machine."""
    key = (h.device.type, h.dtype, *w13.shape, w2.shape[-1], b13 is not None, act is _swiglu,
           expert_choice.bucket(h.shape[0]))
    run = {name: functools.partial(experts, h, w13, w2, weights, idx, grouped=g, b13=b13, b2=b2, act=act)
           for name, g in (("grouped", True), ("loop", False))}
    sync = (lambda: synchronize("timing the experts' forms", h.device.index)) if h.is_cuda else (lambda: None)
    return expert_choice.choose(key, run, sync) == "grouped"


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [T, I] buffer fewer


def clamped_swiglu(alpha: float, limit: float) -> Activation:
    """gpt-oss's expert activation: gate clamped from above, up from both sides, gate·σ(α·gate)·(up + 1)."""
    def act(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return (gate * torch.sigmoid(gate * alpha)).mul_(up.clamp(-limit, limit) + 1)
    return act


def activation(spec: ModelSpec) -> Activation:
    return clamped_swiglu(spec.swiglu_alpha, spec.swiglu_limit) if spec.expert_act == "clamped_swiglu" else _swiglu


def dense_mlp(w: dict, h: torch.Tensor) -> torch.Tensor:
    """The dense SwiGLU MLP of a layer without experts (DeepSeek's and GLM's first layers)."""
    return F.linear(_swiglu(F.linear(h, w["dense_w13"])), w["dense_w2"])


def shared_expert(spec: ModelSpec, w: dict, h: torch.Tensor) -> torch.Tensor:
    """The always-on shared expert, behind a sigmoid gate where the family has one (Qwen2-MoE)."""
    s = F.linear(_swiglu(F.linear(h, w["shared_w13"])), w["shared_w2"])
    if spec.shared_gate:
        s = torch.sigmoid(F.linear(h, w["shared_gate"])) * s
    return s


def device_experts(h: torch.Tensor, parts: list[dict], weights: torch.Tensor, idx: torch.Tensor, *,
                   grouped: bool | None = None, grouped_mm: bool = True, act: Activation | None = None,
                   backend: str | None = None) -> torch.Tensor:
    """Routed experts on an accelerator in launches independent of E, nothing read back. `parts`: stacks (w13,
    w2 or `quant`, b13, b2) of experts 0..E−1 in order; the fused path or grouped_mm per part (fused_moe)."""
    act = act or _swiglu
    quantized = any("quant" in p for p in parts)
    if fused_moe.expert_path(quantized, h.shape[0], grouped_mm, grouped) == "fused":
        return fused_moe.fused_experts(h, parts, weights, idx, act, backend)
    T, k = idx.shape
    E = sum(p["w13"].shape[0] for p in parts)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token_of = order // k
    counts = torch.zeros(E, dtype=torch.int64, device=h.device).index_add_(0, flat, torch.ones_like(flat))
    ys = _grouped_parts(h.index_select(0, token_of), parts, counts, flat.index_select(0, order), act)
    ys = ys * weights.reshape(-1).index_select(0, order)[:, None]
    out = torch.zeros_like(h)
    out.index_add_(0, token_of, ys)
    return out


def _grouped_parts(xs: torch.Tensor, parts, counts: torch.Tensor, sorted_e: torch.Tensor, act) -> torch.Tensor:
    """grouped_mm per part. A part's groups start at row 0, so its first group also covers earlier parts'
    rows: those are dropped by a `where` against an offset kept on the device."""
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = torch.arange(xs.shape[0], device=xs.device)[:, None]

    def each(x, which, bias):
        out, base = None, 0
        for p in parts:
            w = p[which]
            n = w.shape[0]
            y = F.grouped_mm(x, w.transpose(-2, -1), offs=ends[base:base + n])
            out = y if out is None else torch.where(rows < ends[base - 1], out, y, out=y)
            base += n
        if bias in parts[0]:  # per-expert biases, row by row
            out = out + torch.cat([p[bias] for p in parts]).index_select(0, sorted_e)
        return out

    return each(act(each(xs, "w13", "b13")), "w2", "b2")
