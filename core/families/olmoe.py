"""OLMoE: q/k RMSNorm over all heads at once (before the head split), optional clip_qkv."""

from __future__ import annotations

from core.families._common import (Piece, checkpoint_dtype, eos_ids, first, llama_style_attention,
                                   llama_style_globals, need, rope_theta, routed_experts)
from core.spec import ModelSpec

ARCHITECTURES = ("OlmoeForCausalLM",)


def spec(cfg: dict) -> ModelSpec:
    D, H = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
    return ModelSpec(
        architecture=cfg["architectures"][0], family="olmoe",
        num_layers=need(cfg, "num_hidden_layers"), hidden_size=D, num_heads=H,
        num_kv_heads=first(cfg, "num_key_value_heads", default=H), head_dim=first(cfg, "head_dim", default=D // H),
        vocab_size=need(cfg, "vocab_size"), num_experts=need(cfg, "num_experts"),
        top_k=need(cfg, "num_experts_per_tok"), expert_intermediate=need(cfg, "intermediate_size"),
        norm_eps=first(cfg, "rms_norm_eps", default=1e-5), qk_norm="full",
        qkv_bias=bool(cfg.get("attention_bias", False)), clip_qkv=cfg.get("clip_qkv"),
        router_norm="sum" if cfg.get("norm_topk_prob") else "none",
        rope_theta=rope_theta(cfg), max_position=first(cfg, "max_position_embeddings", default=4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), dtype=checkpoint_dtype(cfg),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg),
    )


def layer_pieces(spec: ModelSpec, i: int, keys: set[str]):
    p = f"model.layers.{i}."
    return [
        Piece(p + "input_layernorm.weight", "ln1"),
        Piece(p + "post_attention_layernorm.weight", "ln2"),
        Piece(p + "mlp.gate.weight", "router"),
        *llama_style_attention(p, spec, keys),
        *routed_experts(p + "mlp.", spec, keys),
    ]


def global_pieces(spec: ModelSpec, keys: set[str]):
    return llama_style_globals(spec, keys)
