"""Result writers: JSONL and CSV round trips through our own readers, OpenAI Batch output, atomic writes."""

from __future__ import annotations

import csv
import errno
import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import MlightError, UsageError
from core.io.prompts import read_prompts
from core.io.results import atomic_write, openai_batch_record, output_format, write_csv, write_jsonl, write_records

NASTY = ["plain", 'with "quotes"', "comma, separated", "line\nbreak", "crlf\r\ninside", "lone\rcr",
         "emoji 😀🍂👩‍👩‍👧", "עברית מימין לשמאל", "العربية", "mixed ltr עברית rtl", "tab\there", "\u2028sep",
         "  leading and trailing  ", "=1+1", "back\\slash", "{\"json\": 1}"]


def record(i: int, prompt: str, output: str = "out") -> dict:
    return {"id": str(i), "prompt": prompt, "output": output, "output_token_ids": [1, 2], "prompt_tokens": 3,
            "output_tokens": 2, "finish_reason": "length", "seconds": 0.5}


def write_to(path: Path, records: list[dict]) -> Path:
    write_records(path, records)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_round_trip_nasty_text(tmp_path, suffix):
    recs = [record(i, p, output=p[::-1]) for i, p in enumerate(NASTY)]
    path = write_to(tmp_path / f"out{suffix}", recs)
    back = read_prompts(path)
    assert not back.rejects
    assert [(e.id, e.prompt) for e in back.entries] == [(r["id"], r["prompt"]) for r in recs]


def test_csv_is_rfc4180_and_readable_by_the_csv_module(tmp_path):
    recs = [record(i, p, output=p) for i, p in enumerate(NASTY)]
    path = write_to(tmp_path / "out.csv", recs)
    rows = list(csv.DictReader(io.StringIO(path.read_bytes().decode("utf-8"), newline="")))
    assert [r["output"] for r in rows] == NASTY
    assert rows[0]["output_token_ids"] == "[1, 2]" and rows[0]["prompt_tokens"] == "3"


def test_jsonl_keeps_text_readable(tmp_path):
    path = write_to(tmp_path / "o.jsonl", [record(0, "😀 עברית")])
    raw = path.read_bytes().decode("utf-8")
    assert "😀 עברית" in raw and raw.count("\n") == 1
    assert json.loads(raw) == record(0, "😀 עברית")


def test_openai_batch_record_shape():
    chat = openai_batch_record(record(0, "p", "hello"), "request-1", "/v1/chat/completions", "m")
    assert chat["custom_id"] == "request-1" and chat["error"] is None and chat["output"] == "hello"
    body = chat["response"]["body"]
    assert chat["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    comp = openai_batch_record(record(0, "p", "hi"), "r2", "/v1/completions", "m")
    assert comp["response"]["body"]["choices"][0]["text"] == "hi"


def test_output_format():
    assert output_format("a.JSONL") == "jsonl" and output_format("a b/c.csv") == "csv"
    with pytest.raises(UsageError, match="end --out with .jsonl or .csv"):
        output_format("results.txt")


def test_atomic_write_leaves_old_file_and_no_temp_on_failure(tmp_path):
    target = tmp_path / "o.jsonl"
    target.write_text("old\n")

    def fail(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(MlightError, match=r"disk full while writing .*o\.jsonl"):
        atomic_write(target, fail)
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]


prompt_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1,
                      max_size=40).filter(lambda s: s.strip())


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(prompt_text, min_size=1, max_size=8), fmt=st.sampled_from(["jsonl", "csv"]))
def test_property_any_prompts_written_read_back_identical(prompts, fmt):
    recs = [record(i, p) for i, p in enumerate(prompts)]
    buf = io.BytesIO()
    (write_jsonl if fmt == "jsonl" else write_csv)(buf, recs)
    back = read_prompts(f"out.{fmt}", data=buf.getvalue())
    assert not back.rejects
    assert [e.prompt for e in back.entries] == prompts
    assert [e.id for e in back.entries] == [r["id"] for r in recs]
