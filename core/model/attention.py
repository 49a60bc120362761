"""Grouped-query attention beside the KV cache: decode (one query per request) and causal prefill, with sinks and
sliding windows. Decode runs on the CPU beside the cache, as its arithmetic intensity does not grow with the batch;
query heads are grouped onto their KV head with a view, never a copy. Legend: B = requests, G = Hq / Hkv,
T = cached tokens, L = prompt tokens.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from core.model.cpu import native
from core.model.limits import SCORE_BLOCK_ELEMS as _BLOCK_ELEMS  # score elements per explicit prefill block

RUN_ROWS = 32  # decode attention in runs of this many cache rows, each to its own longest length, where that reads less
ATTN_TILE_BYTES = 4 << 20  # widened K and V of the rows attended together: L2 + a share of L3


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, span: tuple[int, int] | None = None, pad: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None, widen=None, memo: dict | None = None) -> torch.Tensor:
    """q [B, Hq, hd]; k/v_cache [B, Hkv, Tmax, hd] (rows of the cache); lengths [B] -> [B, Hq·dv] in q's dtype.
    `span`: (min, max) of `lengths` known on the host (no device sync); `pad` [B, max] and `memo` (one step's calls
    over the same rows) build masks once a step, not a layer; `sinks` [Hq]: logits in each softmax's denominator."""
    B, Hq, hd = q.shape
    Hkv, Tmax, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    G = Hq // Hkv
    shortest, T = span if span is not None else (int(lengths.min()), int(lengths.max()))
    sink = sinks.view(Hkv, G, 1) if sinks is not None else None
    if widen is not None and k_cache.dtype != widen.math:
        if shortest < T and pad is None:
            pad = padding_mask(lengths, T)
        return _widened(q, k_cache, v_cache, scale, shortest, T, pad, sink, widen)
    qg = q.reshape(B * Hkv, G, hd)
    if not slices(T, Tmax) and k_cache.is_contiguous() and v_cache.is_contiguous():
        # whole cache rows as views, masked past each length (p = 0 there): bmm reads K^T and V in place
        n, k, v = Tmax, k_cache.view(B * Hkv, Tmax, hd), v_cache.view(B * Hkv, Tmax, dv)
        pad = (_memo(memo, ("pad", Tmax), lambda: padding_mask(lengths, Tmax))) if shortest < Tmax else None
    else:  # short rows in a long cache: the first T positions copied out (bmm over strided views is 3-5x slower)
        n = T
        k, v = _copied(k_cache[:, :, :T], v_cache[:, :, :T])
        k, v = k.view(B * Hkv, T, hd), v.view(B * Hkv, T, dv)
        pad = (pad if pad is not None else padding_mask(lengths, T)) if shortest < T else None
    if sink is None:
        # scale and padding inside one baddbmm, softmax in the scores' dtype (its kernel accumulates in fp32):
        # two passes over the scores instead of five, which at B = 256 cost as much as both bmms
        if pad is None:
            scores = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)
        else:
            bias = _memo(memo, ("bias", n, q.dtype, Hkv), lambda: torch.zeros((B, 1, 1, n), dtype=q.dtype, device=q.device)
                         .masked_fill_(pad[:, None, None, :], float("-inf")).expand(B, Hkv, 1, n).reshape(B * Hkv, 1, n))
            scores = torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=scale)
        return torch.bmm(torch.softmax(scores, dim=-1), v).reshape(B, Hq * dv)
    scores = torch.bmm(qg, k.transpose(1, 2)).view(B, Hkv, G, n).float().mul_(scale)
    if pad is not None:
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    p = softmax_with_sinks(scores, sink).to(q.dtype).view(B * Hkv, G, n)
    return torch.bmm(p, v).reshape(B, Hq * dv)


SLICE_BELOW = 0.6  # copy out the first T positions of longer cache rows when T is under this share of a row
_slice_bufs = threading.local()  # per thread (attention runs on its own worker): K and V slices, grown once


def slices(T: int, row: int) -> bool:
    """Whether decode attention copies the first T positions out of `row`-token rows (a copy: ~1.7 passes over T)."""
    return T < SLICE_BELOW * row


