"""Grouped-query attention next to the KV cache: decode (one query per request) and prefill (causal,
per request), with gpt-oss's attention sinks and sliding windows.

Decode attention's arithmetic intensity does not grow with the batch (each query reads its own KV),
which is why it runs on the CPU beside the cache. Query heads are grouped onto their KV head with a
view, never by copying K/V. A sink is a learned per-head logit that joins every softmax's
denominator and contributes no value. A sliding layer's cache keeps the last `window` tokens in a
ring (kvcache.py); here a window only shortens the rows read.
Legend: B = requests, G = Hq / Hkv, T = cached tokens, L = prompt tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BLOCK_ELEMS = 1 << 24  # score elements per block of the explicit prefill (64 MB in fp32)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, span: tuple[int, int] | None = None, pad: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, hd]; k/v_cache [B, Hkv, Tmax, hd] (rows of the cache); lengths [B] -> [B, Hq·hd].

    `span` = (min, max) of `lengths`, known on the host, so a device-side `lengths` costs no sync;
    `pad` [B, max] (True past each length) may be passed in, built once per step rather than per layer.
    `sinks` [Hq]: per-head logits added to each softmax's denominator (gpt-oss).
    """
    B, Hq, hd = q.shape
    Hkv, Tmax = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    shortest, T = span if span is not None else (int(lengths.min()), int(lengths.max()))
    qg = q.reshape(B * Hkv, G, hd)
    if 3 * T >= Tmax and k_cache.is_contiguous():
        # Scores over whole cache rows, cut to T after: bmm reads K^T as a view. Slicing K to T
        # first makes bmm copy the strided, transposed slice, which costs more than the extra rows.
        scores = torch.bmm(qg, k_cache.view(B * Hkv, Tmax, hd).transpose(1, 2))[:, :, :T]
    else:
        scores = torch.bmm(qg, k_cache[:, :, :T].reshape(B * Hkv, T, hd).transpose(1, 2))
    scores = scores.view(B, Hkv, G, T).float() * scale
    if shortest < T:
        if pad is None:
            pad = padding_mask(lengths, T)
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    p = softmax_with_sinks(scores, sinks.view(Hkv, G, 1) if sinks is not None else None)
    p = p.to(q.dtype).view(B * Hkv, G, T)
    v = v_cache.view(B * Hkv, Tmax, hd)[:, :T] if v_cache.is_contiguous() else v_cache[:, :, :T].reshape(B * Hkv, T, hd)
    return torch.bmm(p, v).reshape(B, Hq * hd)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last axis of fp32 `scores`, with `sinks` (broadcast to scores[..., :1]) as extra
    logits in the denominator whose probability is dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sinks = sinks.float()
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    e = (scores - top).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True) + (sinks - top).exp())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One request's prompt: q [L, Hq, hd], k [L, Hkv, hd], v [L, Hkv, dv] -> causal attention [L, Hq·dv].

    `window`: each query sees the last `window` tokens, its own included (0 = all); `sinks` as in decode.
    """
    L, Hq, _ = q.shape
    if sinks is None and (not window or window >= L):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
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
