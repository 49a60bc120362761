"""Pieces shared by the family modules: reading config fields and naming checkpoint tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.errors import ModelError
from core.model.spec import RopeSpec


@dataclass(frozen=True)
class Piece:
    """Copy checkpoint tensor `src` into canonical tensor `dest` at `index`: `view` reshapes the source
    (DBRX's [E·I, D] experts), `transpose` swaps its last two axes, `select` indexes it (interleaved gate/up
    columns, per-group q/k/v/z rows) and `fit` reshapes the selection to the destination's shape."""

    src: str
    dest: str
    index: tuple = ()
    view: tuple[int, ...] | None = None
    transpose: bool = False
    select: tuple | None = None
    fit: bool = False


def need(cfg: dict, key: str, where: str = "config.json"):
    if key not in cfg or cfg[key] is None:
        raise ModelError(
            f"{where} has no `{key}`, which mlight needs for {cfg.get('architectures', ['this model'])[0]}",
            "use the config.json that came with the checkpoint",
        )
    return cfg[key]


def first(cfg: dict, *keys: str, default=None):
    return next((cfg[k] for k in keys if cfg.get(k) is not None), default)


def rope_spec(cfg: dict, default_theta: float = 10000.0, head_dim: int | None = None,
              kinds: tuple[str, ...] = ("default",)) -> RopeSpec:
    """RoPE from `rope_parameters` or `rope_scaling` + `rope_theta`; `kinds`: the scalings the family implements."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in kinds:
        raise ModelError(f"rope scaling {kind!r} is not supported for {cfg['architectures'][0]}",
                         f"use a checkpoint with {' or '.join(kinds)} RoPE")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or default_theta)
    partial = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
    dim = int(head_dim * partial) if partial and head_dim else 0
    if kind == "default":
        return RopeSpec(theta=theta, dim=dim)
    original = int(params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or 0)
    if not original:
        raise ModelError(f"{kind} RoPE without original_max_position_embeddings", "use the checkpoint's own config.json")
    if kind == "yarn":
        return RopeSpec(theta=theta, dim=dim, kind="yarn", factor=float(params.get("factor") or 0.0),
                        original_max=original, beta_fast=float(params.get("beta_fast") or 32),
                        beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)),
                        attention_factor=params.get("attention_factor"), mscale=float(params.get("mscale") or 0),
                        mscale_all_dim=float(params.get("mscale_all_dim") or 0))
    return RopeSpec(theta=theta, dim=dim, kind="longrope", original_max=original,
                    short_factor=tuple(float(x) for x in need(params, "short_factor", "rope_scaling")),
                    long_factor=tuple(float(x) for x in need(params, "long_factor", "rope_scaling")),
                    short_mscale=params.get("short_mscale"), long_mscale=params.get("long_mscale"))


def checkpoint_dtype(cfg: dict) -> str:
    d = first(cfg, "torch_dtype", "dtype", default="bfloat16")
    d = str(d).replace("torch.", "")
    return {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}.get(d, d)


def eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def having(spec, i: int, pieces: list[Piece]) -> list[Piece]:
    """The pieces of the tensors layer i has (a quantized part, "w13.blocks", of w13's): the helpers here name every
    tensor a layer may have, and the spec alone says which are there."""
    shapes = spec.layer_shapes(i)
    return [p for p in pieces if p.dest.split(".")[0] in shapes]


def llama_style_attention(prefix: str, spec) -> list[Piece]:
    """q/k/v/o projections named the Llama way, fused into qkv, with their biases and q/k norms (see `having`)."""
    q, kv = spec.q_size, spec.kv_size
    p = f"{prefix}self_attn."
    rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
    return [*(Piece(f"{p}{n}_proj.weight", "qkv", (r,)) for n, r in rows.items()),
            *(Piece(f"{p}{n}_proj.bias", "qkv_bias", (r,)) for n, r in rows.items()),
            Piece(p + "o_proj.weight", "o"), Piece(p + "o_proj.bias", "o_bias"),
            *(Piece(f"{p}{n}_norm.weight", f"{n}_norm") for n in ("q", "k"))]


def routed_experts(prefix: str, spec, keys: set[str], names=("gate_proj", "up_proj", "down_proj")) -> list[Piece]:
    """Experts either fused ([E, 2I, D] gate_up_proj, [E, D, I] down_proj) or one module per expert."""
    if prefix + "experts.gate_up_proj" in keys:
        return [Piece(prefix + "experts.gate_up_proj", "w13"), Piece(prefix + "experts.down_proj", "w2")]
    gate, up, down = names
    I = spec.expert_intermediate
    pieces = []
    for e in range(spec.num_experts):
        ep = f"{prefix}experts.{e}."
        pieces += [
            Piece(ep + f"{gate}.weight", "w13", (e, slice(0, I))),
            Piece(ep + f"{up}.weight", "w13", (e, slice(I, 2 * I))),
            Piece(ep + f"{down}.weight", "w2", (e,)),
        ]
    return pieces


def moe_layer(spec, i: int, keys: set[str], **ffn) -> list[Piece]:
    p = f"model.layers.{i}."
    return having(spec, i, [*norm_pieces(p), *llama_style_attention(p, spec), *ffn_pieces(p, spec, keys, **ffn)])


def llama_style_globals(spec, keys: set[str], prefix: str = "model.") -> list[Piece]:
    shapes = spec.global_shapes()
    return [p for p in (Piece(prefix + "embed_tokens.weight", "embed"), Piece(prefix + "norm.weight", "norm"),
                        Piece(prefix + "norm.bias", "norm_b"), Piece("lm_head.weight", "lm_head"),
                        Piece("lm_head.bias", "lm_head_b")) if p.dest in shapes]


def llama_style_fields(cfg: dict, norm_eps: float, rope: RopeSpec | None = None) -> dict:
    """ModelSpec fields that Llama-style configs (Mixtral, Qwen-MoE, OLMoE, …) name the same way."""
    D, H = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
    return dict(
        architecture=cfg["architectures"][0], num_layers=need(cfg, "num_hidden_layers"), hidden_size=D,
        num_heads=H, num_kv_heads=first(cfg, "num_key_value_heads", default=H),
        head_dim=first(cfg, "head_dim", default=D // H), vocab_size=need(cfg, "vocab_size"),
        top_k=need(cfg, "num_experts_per_tok"), norm_eps=first(cfg, "rms_norm_eps", default=norm_eps),
        rope=rope or rope_spec(cfg), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=checkpoint_dtype(cfg), bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg),
    )


def yarn_softmax_scale(r: RopeSpec) -> float:
    """DeepSeek's extra softmax scale with YaRN: mscale(factor, mscale_all_dim)² (1 without it)."""
    if r.kind != "yarn" or not r.mscale_all_dim or r.factor <= 1:
        return 1.0
    m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
    return m * m


def quant_method(cfg: dict) -> str | None:
    q = cfg.get("quantization_config") or {}
    return q.get("quant_method") if isinstance(q, dict) else None


def mlp_pieces(prefix: str, dest: str, inter: int) -> list[Piece]:
    return [Piece(prefix + "gate_proj.weight", f"{dest}_w13", (slice(0, inter),)),
            Piece(prefix + "up_proj.weight", f"{dest}_w13", (slice(inter, 2 * inter),)),
            Piece(prefix + "down_proj.weight", f"{dest}_w2")]


def ffn_pieces(prefix: str, spec, keys: set[str], moe: str = "mlp.",
               names=("gate_proj", "up_proj", "down_proj"), router: str = "gate.weight",
               shared: str = "shared_experts.") -> list[Piece]:
    """A layer's FFN under `moe`: every tensor a dense or MoE layer may have (see `having`)."""
    p = prefix + moe
    return [*mlp_pieces(p, "dense", spec.dense_intermediate), Piece(p + router, "router"),
            *routed_experts(p, spec, keys, names), Piece(p + "gate.e_score_correction_bias", "e_bias"),
            *mlp_pieces(p + shared, "shared", spec.shared_intermediate),
            Piece(p + "shared_expert_gate.weight", "shared_gate")]


def norm_pieces(prefix: str) -> list[Piece]:
    return [Piece(prefix + "input_layernorm.weight", "ln1"), Piece(prefix + "post_attention_layernorm.weight", "ln2"),
            Piece(prefix + "input_layernorm.bias", "ln1_b"), Piece(prefix + "post_attention_layernorm.bias", "ln2_b")]


def first_dense(cfg: dict) -> tuple[int, ...]:
    """DeepSeek-style `first_k_dense_replace`: the first k layers have a dense MLP."""
    k = int(cfg.get("first_k_dense_replace") or 0)
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise ModelError(f"{cfg['architectures'][0]} with moe_layer_freq {cfg['moe_layer_freq']} is not supported",
                         "use a checkpoint whose layers after the first dense ones are all MoE")
    return tuple(range(min(k, need(cfg, "num_hidden_layers"))))
