"""Every bad input to `mlight run`: one line saying what is wrong and what to do, exit 2 (input) or 1
(runtime), and nothing left behind in the output folder (a run file with finished results is kept on
purpose: it is what a rerun resumes from)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from app.cli import main
from core.io.runstore import RunStore

DATA = Path(__file__).parent / "data" / "io"
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture
def outdir(tmp_path) -> Path:
    d = tmp_path / "out dir ✓"
    d.mkdir()
    return d


@pytest.fixture
def prompts(tmp_path) -> Path:
    p = tmp_path / "prompts.txt"
    p.write_text("hello\nworld\nthird prompt\n", encoding="utf-8")
    return p


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["run", *args])
    err = capsys.readouterr().err
    return code, err


def assert_one_line(err: str, code: int, expected_code: int, *fragments: str) -> None:
    # informational lines may come first (the plan, once this machine has runs on record); the error is one line
    lines = [x for x in err.strip().splitlines() if not x.startswith("mlight run: planned ")]
    assert code == expected_code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("mlight run: error: ")
    assert " — " in lines[0], "a hint says what to do"
    for f in fragments:
        assert f in lines[0], err


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture
def broken_model(tmp_path, demo_model):
    """A copy of the demo model to damage."""

    def make(name: str = "model copy") -> Path:
        d = tmp_path / name
        shutil.copytree(demo_model, d)
        return d

    return make


def _config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


# ---- the model ---------------------------------------------------------------------------------


def _damage_truncate(d):
    p = d / "model.safetensors"
    os.truncate(p, p.stat().st_size // 2)


def _damage_header(d):
    with open(d / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 64)


def _damage_index(d):
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    wm = {n: "model.safetensors" for n in names}
    wm[names[-1]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def _damage_tokenizer(d):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()


MODEL_CASES = {
    "unsupported architecture": (lambda d: _config(d, architectures=["LlamaForCausalLM"]),
                                 ["architecture LlamaForCausalLM is not supported"]),
    "remote code": (lambda d: _config(d, auto_map={"AutoModelForCausalLM": "x.Model"}),
                    ["asks for remote code (auto_map)"]),
    "truncated shard": (_damage_truncate, ["model.safetensors is truncated", "download the model again"]),
    "corrupt shard": (_damage_header, ["model.safetensors has a corrupt header"]),
    "shard missing from the index": (_damage_index, [("shard model-00002-of-00002.safetensors listed in "
                                                      "model.safetensors.index.json is missing")]),
    "tokenizer missing": (_damage_tokenizer, ["has no tokenizer files"]),
    "config not JSON": (lambda d: (d / "config.json").write_text("{oops"), ["cannot read", "config.json"]),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_broken_model(case, broken_model, prompts, outdir, capsys):
    damage, fragments = MODEL_CASES[case]
    d = broken_model()
    damage(d)
    code, err = run_cli(capsys, "--model", str(d), "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"),
                        "--max-new-tokens", "2")
    assert_one_line(err, code, 2, *fragments)
    assert files(outdir) == []


def test_model_folder_missing_or_not_a_model(prompts, outdir, tmp_path, capsys):
    out = str(outdir / "o.jsonl")
    for model, fragment in ((str(tmp_path / "no such model"), "does not exist"),
                            ("not-a-folder", "model folder not-a-folder does not exist"),
                            (str(prompts), "is a file, not a model folder"),
                            (str(tmp_path), "has no config.json")):
        code, err = run_cli(capsys, "--model", model, "--prompts", str(prompts), "--out", out)
        assert_one_line(err, code, 2, fragment)
    assert files(outdir) == []


@pytest.mark.skipif(IS_ROOT or os.name == "nt", reason="root reads everything; POSIX permissions")
def test_unreadable_model_folder(broken_model, prompts, outdir, capsys):
    d = broken_model()
    d.chmod(0)
    try:
        code, err = run_cli(capsys, "--model", str(d), "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"))
    finally:
        d.chmod(0o755)
    assert_one_line(err, code, 2, "permission denied")


def test_executor_not_available(prompts, outdir, capsys, demo_model):
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"), "--executor", "cuda")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "cuda" in err
    assert files(outdir) == []


def test_budget_nothing_fits(prompts, outdir, capsys, demo_model):
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"), "--cpu-mem", "0.001",
                        "--gpu-mem", "0")
    assert_one_line(err, code, 2, "nothing fits in the memory budget", "raise --gpu-mem / --cpu-mem")
    assert files(outdir) == []


# ---- the prompts file --------------------------------------------------------------------------


PROMPT_CASES = {
    "missing": ("nope.txt", "prompts file", 2),
    "folder": (".", "is a folder, not a prompts file", 2),
    "empty": ("empty.txt", "has no prompts", 2),
    "blank only": ("blank_lines.txt", "has no prompts", 2),
    "binary": ("binary.txt", "looks like a binary file (a NUL byte at byte offset 8)", 2),
    "not UTF-8": ("latin1.txt", "is not UTF-8: byte 0xe9 at byte offset 14 (line 2)", 2),
    "UTF-16": ("utf16.txt", "is UTF-16 text, not UTF-8", 2),
    "no prompt column": ("no_prompt_column.csv", "has no `prompt` column (its columns: id, text)", 2),
}


@pytest.mark.parametrize("case", list(PROMPT_CASES))
def test_bad_prompts_file(case, outdir, capsys):
    name, fragment, want = PROMPT_CASES[case]
    code, err = run_cli(capsys, "--prompts", str(DATA / name), "--out", str(outdir / "o.jsonl"))
    assert_one_line(err, code, want, fragment)
    assert files(outdir) == []


@pytest.mark.skipif(IS_ROOT or os.name == "nt", reason="root reads everything; POSIX permissions")
def test_unreadable_prompts_file(prompts, outdir, capsys):
    prompts.chmod(0)
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"))
    assert_one_line(err, code, 2, "permission denied")


def test_unreadable_prompts_and_model_emulated(prompts, broken_model, outdir, capsys, monkeypatch):
    """Permission denied on the prompts file and the model folder (emulated: the tests may run as root)."""
    real_read, real_access = Path.read_bytes, os.access
    model = broken_model()

    def read_bytes(self):
        if self == prompts:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"))
    assert_one_line(err, code, 2, "cannot read prompts file", "permission denied")
    monkeypatch.undo()
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == model else real_access(p, mode, **kw))
    code, err = run_cli(capsys, "--model", str(model), "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"))
    assert_one_line(err, code, 2, "cannot read model folder", "permission denied")
    assert files(outdir) == []


def test_bad_json_lines_listed_then_one_error(outdir, capsys):
    code, err = run_cli(capsys, "--prompts", str(DATA / "bad.jsonl"), "--out", str(outdir / "o.jsonl"))
    lines = err.strip().splitlines()
    assert code == 2
    assert lines[0].startswith(f"{DATA / 'bad.jsonl'}:2: bad JSON: ")
    assert any(x.endswith(":9: duplicate id 'd' (first used on line 8)") for x in lines)
    assert lines[-1] == ("mlight run: error: 8 bad lines in " + str(DATA / "bad.jsonl") + ", nothing was run — fix "
                         "them, or pass --skip-bad to run the rest (rejects go to o.jsonl.rejected.jsonl)")
    assert files(outdir) == []


def test_skip_bad_writes_rejects_with_reasons(outdir, capsys, demo_model):
    out = outdir / "o.jsonl"
    code, err = run_cli(capsys, "--prompts", str(DATA / "bad.jsonl"), "--out", str(out), "--skip-bad",
                        "--max-new-tokens", "2")
    assert code == 0, err
    assert [json.loads(x)["prompt"] for x in out.read_text().splitlines()] == ["fine", "dup 1"]
    rejects = [json.loads(x) for x in (outdir / "o.jsonl.rejected.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejects] == [2, 4, 5, 6, 7, 9, 10, 11]
    assert rejects[0]["input"] == '{"prompt": "missing brace"' and rejects[0]["reason"].startswith("bad JSON")
    assert files(outdir) == ["o.jsonl", "o.jsonl.rejected.jsonl"]
    assert f"mlight run: 2 results in {out}, 8 rejected → o.jsonl.rejected.jsonl (this run: 2 generated, " in err


def test_the_rule_for_bad_lines_is_cores_and_the_cli_says_it(outdir, tmp_path, capsys):
    """One malformed line: nothing runs, exit 2, in the words of core's rule (which the app follows too,
    naming the same rejects file)."""
    from core.io.prompts import bad_lines_error, read_prompts

    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": \n{"prompt": "b"}\n', encoding="utf-8")
    code, err = run_cli(capsys, "--prompts", str(src), "--out", str(outdir / "o.jsonl"))
    rule = bad_lines_error(read_prompts(src), "o.jsonl.rejected.jsonl")
    assert code == 2 and files(outdir) == []
    assert err.splitlines() == [f"{src}:2: bad JSON: Expecting value at column 12", f"mlight run: error: {rule}"]
    assert str(rule) == (f"1 bad line in {src}, nothing was run — fix it, or pass --skip-bad to run the rest "
                         "(rejects go to o.jsonl.rejected.jsonl)")
    assert bad_lines_error(read_prompts("ok.jsonl", data=b'{"prompt": "a"}\n'), "x") is None


def test_prompt_longer_than_context_is_a_reject(outdir, tmp_path, capsys, demo_model):
    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps({"id": "short", "prompt": "hi"}) + "\n"
                 + json.dumps({"id": "long", "prompt": "word " * 3000}) + "\n")
    out = outdir / "o.jsonl"
    code, err = run_cli(capsys, "--prompts", str(p), "--out", str(out), "--max-new-tokens", "2")
    assert code == 2 and ":2: prompt is " in err and "the model's context is 2048 tokens" in err
    assert files(outdir) == []
    code, err = run_cli(capsys, "--prompts", str(p), "--out", str(out), "--max-new-tokens", "2", "--skip-bad")
    assert code == 0, err
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["short"]
    (rej,) = [json.loads(x) for x in (outdir / "o.jsonl.rejected.jsonl").read_text().splitlines()]
    assert rej["id"] == "long" and "tokens (after the chat template)" in rej["reason"]


# ---- the output --------------------------------------------------------------------------------


def test_output_not_writable(prompts, outdir, capsys):
    blocker = outdir / "a file"
    blocker.write_text("x")
    (outdir / "results.jsonl").mkdir()
    cases = ((outdir / "missing" / "o.jsonl", "output folder", "does not exist"),
             (blocker / "o.jsonl", "is not a folder", "choose another --out"),
             (outdir / "results.jsonl", "is a folder", "give a file name"),
             (outdir / "o.txt", "cannot tell the output format", "end --out with .jsonl or .csv"))
    for out, *fragments in cases:
        code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(out))
        assert_one_line(err, code, 2, *fragments)
    assert files(outdir) == ["a file", "results.jsonl"]


def test_output_folder_without_write_permission(prompts, outdir, capsys, monkeypatch):
    """What a read-only folder gives (emulated: root may write anywhere, Windows has no mode bits)."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == outdir else real(p, mode, **kw))
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"))
    assert_one_line(err, code, 2, "cannot write to", "permission denied", "choose another --out")
    assert files(outdir) == []


