"""`mlight run` end to end on the demo model: every input format, JSONL/CSV/OpenAI Batch output, stdin,
paths with spaces and non-ASCII names, flags passed through to the engine."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from app.cli import main
from core.io.prompts import read_prompts

DATA = Path(__file__).parent / "data" / "io"
FIELDS = ["id", "prompt", "output", "output_token_ids", "prompt_tokens", "output_tokens", "finish_reason", "seconds"]


def run_ok(capsys, *args: str) -> str:
    code = main(["run", *args])
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def out(tmp_path) -> Path:
    d = tmp_path / "résultats 結果"
    d.mkdir()
    return d


def test_txt_to_jsonl_fields_and_order(out, capsys, demo_model):
    err = run_ok(capsys, "--prompts", str(DATA / "prompts.txt"), "--out", str(out / "o.jsonl"), "--max-new-tokens",
                 "5", "--batch", "2", "--micro-batch", "1")
    rows = jsonl(out / "o.jsonl")
    assert [r["id"] for r in rows] == ["1", "3", "5", "6"]
    for r in rows:
        assert list(r) == FIELDS
        assert r["finish_reason"] in ("stop", "length") and r["output_tokens"] == len(r["output_token_ids"]) <= 5
        assert r["finish_reason"] == "stop" or r["output_tokens"] == 5
    assert rows[2]["prompt"] == "مرحبا، كيف حالك؟"
    assert re.fullmatch(rf"mlight run: 4 results in {re.escape(str(out / 'o.jsonl'))} \(this run: 4 generated, "
                        r"\d+ new tokens, [\d.]+ s\)", err.strip()), err
    assert sorted(p.name for p in out.iterdir()) == ["o.jsonl"]


def test_jsonl_messages_and_per_request_fields(out, capsys, demo_model):
    run_ok(capsys, "--prompts", str(DATA / "prompts.jsonl"), "--out", str(out / "o.jsonl"), "--max-new-tokens", "6")
    a, b, c = jsonl(out / "o.jsonl")
    assert a["id"] == "a" and a["output_tokens"] <= 4  # its own max_new_tokens
    assert b["prompt"].startswith("<|system|>\nBe brief.")  # rendered by the chat template
    assert c["id"] == "3" and c["prompt"] == "No id here 😀"
    from transformers import AutoTokenizer

    # README: `prompt` is the text the model was given, whichever the input: its tokens are the prompt's
    tok = AutoTokenizer.from_pretrained(demo_model)
    assert [len(tok(r["prompt"]).input_ids) for r in (a, b, c)] == [r["prompt_tokens"] for r in (a, b, c)]


def test_openai_batch_in_batch_style_out(out, capsys, demo_model):
    run_ok(capsys, "--prompts", str(DATA / "openai_batch.jsonl"), "--out", str(out / "o.jsonl"))
    rows = jsonl(out / "o.jsonl")
    assert [r["custom_id"] for r in rows] == ["request-1", "request-2", "request-3"]
    r1, r2, r3 = rows
    assert set(FIELDS) <= set(r1) and r1["error"] is None and r1["response"]["status_code"] == 200
    body = r1["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "mlight-demo"
    assert body["choices"][0]["message"]["content"] == r1["output"]
    assert body["usage"]["completion_tokens"] == r1["output_tokens"] <= 5 and r2["output_tokens"] <= 3
    assert r3["response"]["body"]["choices"][0]["text"] == r3["output"]


def test_csv_in_csv_out_round_trip_through_the_engine(out, tmp_path, capsys, demo_model):
    nasty = ['with "quotes"', "comma, separated", "line\nbreak", "emoji 😀🍂", "עברית מימין לשמאל", "العربية"]
    src = tmp_path / "nasty prompts.csv"
    with open(src, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "prompt"])
        w.writerows([[f"n{i}", p] for i, p in enumerate(nasty)])
    run_ok(capsys, "--prompts", str(src), "--out", str(out / "o.csv"), "--max-new-tokens", "3")
    back = read_prompts(out / "o.csv")
    assert [(e.id, e.prompt) for e in back.entries] == [(f"n{i}", p) for i, p in enumerate(nasty)]
    rows = list(csv.DictReader(io.StringIO((out / "o.csv").read_text(encoding="utf-8"), newline="")))
    assert list(rows[0]) == FIELDS  # the JSONL's order, README's list
    assert all(len(json.loads(r["output_token_ids"])) == int(r["output_tokens"]) for r in rows)


def test_tsv_and_stdin(out, capsys, monkeypatch, demo_model):
    run_ok(capsys, "--prompts", str(DATA / "prompts.tsv"), "--out", str(out / "t.jsonl"), "--max-new-tokens", "2")
    assert [r["id"] for r in jsonl(out / "t.jsonl")] == ["t1", "t2"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO('{"prompt": "from stdin ✓"}\n'.encode())))
    run_ok(capsys, "--prompts", "-", "--out", str(out / "s.jsonl"), "--max-new-tokens", "2")
    assert jsonl(out / "s.jsonl")[0]["prompt"] == "from stdin ✓"


def test_model_and_files_in_folders_with_spaces_and_non_ascii(tmp_path, out, capsys, demo_model):
    model = tmp_path / "my models ü" / "démo mixtral"
    shutil.copytree(demo_model, model)
    prompts = tmp_path / "my models ü" / "prompts ✓.txt"
    prompts.write_text("hello\n", encoding="utf-8")
    run_ok(capsys, "--model", str(model), "--prompts", str(prompts), "--out", str(out / "sortie ü.jsonl"),
           "--max-new-tokens", "2")
    assert len(jsonl(out / "sortie ü.jsonl")) == 1


def test_same_results_as_uninterrupted_and_seeded_sampling_repeats(out, capsys, monkeypatch, demo_model):
    """Sampled run, Ctrl-C'd after two results and rerun with another batch size: the final file holds
    every request once, with exactly the tokens of an uninterrupted run; another seed changes them."""
    import signal

    from core.io.runstore import RunStore

    args = ["--prompts", str(DATA / "prompts.txt"), "--max-new-tokens", "6", "--temperature", "0.9", "--seed", "7"]
    run_ok(capsys, *args, "--out", str(out / "a.jsonl"))
    append, saved = RunStore.append, []

    def append_then_ctrl_c(store, record):
        append(store, record)
        saved.append(record["id"])
        if len(saved) == 2:  # Ctrl-C, delivered to the handler `mlight run` installed
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)

    monkeypatch.setattr(RunStore, "append", append_then_ctrl_c)
    assert main(["run", *args, "--out", str(out / "b.jsonl"), "--batch", "2"]) == 130
    err = capsys.readouterr().err
    done = len(saved)
    assert 2 <= done < 4 and f"interrupted: {done} of 4 requests done" in err, err
    assert not (out / "b.jsonl").exists()
    monkeypatch.setattr(RunStore, "append", append)
    err = run_ok(capsys, *args, "--out", str(out / "b.jsonl"), "--batch", "1")
    assert f"resuming: {done} of 4 requests already done by an earlier run" in err
    ids = lambda p: [(r["id"], r["output_token_ids"]) for r in jsonl(p)]  # noqa: E731
    assert ids(out / "a.jsonl") == ids(out / "b.jsonl")
    run_ok(capsys, *args[:-1], "8", "--out", str(out / "c.jsonl"))
    assert ids(out / "c.jsonl") != ids(out / "a.jsonl")


def test_executor_and_schedule_reach_engine_load(out, capsys, monkeypatch, demo_model):
    from core.runtime.engine import Engine

    seen = []
    real = Engine.load.__func__

    def load(cls, model_dir, **kw):
        seen.append({k: kw.get(k) for k in ("executor", "schedule") if k in kw})
        kw.pop("executor", None), kw.pop("schedule", None)
        return real(cls, model_dir, **kw)

    monkeypatch.setattr(Engine, "load", classmethod(load))
    base = ["--prompts", str(DATA / "prompts.tsv"), "--max-new-tokens", "2"]
    run_ok(capsys, *base, "--out", str(out / "a.jsonl"), "--executor", "threaded", "--schedule", "s3")
    run_ok(capsys, *base, "--out", str(out / "b.jsonl"))
    assert seen == [{"executor": "threaded", "schedule": "s3"}, {}]


def test_restart_replaces_output(out, capsys, demo_model):
    args = ["--prompts", str(DATA / "prompts.tsv"), "--out", str(out / "o.jsonl"), "--max-new-tokens", "2"]
    run_ok(capsys, *args)
    first = (out / "o.jsonl").read_text()
    run_ok(capsys, *args, "--restart")
    assert [r["id"] for r in jsonl(out / "o.jsonl")] == [r["id"] for r in map(json.loads, first.splitlines())]


def test_memory_budget_plans_the_batch_and_passes_the_policy(out, capsys, monkeypatch, demo_model):
    from core.runtime.engine import Engine
    from core.plan.policy import Policy

    seen = []
    real = Engine.load.__func__

    def load(cls, model_dir, **kw):
        seen.append(kw.get("policy"))
        return real(cls, model_dir, **kw)

    monkeypatch.setattr(Engine, "load", classmethod(load))
    run_ok(capsys, "--prompts", str(DATA / "prompts.tsv"), "--out", str(out / "o.jsonl"), "--max-new-tokens", "2",
           "--cpu-mem", "4", "--gpu-mem", "0")
    assert isinstance(seen[0], Policy) and len(jsonl(out / "o.jsonl")) == 2


def test_progress_lines_fit_the_terminal_so_a_carriage_return_redraws_them(monkeypatch):
    """On an 80-column terminal (here 40) each redraw is one line narrower than the terminal, padded to
    cover a longer line before it: a line that wraps cannot be redrawn by `\\r` (a new line per update)."""
    from app.commands.run import _Counter, _ProgressLine
    from core.telemetry import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = _ProgressLine()
    for done in (1, 5):
        bar(Progress("loading the weights of layer 17 of a model with a long name", done, 10))
        bar(Progress("downloading model-00001-of-00019.safetensors", done * 10**8, 10**9, unit="B"))
    counter = _Counter(12345)
    counter({"output_tokens": 7})
    counter.end()
    redraws = sys.stderr.getvalue().replace("\n", "").split("\r")[1:]
    assert len(redraws) == 5 and all(len(r) == 39 for r in redraws), redraws
    assert redraws[-1].startswith("1/12,345 requests done (")
