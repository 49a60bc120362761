"""Mixtral 8x7B / 8x22B: Llama attention with GQA; top-2 of 8 experts, top-k probabilities renormalised."""

from __future__ import annotations

from core.model.families._common import first, llama_style_fields, llama_style_globals, moe_layer, need
from core.model.spec import ModelSpec

ARCHITECTURES = ("MixtralForCausalLM",)
global_pieces = llama_style_globals


def spec(cfg: dict) -> ModelSpec:
    return ModelSpec(
        **llama_style_fields(cfg, norm_eps=1e-5), family="mixtral",
        num_experts=need(cfg, "num_local_experts"), expert_intermediate=need(cfg, "intermediate_size"),
        router_norm="sum", max_position=first(cfg, "sliding_window", "max_position_embeddings", default=4096),
    )


def layer_pieces(spec: ModelSpec, i: int, keys: set[str]):
    return moe_layer(spec, i, keys, moe="block_sparse_moe.", names=("w1", "w3", "w2"))
