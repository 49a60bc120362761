"""Attention next to the KV cache: decode (one query per request, GQA) and prefill (causal, per request).

Decode attention's arithmetic intensity does not grow with the batch (each query reads its own KV),
which is why it runs on the CPU beside the cache. Query heads are grouped onto their KV head with a
view, never by copying K/V. Legend: B = requests, G = Hq / Hkv, T = cached tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, span: tuple[int, int] | None = None, pad: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, hd]; k/v_cache [B, Hkv, Tmax, hd] (rows of the cache); lengths [B] -> [B, Hq·hd].

    `span` = (min, max) of `lengths`, known on the host, so a device-side `lengths` costs no sync;
    `pad` [B, max] (True past each length) may be passed in, built once per step rather than per layer.
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
    p = torch.softmax(scores, dim=-1).to(q.dtype).view(B * Hkv, G, T)
    v = v_cache.view(B * Hkv, Tmax, hd)[:, :T] if v_cache.is_contiguous() else v_cache[:, :, :T].reshape(B * Hkv, T, hd)
    return torch.bmm(p, v).reshape(B, Hq * hd)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One request's prompt: q [T, Hq, hd], k/v [T, Hkv, hd] -> causal attention [T, Hq·hd]."""
    T, Hq, hd = q.shape
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).reshape(T, Hq * hd)


def padding_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T], True at the cache positions past each request's length."""
    return torch.arange(T, device=lengths.device)[None, :] >= lengths[:, None]
