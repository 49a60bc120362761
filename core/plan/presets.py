"""Model descriptions without weights for `--model` (`resolve_spec`): reads config files only, never downloads,
never loads weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.assets import CONFIGS
from core.assets import config_presets as preset_names
from core.errors import ModelError
from core.model.families import load_spec, spec_from_config
from core.model.spec import ModelSpec


def preset_config(name: str) -> dict:
    path = CONFIGS / name.lower() / "config.json"  # one folder per preset
    if not path.is_file():
        raise ModelError(f"no bundled model preset {name!r}", f"presets: {', '.join(preset_names())}")
    return json.loads(path.read_text(encoding="utf-8"))


def preset_spec(name: str) -> ModelSpec:
    return spec_from_config(preset_config(name), source=f"preset {name}")


def resolve_spec(model: str) -> ModelSpec:
    """ModelSpec for a folder (or GGUF file), a bundled preset name, or a repo id cached locally — in that order."""
    path = Path(model).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        from core.model.gguf.load import load_spec as gguf_spec, open_gguf
        from core.model.gguf.files import find_gguf

        if find_gguf(path) is not None:  # a .gguf file or a folder holding one: sized by its own tensor types
            return gguf_spec(open_gguf(path))
    if path.is_dir():
        return load_spec(path)
    if model.lower() in preset_names():
        return preset_spec(model.lower())
    if "/" in model:
        from huggingface_hub import try_to_load_from_cache

        try:  # the config.json of the repo if the local Hugging Face cache holds it; never goes online
            cfg = try_to_load_from_cache(model, "config.json")
        except Exception:  # an invalid repo id is simply not in the cache
            cfg = None
        if isinstance(cfg, str):
            cfg = Path(cfg)
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ModelError(f"cannot read cached {cfg}: {e}", f"run `mlight download {model}` again") from e
            return spec_from_config(data, source=str(cfg))
    raise ModelError(
        f"{model!r} is not a checkpoint folder, a bundled preset, or a repo id in the local Hugging Face cache",
        f"presets: {', '.join(preset_names())}; or `mlight download {model}` first",
    )
