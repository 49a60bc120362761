"""The Windows branches of mlight, run here by switching `core.platform.SYSTEM` to "windows".

What only a real Windows machine can show is listed in packaging/WINDOWS.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core import platform
from core.errors import MlightError
from core.io import results
from core.io.runstore import RunStore

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = {"model": {"source": "m"}, "prompts": {"sha256": "p"}, "settings": {}, "policy": {}}
REC = {"id": "1", "prompt": "p", "output": "o", "output_token_ids": [1], "prompt_tokens": 1, "output_tokens": 1,
       "finish_reason": "length", "seconds": 0.1}


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setattr(platform, "SYSTEM", "windows")
    monkeypatch.setattr(platform, "_sleep", lambda s: None)


class _HeldOpen:
    """os.replace / os.remove while another program has the file open on Windows: PermissionError for
    the first `times` calls on `path`, then the real call."""

    def __init__(self, monkeypatch, name, path, times):
        self.real, self.path, self.left, self.calls = getattr(os, name), str(path), times, 0
        monkeypatch.setattr(os, name, self)

    def __call__(self, *args):
        if str(args[-1]) == self.path:
            self.calls += 1
            if self.left:
                self.left -= 1
                raise PermissionError(13, "The process cannot access the file because it is being used by "
                                          "another process", self.path)
        return self.real(*args)


# ---- stopping: Ctrl-Break, not SIGTERM ---------------------------------------------------------

def test_ctrl_break_stops_a_run_cleanly_on_windows(windows, monkeypatch):
    from app.commands.run import _Stopper

    # SIGBREAK exists only on Windows; SIGUSR1 stands in for it, delivered for real
    monkeypatch.setattr(signal, "SIGBREAK", signal.SIGUSR1, raising=False)
    before_term = signal.getsignal(signal.SIGTERM)
    stopper = _Stopper().install()
    try:
        assert set(stopper.old) == {signal.SIGINT, signal.SIGUSR1}
        assert signal.getsignal(signal.SIGTERM) is before_term  # never delivered on Windows: not ours
        stopper.generating = True
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stopper.requested  # the engine stops after its step; what finished is saved
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-Break stops at once
            os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        stopper.restore()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


# ---- files: no folder fsync; readers hold files open --------------------------------------------

def test_no_folder_fsync_on_windows(windows, monkeypatch, tmp_path):
    real_open = os.open

    def no_folders(path, flags, *a):
        assert not os.path.isdir(path), "Windows cannot open a folder"
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_folders)
    results.write_records(tmp_path / "out.jsonl", [REC])
    assert json.loads((tmp_path / "out.jsonl").read_text(encoding="utf-8"))["id"] == "1"


def test_final_output_waits_for_a_reader_to_close_it(windows, monkeypatch, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n", encoding="utf-8")
    held = _HeldOpen(monkeypatch, "replace", out, 4)
    results.write_records(out, [REC])
    assert held.calls == 5 and json.loads(out.read_text(encoding="utf-8"))["id"] == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]  # no temporary file left


def test_output_held_open_says_so_and_keeps_the_results(windows, monkeypatch, tmp_path):
    monkeypatch.setattr(platform, "SHARING_RETRY_S", 0.05)
    out = tmp_path / "out.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        st.append(REC)
        _HeldOpen(monkeypatch, "replace", out, 10**9)
        with pytest.raises(MlightError) as e:
            st.finish([REC])
    msg = str(e.value)
    assert "open in another program" in msg and "1 finished result kept" in msg and e.value.exit_code == 1
    assert (tmp_path / "out.jsonl.run.jsonl").is_file()  # nothing lost: rerunning finishes it


def test_run_file_removal_waits_for_a_reader(windows, monkeypatch, tmp_path):
    out = tmp_path / "out.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        st.append(REC)
        held = _HeldOpen(monkeypatch, "remove", st.run_path, 3)
        st.finish([REC])
    assert held.calls == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_posix_permission_error_stays_a_usage_error(monkeypatch, tmp_path):
    monkeypatch.setattr(platform, "SYSTEM", "linux")
    e = results.os_error(PermissionError(13, "Permission denied"), tmp_path / "x.jsonl")
    assert e.exit_code == 2 and "permission denied" in str(e)


def test_long_path_error_names_the_windows_limit(windows):
    path = Path("C:/Users/someone/" + "deep/" * 60 + "out.jsonl")
    e = results.os_error(FileNotFoundError(2, "No such file or directory"), path)
    assert "past Windows' limit of 259" in str(e) and "LongPathsEnabled" in e.hint


# ---- console: UTF-8 out of a cp1252 console -----------------------------------------------------

def test_cli_errors_print_on_a_cp1252_redirected_console(tmp_path):
    """`mlight` on Windows with stderr redirected to a file: Python encodes cp1252, and the one-line error
    (with a non-ASCII file name) must still come out, as UTF-8."""
    code = ("import sys; import core.platform as p; p.SYSTEM = 'windows'; from app.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONIOENCODING="cp1252", PYTHONUTF8="0")
    r = subprocess.run([sys.executable, "-c", code, "run", "--prompts", str(tmp_path / "données→.txt"),
                        "--out", str(tmp_path / "out.jsonl")], cwd=tmp_path, env=env, capture_output=True,
                       timeout=120)
    err = r.stderr.decode("utf-8")
    assert r.returncode == 2, err
    assert "données→.txt" in err and "Traceback" not in err
