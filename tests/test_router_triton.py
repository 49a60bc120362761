"""The router kernel (core.model.router_triton) against the torch router it replaces (core.model.routing), in
triton's interpreter on the CPU; and the `mlight::route` op (core.model.fused_router) against routing.py.

Ids must be equal; weights agree to fp32 rounding: the kernel sums the k weights (and softmax's E
exponentials) in its own order, a few fp32 ulps, so fp32 weights within 4 ulps of their magnitude and weights
rounded to bf16 within one bf16 ulp (a sum an ulp apart can round either side of a bf16 boundary). Logits get
planted near-ties: pairs of experts whose logits differ by 1e-4 relative — far above fp32 rounding, far below
the spread — across and within groups. Exact ties are where torch.topk on the CPU keeps no documented order;
there the kernel's lowest index is checked against a stable sort.
Legend: T = tokens, E = experts, G = groups, k = experts per token.
"""

from __future__ import annotations

import pytest
import torch

from core.model import fused_router, routing
from core.model import router_triton as rt
from matrix import cover

triton = pytest.importorskip("triton")
T = 6
F32_ULPS = 4 * 2.0 ** -23


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _logits(E: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    """[T, E] fp32 with near-ties planted: in each row a few experts copy another's logit times (1 + 1e-4)."""
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(T, E, generator=g)
    for t in range(T):
        src = torch.randint(0, E, (max(2, E // 8),), generator=g)
        dst = torch.randint(0, E, (max(2, E // 8),), generator=g)
        x[t, dst] = x[t, src] * (1 + 1e-4 * torch.sign(torch.randn(len(dst), generator=g)))
    return x


def _bf16_logits(E: int, seed: int) -> torch.Tensor:
    """[T, E] bf16, distinct in each row (a 0.03 grid, coarser than bf16's spacing below 4), with near-ties:
    disjoint pairs one bf16 ulp apart."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(T):
        x = ((torch.randperm(E, generator=g) - E // 2) * 0.03).to(torch.bfloat16)
        p = torch.randperm(E, generator=g)[:2 * max(1, E // 8)].view(-1, 2)
        x[p[:, 1]] = (x[p[:, 0]].view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 away from zero
        rows.append(x)
    return torch.stack(rows)


def _cases():
    out = []
    for E in (8, 64, 128, 256):
        for G in (1, 4, 8):
            if E % G or E // G < 2:
                continue
            for keep in sorted({1, G // 2, G} if G > 1 else {1}):
                for k in (1, 2, 8):
                    if k <= keep * (E // G) and k < E:
                        out.append((E, G, keep, k))
    return out


# The cover: E = 8, 64, 128, 256 each (E only sizes the row: all are powers of two, so no lane is masked);
# every (G, keep) — no groups, keep = G (no group masked), and 1 or several groups kept; k = 1, 2, 8 with and
# without groups; the edges: groups of two experts (the sum of a group's two best is the whole group) and k equal
# to the experts left in the kept groups; and DeepSeek-V3's own (256, 8, 4, 8)
CASES = cover(_cases(), [(8, 1, 1, 2), (8, 4, 1, 2), (8, 4, 2, 1), (64, 1, 1, 1), (64, 4, 4, 8), (64, 8, 1, 8),
                         (128, 4, 2, 8), (128, 8, 8, 2), (256, 1, 1, 8), (256, 4, 1, 1), (256, 8, 4, 8)])


def _spec(kind: str, G: int, keep: int, k: int, E: int, renorm: bool, scale: float, bias: bool):
    return fused_router.types.SimpleNamespace(router=kind, top_k=k, router_groups=G, router_topk_groups=keep,
                                              num_experts=E, router_correction=bias, router_softmax_fp32=True,
                                              router_norm="sum" if renorm else "none", routed_scale=scale)


def _check(got, want, dtype):
    (w, i), (w0, i0) = got, want
    assert torch.equal(i, i0), (i, i0)
    assert w.dtype == w0.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(w, w0, rtol=F32_ULPS, atol=1e-30), (w - w0).abs().max()
    else:  # one ulp of the output dtype
        ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
        assert ((w.float() - w0.float()).abs() <= ulp * w0.float().abs().clamp(min=2.0 ** -14)).all()


@pytest.mark.parametrize("E,G,keep,k", CASES)
def test_sigmoid_group_matches_the_torch_router(E, G, keep, k):
    x = _logits(E, seed=E + 10 * G + k)
    bias = (0.1 * torch.randn(E, generator=torch.Generator().manual_seed(E))).to(torch.bfloat16)
    for renorm, scale, dtype in ((True, 2.5, torch.bfloat16), (True, 1.0, torch.float32), (False, 1.0, torch.bfloat16)):
        spec = _spec("sigmoid_group", G, keep, k, E, renorm, scale, True)
        want = routing.choose(spec, x, {"e_bias": bias}, dtype)
        got = rt.route(x, bias, dtype, kind="sigmoid_group", top_k=k, groups=G, topk_groups=keep, renorm=renorm,
                       scale=scale)
        _check(got, want, dtype)


@pytest.mark.parametrize("E,G,keep,k", CASES)
def test_softmax_group_matches_the_torch_router(E, G, keep, k):
    x = _logits(E, seed=3 * E + G + k)
    for renorm, dtype in ((False, torch.bfloat16), (True, torch.float32)):
        spec = _spec("softmax_group", G, keep, k, E, renorm, 1.0, False)
        want = routing.choose(spec, x, {}, dtype)
        got = rt.route(x, None, dtype, kind="softmax_group", top_k=k, groups=G, topk_groups=keep, renorm=renorm)
        _check(got, want, dtype)


# every E and every k once (the softmax path has no groups: E only sizes the row)
@pytest.mark.parametrize("E,k", cover([(E, k) for E in (8, 64, 128, 256) for k in (1, 2, 8) if k < E],
                                      [(8, 2), (64, 8), (128, 1), (256, 2)]))
def test_softmax_matches_the_torch_router_from_bf16_logits(E, k):
    x = _bf16_logits(E, seed=E * k)  # a bf16 router's logits: the softmax widens them
    for renorm in (True, False):
        spec = _spec("softmax", 1, 1, k, E, renorm, 1.0, False)
        want = routing.choose(spec, x, {}, torch.bfloat16)
        got = rt.route(x, None, torch.bfloat16, kind="softmax", top_k=k, renorm=renorm)
        _check(got, want, torch.bfloat16)


def _stable_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k]


@pytest.mark.parametrize("E,G,keep,k", [(256, 8, 4, 8), (64, 4, 2, 2), (8, 1, 1, 2)])
def test_exact_ties_go_to_the_lowest_index(E, G, keep, k):
    """Logits from three values: many exact ties in experts and in groups. The reference: the torch router's
    arithmetic with every choice by a stable sort (lowest index first)."""
    x = torch.randint(0, 3, (T, E), generator=torch.Generator().manual_seed(E)).float()
    bias = torch.zeros(E)
    scores = x.sigmoid()
    per = scores.view(T, G, E // G)
    gscore = per.topk(2, dim=-1).values.sum(-1) if E // G > 1 else per[..., 0]
    kept = torch.zeros(T, G, dtype=torch.bool).scatter_(1, _stable_topk(gscore, keep), True)
    choice = torch.where(kept.repeat_interleave(E // G, 1), scores, float("-inf"))
    ids = _stable_topk(choice, k)
    w, i = rt.route(x, bias, torch.float32, kind="sigmoid_group", top_k=k, groups=G, topk_groups=keep, renorm=True)
    assert torch.equal(i, ids)
    top = scores.gather(1, ids)
    assert torch.allclose(w, top / (top.sum(-1, keepdim=True) + 1e-20), rtol=F32_ULPS)


def test_torch_topk_on_the_cpu_keeps_no_lowest_index_order():
    """Why the exact-tie test has its own reference: torch.topk's choice among equal values here."""
    x = torch.zeros(1, 256)
    assert not torch.equal(torch.topk(x, 8).indices, torch.arange(8)[None])


# ---- the op ---------------------------------------------------------------------------------------------------
FAMILY_ROUTERS = [  # (kind, groups, topk_groups, k, E, norm, scale, correction): the families' shapes, tiny
    ("sigmoid_group", 8, 4, 8, 64, "sum", 2.5, True),  # DeepSeek-V3
    ("sigmoid_group", 1, 1, 8, 64, "sum", 1.0, True),  # GLM-4.5
    ("softmax_group", 4, 2, 6, 64, "none", 1.0, False),  # DeepSeek-V2
    ("softmax", 1, 1, 2, 8, "sum", 1.0, False),  # Mixtral
    ("softmax", 1, 1, 8, 128, "none", 1.0, False),  # Qwen3 without norm_topk_prob
]


@pytest.mark.parametrize("kind,G,keep,k,E,norm,scale,corr", FAMILY_ROUTERS)
@pytest.mark.parametrize("fp32", (True, False))
def test_the_op_is_the_torch_router_bit_for_bit_off_cuda(kind, G, keep, k, E, norm, scale, corr, fp32):
    """routing.route with `fused` (one `mlight::route` op after the matmul) gives exactly what it gives without."""
    from core.model.spec import ModelSpec

    D = 32
    g = torch.Generator().manual_seed(E + k)
    spec = ModelSpec(architecture="X", family="x", hidden_size=D, num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=16, expert_intermediate=8, vocab_size=16, num_experts=E, top_k=k, router=kind, router_groups=G,
                     router_topk_groups=keep, router_norm=norm, routed_scale=scale, router_correction=corr,
                     router_fp32=fp32)
    w = {"router": torch.randn(E, D, generator=g).to(torch.bfloat16)}
    if corr:
        w["e_bias"] = (0.1 * torch.randn(E, generator=g)).to(torch.bfloat16)
    h = torch.randn(T, D, generator=g).to(torch.bfloat16)
    assert fused_router.takes(spec)
    plain, fused = routing.route(spec, h, w), routing.route(spec, h, w, fused=True)
    assert torch.equal(plain[1], fused[1]) and torch.equal(plain[0], fused[0])


def test_the_op_has_shapes_on_meta():
    x = torch.empty(5, 64, device="meta")
    w, i = torch.ops.mlight.route(x, None, "sigmoid_group", 8, 8, 4, True, 2.5, torch.bfloat16)
    assert (w.shape, w.dtype, i.shape, i.dtype) == ((5, 8), torch.bfloat16, (5, 8), torch.int64)


def test_routers_the_kernel_does_not_compute_stay_on_routing_ops():
    from core.model.spec import ModelSpec

    base = dict(architecture="X", family="x", hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                expert_intermediate=8, vocab_size=8, num_experts=8, top_k=2)
    assert not fused_router.takes(ModelSpec(**base, router="topk_softmax"))
    assert not fused_router.takes(ModelSpec(**base, router="sparsemixer"))
    assert not fused_router.takes(ModelSpec(**base, router="softmax", router_softmax_fp32=False))
    assert not fused_router.takes(ModelSpec(**base, router="softmax", router_norm="pnorm"))
