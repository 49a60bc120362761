"""Grouped-query attention as CGOPipe runs it: `pre` (QKV, q/k norm, RoPE) on the accelerator, `attend` (cache
write + decode attention) on the CPU next to the KV store, `post` (output gate, O) back on the accelerator.
D1: [q | k | v] a token (Hq·hd + 2·Hkv·hd); D2: the output (Hq·hd). Legend: T = tokens, B = requests, D = hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.model.attention import decode_over_rows, prefill_attention
from core.model.cpu import row_ops
from core.model.cpu.kernels import linear
from core.model.layers import derived, norm, normed, rms_norm
from core.model.spec import ModelSpec


def d1_width(spec: ModelSpec) -> int:
    return spec.q_size + 2 * spec.kv_size


def d2_width(spec: ModelSpec) -> int:
    return spec.q_size


def _qk_norm(spec: ModelSpec, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, w, spec.norm_eps) if spec.norm == "layernorm" else norm(spec, x, w)


def project(spec: ModelSpec, w: dict, h: torch.Tensor, positions: torch.Tensor, rope, call_lengths=None,
            full_norm=None):
    """Normed h [T, D] -> q [T, Hq, hd], k, v [T, Hkv, hd], output gate [T, Hq·hd] or None (`full_norm`: mixer's)."""
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


def pre(spec: ModelSpec, w: dict, h: torch.Tensor, positions: torch.Tensor, rope, call_lengths=None, full_norm=None,
        out: torch.Tensor | None = None):
    """-> (payload [T, d1] for the CPU, what stays for `post`); `out`: the device's D1 block, written in place."""
    T = h.shape[0]
    if spec.qk_norm == "none" and spec.clip_qkv is None:
        # q and k side by side as projected: one RoPE over both and one join with v, bit for bit `project`'s
        # in 14 ops fewer a layer (at batch 1 a decode step's ops cost more than their arithmetic)
        qkv = linear(h, w["qkv"], w.get("qkv_bias"))
        qk, kv = spec.q_size + spec.kv_size, spec.q_size + 2 * spec.kv_size
        gate = qkv[:, kv:] if spec.attn_gate else None
        if rope.joins_in_c(qkv):  # the same roundings in one C pass (core.model.cpu.row_ops)
            cos, sin = rope.tables(positions, call_lengths)
            joined = row_ops.rope_join(qkv, spec.num_heads + spec.num_kv_heads, spec.head_dim, cos, sin, spec.kv_size)
            if joined is not None:
                return joined, gate
        roped = rope.apply(qkv[:, :qk].view(T, spec.num_heads + spec.num_kv_heads, spec.head_dim), positions,
                           call_lengths)
        return torch.cat((roped.view(T, qk), qkv[:, qk:kv]), dim=-1, out=out), gate
    if spec.qk_norm == "head" and spec.clip_qkv is None and not rope.pairs:
        return _pre_into(spec, w, h, positions, rope, call_lengths, out)
    q, k, v, gate = project(spec, w, h, positions, rope, call_lengths, full_norm)
    return torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1, out=out), gate


def _pre_into(spec: ModelSpec, w: dict, h: torch.Tensor, positions, rope, call_lengths, out):
    """`project`'s per-head-norm case written straight into the payload [T, Hq + 2·Hkv, hd] (`out` when given):
    the same values without joins after (GLM-4.5: 9 ops where `project` and the join took 19)."""
    T, Hq, Hkv, hd = h.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    W, bias = w["qkv"], w.get("qkv_bias")
    if out is not None and not spec.attn_gate and type(W) is torch.Tensor and out.dtype == h.dtype == W.dtype:
        # the projection is the payload's layout: it lands there, and the norms write over q and k in place
        qkv = torch.mm(h, W.t(), out=out) if bias is None else torch.addmm(bias, h, W.t(), out=out)
    else:
        qkv = F.linear(h, W, bias)
    payload = torch.empty((T, d1_width(spec)), dtype=qkv.dtype, device=qkv.device) if out is None else out
    P = payload.view(T, Hq + 2 * Hkv, hd)
    qk = qkv[:, :spec.q_size + spec.kv_size].view(T, Hq + Hkv, hd)
    llama_style = spec.norm in ("rms", "layernorm")
    # q_norm's weight for each q head's row, k_norm's for each k head's [Hq + Hkv, hd], made in the first step
    side = derived((w["q_norm"], w["k_norm"]), lambda wq, wk: torch.cat((wq.expand(Hq, -1), wk.expand(Hkv, -1))),
                   Hq, Hkv) if llama_style else None
    if llama_style and not (h.device.type == "cpu" and row_ops.library() is not None):
        # the statistics per head row, then each row's weight: q's and k's rows in one kernel and one product
        torch.mul(side, normed(qk, None, spec.norm_eps), out=P[:, :Hq + Hkv])
    else:
        _qk_norm_into(spec, qk[:, :Hq], w["q_norm"], P[:, :Hq])
        _qk_norm_into(spec, qk[:, Hq:], w["k_norm"], P[:, Hq:Hq + Hkv])
    if qkv.data_ptr() != payload.data_ptr():
        P[:, Hq + Hkv:].copy_(qkv[:, spec.q_size + spec.kv_size:spec.q_size + 2 * spec.kv_size].view(T, Hkv, hd))
    qk = P[:, :Hq + Hkv, :rope.dim]
    rope.apply(qk, positions, call_lengths, out=qk)
    return payload, (qkv[:, spec.q_size + 2 * spec.kv_size:] if spec.attn_gate else None)


def _qk_norm_into(spec: ModelSpec, x: torch.Tensor, w: torch.Tensor, dst: torch.Tensor) -> None:
    """`_qk_norm(spec, x, w)` into dst: Llama's style ends in its weight's product, which writes there."""
    if spec.norm in ("rms", "layernorm"):
        rms_norm(x, w, spec.norm_eps, out=dst)
    else:
        dst.copy_(_qk_norm(spec, x, w))


def attend(spec: ModelSpec, w: dict, payload: torch.Tensor, store, rows, widen=None) -> torch.Tensor:
    """One new token per row: write its K/V, attend over the row. payload [B, d1] -> [B, Hq·hd]."""
    B, H, Hkv, hd = rows.B, spec.num_heads, spec.num_kv_heads, spec.head_dim
    # split_with_sizes, not Tensor.split: the same one op without Tensor.split's Python wrapper (it shows at B = 1)
    q, k, v = payload.split_with_sizes([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    k, v = k.view(B, Hkv, hd), v.view(B, Hkv, hd)
    store.write_rows(rows, k, v)
    return decode_over_rows(q.reshape(B, H, hd), store, rows, spec.scale, w.get("sinks"), widen)


def post(spec: ModelSpec, w: dict, out: torch.Tensor, keep) -> torch.Tensor:
    if keep is not None:
        out = out * torch.sigmoid(keep)
    return linear(out, w["o"], w.get("o_bias"))


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
