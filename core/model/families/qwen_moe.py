"""Qwen2-MoE (shared expert behind a sigmoid gate, q/k/v bias) and Qwen3-MoE (per-head q/k RMSNorm); top-k
renormalised only with `norm_topk_prob`. Dense layers (`mlp_only_layers`, `decoder_sparse_step`) are in no
released checkpoint, so such configs are refused rather than guessed.
"""

from __future__ import annotations

from core.errors import ModelError
from core.model.families._common import first, llama_style_fields, llama_style_globals, moe_layer, need
from core.model.spec import ModelSpec

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
global_pieces = llama_style_globals


def spec(cfg: dict) -> ModelSpec:
    arch = cfg["architectures"][0]
    if cfg.get("mlp_only_layers") or first(cfg, "decoder_sparse_step", default=1) != 1:
        raise ModelError(f"{arch} with dense MLP layers (mlp_only_layers / decoder_sparse_step) is not supported",
                         "use a checkpoint whose every layer is an MoE layer")
    qwen2 = arch.startswith("Qwen2")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return ModelSpec(
        **llama_style_fields(cfg, norm_eps=1e-6), family="qwen2_moe" if qwen2 else "qwen3_moe",
        num_experts=first(cfg, "num_experts", "num_local_experts") or need(cfg, "num_experts"),
        expert_intermediate=need(cfg, "moe_intermediate_size"), shared_intermediate=shared, shared_gate=bool(shared),
        qk_norm="none" if qwen2 else "head",
        qkv_bias=bool(cfg.get("qkv_bias", True)) if qwen2 else bool(cfg.get("attention_bias", False)),
        router_norm="sum" if cfg.get("norm_topk_prob") else "none",
        max_position=first(cfg, "max_position_embeddings", default=32768),
    )


def layer_pieces(spec: ModelSpec, i: int, keys: set[str]):
    return moe_layer(spec, i, keys, shared="shared_expert.")
