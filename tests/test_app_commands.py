"""The `mlight` command line as a newcomer meets it (issue 12's defects 18 and 22).

- `mlight --help` and `mlight COMMAND --help` import nothing heavy (2.4 s before: torch was imported
  to list the commands), and every option says what it does and what its default is.
- Rerunning the exact command of a run that finished has nothing to do: exit 0, say so, write nothing;
  a changed job, or an output changed since, is still refused.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import COMMANDS, main as mlight
from test_app_support import write_prompts

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "numpy", "huggingface_hub", "pulp", "textual", "safetensors")


def test_help_imports_nothing_heavy():
    """In a fresh interpreter, as the `mlight` script runs: help is quick because nothing heavy loads
    (one interpreter for every command's help; each is checked as it goes)."""
    helps = [["--help"], *[[name, "--help"] for name in COMMANDS]]
    code = ("import sys, contextlib, io\n"
            "from app.cli import main\n"
            f"for argv in {helps!r}:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "    assert 'usage: mlight' in out.getvalue(), out.getvalue()\n"
            f"    heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
            "    assert not heavy, f\"`mlight {' '.join(argv)}` imported {heavy}\"\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_top_level_help_lists_every_command_with_what_it_does(capsys):
    with pytest.raises(SystemExit):
        mlight(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    for name, (_, line) in COMMANDS.items():
        assert name in out and line in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_says_what_it_does_and_its_default(name):
    parser = importlib.import_module(COMMANDS[name][0]).add_parser(argparse.ArgumentParser().add_subparsers())
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help, f"mlight {name} {flag} has no help text"
        if action.default not in (None, False, 0, argparse.SUPPRESS):
            assert "default" in action.help.lower(), f"mlight {name} {flag}: the default {action.default!r} is not shown"


def test_every_command_says_what_it_is_and_names_its_values_alike():
    """`mlight CMD --help` opens with what the command does; a flag that takes a number shows a short
    name for it (not argparse's PROMPT_LEN), the same one in every command that has the flag."""
    names: dict[str, set[str]] = {}
    for name, (module, _) in COMMANDS.items():
        parser = importlib.import_module(module).add_parser(argparse.ArgumentParser().add_subparsers())
        assert parser.description, f"`mlight {name} --help` does not say what the command does"
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.choices or action.type is None:
                continue
            flag = action.option_strings[0]
            assert action.metavar, f"mlight {name} {flag} shows argparse's {flag[2:].upper().replace('-', '_')}"
            names.setdefault(flag, set()).add(action.metavar)
    assert {flag: m for flag, m in names.items() if len(m) > 1} == {}


def _run(*argv) -> tuple[int, str]:
    import io

    err = io.StringIO()
    old, sys.stderr = sys.stderr, err
    try:
        code = mlight(["run", *argv])
    finally:
        sys.stderr = old
    return code, err.getvalue()


def test_rerunning_a_finished_run_on_ray_says_it_is_done_and_writes_nothing(tmp_path, demo_model, monkeypatch):
    """`mlight run --ray` shared run.py's run-file sequence but not its "already finished" check: a rerun of
    a finished job (whose run file is gone) connected to the cluster and ran every prompt again."""
    import app.commands.run_ray as run_ray

    prompts = write_prompts(tmp_path / "p.jsonl", n=2, max_new_tokens=2)
    out = tmp_path / "out.jsonl"
    args = ["--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "2"]
    code, err = _run(*args)
    assert code == 0, err
    written, stat = out.read_bytes(), out.stat()
    files = sorted(p.name for p in tmp_path.iterdir())

    class NoCluster:  # Ray itself is not needed: a finished job must not reach for the cluster at all
        def __getattr__(self, name):
            raise AssertionError(f"a finished run used ray.{name}")

    monkeypatch.setattr(run_ray, "_ray", NoCluster)
    code, err = _run(*args, "--ray", "auto")
    assert code == 0, err
    assert "all 2 requests are already done" in err and str(out) in err and "generated on Ray" not in err
    assert out.read_bytes() == written and out.stat().st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_rerunning_a_finished_run_says_it_is_done_and_writes_nothing(tmp_path, demo_model):
    prompts = write_prompts(tmp_path / "p.jsonl", n=2, max_new_tokens=2)
    out = tmp_path / "out.jsonl"
    args = ["--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "2"]
    code, err = _run(*args)
    assert code == 0, err
    written, stat = out.read_bytes(), out.stat()
    files = sorted(p.name for p in tmp_path.iterdir())

    code, err = _run(*args)  # a retry loop or a scheduler runs the same job again
    assert code == 0, err
    assert "all 2 requests are already done" in err and str(out) in err
    assert out.read_bytes() == written and out.stat().st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # nothing written, nothing left behind

    code, err = _run(*args[:-1], "3")  # another job on the same output is still refused
    assert code == 2 and "already exists" in err
    out.write_bytes(written + b'{"id": "edited by hand"}\n')  # the output changed since: refused too
    code, err = _run(*args)
    assert code == 2 and "already exists" in err
    out.write_bytes(written)
    code, err = _run(*args, "--restart")  # and --restart still runs it again
    assert code == 0 and "already done" not in err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["mtbench-81", "mtbench-82"]
    code, err = _run(*args)  # and the job it finished is known as done in turn
    assert code == 0 and "all 2 requests are already done" in err