@pytest.mark.skipif(IS_ROOT or os.name == "nt", reason="root writes everywhere; POSIX permissions")
def test_output_folder_read_only(prompts, outdir, capsys):
    outdir.chmod(0o555)
    try:
        code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"))
    finally:
        outdir.chmod(0o755)
    assert_one_line(err, code, 2, "permission denied")


def test_output_is_the_prompts_file(outdir, capsys):
    p = outdir / "prompts.jsonl"
    p.write_text('{"prompt": "hi"}\n')
    code, err = run_cli(capsys, "--prompts", str(p), "--out", str(p))
    assert_one_line(err, code, 2, "is the prompts file itself")
    assert files(outdir) == ["prompts.jsonl"] and p.read_text() == '{"prompt": "hi"}\n'


def test_two_runs_on_the_same_output(prompts, outdir, capsys):
    out = outdir / "o.jsonl"
    with RunStore(out):  # another run holds the output
        code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(out))
    assert_one_line(err, code, 2, "another mlight run is writing", "o.jsonl.lock")  # the user chose --out
    assert files(outdir) == []


def test_existing_output_and_changed_prompts(prompts, outdir, capsys, demo_model):
    out = outdir / "o.jsonl"
    out.write_text("keep me\n")
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(out))
    assert_one_line(err, code, 2, "already exists", "--restart")
    assert out.read_text() == "keep me\n"


