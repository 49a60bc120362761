"""packaging/install.sh run for real under POSIX sh, with fakes for what it talks to: nvidia-smi (the
drivers of tests/test_torch_choice.py) and uv (a script that records what it is asked to do).
install.ps1 cannot run here (no PowerShell): it is checked for the same decisions and listed in
packaging/WINDOWS.md for a real Windows machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_torch_choice import fake_smi_dir

ROOT = Path(__file__).resolve().parent.parent
INSTALL_SH = ROOT / "packaging" / "install.sh"
pytestmark = pytest.mark.skipif(os.name == "nt" or not shutil.which("sh"), reason="POSIX sh")


def fake_uv(tmp_path: Path, torch_backend_flag: bool = True) -> Path:
    """A `uv` that logs its arguments and, on `tool install`, puts a working `mlight` in its bin folder."""
    d = tmp_path / "uvbin"
    d.mkdir(exist_ok=True)
    tools = tmp_path / "tools-bin"
    help_text = "--torch-backend <TORCH_BACKEND>" if torch_backend_flag else "--python <PYTHON>"
    script = d / "uv"
    script.write_text(f"""#!/bin/sh
echo "$*" >> "{tmp_path / 'uv.log'}"
case "$*" in
  --version) echo "uv 0.13.9" ;;
  "tool install --help") echo "{help_text}" ;;
  "tool dir --bin") echo "{tools}" ;;
  "tool update-shell") ;;
  "tool install "*) mkdir -p "{tools}"; printf '#!/bin/sh\\necho "mlight 0.1.0"\\n' > "{tools}/mlight"
                    chmod +x "{tools}/mlight" ;;
  *) echo "fake uv: unexpected $*" >&2; exit 3 ;;
