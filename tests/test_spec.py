"""ModelSpec from config.json: families, sizes against real files, refusals with clear messages."""

from __future__ import annotations

import json

import pytest

from checkpoints import FAMILIES
from core.errors import ModelError, UnsupportedModelError
from core.model.families import family_module, load_spec, spec_from_config
from core.model.kvcache import KVCache
from core.model.safetensors_io import Checkpoint


UNREAD = {"qwen3_5_moe": "model.visual."}  # the vision tower beside the text model


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_sizes_match_the_checkpoint(family, checkpoint_factory):
    path = checkpoint_factory(family)
    spec = load_spec(path)
    assert spec.family == family
    ckpt = Checkpoint(path)
    keys, fam = ckpt.keys(), family_module(spec)
    read = {p.src for p in fam.global_pieces(spec, keys)}
    read |= {p.src for i in range(spec.num_layers) for p in fam.layer_pieces(spec, i, keys)}
    assert all(k.startswith(UNREAD[family]) for k in keys - read) if family in UNREAD else keys == read
    assert spec.total_bytes == sum(ckpt.info(k).end - ckpt.info(k).start for k in read)
    assert spec.total_expert_bytes == spec.moe_layers * spec.num_experts * spec.expert_bytes
    assert spec.nonexpert_bytes + spec.total_expert_bytes == spec.total_bytes
    if all(spec.layer_state(i).kind == "kv" for i in range(spec.num_layers)):
        assert spec.kv_bytes_per_token == spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes
    for tokens in (5, 40):  # what the planner counts per sequence is what the engine's stores hold
        assert KVCache(spec, 3, tokens, spec.torch_dtype).nbytes == 3 * spec.state_bytes(tokens)


def test_family_quirks_are_read_from_config(checkpoint_factory):
    dbrx, qwen2, qwen3, olmoe = (load_spec(checkpoint_factory(f)) for f in ("dbrx", "qwen2_moe", "qwen3_moe", "olmoe"))
    assert dbrx.norm == "layernorm" and dbrx.clip_qkv == 0.5 and dbrx.router_norm == "pnorm"
    assert qwen2.shared_intermediate == 80 and qwen2.shared_gate and qwen2.qkv_bias and qwen2.router_norm == "none"
    assert qwen3.qk_norm == "head" and qwen3.router_norm == "sum" and qwen3.head_dim == 16
    assert olmoe.qk_norm == "full" and olmoe.clip_qkv == 2.0


def test_mixtral_8x7b_sizes():
    cfg = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "num_experts_per_tok": 2, "vocab_size": 32000, "torch_dtype": "bfloat16", "rope_theta": 1e6}
    spec = spec_from_config(cfg)
    assert 46.0e9 < spec.num_params < 47.0e9  # Mixtral 8x7B: 46.7B parameters
    assert 12.5e9 < spec.active_params < 13.1e9  # 12.9B active
    assert spec.expert_bytes == 3 * 4096 * 14336 * 2
    assert spec.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2


@pytest.mark.parametrize("cfg,kind,words", [
    ({"architectures": ["LlamaForCausalLM"]}, UnsupportedModelError, "LlamaForCausalLM is not supported"),
    ({"architectures": ["MixtralForCausalLM"], "auto_map": {"AutoModel": "x.Y"}}, UnsupportedModelError, "remote code"),
    ({"architectures": ["MixtralForCausalLM"], "hidden_size": 64}, ModelError, "num_attention_heads"),
    ({}, ModelError, "architectures"),
])
def test_refusals_name_the_problem(cfg, kind, words):
    with pytest.raises(kind, match=words):
        spec_from_config(cfg)


def test_missing_and_broken_config(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_spec(tmp_path / "nope")
    with pytest.raises(ModelError, match="no config.json"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["JambaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ModelError, match="has no `kv_lora_rank`"):
        load_spec(tmp_path)
