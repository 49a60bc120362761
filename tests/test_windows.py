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


# ---- text encodings: Windows' default is the ANSI code page, not UTF-8 ---------------------------

def _implicit_encodings(path: Path) -> list[str]:
    """Calls in `path` that would read or write text in the locale's encoding."""
    import ast

    found = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(n, ast.Call):
            continue
        kws = {k.arg for k in n.keywords}
        if "encoding" in kws:
            continue
        f = n.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        owner = getattr(f.value, "id", None) if isinstance(f, ast.Attribute) else None
        if name in ("read_text", "write_text", "TextIOWrapper"):
            found.append(f"{path.name}:{n.lineno} {name}")
        elif name == "open" and owner not in ("os", "self"):
            args = n.args[1:] if isinstance(f, ast.Name) else n.args  # open(path, mode) / path.open(mode)
            mode = args[0] if args else next((k.value for k in n.keywords if k.arg == "mode"), None)
            if not (isinstance(mode, ast.Constant) and "b" in str(mode.value)):
                found.append(f"{path.name}:{n.lineno} open")
        elif name in ("run", "check_output", "Popen") and kws & {"text", "universal_newlines"}:
            found.append(f"{path.name}:{n.lineno} {name}(text=True)")
    return found


def test_text_is_never_read_or_written_in_the_locale_encoding():
    found = [x for d in ("core", "app") for p in sorted((ROOT / d).rglob("*.py")) for x in _implicit_encodings(p)]
    assert not found, "pass encoding='utf-8' (Windows would use cp1252): " + ", ".join(found)


def test_the_encoding_check_catches_a_plain_open(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("open('a.txt')\nopen('b', 'rb')\nPath('c').read_text()\np.open('w')\np.open('rb')\n"
                 "subprocess.run(['x'], text=True)\n", encoding="utf-8")
    assert _implicit_encodings(f) == ["x.py:1 open", "x.py:3 read_text", "x.py:4 open", "x.py:6 run(text=True)"]


# ---- paths: drive letters, spaces, non-ASCII, backslashes that are not escapes ------------------

@pytest.mark.parametrize("pasted, path", [
    (r"C:\Users\José\My Prompts\p.jsonl", r"C:\Users\José\My Prompts\p.jsonl"),
    (r'"C:\Users\José\My Prompts\p.jsonl"', r"C:\Users\José\My Prompts\p.jsonl"),  # Windows Terminal
    (r"& 'D:\données\prompts v2.csv'", r"D:\données\prompts v2.csv"),  # PowerShell
    (r"prompts\my file.txt", r"prompts\my file.txt"),  # relative: on POSIX this would be an escape
    (r"prompts\batch\ 1.txt", r"prompts\batch\ 1.txt"),
    (r'"C:\a b.txt" "C:\c d.txt"', r"C:\a b.txt"),  # two files dropped: the first
    (r"\\nas\share\prompts.txt", r"\\nas\share\prompts.txt"),
    ("file:///C:/Users/Jos%C3%A9/p.txt", "C:/Users/José/p.txt"),
])
def test_dropped_paths_on_windows(windows, pasted, path):
    from app.tui.paths import parse_dropped_path

    assert parse_dropped_path(pasted) == path


def test_posix_still_unescapes_backslashes(monkeypatch):
    from app.tui.paths import parse_dropped_path

    monkeypatch.setattr(platform, "SYSTEM", "linux")
    assert parse_dropped_path(r"prompts\ v2/my\ file.txt") == "prompts v2/my file.txt"


# ---- the Hugging Face cache without symlinks (Windows without Developer Mode) --------------------

from test_download import hub, sharded_files  # noqa: E402,F401  (fixtures: a fake Hub on localhost)


def test_hub_cache_without_symlinks_says_so_once_and_downloads_copies(windows, hub, monkeypatch):  # noqa: F811
    import warnings

    from huggingface_hub import file_download

    from core.io.download import download_model
    from core.telemetry import WarningEvent

    def refuse(*a, **k):
        raise OSError(1314, "A required privilege is not held by the client")  # what Windows answers

    monkeypatch.setattr(file_download.os, "symlink", refuse)
    monkeypatch.setattr(file_download, "_are_symlinks_supported_in_dir", {})
    events = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = download_model("org/tiny", progress=events.append)
    notes = [e.message for e in events if isinstance(e, WarningEvent)]
    assert len(notes) == 1 and "Developer Mode" in notes[0] and "plain copies" in notes[0]
    assert not [w for w in caught if "symlink" in str(w.message)], [str(w.message)[:300] for w in caught]
    shards = sorted(path.glob("*.safetensors"))
    assert shards and not any(p.is_symlink() for p in path.iterdir())  # copies, and complete
    from core.model.safetensors_io import Checkpoint

    assert Checkpoint(path).keys()


def test_no_symlink_note_off_windows(monkeypatch):
    from huggingface_hub import file_download

    from core.io.download import _note_symlinks

    monkeypatch.setattr(platform, "SYSTEM", "linux")
    monkeypatch.setattr(file_download, "are_symlinks_supported", lambda *a: pytest.fail("checked off Windows"))
    events = []
    _note_symlinks("org/tiny", None, events.append)
    assert events == []


def test_a_model_folder_past_the_path_limit_says_so(windows):
    from core.errors import ModelError
    from core.io.download import resolve_model

    deep = "C:/models/" + "/".join(["a long folder name"] * 15) + "/Mixtral-8x7B"
    with pytest.raises(ModelError) as e:
        resolve_model(deep)
    assert "past Windows' limit" in str(e.value) and "LongPathsEnabled" in e.value.hint


def test_a_name_too_long_for_the_file_system_is_a_clear_error(monkeypatch):
    from core.errors import ModelError
    from core.io.download import resolve_model

    monkeypatch.setattr(platform, "SYSTEM", "linux")
    with pytest.raises(ModelError) as e:  # was a traceback: Path.exists() raises ENAMETOOLONG
        resolve_model("x" * 300)
    assert "cannot be opened" in str(e.value)


# ---- the terminal app: Ctrl-Break ends it like quitting, not mid-screen ---------------------------

def test_ctrl_break_quits_the_app_cleanly(windows, monkeypatch):
    from app.tui.app import create_app
    from app.tui.main import exit_on_stop_signals
    from test_app_support import sync

    monkeypatch.setattr(signal, "SIGBREAK", signal.SIGUSR1, raising=False)  # stands in for Ctrl-Break
    old = signal.getsignal(signal.SIGUSR1)

    @sync
    async def run():
        app = create_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            exit_on_stop_signals(app)
            assert not app._exit
            os.kill(os.getpid(), signal.SIGUSR1)
            await pilot.pause()
            assert app._exit  # quitting, as Ctrl+Q would: the terminal is restored
        return app

    try:
        app = run()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert app.return_code == 0
