"""Loading quirks of the new families: what is refused with a clear message, what is skipped on purpose."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from core.errors import ModelError, UnsupportedModelError
from core.model.families import load_spec, spec_from_config
from core.model.weights import load_weights
from core.plan.presets import preset_config
from core.telemetry import WarningEvent


def _copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_quantized_checkpoints_mlight_cannot_read_are_refused_with_what_to_do(checkpoint_factory, tmp_path):
    """gpt-oss MXFP4 loads (tests/test_quant_mxfp4.py); other quantizations are refused, and a config that says
    MXFP4 over bf16 experts is named for the tensor it lacks."""
    path = _copy(checkpoint_factory("gpt_oss"), tmp_path / "oss", quantization_config={"quant_method": "fp8"})
    spec = load_spec(path)  # planning still works: the spec is read
    assert spec.quant_method == "fp8"
    with pytest.raises(UnsupportedModelError, match=r"quantized \(fp8\).*bf16"):
        load_weights(path, spec)
    from checkpoints import make_checkpoint

    path = _copy(make_checkpoint("gpt_oss", tmp_path / "oss64", intermediate_size=64), tmp_path / "oss4",
                 quantization_config={"quant_method": "mxfp4"})  # MXFP4 blocks are 32 wide
    with pytest.raises(ModelError, match="gate_up_proj_blocks"):
        load_weights(path, load_spec(path))


def test_glm_mtp_layer_in_the_checkpoint_is_not_read(checkpoint_factory, tmp_path):
    src = checkpoint_factory("glm4_moe")
    path = _copy(src, tmp_path / "glm")
    L = load_spec(path).num_layers
    # the NextN layer ships as layer L (one past the decoder), with its own norms and projections
    extra = {f"model.layers.{L}.eh_proj.weight": torch.randn(64, 128), f"model.layers.{L}.enorm.weight": torch.ones(64),
             f"model.layers.{L}.mlp.gate.weight": torch.randn(8, 64)}
    save_file(extra, str(path / "model-mtp.safetensors"))
    a, b = load_weights(src, load_spec(src)), load_weights(path, load_spec(path))
    assert all(torch.equal(x[n], y[n]) for x, y in zip(a.layers, b.layers) for n in x.tensors)


def test_qwen35_vision_tower_is_left_unread_and_said_so(checkpoint_factory):
    path = checkpoint_factory("qwen3_5_moe")
    events = []
    w = load_weights(path, load_spec(path), progress=events.append)
    notes = [e.message for e in events if isinstance(e, WarningEvent)]
    assert any("vision tower is not loaded" in n for n in notes)
    assert w.spec.family == "qwen3_5_moe" and w.spec.num_layers == 4


def test_other_vision_language_models_are_refused_politely():
    cfg = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "vision_config": {"depth": 27},
           "text_config": {"hidden_size": 2048}}
    with pytest.raises(UnsupportedModelError, match="vision-language model.*text-only"):
        spec_from_config(cfg)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "phi-3.5-moe"])
def test_published_configs_naming_remote_code_run_natively(name):
    cfg = preset_config(name)
    assert cfg.get("auto_map")  # as published
    assert spec_from_config(cfg).num_layers > 0


def test_cpu_calibration_times_decode_over_any_layer_kind(checkpoint_factory):
    """`mlight bench --calibrate` times the engine's own steps: a linear-attention layer's fixed-size state too,
    not only K/V."""
    from core.runtime import calibrate
    from core.runtime.engine import Engine

    engine = Engine.load(checkpoint_factory("qwen3_next"), device="cpu")
    steps = calibrate.run_steps(engine, ["a b c d e f", "g h i"], batch=2, micro_batch=1, gen=2)
    assert [s.kind for s in steps].count("decode") == 1 and all(s.tasks for s in steps)
