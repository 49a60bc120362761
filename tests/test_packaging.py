"""The wheel carries everything mlight reads at run time, and the code reads nothing from the checkout.

Runtime data lives in `core/assets/` (see its __init__). The top-level `assets/` holds only what a
checkout needs (screen captures, their script, notes). packaging/check_wheel.sh (run by .ci/run) goes
further: a fresh venv, the real wheel, the demo, a plan and the app's smoke test from outside the checkout.
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "core" / "assets"
CHECKOUT_ONLY = {"README.md", "screens"}  # top-level assets/: docs and captures, never read by mlight


def test_runtime_data_is_inside_the_packages():
    stray = sorted(p.name for p in (ROOT / "assets").iterdir() if p.name not in CHECKOUT_ONLY)
    assert not stray, (f"assets/{stray[0]} is outside the packages, so a wheel would not ship it: put runtime "
                       "data (model configs, prompts, MT-Bench) under core/assets/ and read it through core.assets")


def test_only_core_assets_locates_files_by_its_own_path():
    """Code that finds files next to itself is how data gets read from the checkout: one place does it."""
    users = sorted(str(p.relative_to(ROOT)) for d in ("core", "app") for p in (ROOT / d).rglob("*.py")
                   if "__file__" in p.read_text(encoding="utf-8"))
    assert users == [os.path.join("core", "assets", "__init__.py")], (
        "read runtime files through core.assets (data in core/assets/ ships in the wheel); a file that must sit "
        "beside its module needs a package-data pattern in pyproject.toml and a place in this test")


def test_every_bundled_preset_is_a_config_folder():
    for d in (ASSETS / "configs").iterdir():
        assert d.is_dir() and (d / "config.json").is_file(), f"{d}: a preset is a folder holding config.json"
        json.loads((d / "config.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (so the checkout gets no build/ or egg-info)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "NOTICE", "MANIFEST.in"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("core", "app"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return next(out.glob("mlight-*.whl"))


def test_the_wheel_ships_all_runtime_data_and_the_licences(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = [p for p in ASSETS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    data += list((ROOT / "app").rglob("*.tcss"))
    missing = [str(p.relative_to(ROOT)).replace(os.sep, "/") for p in data]
    missing = [n for n in missing if n not in names]
    assert not missing, f"not in the wheel (add them to package-data in pyproject.toml): {missing}"
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert {f"{info}/licenses/LICENSE", f"{info}/licenses/NOTICE"} <= names
    assert not [n for n in names if n.split("/")[0] not in ("core", "app", info)]


def test_the_wheel_metadata(wheel):
    import core

    z = zipfile.ZipFile(wheel)
    info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = email.message_from_bytes(z.read(info))
    assert meta["Version"] == core.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert {u.split(",")[0] for u in meta.get_all("Project-URL")} >= {"Homepage", "Repository", "Issues", "Changelog"}
    assert "Operating System :: Microsoft :: Windows" in meta.get_all("Classifier")
    scripts = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert "mlight = app.cli:main" in scripts and "mlight-app = app.tui.main:main" in scripts


def test_the_unpacked_wheel_runs_from_another_folder(wheel, tmp_path):
    """What reads files at run time, imported from the wheel's contents, with the checkout out of reach."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    presets = sorted(p.name for p in (ASSETS / "configs").iterdir())
    code = f"""
import json, sys
from pathlib import Path
import core, app
assert Path(core.__file__).is_relative_to({str(site)!r}), core.__file__
from core.plan import presets
assert presets.preset_names() == {presets!r}, presets.preset_names()
for name in presets.preset_names():
    assert presets.resolve_spec(name).num_layers > 0
from core.io import workloads
from core.io.prompts import read_prompts
from core.model import demo
assert len(workloads.first_turns()) == 80
assert len(demo.training_text()) > 80
assert len(read_prompts("demo").entries) == 16
from app.tui.app import MlightApp
assert (Path(sys.modules[MlightApp.__module__].__file__).parent / MlightApp.CSS_PATH).is_file()
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_ci_runs_the_installed_wheel_check():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "packaging/check_wheel.sh" in ci


def test_version_names_mlight_python_and_torch(capsys):
    import core
    from app.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"mlight {core.__version__}"
    assert lines[1].startswith("python ") and lines[2].startswith("torch ")
    assert "CPU-only build" in lines[2] or "CUDA" in lines[2]


def test_demo_prompts_by_name_unless_a_file_has_that_name(tmp_path, monkeypatch):
    from core.io.prompts import read_prompts

    monkeypatch.chdir(tmp_path)
    ps = read_prompts("demo")
    assert len(ps.entries) == 16 and Path(ps.source).name == "demo_prompts.jsonl"
    (tmp_path / "demo").write_text("my own prompt\n", encoding="utf-8")
    ps = read_prompts("demo", fmt="txt")
    assert [e.prompt for e in ps.entries] == ["my own prompt"]


def test_version_says_when_a_cpu_only_torch_leaves_an_nvidia_gpu_idle(monkeypatch):
    import pynvml
    import torch

    from app.cli import version_report

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: "NVIDIA GeForce RTX 4070")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: types.SimpleNamespace(total=12 << 30, free=11 << 30))
    note = version_report().splitlines()[-1]
    assert note.startswith("note: this machine has an NVIDIA GeForce RTX 4070") and "--torch-backend auto" in note

    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert not version_report().splitlines()[-1].startswith("note:")


# the whole cross for `mlight`: --version (its own action, which imports torch) and --help (argparse's),
# each buffered (the pipe breaks at the flush on the way out) and not (at the first write); `mlight-app`
# wraps its main in the same function, so one case shows that it does
@pytest.mark.parametrize("module,unbuffered,args", [
    *(("app.cli", unbuffered, args) for unbuffered in (False, True) for args in (["--version"], ["--help"])),
    ("app.tui.main", False, ["--version"])], ids=lambda v: v[0] if isinstance(v, list) else str(v))
def test_a_reader_that_stops_early_is_not_an_error(module, unbuffered, args):
    """`mlight --version | head -1` under `set -o pipefail`: head closes the pipe after one line. CI once
    failed on that race (BrokenPipeError, exit 1, a traceback). Here the reader closes before a byte is
    written, so the write always meets a closed pipe, buffered or not."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], stdout=w, stderr=subprocess.PIPE,
                              env=env, timeout=120)
    finally:
        os.close(w)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0 and "Traceback" not in err and "BrokenPipe" not in err, (proc.returncode, err)
