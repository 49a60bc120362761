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
    from transformers import DbrxConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, initializer_range=0.08, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=3)
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
    }


FAMILIES = ("mixtral", "dbrx", "qwen2_moe", "qwen3_moe", "olmoe")


def make_checkpoint(family: str, out_dir: Path, *, dtype=torch.float32, seed: int = 0,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Write a tiny `family` checkpoint + tokenizer into out_dir and return it."""
    import transformers
    from transformers.utils import logging as hf_logging

    from core.model.demo import build_tokenizer

    hf_logging.disable_progress_bar()
    cfg_cls, model_cls, kwargs = _configs()[family]
    cfg = cfg_cls(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(dtype).eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save = dict(max_shard_size=max_shard_size) if max_shard_size else {}
    model.save_pretrained(str(out_dir), **save)
    build_tokenizer(out_dir, vocab_size=VOCAB)
    return out_dir


def hf_model(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    # eager experts and attention: the plain reference loops (grouped_mm has no float64 kernel)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, experts_implementation="eager",
                                                attn_implementation="eager").eval()
