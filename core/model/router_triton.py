"""The MoE router after its matmul in Triton: one program a token, routing's fp32 arithmetic for sigmoid_group,
softmax_group and softmax, × `scale`, rounded once. Ties break by the lowest index (torch.topk on the CPU documents
no order): ids agree wherever values differ, weights to fp32 rounding.
Legend: T = tokens, E = experts, G = groups, k = experts per token.
"""

from __future__ import annotations

import functools
import os

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the router keeps its torch form
    triton = tl = None

KINDS = {"softmax": 0, "softmax_group": 1, "sigmoid_group": 2}


def route(logits, bias, out_dtype, *, kind: str, top_k: int, groups: int = 1, topk_groups: int = 1,
          renorm: bool = True, scale: float = 1.0):
    """logits [T, E], bias [E] or None -> (weights [T, k] in out_dtype, ids [T, k] int64), in fp32. One launch."""
    import torch

    T, E = logits.shape
    if E % groups:
        raise ValueError(f"{E} experts do not split into {groups} groups")
    logits = logits.contiguous()
    w = torch.empty((T, top_k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T == 0:
        return w, ids
    _kernel(os.environ.get("TRITON_INTERPRET") == "1")[(T,)](logits, logits if bias is None else bias, w, ids, E, KIND=KINDS[kind], HAS_BIAS=bias is not None,
                 K=top_k, G=groups, KEEP_G=topk_groups, RENORM=renorm, SCALE=float(scale), BF16=out_dtype == torch.bfloat16,
                 BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
                 BLOCK_G=triton.next_power_of_2(groups), enable_fp_fusion=True)  # as fused_moe_triton's
    return w, ids


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    """Jitted on first launch: TRITON_INTERPRET is read at decoration, which tests set after import."""
    return triton.jit(_route)


if triton is not None:
    # tl.reduce with standard's combine functions: the interpreter runs them however triton was imported, where
    # tl.max & co. are jit functions it cannot call once TRITON_INTERPRET was set after the import
    _MAX, _MIN, _SUM = tl.standard._elementwise_max, tl.standard._elementwise_min, tl.standard._sum_combine

    def _route(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
               K: tl.constexpr, G: tl.constexpr, KEEP_G: tl.constexpr, RENORM: tl.constexpr, SCALE: tl.constexpr, BF16: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        live = e < E
        ninf = float("-inf")
        x = tl.load(logits_ptr + t * E + e, mask=live, other=ninf).to(tl.float32)
        if KIND == 2:
            scores = 1.0 / (1.0 + tl.exp(-x))
            choice = scores
            if HAS_BIAS:
                choice = scores + tl.load(bias_ptr + e, mask=live, other=0.0).to(tl.float32)
        else:
            ex = tl.exp(x - tl.reduce(x, 0, _MAX))
            ex = tl.where(live, ex, 0.0)
            scores = ex / tl.reduce(ex, 0, _SUM)
            choice = scores
        choice = tl.where(live, choice, ninf)
        if G > 1 and KEEP_G < G:
            per = E // G
            group = e // per
            gi = tl.arange(0, BLOCK_G)
            gscore = tl.full((BLOCK_G,), ninf, tl.float32)
            for g in tl.static_range(G):
                mine = live & (group == g)
                c = tl.where(mine, choice, ninf)
                best = tl.reduce(c, 0, _MAX)
                if KIND == 2:  # the sum of the group's two best: the first best's lowest lane out, then the best again
                    first = tl.reduce(tl.where(c == best, e, BLOCK_E), 0, _MIN)
                    best = best + tl.reduce(tl.where(e == first, ninf, c), 0, _MAX)
                gscore = tl.where(gi == g, best, gscore)
            gscore = tl.where(gi < G, gscore, ninf)
            keep = tl.full((BLOCK_G,), 0, tl.int32)
            for _ in tl.static_range(KEEP_G):
                best = tl.reduce(gscore, 0, _MAX)
                pick = tl.reduce(tl.where(gscore == best, gi, BLOCK_G), 0, _MIN)
                keep = tl.where(gi == pick, 1, keep)
                gscore = tl.where(gi == pick, ninf, gscore)
            kept = tl.full((BLOCK_E,), 0, tl.int32)
            for g in tl.static_range(G):
                kg = tl.reduce(tl.where(gi == g, keep, 0), 0, _SUM)
                kept = tl.where(group == g, kg, kept)
            other = ninf if KIND == 2 else 0.0  # routing.py's: −inf for sigmoid_group, 0 for softmax_group
            choice = tl.where(live, tl.where(kept != 0, choice, other), ninf)
        j = tl.arange(0, BLOCK_K)
        top = tl.full((BLOCK_K,), 0.0, tl.float32)
        idx = tl.full((BLOCK_K,), 0, tl.int64)
        for i in tl.static_range(K):
            best = tl.reduce(choice, 0, _MAX)
            pick = tl.reduce(tl.where(choice == best, e, BLOCK_E), 0, _MIN)
            top = tl.where(j == i, tl.reduce(tl.where(e == pick, scores, 0.0), 0, _SUM), top)
            idx = tl.where(j == i, pick.to(tl.int64), idx)
            choice = tl.where(e == pick, ninf, choice)
        if RENORM:
            denom = tl.reduce(top, 0, _SUM)
            if KIND == 2:
                denom = denom + 1e-20
            top = top / denom
        if SCALE != 1.0:
            top = top * SCALE
        out = j < K
        if BF16:  # rounded to the nearest bf16 (ties to even) in the bits: triton's interpreter truncates in its cast
            bits = top.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            top = bits.to(tl.float32, bitcast=True)
        tl.store(w_ptr + t * K + j, top.to(w_ptr.dtype.element_ty), mask=out)
        tl.store(ids_ptr + t * K + j, idx, mask=out)
