"""DBRX: fused Wqkv with clip_qkv, bias-free LayerNorm, experts stored as [E·I, D] blocks, w2 as [I, D];
its router softmaxes in the weights' dtype and divides the top-k by their p-norm.
"""

from __future__ import annotations

from core.model.families._common import Piece, checkpoint_dtype, eos_ids, first, need, rope_spec
from core.model.spec import ModelSpec, RopeSpec

ARCHITECTURES = ("DbrxForCausalLM",)


def spec(cfg: dict) -> ModelSpec:
    attn, ffn = need(cfg, "attn_config"), need(cfg, "ffn_config")
    D, H = need(cfg, "d_model"), need(cfg, "n_heads")
    act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
    if act != "silu":
        from core.errors import ModelError
        raise ModelError(f"DBRX with activation {act!r} is not supported", "mlight implements SiLU experts")
    pnorm = ffn.get("moe_normalize_expert_weights")
    return ModelSpec(
        architecture=cfg["architectures"][0], family="dbrx",
        num_layers=need(cfg, "n_layers"), hidden_size=D, num_heads=H,
        num_kv_heads=first(attn, "kv_n_heads", default=H), head_dim=D // H,
        vocab_size=need(cfg, "vocab_size"), num_experts=need(ffn, "moe_num_experts", "ffn_config"),
        top_k=need(ffn, "moe_top_k", "ffn_config"), expert_intermediate=need(ffn, "ffn_hidden_size", "ffn_config"),
        norm="layernorm", norm_eps=1e-5, clip_qkv=attn.get("clip_qkv"),
        router_norm="none" if pnorm is None else "pnorm", router_pnorm=float(pnorm or 1.0),
        router_softmax_fp32=False,
        rope=RopeSpec(theta=float(attn.get("rope_theta") or rope_spec(cfg, 500000.0).theta)),
        max_position=first(cfg, "max_seq_len", default=32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), dtype=checkpoint_dtype(cfg),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg),
    )


def layer_pieces(spec: ModelSpec, i: int, keys: set[str]):
    p = f"transformer.blocks.{i}."
    E, I, D = spec.num_experts, spec.expert_intermediate, spec.hidden_size
    m = p + "ffn.experts.mlp."
    return [
        Piece(p + "norm_attn_norm.norm_1.weight", "ln1"),
        Piece(p + "norm_attn_norm.norm_2.weight", "ln2"),
        Piece(p + "norm_attn_norm.attn.Wqkv.weight", "qkv"),
        Piece(p + "norm_attn_norm.attn.out_proj.weight", "o"),
        Piece(p + "ffn.router.layer.weight", "router"),
        Piece(m + "w1", "w13", (slice(None), slice(0, I)), view=(E, I, D)),
        Piece(m + "v1", "w13", (slice(None), slice(I, 2 * I)), view=(E, I, D)),
        Piece(m + "w2", "w2", (), view=(E, I, D), transpose=True),
    ]


def global_pieces(spec: ModelSpec, keys: set[str]):
    pieces = [Piece("transformer.wte.weight", "embed"), Piece("transformer.norm_f.weight", "norm")]
    if not spec.tie_word_embeddings:
        pieces.append(Piece("lm_head.weight", "lm_head"))
    return pieces
