"""Qwen3-Next and Qwen3.5-MoE (text model): three Gated-DeltaNet layers per full-attention layer. Full
attention: q_proj also yields a per-head output gate, per-head q/k norm, partial RoPE. Zero-centred
RMSNorms x·(1 + w); a shared expert behind a sigmoid gate. Qwen3-Next fuses its linear projections per key-head
group, Qwen3.5 keeps them apart: both load into one lin_in [q, k, v, z, b, a].
"""

from __future__ import annotations

from core.model.families._common import (Piece, checkpoint_dtype, eos_ids, ffn_pieces, first, having,
                                         llama_style_fields, llama_style_globals, need, norm_pieces, quant_method,
                                         rope_spec)
from core.model.spec import LinearAttnSpec, ModelSpec

ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
TYPES = {"linear_attention": "linear", "full_attention": "full"}


def spec(cfg: dict) -> ModelSpec:
    arch, top, text = cfg["architectures"][0], cfg, cfg.get("text_config")
    if isinstance(text, dict):  # a vision-language checkpoint's language model
        cfg = {**text, "architectures": cfg["architectures"]}
    D, H, L = need(cfg, "hidden_size"), need(cfg, "num_attention_heads"), need(cfg, "num_hidden_layers")
    hd = first(cfg, "head_dim", default=D // H)
    interval = int(cfg.get("full_attention_interval") or 4)
    names = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
    if bad := [t for t in names if t not in TYPES]:
        raise ValueError(f"unknown layer type {bad[0]!r}")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = tuple(sorted(set(cfg.get("mlp_only_layers") or ()) | {i for i in range(L) if (i + 1) % step}))
    qwen35 = arch.startswith("Qwen3_5")
    cfg = {"partial_rotary_factor": 0.25, **cfg}  # the reference's default when the config is silent
    bias = bool(cfg.get("attention_bias", False))
    fields = llama_style_fields(cfg, norm_eps=1e-6, rope=rope_spec(cfg, 10000.0, head_dim=hd))
    fields.update(  # a vision-language checkpoint may say these at its top level only
        tie_word_embeddings=bool(first(cfg, "tie_word_embeddings", default=top.get("tie_word_embeddings", False))),
        dtype=checkpoint_dtype(cfg if ("torch_dtype" in cfg or "dtype" in cfg) else top),
        eos_token_ids=eos_ids(cfg) or eos_ids(top))
    return ModelSpec(
        **fields, family="qwen3_5_moe" if qwen35 else "qwen3_next", num_experts=need(cfg, "num_experts"),
        expert_intermediate=need(cfg, "moe_intermediate_size"),
        shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0), shared_gate=True,
        norm="rms_offset", qk_norm="head", qkv_bias=bias, attn_o_bias=bias, attn_gate=True,
        router_norm="sum" if qwen35 or cfg.get("norm_topk_prob", True) else "none",
        dense_layers=dense, dense_intermediate=int(cfg.get("intermediate_size") or 0) if dense else 0,
        layer_types=tuple(TYPES[t] for t in names),
        linear=LinearAttnSpec(num_k_heads=need(cfg, "linear_num_key_heads"), num_v_heads=need(cfg, "linear_num_value_heads"),
                              k_head_dim=need(cfg, "linear_key_head_dim"), v_head_dim=need(cfg, "linear_value_head_dim"),
                              conv_kernel=need(cfg, "linear_conv_kernel_dim")),
        max_position=first(cfg, "max_position_embeddings", default=32768),
        quant_method=quant_method(top) or quant_method(cfg),
    )


def _prefix(keys: set[str]) -> str:
    return "model.language_model." if any(k.startswith("model.language_model.") for k in keys) else "model."


def notes(spec: ModelSpec, keys: set[str]) -> list[str]:
    if any(k.startswith(("model.visual.", "visual.")) for k in keys):
        return ["this checkpoint's vision tower is not loaded: mlight runs its text model (images in prompts are not supported)"]
    return []


