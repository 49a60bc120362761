"""GLM-4.5 / GLM-4.5-Air: GQA with q/k/v bias, optional per-head q/k RMSNorm, partial RoPE; DeepSeek-V3's
router, one shared expert, the first `first_k_dense_replace` layers dense. The MTP layer is not read.
"""

from __future__ import annotations

from core.model.families._common import (first, first_dense, llama_style_fields, llama_style_globals, moe_layer, need,
                                         quant_method, rope_spec)
from core.model.spec import ModelSpec

ARCHITECTURES = ("Glm4MoeForCausalLM",)
global_pieces = llama_style_globals
layer_pieces = moe_layer


def spec(cfg: dict) -> ModelSpec:
    D, H = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
    hd = first(cfg, "head_dim", default=D // H)
    cfg = {"partial_rotary_factor": 0.5, **cfg}  # the reference's default when the config is silent
    return ModelSpec(
        **llama_style_fields(cfg, norm_eps=1e-5, rope=rope_spec(cfg, 10000.0, head_dim=hd)), family="glm4_moe",
        num_experts=need(cfg, "n_routed_experts"), expert_intermediate=need(cfg, "moe_intermediate_size"),
        shared_intermediate=need(cfg, "moe_intermediate_size") * int(cfg.get("n_shared_experts") or 0),
        qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm="head" if cfg.get("use_qk_norm") else "none",
        router="sigmoid_group", router_correction=True, router_fp32=True,
        router_norm="sum" if cfg.get("norm_topk_prob", True) else "none",
        router_groups=int(cfg.get("n_group") or 1), router_topk_groups=int(cfg.get("topk_group") or 1),
        routed_scale=float(cfg.get("routed_scaling_factor") or 1.0),
        dense_layers=first_dense(cfg), dense_intermediate=need(cfg, "intermediate_size"),
        max_position=first(cfg, "max_position_embeddings", default=131072), quant_method=quant_method(cfg),
    )
