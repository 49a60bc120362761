"""DeepSeek-V2 / V3 (and R1, Kimi K2, Moonlight): latent attention with YaRN whose mscale also scales the
softmax, the first `first_k_dense_replace` layers dense. V2 routes softmax + (group-limited) greedy, never
renormalised (as transformers); V3 sigmoid scores chosen with `e_score_correction_bias`. The configs name
remote code (auto_map); mlight, like transformers, implements it and never runs it.
"""

from __future__ import annotations

import dataclasses

from core.errors import ModelError
from core.model.families._common import (Piece, ffn_pieces, first, first_dense, having, llama_style_fields,
                                         llama_style_globals, need, norm_pieces, quant_method, rope_spec,
                                         yarn_softmax_scale)
from core.model.spec import MLASpec, ModelSpec

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
global_pieces = llama_style_globals
NATIVE_DESPITE_AUTO_MAP = True


def spec(cfg: dict) -> ModelSpec:
    arch = cfg["architectures"][0]
    v3 = arch.startswith("DeepseekV3")
    if cfg.get("attention_bias"):
        raise ModelError(f"{arch} with attention_bias is not supported", "no released checkpoint has it")
    m = MLASpec(q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=need(cfg, "kv_lora_rank"),
                qk_nope_dim=need(cfg, "qk_nope_head_dim"), qk_rope_dim=need(cfg, "qk_rope_head_dim"),
                v_head_dim=need(cfg, "v_head_dim"))
    rope = dataclasses.replace(rope_spec(cfg, 10000.0, kinds=("default", "yarn")),
                               pairs=bool(cfg.get("rope_interleave", True)) if v3 else True)
    H, E = need(cfg, "num_attention_heads"), need(cfg, "n_routed_experts")
    groups, topk_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if v3:
        routing = dict(router="sigmoid_group", router_correction=True,
                       router_norm="sum" if cfg.get("norm_topk_prob", True) else "none")
    else:
        limited = cfg.get("topk_method", "greedy") == "group_limited_greedy"
        routing = dict(router="softmax_group", router_norm="none")
        groups, topk_groups = (groups, topk_groups) if limited else (1, 1)
    qk = m.qk_nope_dim + m.qk_rope_dim
    return ModelSpec(
        **{**llama_style_fields(cfg, norm_eps=1e-6, rope=rope), "num_kv_heads": H, "head_dim": qk},
        family="deepseek_v3" if v3 else "deepseek_v2", num_experts=E, expert_intermediate=need(cfg, "moe_intermediate_size"),
        shared_intermediate=need(cfg, "moe_intermediate_size") * int(cfg.get("n_shared_experts") or 0),
        router_fp32=True, router_groups=groups, router_topk_groups=topk_groups,
        routed_scale=float(cfg.get("routed_scaling_factor") or 1.0), **routing,
        dense_layers=first_dense(cfg), dense_intermediate=need(cfg, "intermediate_size"), mla=m,
        attn_scale=qk ** -0.5 * yarn_softmax_scale(rope), max_position=first(cfg, "max_position_embeddings", default=4096),
        quant_method=quant_method(cfg),
    )


def layer_pieces(spec: ModelSpec, i: int, keys: set[str]):
    p = f"model.layers.{i}."
    a = p + "self_attn."
    return having(spec, i, [
        *norm_pieces(p), Piece(a + "q_a_proj.weight", "q_a"), Piece(a + "q_a_layernorm.weight", "q_a_norm"),
        Piece(a + "q_b_proj.weight", "q_b"), Piece(a + "q_proj.weight", "q"),  # low-rank q, or a full one
        Piece(a + "kv_a_proj_with_mqa.weight", "kv_a"), Piece(a + "kv_a_layernorm.weight", "kv_a_norm"),
        Piece(a + "kv_b_proj.weight", "kv_b"), Piece(a + "o_proj.weight", "o"), *ffn_pieces(p, spec, keys)])
