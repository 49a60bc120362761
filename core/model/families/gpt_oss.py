"""gpt-oss (20b, 120b): alternating sliding-window and full attention, sinks, q/k/v/o biases, YaRN; a
biased router taking the top-k logits before its softmax; biased experts with a clamped SwiGLU whose gate
and up columns interleave in `gate_up_proj`. MXFP4 releases stay 4-bit: blocks and exponents are read as they
are, their interleaved gate and up rows into our gate-then-up parts (rows move as bytes, never as values).
"""

from __future__ import annotations

from core.model.families._common import (Piece, first, having, llama_style_attention, llama_style_fields,
                                         llama_style_globals, need, norm_pieces, quant_method, rope_spec)
from core.model.spec import ModelSpec

ARCHITECTURES = ("GptOssForCausalLM",)
global_pieces = llama_style_globals
TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def spec(cfg: dict) -> ModelSpec:
    L = need(cfg, "num_hidden_layers")
    names = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    if bad := [t for t in names if t not in TYPES]:
        raise ValueError(f"unknown gpt-oss layer type {bad[0]!r}")
    bias = bool(cfg.get("attention_bias", True))
    return ModelSpec(
        **llama_style_fields(cfg, norm_eps=1e-5, rope=rope_spec(cfg, 150000.0, kinds=("default", "yarn"))),
        family="gpt_oss", num_experts=need(cfg, "num_local_experts"), expert_intermediate=need(cfg, "intermediate_size"),
        norm="rms_fp32", qkv_bias=bias, attn_o_bias=bias, attn_sinks=True,
        layer_types=tuple(TYPES[t] for t in names), sliding_window=int(cfg.get("sliding_window") or 0),
        router="topk_softmax", router_bias=True, expert_bias=True, expert_act="clamped_swiglu",
        swiglu_alpha=float(first(cfg, "swiglu_alpha", default=1.702)),
        swiglu_limit=float(first(cfg, "swiglu_limit", default=7.0)),
        max_position=first(cfg, "max_position_embeddings", default=131072), quant_method=quant_method(cfg),
    )


def layer_pieces(spec: ModelSpec, i: int, keys: set[str]):
    p = f"model.layers.{i}."
    m = p + "mlp."
    I = spec.expert_intermediate
    every = slice(None)
    halves = ((slice(0, I), slice(0, None, 2)), (slice(I, 2 * I), slice(1, None, 2)))  # gate rows even, up odd
    if spec.expert_format == "mxfp4":  # [E, 2I, K/32, ...], gate/up interleaved on the rows
        experts = [*(Piece(f"{m}experts.gate_up_proj_{x}", f"w13.{x}", (every, rows), select=(every, pick))
                     for x in ("blocks", "scales") for rows, pick in halves),
                   *(Piece(f"{m}experts.down_proj_{x}", f"w2.{x}") for x in ("blocks", "scales"))]
    else:  # [E, D, 2I], gate/up interleaved in the last axis -> rows of [E, 2I, D]
        experts = [*(Piece(m + "experts.gate_up_proj", "w13", (every, rows), transpose=True, select=(every, pick))
                     for rows, pick in halves), Piece(m + "experts.down_proj", "w2", transpose=True)]
    return having(spec, i, [
        *norm_pieces(p),
        *llama_style_attention(p, spec),
        Piece(p + "self_attn.sinks", "sinks"),
        Piece(m + "router.weight", "router"),
        Piece(m + "router.bias", "router_bias"),
        *experts,
        *(Piece(m + "experts.gate_up_proj_bias", "b13", (every, rows), select=(every, pick)) for rows, pick in halves),
        Piece(m + "experts.down_proj_bias", "b2"),
    ])