def _memo(memo: dict | None, key, make):
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _copied(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous copies of K and V slices in this thread's reused buffers (valid until its next call)."""
    nk, nv = k.numel(), v.numel()
    buf = getattr(_slice_bufs, "buf", None)
    if buf is None or buf.numel() < nk + nv or buf.dtype != k.dtype or buf.device != k.device:
        buf = _slice_bufs.buf = torch.empty(nk + nv, dtype=k.dtype, device=k.device)
    return buf[:nk].view(k.shape).copy_(k), buf[nk:nk + nv].view(v.shape).copy_(v)


def decode_over_rows(q: torch.Tensor, store, rows, scale: float, sinks: torch.Tensor | None = None,
                     widen=None) -> torch.Tensor:
    """q [B, Hq, hd] -> [B, Hq·dv] over a KV store's `rows` (a kvcache.Rows): by the C kernel where it takes the
    call, else with torch ops as the rows' `plan` says (in place, in runs, or gathered)."""
    if rows.device is None and native.usable(q, store.k, store.v, sinks):
        lengths, host, bounds = rows.native_split(store)
        return native.decode_attention(q, store.k, store.v, rows.slots, lengths, host, scale, bounds)
    p = rows.plan(store, widen is not None and store.k.dtype != widen.math)
    if p.rows is None:
        return decode_attention(q, rows.take(store.k), rows.take(store.v), p.lengths, scale, p.span, p.pad,
                                sinks, widen, p.memo)
    k, v = store.k[p.rows], store.v[p.rows]
    if p.at is not None:
        q = rows.covering_queries(q)
    if not p.runs:
        o = decode_attention(q, k, v, p.lengths, scale, p.span, p.pad, sinks, widen, p.memo)
    else:
        o = torch.empty((q.shape[0], q.shape[1] * v.shape[-1]), dtype=q.dtype, device=q.device)
        for a, b, span in p.runs:
            o[a:b] = decode_attention(q[a:b], k[a:b], v[a:b], p.lengths[a:b], scale, span, None, sinks, widen,
                                      p.memo.setdefault(("run", a), {}))
    return o if p.at is None else o.index_select(0, p.at)


def attention_runs(lengths: list[int], row: int, widened: bool = False, rows: int | None = None) -> list:
    """[(first, end, (shortest, longest))]: runs of `rows` neighbouring cache rows (of `row` tokens each), each read
    to its own longest length, or [] when one call over all reads no less. Algorithm 2 admits the longest prompts
    first, so neighbours hold similar lengths; costs as decode_attention's `slices` (widening always copies)."""
    rows = rows or RUN_ROWS
    if len(lengths) < 2 * rows:
        return []

    def cost(ls):
        top = max(ls)
        return len(ls) * (3 * top if widened else 1.7 * top if slices(top, row) else row)

    runs = [(a, min(a + rows, len(lengths))) for a in range(0, len(lengths), rows)]
    if sum(cost(lengths[a:b]) for a, b in runs) > 0.75 * cost(lengths):
        return []
    return [(a, b, (min(lengths[a:b]), max(lengths[a:b]))) for a, b in runs]


def _widened(q, k_rows, v_rows, scale: float, shortest: int, T: int, pad, sink, widen) -> torch.Tensor:
    """decode_attention in `widen.math` (the CPU is slow in the cache's dtype: bf16 on AVX2), K/V converted a few
    rows at a time into one reused buffer (read back from cache)."""
    B, Hq, hd = q.shape
    Hkv, dv = k_rows.shape[1], v_rows.shape[-1]
    m = widen.math
    qm = q.to(m).view(B, Hkv, Hq // Hkv, hd)
    per_k, per_v = Hkv * T * hd, Hkv * T * dv
    n = max(1, ATTN_TILE_BYTES // ((per_k + per_v) * m.itemsize))
    out = torch.empty((B, Hkv, Hq // Hkv, dv), dtype=m, device=q.device)
    for b0 in range(0, B, n):
        r = min(n, B - b0)
        buf = widen.scratch(r * (per_k + per_v))
        kt = buf[:r * per_k].view(r, Hkv, T, hd).copy_(k_rows[b0:b0 + r, :, :T])
        vt = buf[r * per_k:].view(r, Hkv, T, dv).copy_(v_rows[b0:b0 + r, :, :T])
        s = torch.matmul(qm[b0:b0 + r], kt.transpose(-1, -2)).mul_(scale)  # [r, Hkv, G, T]
        if shortest < T:
            s.masked_fill_(pad[b0:b0 + r, None, None, :], float("-inf"))
        torch.matmul(softmax_with_sinks(s, sink), vt, out=out[b0:b0 + r])
    return out.view(B, Hq * dv).to(q.dtype)


# scaled_dot_product_attention's enable_gqa came with torch 2.5; we support 2.4
SDPA_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last axis of fp32 `scores`, `sinks` (broadcast to scores[..., :1]) extra denominator logits."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sinks = sinks.float()
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    e = (scores - top).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True) + (sinks - top).exp())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [L, Hq, hd], k [L, Hkv, hd], v [L, Hkv, dv] -> causal attention [L, Hq·dv]; `window`: each query sees the
    last `window` tokens, its own included (0 = all)."""
    L, Hq, _ = q.shape
    if sinks is None and (not window or window >= L):
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        gqa = {}
        if Hq != k.shape[1]:
            if SDPA_GQA:
                gqa = {"enable_gqa": True}
            else:  # older torch: give every query head its KV head (one prompt's K and V, copied G times)
                G = Hq // k.shape[1]
                kh, vh = kh.repeat_interleave(G, dim=1), vh.repeat_interleave(G, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, **gqa)
        return out[0].transpose(0, 1).reshape(L, -1)
    return _explicit_prefill(q, k, v, scale, window, sinks)


def _explicit_prefill(q, k, v, scale, window, sinks):
    """Causal (and windowed) attention with sinks, in blocks of queries so the scores stay bounded."""
    L, Hq, hd = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    G = Hq // Hkv
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, ·]
    qh = q.transpose(0, 1).reshape(Hkv, G, L, hd)
    out = torch.empty(Hkv, G, L, dv, dtype=v.dtype, device=v.device)
    block = max(1, _BLOCK_ELEMS // (Hq * L))
    keys = torch.arange(L, device=q.device)
    sink = sinks.view(Hkv, G, 1, 1) if sinks is not None else None
    for a in range(0, L, block):
        b = min(L, a + block)
        lo = max(0, a - window + 1) if window else 0  # earliest key any query of the block sees
        s = torch.matmul(qh[:, :, a:b], kh[:, None, lo:b].transpose(-1, -2)).float() * scale  # [Hkv, G, b-a, b-lo]
        rows = torch.arange(a, b, device=q.device)[:, None]
        cols = keys[None, lo:b]
        hidden = cols > rows
        if window:
            hidden |= cols <= rows - window
        s.masked_fill_(hidden, float("-inf"))
        p = softmax_with_sinks(s, sink).to(v.dtype)
        out[:, :, a:b] = torch.matmul(p, vh[:, None, lo:b])
    return out.reshape(Hq, L, dv).transpose(0, 1).reshape(L, Hq * dv)


def padding_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T], True at the cache positions past each request's length."""
    return torch.arange(T, device=lengths.device)[None, :] >= lengths[:, None]
