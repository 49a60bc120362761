"""Tiny random-weight checkpoints of every supported family, made by transformers' own classes.

Each is saved with `save_pretrained` (safetensors, the legacy per-expert layout real hub
checkpoints use) next to a byte-level BPE tokenizer trained by `core.model.demo.build_tokenizer`, so
tests load them through mlight's real loading code. A larger init range than transformers'
default keeps logits peaked, so greedy choices are not decided by rounding noise.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512


def _configs():
    from transformers import (DbrxConfig, DeepseekV2Config, DeepseekV3Config, Glm4MoeConfig, GptOssConfig, MixtralConfig,
                              OlmoeConfig, PhimoeConfig, Qwen2MoeConfig, Qwen3_5MoeConfig, Qwen3MoeConfig,
                              Qwen3NextConfig)

    common = dict(vocab_size=VOCAB, initializer_range=0.08, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=3)
    mla = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
               n_group=4, max_position_embeddings=512, **common)
    linear = dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
    return {
        "mixtral": (MixtralConfig, "MixtralForCausalLM", dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512, **common)),
        "dbrx": (DbrxConfig, "DbrxForCausalLM", dict(
            d_model=64, n_heads=8, n_layers=2, max_seq_len=512,
            attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2), **common)),
        "qwen2_moe": (Qwen2MoeConfig, "Qwen2MoeForCausalLM", dict(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=48, shared_expert_intermediate_size=80,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=512, **common)),
        "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", dict(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=512, **common)),
        "olmoe": (OlmoeConfig, "OlmoeForCausalLM", dict(
            hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2, clip_qkv=2.0, max_position_embeddings=512, **common)),
        # sliding window 8: most prompts are longer; swiglu_limit 0.5: the clamp bites at this init
        "gpt_oss": (GptOssConfig, "GptOssForCausalLM", dict(
            hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.5,
            max_position_embeddings=512, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
            beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=128), **common)),
        # 8 experts in 4 groups, 1 (V2) or 2 (V3) groups eligible; YaRN with mscale ≠ mscale_all_dim scales cos/sin
        # and the softmax
        "deepseek_v2": (DeepseekV2Config, "DeepseekV2ForCausalLM", dict(
            q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5, topk_group=1,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                                 original_max_position_embeddings=128), **mla)),
        "deepseek_v3": (DeepseekV3Config, "DeepseekV3ForCausalLM", dict(
            q_lora_rank=24, norm_topk_prob=True, routed_scaling_factor=2.5, topk_group=2,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.9, mscale_all_dim=0.7,
                                 original_max_position_embeddings=128), **mla)),
        "glm4_moe": (Glm4MoeConfig, "Glm4MoeForCausalLM", dict(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
            use_qk_norm=True, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=1.5, max_position_embeddings=512, **common)),
        "qwen3_next": (Qwen3NextConfig, "Qwen3NextForCausalLM", dict(
            intermediate_size=96, norm_topk_prob=True, **linear, **common)),
        # the vision-language checkpoint the model ships as: text config nested, a (tiny) vision tower beside
        "qwen3_5_moe": (Qwen3_5MoeConfig, "Qwen3_5MoeForConditionalGeneration", dict(
            text_config=dict(**linear, **common), tie_word_embeddings=False,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=4, spatial_merge_size=1, temporal_patch_size=2, num_position_embeddings=16))),
        # LongRoPE switching scale past 16 tokens; LayerNorm biases, LM-head bias, sparse-mixer routing
        "phimoe": (PhimoeConfig, "PhimoeForCausalLM", dict(
            hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True, sliding_window=None,
            max_position_embeddings=512, rope_parameters=dict(
                rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.1, 1.3, 1.6],
                long_factor=[1.2, 1.5, 2.0, 3.0], short_mscale=1.1, long_mscale=1.3, original_max_position_embeddings=16),
            **common)),
    }


FAMILIES = ("mixtral", "dbrx", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe",
            "qwen3_next", "qwen3_5_moe", "phimoe")
NEW_FAMILIES = FAMILIES[5:]  # issue 14's: each with a quirk the first five lack


def make_checkpoint(family: str, out_dir: Path, *, dtype=torch.float32, seed: int = 0,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Write a tiny `family` checkpoint + tokenizer into out_dir and return it."""
    import transformers
    from transformers.utils import logging as hf_logging

    from core.model.demo import build_tokenizer

    hf_logging.disable_progress_bar()
    cfg_cls, model_cls, kwargs = _configs()[family]
    if "text_config" in kwargs:  # a vision-language checkpoint: the overrides are the text model's
        kwargs, overrides = {**kwargs, "text_config": {**kwargs["text_config"], **overrides}}, {}
    cfg = cfg_cls(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(dtype).eval()
    _perturb_constants(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save = dict(max_shard_size=max_shard_size) if max_shard_size else {}
    model.save_pretrained(str(out_dir), **save)
    build_tokenizer(out_dir, vocab_size=VOCAB)
    return out_dir


def _perturb_constants(model) -> None:
    """Tensors initialised to one constant (biases at 0, norms at 1, e_score_correction_bias at 0) get a
    little noise, so that loading them in the wrong place, or not at all, changes the output."""
    with torch.no_grad():
        for _, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and t.numel() > 1 and bool((t == t.reshape(-1)[0]).all()):
                t.add_(torch.randn_like(t) * 0.05)


def hf_model(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    # eager experts and attention: the plain reference loops (grouped_mm has no float64 kernel)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, experts_implementation="eager",
                                                attn_implementation="eager").eval()


_MODELS: dict[str, object] = {}
_GREEDY: dict[tuple, list[int]] = {}


def reference_greedy(path: Path, ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of `ids` (no EOS stop), computed once per session and reused by
    every parity test (a stop at EOS is this with the tail cut at the first EOS)."""
    key = (str(path), tuple(ids), max_new)
    if key not in _GREEDY:
        model = _MODELS.get(str(path)) or _MODELS.setdefault(str(path), hf_model(path))
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        _GREEDY[key] = out[0, len(ids):].tolist()
    return _GREEDY[key]
