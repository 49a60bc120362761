"""Decode attention against a per-request float64 reference: both bmm paths, GQA, ragged lengths."""

from __future__ import annotations

import pytest
import torch

from core.model.attention import decode_attention, padding_mask


def reference(q, k, v, lengths, scale):
    B, Hq, hd = q.shape
    G = Hq // k.shape[1]
    out = []
    for b in range(B):
        n = int(lengths[b])
        kk = k[b, :, :n].double().repeat_interleave(G, 0)  # [Hq, n, hd]
        vv = v[b, :, :n].double().repeat_interleave(G, 0)
        p = torch.softmax((q[b].double()[:, None, :] @ kk.transpose(-1, -2)) * scale, -1)
        out.append((p @ vv).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("lengths,Tmax", [([5, 9, 12], 12), ([3, 4, 2], 40), ([7, 7, 7], 8), ([1, 30, 2], 31)])
@pytest.mark.parametrize("gathered", [False, True])
def test_decode_attention_matches_reference(lengths, Tmax, gathered):
    g = torch.Generator().manual_seed(len(lengths) * Tmax)
    B, Hq, Hkv, hd, S = len(lengths), 8, 2, 16, 6
    cache_k, cache_v = torch.randn(S, Hkv, Tmax, hd, generator=g), torch.randn(S, Hkv, Tmax, hd, generator=g)
    slots = torch.tensor([4, 1, 3]) if gathered else torch.tensor([2, 3, 4])
    rows_k = cache_k.index_select(0, slots) if gathered else cache_k[2:5]
    rows_v = cache_v.index_select(0, slots) if gathered else cache_v[2:5]
    q = torch.randn(B, Hq, hd, generator=g)
    lens = torch.tensor(lengths)
    scale = hd ** -0.5
    got = decode_attention(q, rows_k, rows_v, lens, scale, (min(lengths), max(lengths)),
                           padding_mask(lens, max(lengths)))
    torch.testing.assert_close(got.double(), reference(q, rows_k, rows_v, lens, scale), rtol=1e-5, atol=1e-5)
    # without the host-side hints it must give the same
    torch.testing.assert_close(decode_attention(q, rows_k, rows_v, lens, scale), got)
