"""Registry of supported MoE families, keyed by the config's `architectures` name."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from core.errors import ModelError, UnsupportedModelError
from core.model.families import dbrx, deepseek, glm4_moe, gpt_oss, mixtral, olmoe, phimoe, qwen3_next, qwen_moe
from core.model.spec import ModelSpec

_MODULES: tuple[ModuleType, ...] = (mixtral, dbrx, qwen_moe, olmoe, gpt_oss, deepseek, glm4_moe, qwen3_next, phimoe)
REGISTRY: dict[str, ModuleType] = {arch: m for m in _MODULES for arch in m.ARCHITECTURES}


def family_module(spec: ModelSpec) -> ModuleType:
    return REGISTRY[spec.architecture]


def spec_from_config(cfg: dict, source: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a parsed config.json, refusing what mlight cannot run faithfully."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelError(f"{source} has no `architectures` field", "use the config.json that came with the checkpoint")
    arch, supported = archs[0], ", ".join(sorted(REGISTRY))
    # Architectures mlight implements itself (as transformers does) run without the repo's code even
    # when the published config names it; for any other, auto_map means "only its own code runs it".
    if cfg.get("auto_map") and not getattr(REGISTRY.get(arch), "NATIVE_DESPITE_AUTO_MAP", False):
        raise UnsupportedModelError(
            f"{source} asks for remote code (auto_map) for {arch}; mlight never runs code from a model repo",
            f"use a checkpoint of a supported architecture: {supported}")
    if arch not in REGISTRY and cfg.get("vision_config"):
        raise UnsupportedModelError(
            f"{arch} is a vision-language model, and mlight runs text-only MoE language models",
            f"supported: {supported} (Qwen3.5-MoE's text model is read from its vision-language checkpoint)")
    if arch not in REGISTRY:
        raise UnsupportedModelError(f"architecture {arch} is not supported", f"supported: {supported}")
    try:
        spec = REGISTRY[arch].spec(cfg)
        if spec.quant_method == "mxfp4" and spec.family == "gpt_oss":  # experts kept 4-bit (families.gpt_oss)
            from core.model.quant.formats import Format, quantized_spec

            spec = quantized_spec(spec, Format("mxfp4"))
        return spec
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ModelError(f"{source} for {arch} is not usable: {e}", "check that it is the checkpoint's own config") from e


def load_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir)
    if not path.exists():
        raise ModelError(f"model folder {path} does not exist", "give a checkpoint folder, a repo id, or omit --model for the demo")
    if not path.is_dir():
        raise ModelError(f"{path} is not a folder", "give the folder holding config.json and the .safetensors files")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{path} has no config.json", "give the folder holding config.json and the .safetensors files")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {cfg_path}: {e}", "the file is damaged; download the model again") from e
    return spec_from_config(cfg, source=str(cfg_path))
