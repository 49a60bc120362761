"""Phi-3.5-MoE: LayerNorm with bias, q/k/v/o and LM-head biases, LongRoPE, and sparse-mixer top-2 routing. The
config names remote code, which transformers and mlight implement natively. A `sliding_window` shorter than the
context makes every layer a sliding one.
"""

from __future__ import annotations

from core.errors import ModelError
from core.model.families._common import (first, llama_style_fields, llama_style_globals, moe_layer, need, quant_method,
                                         rope_spec)
from core.model.spec import ModelSpec

ARCHITECTURES = ("PhimoeForCausalLM", "PhiMoEForCausalLM")
global_pieces = llama_style_globals
NATIVE_DESPITE_AUTO_MAP = True


def spec(cfg: dict) -> ModelSpec:
    if need(cfg, "num_experts_per_tok") != 2:
        raise ModelError(f"Phi-MoE routes to 2 experts (sparse mixer); this config asks for {cfg['num_experts_per_tok']}",
                         "use the checkpoint's own config.json")
    L, max_pos = need(cfg, "num_hidden_layers"), first(cfg, "max_position_embeddings", default=131072)
    window = int(cfg.get("sliding_window") or 0)
    sliding = 0 < window < max_pos
    bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(
        **llama_style_fields(cfg, norm_eps=1e-5, rope=rope_spec(cfg, 10000.0, kinds=("default", "longrope"))),
        family="phimoe", num_experts=need(cfg, "num_local_experts"), expert_intermediate=need(cfg, "intermediate_size"),
        norm="layernorm", norm_bias=True, qkv_bias=bias, attn_o_bias=bias, router="sparsemixer",
        router_jitter=float(first(cfg, "router_jitter_noise", default=0.01)),
        layer_types=("sliding",) * L if sliding else (), sliding_window=window if sliding else 0,
        lm_head_bias=bool(cfg.get("lm_head_bias", False)), max_position=max_pos, quant_method=quant_method(cfg),
    )


def layer_pieces(spec: ModelSpec, i: int, keys: set[str]):
    p = f"model.layers.{i}."
    moe = "block_sparse_moe." if any(k.startswith(p + "block_sparse_moe.") for k in keys) else "mlp."
    router = "gate.weight" if p + moe + "gate.weight" in keys else "router.weight"
    return moe_layer(spec, i, keys, moe=moe, names=("w1", "w3", "w2"), router=router)
