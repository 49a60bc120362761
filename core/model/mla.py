"""Multi-head latent attention (DeepSeek-V2/V3) as CGOPipe runs it, over a cache of each token's normed latent c [R]
and roped shared key k_pe [dr]: K/V are never expanded at decode. kv_b splits per head into W_UK [dn, R] and W_UV
[dv, R]; since q_nope·(W_UK c) = (W_UKᵀ q_nope)·c, `pre` absorbs the query into latent space, the CPU attends like
multi-query attention with one head of width R + dr (`attend`: o_lat = p·c), and `post` applies W_UV and O. Prefill
expands K/V. D1: [q_lat | q_pe] per head and the token's [c | k_pe]; D2: o_lat (H·R).
Legend: T = tokens, B = requests, H = heads, R = latent rank, dn/dr/dv = no-rope/rope/value head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.model.attention import prefill_attention
from core.model.layers import rms_norm
from core.model.spec import ModelSpec

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


def d1_width(spec: ModelSpec) -> int:
    m = spec.mla
    return (spec.num_heads + 1) * (m.kv_lora_rank + m.qk_rope_dim)


def d2_width(spec: ModelSpec) -> int:
    return spec.num_heads * spec.mla.kv_lora_rank


def _up(spec: ModelSpec, w: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b as W_UK [H, dn, R] and W_UV [H, dv, R] (views)."""
    m = spec.mla
    kv_b = w["kv_b"].view(spec.num_heads, m.qk_nope_dim + m.v_head_dim, m.kv_lora_rank)
    return kv_b[:, :m.qk_nope_dim], kv_b[:, m.qk_nope_dim:]


def join_down(w: dict) -> dict:
    """w with q_a and kv_a as one "qkv_a" [q_lora + R + dr, D] (one product for both) where q is low-rank; else w."""
    if "q_a" not in w or "kv_a" not in w:
        return w
    return {**{n: t for n, t in w.items() if n not in ("q_a", "kv_a")}, "qkv_a": torch.cat((w["q_a"], w["kv_a"]))}


def _down(spec: ModelSpec, w: dict, h: torch.Tensor):
    """h [T, D] -> (the query's latent before its norm [T, q_lora], or None without one; kv_a's [T, R + dr])."""
    m = spec.mla
    if "qkv_a" in w:
        return F.linear(h, w["qkv_a"]).split([m.q_lora_rank, m.kv_lora_rank + m.qk_rope_dim], dim=-1)
    return (F.linear(h, w["q_a"]) if "q_a" in w else None), F.linear(h, w["kv_a"])


def pre(spec: ModelSpec, w: dict, h: torch.Tensor, positions: torch.Tensor, rope, call_lengths=None, full_norm=None,
        out: torch.Tensor | None = None):
    """-> the payload [T, d1] (into `out` when given), None. Its rows [T, H + 1, R + dr] are the heads'
    [q_lat | q_pe] and the token's [c | k_pe], each written in place, q_pe and k_pe roped in one call."""
    m, T, H = spec.mla, h.shape[0], spec.num_heads
    R, dr = m.kv_lora_rank, m.qk_rope_dim
    q_lat, kv = _down(spec, w, h)
    q = _query(spec, w, h, q_lat).view(T, H, -1)
    c, k_pe = kv.split([R, dr], dim=-1)
    payload = torch.empty((T, d1_width(spec)), dtype=q.dtype, device=q.device) if out is None else out
    P = payload.view(T, H + 1, R + dr)
    w_uk, _ = _up(spec, w)
    torch.bmm(q[..., :m.qk_nope_dim].transpose(0, 1), w_uk, out=P[:, :H, :R].transpose(0, 1))  # q_lat [T, H, R]
    rms_norm(c, w["kv_a_norm"], LATENT_NORM_EPS, out=P[:, H, :R])
    pe = torch.cat((q[..., m.qk_nope_dim:], k_pe[:, None, :]), dim=1)  # [T, H + 1, dr]
    rope.apply(pe, positions, call_lengths, out=P[:, :, R:])
    return payload, None


