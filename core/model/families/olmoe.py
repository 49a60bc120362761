"""OLMoE: q/k RMSNorm over all heads at once (before the head split), optional clip_qkv."""

from __future__ import annotations

from core.model.families._common import first, llama_style_fields, llama_style_globals, moe_layer, need
from core.model.spec import ModelSpec

ARCHITECTURES = ("OlmoeForCausalLM",)
global_pieces = llama_style_globals
layer_pieces = moe_layer


def spec(cfg: dict) -> ModelSpec:
    return ModelSpec(
        **llama_style_fields(cfg, norm_eps=1e-5), family="olmoe",
        num_experts=need(cfg, "num_experts"), expert_intermediate=need(cfg, "intermediate_size"),
        qk_norm="full", qkv_bias=bool(cfg.get("attention_bias", False)), clip_qkv=cfg.get("clip_qkv"),
        router_norm="sum" if cfg.get("norm_topk_prob") else "none",
        max_position=first(cfg, "max_position_embeddings", default=4096),
    )
