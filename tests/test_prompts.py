"""Prompt readers: every format, encodings, bad lines with file:line, duplicate ids, per-request fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import UsageError
from core.io.prompts import PromptEntry, read_prompts, reject_too_long

DATA = Path(__file__).parent / "data" / "io"


def test_txt_one_prompt_a_line_blank_lines_counted():
    ps = read_prompts(DATA / "prompts.txt")
    assert ps.format == "txt"
    assert [e.prompt for e in ps.entries] == [
        "What is the capital of France?", "Write a haiku about autumn 🍂", "مرحبا، كيف حالك؟",
        "Last line without newline"]
    assert [e.id for e in ps.entries] == ["1", "3", "5", "6"]  # ids are line numbers
    assert ps.blank_lines == 2 and not ps.rejects
    assert len(ps.sha256) == 64


def test_jsonl_prompt_messages_and_fields():
    ps = read_prompts(DATA / "prompts.jsonl")
    a, b, c = ps.entries
    assert (a.id, a.prompt, a.max_new_tokens) == ("a", "Tell me a joke, please.", 4)
    assert b.messages[1] == {"role": "user", "content": 'Say "hi"\nin two lines'}
    assert (b.temperature, b.stop) == (0.5, ("\n\n",))
    assert (c.id, c.stop) == ("3", ("END",))
    kw = b.request_kwargs({"max_new_tokens": 9, "temperature": 0.0, "seed": 1})
    assert kw["max_new_tokens"] == 9 and kw["temperature"] == 0.5 and kw["seed"] == 1
    assert "prompt" not in kw and kw["messages"][0]["content"] == "Be brief."


def test_openai_batch_lines():
    ps = read_prompts(DATA / "openai_batch.jsonl")
    assert ps.format == "openai-batch" and ps.is_openai_batch
    r1, r2, r3 = ps.entries
    assert (r1.custom_id, r1.id, r1.max_new_tokens, r1.model) == ("request-1", "request-1", 5, "gpt-4o-mini")
    assert r2.messages[1]["content"] == "Name three colors." and r2.max_new_tokens == 3
    assert (r3.prompt, r3.endpoint, r3.stop) == ("Once upon a time", "/v1/completions", (".",))


def test_csv_with_bom_quotes_newlines_and_fields():
    ps = read_prompts(DATA / "prompts.csv")
    q1, q2, q3 = ps.entries
    assert (q1.id, q1.prompt, q1.max_new_tokens, q1.temperature) == ("q1", "Hello, world", 3, None)
    assert q2.prompt == 'A prompt with "quotes" and a\nnewline' and q2.stop == ("\n",) and q2.temperature == 0.7
    assert (q3.prompt, q3.stop, q3.line) == ("שלום עולם", ("###",), 5)  # line of the record's start


def test_tsv():
    ps = read_prompts(DATA / "prompts.tsv")
    assert [(e.id, e.prompt) for e in ps.entries] == [("t1", "first prompt, with comma"),
                                                      ("t2", 'second "quoted" prompt')]


def test_stdin_bytes_sniffed():
    assert read_prompts("-", data=b"one\ntwo\n").format == "txt"
    ps = read_prompts("-", data=b'{"prompt": "x"}\n')
    assert ps.format == "jsonl" and ps.source == "<stdin>" and ps.entries[0].prompt == "x"
    assert read_prompts("-", data=b"prompt\nhi\n", fmt="csv").entries[0].prompt == "hi"


def test_bad_lines_reported_with_file_and_line():
    ps = read_prompts(DATA / "bad.jsonl")
    assert [e.prompt for e in ps.entries] == ["fine", "dup 1"]
    got = {r.line: r.reason for r in ps.rejects}
    assert got[2].startswith("bad JSON: ")
    assert got[4] == "has neither `prompt` nor `messages` (nor MT-Bench's `turns`)"
    assert got[5] == "expected a JSON object, got list"
    assert got[6] == "max_new_tokens must be at least 1, got -3"
    assert got[7] == "`prompt` is empty"
    assert got[9] == "duplicate id 'd' (first used on line 8)"
    assert got[10] == "`prompt` must be a string, got int"
    assert "messages[0]" in got[11]
    assert ps.blank_lines == 1
    assert str(ps.rejects[0]) == f"{DATA / 'bad.jsonl'}:2: {got[2]}"


def test_mixed_batch_and_plain_lines_rejected():
    ps = read_prompts("x.jsonl", data=b'{"custom_id": "a", "body": {"prompt": "p"}}\n{"prompt": "q"}\n')
    assert ps.format == "openai-batch" and [r.line for r in ps.rejects] == [2]


@pytest.mark.parametrize("row, reason", [
    ("x,5", "row has 2 fields, the header has 3"),
    ("hi,,abc", "temperature must be a number, got 'abc'"),
    ("hi,0,", "max_new_tokens must be at least 1, got 0"),
    ("  ,3,", "`prompt` is empty"),
])
def test_csv_bad_rows(row, reason):
    ps = read_prompts("t.csv", data=f"prompt,max_new_tokens,temperature\nok,1,0\n{row}\n".encode())
    assert [str(r) for r in ps.rejects] == [f"t.csv:3: {reason}"]
    assert len(ps.entries) == 1


def test_csv_unterminated_quote_is_a_reject():
    ps = read_prompts("t.csv", data=b'prompt\nok\n"never closed\n')
    assert ps.rejects and ps.rejects[0].line == 3 and "CSV" in ps.rejects[0].reason


def test_missing_prompt_column_is_refused():
    with pytest.raises(UsageError, match=r"no `prompt` column \(its columns: id, text\)"):
        read_prompts(DATA / "no_prompt_column.csv")


@pytest.mark.parametrize("name, pattern", [
    ("latin1.txt", r"is not UTF-8: byte 0xe9 at byte offset 14 \(line 2\)"),
    ("utf16.txt", r"is UTF-16 text, not UTF-8"),
    ("binary.txt", r"looks like a binary file \(a NUL byte at byte offset 8\)"),
    ("empty.txt", r"has no prompts"),
    ("blank_lines.txt", r"has no prompts"),
])
def test_whole_file_refusals(name, pattern):
    with pytest.raises(UsageError, match=pattern):
        read_prompts(DATA / name)


def test_bom_offset_counts_from_file_start():
    with pytest.raises(UsageError, match="byte offset 5 "):
        read_prompts("b.txt", data=b"\xef\xbb\xbfok\xff\n")


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        read_prompts(tmp_path / "nope.txt")
    with pytest.raises(UsageError, match="is a folder"):
        read_prompts(tmp_path)


def test_paths_with_spaces_and_non_ascii(tmp_path):
    p = tmp_path / "mes prompts é 日本" / "fichier à lire.txt"
    p.parent.mkdir()
    p.write_text("bonjour\n", encoding="utf-8")
    assert read_prompts(p).entries[0].prompt == "bonjour"


def test_only_newline_ends_a_line():
    # U+2028 and \x0b are text, not line breaks, in a .txt file
    ps = read_prompts("x.txt", data="a\u2028b\x0bc\r\nd\n".encode())
    assert [e.prompt for e in ps.entries] == ["a\u2028b\x0bc", "d"]


def test_reject_too_long_gives_token_count():
    ps = read_prompts("x.txt", data=b"short\nthis one is very long\n")
    reject_too_long(ps, lambda e: len(e.prompt.split()) * 10, context_length=20)
    assert [e.prompt for e in ps.entries] == ["short"]
    assert str(ps.rejects[0]) == ("x.txt:2: prompt is 50 tokens (after the chat template); the model's context is "
                                  "20 tokens")


def test_entry_request_kwargs_default_fields():
    e = PromptEntry(id="1", line=1, prompt="p")
    assert e.request_kwargs({"max_new_tokens": 8}) == {"id": "1", "prompt": "p", "max_new_tokens": 8}