esac
""", encoding="utf-8")
    script.chmod(0o755)
    return d


def run_sh(args, tmp_path, path_dirs=(), stdin=None, script=INSTALL_SH, **env):
    """install.sh under `sh` with a PATH of the fakes, this Python, and the base system tools only."""
    pybin = tmp_path / "pybin"
    if not pybin.exists():
        pybin.mkdir()
        (pybin / "python3").symlink_to(sys.executable)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MLIGHT_", "UV_"))}
    e.update(PATH=os.pathsep.join([str(p) for p in path_dirs] + [str(pybin), "/usr/bin", "/bin"]),
             HOME=str(tmp_path / "home"), MLIGHT_SYSTEM="linux")
    e.update(env)
    argv = ["sh", "-s", "--", *args] if stdin is not None else ["sh", str(script), *args]
    return subprocess.run(argv, env=e, input=stdin, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def uv_calls(tmp_path) -> list[str]:
    log = tmp_path / "uv.log"
    return log.read_text(encoding="utf-8").splitlines() if log.exists() else []


@pytest.mark.parametrize("case, backend", [("rtx4090-570", "cu128"), ("gtx1080-580", "cu126"),
                                           ("broken-no-driver", "cpu"), ("no-devices", "cpu")])
def test_dry_run_prints_what_it_would_install(tmp_path, case, backend):
    r = run_sh(["--dry-run"], tmp_path, [fake_smi_dir(tmp_path, case)])
    assert r.returncode == 0, r.stderr
    assert "would install uv" in r.stdout  # no uv on this PATH
    assert f"would run:     uv tool install --force --python 3.12 --torch-backend {backend} " \
           f"--reinstall-package torch mlight" in r.stdout
    assert "torch: the " in r.stderr  # the chooser's explanation


def test_dry_run_without_any_nvidia_driver(tmp_path):
    r = run_sh(["--dry-run"], tmp_path)
    assert r.returncode == 0 and "--torch-backend cpu" in r.stdout and "no NVIDIA GPU found" in r.stderr


def test_dry_run_never_touches_uv(tmp_path):
    uv = fake_uv(tmp_path)
    r = run_sh(["--dry-run", "--cuda", "12.8"], tmp_path, [uv, fake_smi_dir(tmp_path, "rtx3090-550")])
    assert r.returncode == 0, r.stderr
    assert "would install uv" not in r.stdout and "--torch-backend cu128" in r.stdout
    assert uv_calls(tmp_path) == []
    assert not (tmp_path / "tools-bin").exists()


def test_overrides(tmp_path):
    smi = fake_smi_dir(tmp_path, "rtx4090-570")
    assert "--torch-backend cpu " in run_sh(["--dry-run", "--cpu"], tmp_path, [smi]).stdout
    assert "--torch-backend cu126 " in run_sh(["--dry-run", "--cuda=12.6"], tmp_path, [smi]).stdout
    r = run_sh(["--dry-run", "--python", "3.11", "--from", "/tmp/my wheels/mlight-0.1.0-py3-none-any.whl"],
               tmp_path, [smi])
    assert "--python 3.11 --torch-backend cu128 --reinstall-package torch /tmp/my wheels/mlight-0.1.0" in r.stdout
    bad = run_sh(["--dry-run", "--cuda", "twelve"], tmp_path, [smi])
    assert bad.returncode == 2 and "not a CUDA version" in bad.stderr
    assert run_sh(["--frobnicate"], tmp_path).returncode == 2


def test_macos_takes_the_default_build(tmp_path):
    r = run_sh(["--dry-run"], tmp_path, MLIGHT_SYSTEM="macos")
    assert r.returncode == 0, r.stderr
    assert "--torch-backend" not in r.stdout and "uv tool install --force --python 3.12 --reinstall-package " \
                                                   "torch mlight" in r.stdout


def test_install_runs_uv_puts_mlight_on_path_and_says_how_to_start(tmp_path):
    uv = fake_uv(tmp_path)
    r = run_sh([], tmp_path, [uv, fake_smi_dir(tmp_path, "rtx5090-580")])
    assert r.returncode == 0, r.stdout + r.stderr
    calls = uv_calls(tmp_path)
    assert "tool install --force --python 3.12 --torch-backend cu130 --reinstall-package torch mlight" in calls
    assert "tool update-shell" in calls  # the tools folder was not on PATH
    assert "mlight 0.1.0" in r.stdout  # the installed command ran
    assert "Open a new terminal first" in r.stdout and "mlight-app" in r.stdout


def test_install_refuses_a_uv_too_old_to_choose_torch(tmp_path):
    uv = fake_uv(tmp_path, torch_backend_flag=False)
    r = run_sh([], tmp_path, [uv])
    assert r.returncode == 1 and "uv self update" in r.stderr
    assert not [c for c in uv_calls(tmp_path) if c.startswith("tool install --force")]


@pytest.mark.skipif(not shutil.which("curl"), reason="curl fetches the chooser")
def test_through_a_pipe_it_fetches_the_chooser(tmp_path):
    """`curl ... | sh`: no file beside the script, so torch_choice.py comes from MLIGHT_INSTALL_BASE."""
    r = run_sh(["--dry-run", "--cpu"], tmp_path, [Path(shutil.which("curl")).parent],
               stdin=INSTALL_SH.read_text(encoding="utf-8"),
               MLIGHT_INSTALL_BASE=(ROOT / "packaging").as_uri())
    assert r.returncode == 0, r.stderr
    assert "--torch-backend cpu" in r.stdout


def test_the_powershell_installer_makes_the_same_decisions():
    """Same chooser, same flags, same uv command; ASCII only, since Windows PowerShell 5.1 reads a script
    without a byte-order mark in the ANSI code page."""
    ps = (ROOT / "packaging" / "install.ps1").read_bytes()
    ps.decode("ascii")
    text = ps.decode()
    assert re.search(r"param\(.*\[switch\]\$Cpu.*\[string\]\$Cuda.*\[string\]\$Python.*\[string\]\$From.*"
                     r"\[switch\]\$DryRun", text, re.S)
    for needle in ('"torch_choice.py"', '"--system", "windows"', '"--cpu"', '"--cuda", $Cuda',
                   '@("tool", "install", "--force", "--python", $Python)', '@("--torch-backend", $backend)',
                   '@("--reinstall-package", "torch", $From)', "tool update-shell", "--torch-backend\")",
                   "MLIGHT_INSTALL_BASE"):
        assert needle in text, needle
    assert not re.search(r"^\s*exit\b", text, re.M)  # exit would close the window under `irm | iex`
    sh = INSTALL_SH.read_text(encoding="utf-8")
    assert "--force --python" in sh and "--reinstall-package torch" in sh