def _attention(p: str, spec: ModelSpec) -> list[Piece]:
    a, H, hd, q, kv = p + "self_attn.", spec.num_heads, spec.head_dim, spec.q_size, spec.kv_size
    every, query, gate = slice(None), slice(0, hd), slice(hd, 2 * hd)
    pieces = [Piece(a + "q_norm.weight", "q_norm"), Piece(a + "k_norm.weight", "k_norm")]
    for kind, dest, out, view in (("weight", "qkv", "o", (H, 2 * hd, spec.hidden_size)),
                                  ("bias", "qkv_bias", "o_bias", (H, 2 * hd))):
        pieces += [  # q_proj rows are [q | gate] per head
            Piece(f"{a}q_proj.{kind}", dest, (slice(0, q),), view=view, select=(every, query), fit=True),
            Piece(f"{a}q_proj.{kind}", dest, (slice(q + 2 * kv, 2 * q + 2 * kv),), view=view, select=(every, gate),
                  fit=True),
            Piece(f"{a}k_proj.{kind}", dest, (slice(q, q + kv),)),
            Piece(f"{a}v_proj.{kind}", dest, (slice(q + kv, q + 2 * kv),)),
            Piece(f"{a}o_proj.{kind}", out),
        ]
    return pieces


def _linear(p: str, spec: ModelSpec, keys: set[str]) -> list[Piece]:
    a, la, D = p + "linear_attn.", spec.linear, spec.hidden_size
    kd, vd, Hv, Hk = la.key_dim, la.value_dim, la.num_v_heads, la.num_k_heads
    at = {"q": 0, "k": kd, "v": 2 * kd, "z": 2 * kd + vd, "b": 2 * kd + 2 * vd, "a": 2 * kd + 2 * vd + Hv}
    size = {"q": kd, "k": kd, "v": vd, "z": vd, "b": Hv, "a": Hv}

    def rows(part):
        return (slice(at[part], at[part] + size[part]),)

    pieces = [Piece(a + "conv1d.weight", "conv", view=(la.conv_dim, la.conv_kernel)),
              Piece(a + "dt_bias", "dt_bias"), Piece(a + "A_log", "A_log"), Piece(a + "norm.weight", "gnorm"),
              Piece(a + "out_proj.weight", "lin_out")]
    if a + "in_proj_qkvz.weight" in keys:  # Qwen3-Next: per key-head group [q, k, v, z] and [b, a]
        r, dk, dv = Hv // Hk, la.k_head_dim, la.v_head_dim
        group = {"q": (0, dk), "k": (dk, 2 * dk), "v": (2 * dk, 2 * dk + r * dv), "z": (2 * dk + r * dv, 2 * dk + 2 * r * dv)}
        view = (Hk, 2 * dk + 2 * r * dv, D)
        pieces += [Piece(a + "in_proj_qkvz.weight", "lin_in", rows(n), view=view, select=(slice(None), slice(*group[n])),
                         fit=True) for n in ("q", "k", "v", "z")]
        pieces += [Piece(a + "in_proj_ba.weight", "lin_in", rows(n), view=(Hk, 2 * r, D),
                         select=(slice(None), slice(j * r, (j + 1) * r)), fit=True) for j, n in enumerate(("b", "a"))]
    else:  # Qwen3.5: separate projections
        pieces += [Piece(a + "in_proj_qkv.weight", "lin_in", (slice(0, la.conv_dim),)),
                   Piece(a + "in_proj_z.weight", "lin_in", rows("z")),
                   Piece(a + "in_proj_b.weight", "lin_in", rows("b")),
                   Piece(a + "in_proj_a.weight", "lin_in", rows("a"))]
    return pieces


def layer_pieces(spec: ModelSpec, i: int, keys: set[str]):
    p = f"{_prefix(keys)}layers.{i}."
    mixer = _linear(p, spec, keys) if spec.layer_type(i) == "linear" else _attention(p, spec)
    return having(spec, i, [*norm_pieces(p), *mixer, *ffn_pieces(p, spec, keys, shared="shared_expert.")])


def global_pieces(spec: ModelSpec, keys: set[str]):
    return llama_style_globals(spec, keys, prefix=_prefix(keys))