def _full_after(n_ok: int):
    """An open() result whose writes fail with ENOSPC after n_ok successful ones."""

    class Full:
        def __init__(self, f):
            self.f, self.left = f, n_ok

        def write(self, b):
            if self.left <= 0:
                self.f.write(b[: len(b) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= 1
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    return Full


def test_disk_full_while_saving_results(prompts, outdir, capsys, monkeypatch, demo_model):
    out = outdir / "o.jsonl"
    real_open = RunStore._open_append

    def open_full(self):
        real_open(self)
        self._file = _full_after(1)(self._file)

    monkeypatch.setattr(RunStore, "_open_append", open_full)
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "2", "--batch", "1")
    assert_one_line(err, code, 1, "disk full while writing", "o.jsonl.run.jsonl", "(1 finished result kept)",
                    "free some disk space and rerun the same command to finish")
    assert files(outdir) == ["o.jsonl.run.jsonl"]  # the finished result, for the rerun; no output, no torn line
    run_file = (outdir / "o.jsonl.run.jsonl").read_text()
    assert run_file.endswith("\n") and len(run_file.splitlines()) == 2
    monkeypatch.undo()
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "2", "--batch", "1")
    assert code == 0 and "resuming: 1 of 3 requests already done" in err
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["1", "2", "3"]
    assert files(outdir) == ["o.jsonl"]


