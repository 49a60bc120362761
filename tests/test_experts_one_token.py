"""The routed experts of one token (a decode step at batch 1): bit for bit the general path's result,
against a float64 reference, and without the general path's sort, scatter and bookkeeping ops —
counted as the ops torch dispatches from Python (its in-process profiler's top-level events)."""

from __future__ import annotations

import pytest
import torch

from core.model import moe
from core.model.quant.experts import ExpertScheme, QuantExperts
from core.model.quant.formats import Format, dequantize, quantize

E, D, I = 6, 64, 128


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, D, generator=g) / D ** 0.5, torch.randn(E, D, I, generator=g) / I ** 0.5


def _backends():
    """name -> (experts kwargs, float64 w13, w2 the backend computes with)."""
    w13, w2 = _weights()
    out = {"loop": (dict(w13=w13.bfloat16(), w2=w2.bfloat16(), grouped=False), w13.bfloat16(), w2.bfloat16())}
    if moe.can_pack(torch.bfloat16):
        out["packed"] = (dict(w13=None, w2=None, packed=moe.pack_experts(w13.bfloat16(), w2.bfloat16())),
                         w13.bfloat16(), w2.bfloat16())
    for fmt in (Format("int8"), Format("int4", 32)):
        parts = {f"w13.{s}": t for s, t in quantize(fmt, w13).items()}
        parts.update({f"w2.{s}": t for s, t in quantize(fmt, w2).items()})
        q = QuantExperts(ExpertScheme.uniform(fmt, D, I), parts, torch.bfloat16)
        ref = (dequantize(fmt, {s[4:]: t for s, t in parts.items() if s.startswith("w13.")}),
               dequantize(fmt, {s[3:]: t for s, t in parts.items() if s.startswith("w2.")}))
        if q.pack_cpu():
            out[f"{fmt.label}-kernel"] = (dict(w13=None, w2=None, quant=q), *ref)
        if q.native:  # int4 on mlight's C kernel above: torch's int4 kernel as well
            t = QuantExperts(q.scheme, parts, torch.bfloat16)
            t._native_ok = lambda: False
            if t.pack_cpu():
                out[f"{fmt.label}-torch-kernel"] = (dict(w13=None, w2=None, quant=t), *ref)
        expand = QuantExperts(q.scheme, parts, torch.bfloat16)
        out[f"{fmt.label}-expand"] = (dict(w13=None, w2=None, quant=expand), *ref)
    return out


BACKENDS = _backends()
IDX = torch.tensor([[4, 1]])  # not in id order: the sum still goes in id order, as the general path's


def _route(seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, D, generator=g).bfloat16()
    w = torch.tensor([[0.625, 0.375], [0.5, 0.5]], dtype=torch.bfloat16)
    return h, w


@pytest.mark.parametrize("name", list(BACKENDS))
def test_one_token_equals_the_general_path_and_float64(name):
    kw, w13, w2 = BACKENDS[name]
    h, w = _route()
    one = moe.experts(h[:1], weights=w[:1], idx=IDX, **kw)
    # the same token in a batch of two whose other token chose other experts: the general path, where
    # every expert of token 0 still multiplies one row
    two = moe.experts(h, weights=w, idx=torch.cat([IDX, torch.tensor([[0, 5]])]), **kw)
    x = h[0].double()
    ref = sum(float(wj) * (torch.nn.functional.silu(w13[e].double()[:I] @ x) * (w13[e].double()[I:] @ x)) @ w2[e].double().T
              for e, wj in zip(IDX[0].tolist(), w[0].tolist()))
    err = (one[0].double() - ref).abs().max() / ref.abs().max()
    fused = getattr(kw.get("quant"), "native", False)
    if fused:  # one C call keeps every intermediate in fp32: only the output rounds to bf16
        assert err < 8e-3, err
        assert ((one[0].double() - two[0].double()).abs().max() / ref.abs().max()) < 2e-2
    else:
        assert torch.equal(one[0], two[0])
        assert err < 2e-2, err  # bf16 activations and outputs between the two projections


def _ops(fn) -> list[str]:
    with torch.autograd.profiler.profile(use_kineto=False) as prof:
        fn()
    return [ev.name for ev in prof.function_events if ev.cpu_parent is None]


@pytest.mark.parametrize("name", [n for n in BACKENDS if "kernel" in n or n == "packed"])
def test_one_token_dispatches_only_the_experts_own_ops(name):
    """Reading the routing (two tolist: 4 ops), then per expert: up, the activation (chunk, silu, mul), down,
    the scale and the sum; nothing else (the general path adds ≈ 20 ops of sorting, counting, gathering
    and scattering per layer)."""
    kw, _, _ = BACKENDS[name]
    h, w = (t[:1].clone() for t in _route())
    moe.experts(h, weights=w, idx=IDX, **kw)
    ops = _ops(lambda: moe.experts(h, weights=w, idx=IDX, **kw))
    assert not {"aten::argsort", "aten::sort", "aten::index_select", "aten::index_add_", "aten::zeros_like"} & set(ops), ops
    if getattr(kw.get("quant"), "native", False):  # one C call: its output, and nothing per expert
        assert len(ops) <= 2, ops
    else:
        assert len(ops) <= 4 + 7 * IDX.shape[1], ops
