"""Grouped-query attention as CGOPipe runs it: `pre` (QKV projection, q/k norm, RoPE) on the
accelerator, `attend` (cache write + decode attention) next to the KV store on the CPU, `post`
(output gate, O projection) back on the accelerator; `prefill` is a whole prompt at once.

The D1 payload is [q | k | v] per token (Hq·hd + 2·Hkv·hd); D2 carries the attention output
(Hq·hd). Quirks from ModelSpec: qkv bias, q/k norm per head or over all heads, clip_qkv, an output
gate from a second half of q_proj (Qwen3-Next), sinks and sliding windows (gpt-oss), O bias.
Legend: T = tokens, B = requests, D = hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.model.attention import decode_over_rows, prefill_attention
from core.model.cpu import row_ops
from core.model.layers import norm, rms_norm
from core.model.spec import ModelSpec


def d1_width(spec: ModelSpec) -> int:
    return spec.q_size + 2 * spec.kv_size


def d2_width(spec: ModelSpec) -> int:
    return spec.q_size


def _qk_norm(spec: ModelSpec, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, w, spec.norm_eps) if spec.norm == "layernorm" else norm(spec, x, w)


def project(spec: ModelSpec, w: dict, h: torch.Tensor, positions: torch.Tensor, rope, call_lengths=None,
            full_norm=None):
    """Normed h [T, D] -> q [T, Hq, hd], k, v [T, Hkv, hd], output gate [T, Hq·hd] or None.
    `full_norm(q, k, wq, wk, eps)` replaces the norm over all heads on a tensor-parallel rank that holds
    only some of them (core.runtime.distributed.tensor_parallel.FullQKNorm)."""
    qkv = F.linear(h, w["qkv"], w.get("qkv_bias"))
    sizes = [spec.q_size, spec.kv_size, spec.kv_size] + ([spec.q_size] if spec.attn_gate else [])
    q, k, v, *gate = qkv.split(sizes, dim=-1)
    if spec.qk_norm == "full" and full_norm is not None:
        q, k = full_norm(q, k, w["q_norm"], w["k_norm"], spec.norm_eps)
    elif spec.qk_norm == "full":  # OLMoE: one norm over all heads, before the head split and the clip
        q, k = _qk_norm(spec, q, w["q_norm"]), _qk_norm(spec, k, w["k_norm"])
    if spec.clip_qkv is not None:
        c = spec.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    T = h.shape[0]
    q = q.reshape(T, spec.num_heads, spec.head_dim)
    k = k.reshape(T, spec.num_kv_heads, spec.head_dim)
    v = v.reshape(T, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == "head":  # Qwen3, GLM, Qwen3-Next: per-head norm after the split
        q, k = _qk_norm(spec, q, w["q_norm"]), _qk_norm(spec, k, w["k_norm"])
    return rope.apply(q, positions, call_lengths), rope.apply(k, positions, call_lengths), v, (gate[0] if gate else None)


def pre(spec: ModelSpec, w: dict, h: torch.Tensor, positions: torch.Tensor, rope, call_lengths=None, full_norm=None):
    """-> (payload [T, d1] for the CPU, what stays on the device for `post`)."""
    T = h.shape[0]
    if spec.qk_norm == "none" and spec.clip_qkv is None:
        # q and k side by side as the projection left them: one RoPE over both heads' rows and one join
        # with v — bit for bit `project`'s, in 14 ops fewer a layer (at batch 1 a decode step's ops cost
        # more than their arithmetic)
        qkv = F.linear(h, w["qkv"], w.get("qkv_bias"))
        qk, kv = spec.q_size + spec.kv_size, spec.q_size + 2 * spec.kv_size
        gate = qkv[:, kv:] if spec.attn_gate else None
        if rope.joins_in_c(qkv):  # the same roundings in one C pass (core.model.cpu.row_ops)
            cos, sin = rope.tables(positions, call_lengths)
            out = row_ops.rope_join(qkv, spec.num_heads + spec.num_kv_heads, spec.head_dim, cos, sin, spec.kv_size)
            if out is not None:
                return out, gate
        roped = rope.apply(qkv[:, :qk].view(T, spec.num_heads + spec.num_kv_heads, spec.head_dim), positions,
                           call_lengths)
        return torch.cat((roped.view(T, qk), qkv[:, qk:kv]), dim=-1), gate
    q, k, v, gate = project(spec, w, h, positions, rope, call_lengths, full_norm)
    return torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1), gate


def attend(spec: ModelSpec, w: dict, payload: torch.Tensor, store, rows, widen=None) -> torch.Tensor:
    """One new token per row: write its K/V, attend over the row. payload [B, d1] -> [B, Hq·hd]."""
    B, H, Hkv, hd = rows.B, spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = payload.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    k, v = k.view(B, Hkv, hd), v.view(B, Hkv, hd)
    if hasattr(store, "write_rows"):
        store.write_rows(rows, k, v)
    else:
        store.write(rows.slots, rows.positions, k, v)
    return decode_over_rows(q.reshape(B, H, hd), store, rows, spec.scale, w.get("sinks"), widen)


def post(spec: ModelSpec, w: dict, out: torch.Tensor, keep) -> torch.Tensor:
    if keep is not None:
        out = out * torch.sigmoid(keep)
    return F.linear(out, w["o"], w.get("o_bias"))


def prefill(spec: ModelSpec, w: dict, h: torch.Tensor, positions: torch.Tensor, rope, lens: list[int],
            call_lengths=None, window: int = 0, full_norm=None):
    """Whole prompts packed in h [T, D] -> (output [T, D], per prompt the (k, v) [L, Hkv, hd] to store)."""
    q, k, v, gate = project(spec, w, h, positions, rope, call_lengths, full_norm)
    v = v.contiguous()  # v is a view of the whole QKV projection: the stored parts keep only v, not it
    parts, outs, start = [], [], 0
    for n in lens:
        outs.append(prefill_attention(q[start:start + n], k[start:start + n], v[start:start + n], spec.scale,
                                      window=window, sinks=w.get("sinks")))
        parts.append((k[start:start + n], v[start:start + n]))
        start += n
    return post(spec, w, torch.cat(outs), gate), parts
