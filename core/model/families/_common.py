"""Pieces shared by the family modules: reading config fields and naming checkpoint tensors."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ModelError


@dataclass(frozen=True)
class Piece:
    """Copy checkpoint tensor `src` into canonical tensor `dest` at `index`.

    `view` reshapes the source first (DBRX stores experts as [E·I, D]); `transpose` swaps its last
    two axes (DBRX's w2 is stored [I, D] per expert, ours is [D, I]).
    """

    src: str
    dest: str
    index: tuple = ()
    view: tuple[int, ...] | None = None
    transpose: bool = False


def need(cfg: dict, key: str, where: str = "config.json"):
    if key not in cfg or cfg[key] is None:
        raise ModelError(
            f"{where} has no `{key}`, which mlight needs for {cfg.get('architectures', ['this model'])[0]}",
            "use the config.json that came with the checkpoint",
        )
    return cfg[key]


def first(cfg: dict, *keys: str, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ModelError(f"rope scaling {kind!r} is not supported yet", "use a checkpoint with default RoPE")
    return float(params.get("rope_theta") or cfg.get("rope_theta") or default)


def checkpoint_dtype(cfg: dict) -> str:
    d = first(cfg, "torch_dtype", "dtype", default="bfloat16")
    d = str(d).replace("torch.", "")
    return {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}.get(d, d)


def eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def llama_style_attention(prefix: str, spec, keys: set[str], attn: str = "self_attn") -> list[Piece]:
    """q/k/v/o projections named the Llama way, fused into qkv."""
    q, kv = spec.q_size, spec.kv_size
    p = f"{prefix}{attn}."
    pieces = [
        Piece(p + "q_proj.weight", "qkv", (slice(0, q),)),
        Piece(p + "k_proj.weight", "qkv", (slice(q, q + kv),)),
        Piece(p + "v_proj.weight", "qkv", (slice(q + kv, q + 2 * kv),)),
        Piece(p + "o_proj.weight", "o"),
    ]
    if spec.qkv_bias:
        pieces += [
            Piece(p + "q_proj.bias", "qkv_bias", (slice(0, q),)),
            Piece(p + "k_proj.bias", "qkv_bias", (slice(q, q + kv),)),
            Piece(p + "v_proj.bias", "qkv_bias", (slice(q + kv, q + 2 * kv),)),
        ]
    if spec.qk_norm != "none":
        pieces += [Piece(p + "q_norm.weight", "q_norm"), Piece(p + "k_norm.weight", "k_norm")]
    return pieces


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


def llama_style_globals(spec, keys: set[str]) -> list[Piece]:
    pieces = [Piece("model.embed_tokens.weight", "embed"), Piece("model.norm.weight", "norm")]
    if not spec.tie_word_embeddings:
        pieces.append(Piece("lm_head.weight", "lm_head"))
    return pieces


def llama_style_fields(cfg: dict, norm_eps: float) -> dict:
    """ModelSpec fields that Llama-style configs (Mixtral, Qwen-MoE, OLMoE) name the same way."""
    D, H = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
    return dict(
        architecture=cfg["architectures"][0], num_layers=need(cfg, "num_hidden_layers"), hidden_size=D,
        num_heads=H, num_kv_heads=first(cfg, "num_key_value_heads", default=H),
        head_dim=first(cfg, "head_dim", default=D // H), vocab_size=need(cfg, "vocab_size"),
        top_k=need(cfg, "num_experts_per_tok"), norm_eps=first(cfg, "rms_norm_eps", default=norm_eps),
        rope_theta=rope_theta(cfg), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=checkpoint_dtype(cfg), bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg),
    )
