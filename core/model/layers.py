"""The decoder layer's dense pieces as plain functions over a layer's weight views.

Split the way CGOPipe schedules them: `pre_attn` (norm + QKV + RoPE) and `post_attn` (O-proj +
residual + norm + MoE + residual) run on the accelerator; attention itself lives in
`core.model.attention` so it can run next to the KV cache. Family quirks come from ModelSpec fields.
Legend: T = tokens, D = hidden, Hq/Hkv = query/kv heads, hd = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.model.moe import moe_ffn
from core.model.spec import ModelSpec


def norm(spec: ModelSpec, x: torch.Tensor, w: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    eps = spec.norm_eps if eps is None else eps
    if spec.norm == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), w, None, eps)
    return rms_norm(x, w, eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32 then back to the input dtype before the scale, as the reference models do.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


class Rope:
    """cos/sin tables for every position up to the context length, computed once."""

    def __init__(self, spec: ModelSpec, max_positions: int, dtype: torch.dtype, device="cpu"):
        hd = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
        freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)  # [P, hd]

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, hd], positions [T] -> x rotated."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def pre_attn(spec: ModelSpec, w: dict, x: torch.Tensor, positions: torch.Tensor, rope: Rope):
    """x [T, D] -> q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd]."""
    h = norm(spec, x, w["ln1"])
    qkv = F.linear(h, w["qkv"], w.get("qkv_bias"))
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    if spec.qk_norm == "full":  # OLMoE: one norm over all heads, before the head split and the clip
        q, k = rms_norm(q, w["q_norm"], spec.norm_eps), rms_norm(k, w["k_norm"], spec.norm_eps)
    if spec.clip_qkv is not None:
        c = spec.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    T = x.shape[0]
    q = q.reshape(T, spec.num_heads, spec.head_dim)
    k = k.reshape(T, spec.num_kv_heads, spec.head_dim)
    v = v.reshape(T, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == "head":  # Qwen3: per-head norm after the split
        q, k = rms_norm(q, w["q_norm"], spec.norm_eps), rms_norm(k, w["k_norm"], spec.norm_eps)
    return rope.apply(q, positions), rope.apply(k, positions), v


def post_attn(spec: ModelSpec, w: dict, x: torch.Tensor, attn_out: torch.Tensor, grouped: bool | None = None):
    """x [T, D] residual stream, attn_out [T, Hq·hd] -> the layer's output [T, D]."""
    x = x + F.linear(attn_out, w["o"])
    h = norm(spec, x, w["ln2"])
    return x + moe_ffn(spec, w, h, grouped=grouped)


def final_logits(spec: ModelSpec, norm_w: torch.Tensor, lm_head: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(norm(spec, x, norm_w), lm_head).float()