def _query(spec: ModelSpec, w: dict, h: torch.Tensor, q_lat: torch.Tensor | None) -> torch.Tensor:
    """-> q [T, H·(dn + dr)]; q_lat: _down's query latent (None without a low-rank query)."""
    if "q" in w:
        return F.linear(h, w["q"])
    return F.linear(rms_norm(q_lat, w["q_a_norm"], LATENT_NORM_EPS), w["q_b"])


def attend(spec: ModelSpec, w: dict, payload: torch.Tensor, store, rows, widen=None) -> torch.Tensor:
    """Write the new latents, attend over each row's: payload [B, d1] -> o_lat [B, H·R] (`widen`: in its dtype)."""
    m, B, H = spec.mla, rows.B, spec.num_heads
    width = m.kv_lora_rank + m.qk_rope_dim
    q, lat_new = payload.split([H * width, width], dim=-1)
    store.write(rows.slots, rows.positions, lat_new)
    lengths, (shortest, T), pad = rows.kept(store)
    lat = rows.take(store.lat)[:, :T]  # [B, T, R + dr]
    math = widen.math if widen is not None else q.dtype
    if lat.dtype != math:  # a narrower cache than the math: convert these rows once, into a reused buffer
        lat = (widen.scratch(lat.numel()).view(lat.shape) if widen is not None else torch.empty(
            lat.shape, dtype=math, device=lat.device)).copy_(lat)
    scores = torch.bmm(q.reshape(B, H, width).to(math), lat.transpose(1, 2)).float() * spec.scale  # [B, H, T]
    if shortest < T:
        scores.masked_fill_(pad[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(math)
    # p·[c | k_pe] and drop the rope columns: dr/R more FLOPs, but no copy of the strided c slice
    return torch.bmm(p, lat)[:, :, :m.kv_lora_rank].reshape(B, H * m.kv_lora_rank).to(payload.dtype)


def post(spec: ModelSpec, w: dict, out: torch.Tensor, keep) -> torch.Tensor:
    """o_lat [B, H·R] -> W_UV per head -> O projection [B, D]."""
    B, H = out.shape[0], spec.num_heads
    _, w_uv = _up(spec, w)
    o = torch.empty((B, H, spec.mla.v_head_dim), dtype=out.dtype, device=out.device)
    torch.bmm(out.view(B, H, -1).transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))  # by heads, [B, H, dv]
    return F.linear(o.view(B, -1), w["o"])


def prefill(spec: ModelSpec, w: dict, h: torch.Tensor, positions: torch.Tensor, rope, lens: list[int],
            call_lengths=None, window: int = 0, full_norm=None):
    """Whole prompts in h [T, D] -> (output [T, D], per prompt its latents [L, R + dr] to store)."""
    m, T, H = spec.mla, h.shape[0], spec.num_heads
    q_lat, kv = _down(spec, w, h)
    q_nope, q_pe = _query(spec, w, h, q_lat).view(T, H, -1).split([m.qk_nope_dim, m.qk_rope_dim], dim=-1)
    q_pe = rope.apply(q_pe, positions, call_lengths)
    c, k_pe = kv.split([m.kv_lora_rank, m.qk_rope_dim], dim=-1)  # cached normed, and roped
    c, k_pe = rms_norm(c, w["kv_a_norm"], LATENT_NORM_EPS), rope.apply(k_pe[:, None, :], positions, call_lengths)[:, 0]
    lat = torch.cat((c, k_pe), dim=-1)
    k_nope, v = F.linear(c, w["kv_b"]).view(T, H, -1).split([m.qk_nope_dim, m.v_head_dim], dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    k = torch.cat((k_nope, k_pe[:, None, :].expand(T, H, m.qk_rope_dim)), dim=-1)
    outs, parts, start = [], [], 0
    for n in lens:
        s = slice(start, start + n)
        outs.append(prefill_attention(q[s], k[s], v[s], spec.scale))
        parts.append((lat[s],))
        start += n
    return F.linear(torch.cat(outs), w["o"]), parts