def test_disk_full_while_writing_the_final_file(prompts, outdir, capsys, monkeypatch, demo_model):
    import core.io.results

    def full(f, records):
        f.write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    out = outdir / "o.csv"
    monkeypatch.setitem(core.io.results.WRITERS, "csv", full)
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "2")
    assert_one_line(err, code, 1, "disk full while writing", "(3 finished results kept in o.csv.run.jsonl)")
    assert files(outdir) == ["o.csv.run.jsonl"]  # no partial o.csv, no temp file
    monkeypatch.undo()
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "2")
    assert code == 0 and "resuming: 3 of 3" in err and files(outdir) == ["o.csv"]


def test_bad_flags(prompts, outdir, capsys):
    code, err = run_cli(capsys, "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"), "--batch", "2",
                        "--micro-batch", "4")
    assert_one_line(err, code, 2, "--micro-batch 4 is larger than --batch 2")
    for flag, value, says in (("--max-new-tokens", "0", "must be at least 1, got 0"),
                              ("--temperature", "-1", "must be 0 or more, got -1"),
                              ("--top-p", "2", "must be in (0, 1], got 2"),
                              ("--batch", "0", "must be at least 1, got 0"),
                              ("--batch", "x", "expected a whole number, got 'x'"),
                              ("--gpu-mem", "-3", "must be 0 or more GB, got -3 GB"),
                              ("--cpu-mem", "0", "must be more than 0 GB, got 0 GB")):
        with pytest.raises(SystemExit) as e:
            main(["run", "--prompts", str(prompts), "--out", str(outdir / "o.jsonl"), flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "usage" not in err, err  # one line, no usage first
        assert err == f"mlight run: error: argument {flag}: {says} — `mlight run --help` lists the options\n"
    assert files(outdir) == []


def test_a_negative_budget_is_said_back_in_gb_on_every_path():
    """`mlight plan` and the app hand the GB figures to the planner's budget: it answers in GB too."""
    from core.errors import UsageError
    from core.plan.hardware import resolve
    from core.plan.planner import Budget

    with pytest.raises(UsageError, match=r"^--gpu-mem must be 0 or more GB, got -3 — ") as e:
        Budget.for_hardware(resolve("t4"), -3, None)
    assert "bytes" not in str(e.value)
    with pytest.raises(UsageError, match=r"^--cpu-mem must be more than 0 GB, got -0.5 — "):
        Budget.for_hardware(resolve("t4"), 8, -0.5)
    assert Budget.for_hardware(resolve("t4"), 0, 2).gpu_bytes == 0  # no GPU memory: a CPU-only plan


def test_messages_without_a_chat_template_are_rejects(broken_model, outdir, tmp_path, capsys):
    model = broken_model()
    (model / "chat_template.jinja").unlink()
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    p = tmp_path / "chat.jsonl"
    p.write_text('{"prompt": "plain"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    out = outdir / "o.jsonl"
    code, err = run_cli(capsys, "--model", str(model), "--prompts", str(p), "--out", str(out))
    assert code == 2 and f"{p}:2: request '2' has `messages` but the model's tokenizer has no chat template" in err
    assert files(outdir) == []
    code, err = run_cli(capsys, "--model", str(model), "--prompts", str(p), "--out", str(out), "--skip-bad",
                        "--max-new-tokens", "2")
    assert code == 0, err
    assert files(outdir) == ["o.jsonl", "o.jsonl.rejected.jsonl"]
