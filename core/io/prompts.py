"""Prompt readers (txt, jsonl plain or OpenAI Batch, csv, tsv, stdin): bytes in, valid entries and `Reject`s out;
a bad line never raises, so the caller decides whether to stop or skip. Ids default to the line number.
MT-Bench `turns` become one entry per turn (`81:1`, `81:2`), a later turn naming the `earlier` ones.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.assets import DEMO_PROMPTS
from core.errors import UsageError

FORMATS = ("txt", "jsonl", "csv", "tsv")
SUFFIX_FORMAT = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
                 ".csv": "csv", ".tsv": "tsv", ".tab": "tsv"}
STDIN = "-"
DEMO = "demo"  # the bundled demo prompts, unless a file of that name is in the working folder
HINT_FORMATS = "give a UTF-8 .txt (one prompt a line), .jsonl, .csv or .tsv file"
# the per-request fields a file may set, each overriding the command's default
REQUEST_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


@dataclass(frozen=True)
class PromptEntry:
    """None means "use the command's default"."""

    id: str
    line: int  # 1-based line where the record starts
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None  # [{"role": ..., "content": str}, ...]
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    custom_id: str | None = None  # set when read from an OpenAI Batch file
    endpoint: str | None = None  # OpenAI Batch `url`, e.g. /v1/chat/completions
    model: str | None = None  # OpenAI Batch body.model, echoed back in the response
    turn: int | None = None  # 1-based turn of a multi-turn question; `messages` then holds its user turns so far
    earlier: tuple[str, ...] = ()  # ids of the question's earlier turns, whose answers this turn's request needs

    def request_kwargs(self, defaults: dict[str, Any] | None = None,
                       answers: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
        """Keyword arguments for `core.runtime.engine.Request`: this entry's fields over `defaults`. A later
        turn takes the model's `answers` to the earlier turns, which go between the user turns."""
        if len(answers) != len(self.earlier):
            raise ValueError(f"entry {self.id!r} needs {len(self.earlier)} earlier answers, got {len(answers)}")
        kw = {**(defaults or {}), "id": self.id}
        if self.messages is not None:
            kw["messages"] = [dict(m) for m in self.messages]
            for i, answer in enumerate(answers):  # user, assistant, user, assistant, ..., user
                kw["messages"].insert(2 * i + 1, {"role": "assistant", "content": answer})
        else:
            kw["prompt"] = self.prompt
        return kw | {name: getattr(self, name) for name in REQUEST_FIELDS if getattr(self, name) is not None}


@dataclass(frozen=True)
class Reject:
    file: str
    line: int
    reason: str
    id: str | None = None
    text: str = ""  # the offending line (or row), for <out>.rejected.jsonl

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "id": self.id, "reason": self.reason, "input": self.text}


@dataclass
class PromptSet:
    source: str  # file name as given ("<stdin>" for stdin)
    format: str  # txt | jsonl | openai-batch | csv | tsv
    sha256: str  # of the raw bytes: a changed file is a different run
    entries: list[PromptEntry] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    blank_lines: int = 0

    @property
    def is_openai_batch(self) -> bool:
        return self.format == "openai-batch"


class _Bad(Exception):
    """Why one record is rejected."""


def read_prompts(source: str | Path, *, data: bytes | None = None, fmt: str | None = None) -> PromptSet:
    """`data`: the bytes, read already (stdin: source "-")."""
    if data is None and str(source) == DEMO and not Path(source).exists():
        source = DEMO_PROMPTS
    name = "<stdin>" if str(source) == STDIN else str(source)
    if data is None:
        data = _read_bytes(Path(source))
    fmt = fmt or _guess_format(source, data)
    if fmt not in FORMATS:
        raise UsageError(f"unknown prompts format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    text = decode_text(data, name)
    out = PromptSet(source=name, format=fmt, sha256=hashlib.sha256(data).hexdigest())
    if fmt == "txt":
        out.entries.extend(PromptEntry(id=str(n), line=n, prompt=line) for n, line in _lines(text, out))
    elif fmt == "jsonl":
        _read_jsonl(text, out)
    else:
        _read_table(text, out, delimiter="," if fmt == "csv" else "\t")
    _reject_duplicates(out)
    if not out.entries and not out.rejects:
        raise UsageError(f"{name} has no prompts (it is empty or only blank lines)", HINT_FORMATS)
    return out


def decode_text(data: bytes, name: str) -> str:
    """UTF-8 with or without a BOM; anything else is refused with the problem's byte offset."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UsageError(f"{name} is UTF-16 text, not UTF-8", "re-save it as UTF-8")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise UsageError(f"{name} looks like a binary file (a NUL byte at byte offset {nul})", HINT_FORMATS)
    shift = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    data = data[shift:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UsageError(f"{name} is not UTF-8: byte 0x{data[e.start]:02x} at byte offset {e.start + shift} "
                         f"(line {line})", "re-save the file as UTF-8") from None


def reject_too_long(prompts: PromptSet, count_tokens: Callable[[PromptEntry], int], context_length: int) -> None:
    """Set aside prompts too long for the context (after the chat template), and their questions' later turns."""
    def why(e: PromptEntry) -> str | None:
        try:
            n = count_tokens(e)
        except UsageError as err:  # e.g. `messages` for a tokenizer without a chat template
            return err.problem
        return (f"prompt is {n} tokens (after the chat template); the model's context is {context_length} tokens"
                if n >= context_length else None)

    _set_aside(prompts, why)
    reject_orphan_turns(prompts)


def reject_orphan_turns(prompts: PromptSet) -> None:
    kept = set()  # ids are unique: read_prompts set the duplicates aside

    def why(e: PromptEntry) -> str | None:
        missing = next((i for i in e.earlier if i not in kept), None)
        if missing is None:
            kept.add(e.id)
            return None
        return f"turn {e.turn} cannot run: turn {missing} of the same question was set aside"

    _set_aside(prompts, why)


def _set_aside(prompts: PromptSet, why: Callable[[PromptEntry], str | None], ensure_ascii: bool = True) -> None:
    """Move the entries `why` gives a reason for to the rejects, kept in line order."""
    keep = []
    for e in prompts.entries:
        reason = why(e)
        if reason is None:
            keep.append(e)
        else:
            text = e.prompt or json.dumps(list(e.messages or ()), ensure_ascii=ensure_ascii)
            prompts.rejects.append(Reject(prompts.source, e.line, reason, e.id, text))
    prompts.entries = keep
    prompts.rejects.sort(key=lambda r: r.line)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"prompts file {path} not found", "check the path given to --prompts") from None
    except OSError as e:
        if path.is_dir():  # IsADirectoryError; Windows says PermissionError
            raise UsageError(f"{path} is a folder, not a prompts file", HINT_FORMATS) from None
        if isinstance(e, PermissionError):
            raise UsageError(f"cannot read prompts file {path}: permission denied",
                             "fix its permissions or copy it somewhere readable") from None
        raise UsageError(f"cannot read prompts file {path}: {e.strerror or e}", "check the path") from None


def _guess_format(source: str | Path, data: bytes) -> str:
    fmt = SUFFIX_FORMAT.get(Path(str(source)).suffix.lower())
    if fmt:
        return fmt
    # stdin or an unknown suffix: JSON lines start with "{", anything else is one prompt a line
    return "jsonl" if data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"{" else "txt"


def _lines(text: str, out: PromptSet) -> Iterable[tuple[int, str]]:
    """Blank lines are counted in `out`."""
    # only \n and \r\n end a line: str.splitlines would also split on \x0b, \x1c, U+2028, ...
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for n, line in enumerate(lines, 1):
        line = line.removesuffix("\r")
        if line.strip():
            yield n, line
        else:
            out.blank_lines += 1


def _read_jsonl(text: str, out: PromptSet) -> None:
    batch = None  # decided by the first valid record: OpenAI Batch lines carry custom_id
    for n, line in _lines(text, out):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            out.rejects.append(Reject(out.source, n, f"bad JSON: {e.msg} at column {e.colno}", text=line))
            continue
        try:
            if not isinstance(obj, dict):
                raise _Bad(f"expected a JSON object, got {type(obj).__name__}")
            is_batch = "custom_id" in obj
            if batch is None:
                batch = is_batch
            elif batch != is_batch:
                raise _Bad("mixes OpenAI Batch lines (custom_id) with plain lines" if is_batch
                           else "missing custom_id (the file's other lines are OpenAI Batch requests)")
            entry = _batch_entry(obj, n) if is_batch else _plain_entry(obj, n)
        except _Bad as e:
            rid = obj.get("custom_id", obj.get("id")) if isinstance(obj, dict) else None
            out.rejects.append(Reject(out.source, n, str(e), None if rid is None else str(rid), line))
            continue
        out.entries.extend(entry if isinstance(entry, list) else [entry])
    if batch:
        out.format = "openai-batch"


def _plain_entry(obj: dict, n: int) -> PromptEntry | list[PromptEntry]:
    if "turns" in obj and obj.get("prompt") is None and obj.get("messages") is None:
        return _turn_entries(obj, n)
    prompt, messages = _prompt_or_messages(obj.get("prompt"), obj.get("messages"))
    return PromptEntry(id=_id(obj.get("id"), n), line=n, prompt=prompt, messages=messages,
                       **_fields(obj, max_tokens_key="max_new_tokens"))


def _turn_entries(obj: dict, n: int) -> list[PromptEntry]:
    """A FastChat (MT-Bench) question: one entry per user turn, each with the user turns so far."""
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise _Bad("`turns` must be a non-empty list of non-empty strings (the user's turns)")
    if obj.get("question_id") is not None and obj.get("id") is not None:
        raise _Bad("has both `question_id` and `id`; give one")
    qid = _id(obj.get("question_id", obj.get("id")), n)
    fields = _fields(obj, max_tokens_key="max_new_tokens")
    users = tuple({"role": "user", "content": t} for t in turns)
    ids = [f"{qid}:{k}" for k in range(1, len(turns) + 1)]
    return [PromptEntry(id=ids[k], line=n, messages=users[:k + 1], turn=k + 1, earlier=tuple(ids[:k]), **fields)
            for k in range(len(turns))]


def _batch_entry(obj: dict, n: int) -> PromptEntry:
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise _Bad("custom_id must be a non-empty string")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Bad("OpenAI Batch line has no `body` object")
    prompt, messages = _prompt_or_messages(body.get("prompt"), body.get("messages"))
    fields = _fields(body, max_tokens_key="max_tokens")
    if fields["max_new_tokens"] is None and "max_completion_tokens" in body:
        fields["max_new_tokens"] = _int(body["max_completion_tokens"], "max_completion_tokens", lo=1)
    url = obj.get("url")
    url = url if isinstance(url, str) else ("/v1/chat/completions" if messages is not None else "/v1/completions")
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return PromptEntry(id=cid, line=n, prompt=prompt, messages=messages, custom_id=cid, endpoint=url, model=model,
                       **fields)


def _read_table(text: str, out: PromptSet, delimiter: str) -> None:
    kind = "CSV" if delimiter == "," else "TSV"
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    try:
        header = next(reader, None)
    except csv.Error as e:
        raise UsageError(f"{out.source}:1: cannot read the {kind} header: {e}", "fix the first line") from None
    if not header or not any(h.strip() for h in header):
        return
    names = [h.strip().lower() for h in header]
    if "prompt" not in names:
        raise UsageError(f"{out.source} has no `prompt` column (its columns: {', '.join(h for h in header) or '-'})",
                         f"name the column holding the prompts `prompt` in the first line of the {kind} file")
    start = reader.line_num + 1
    try:
        for row in reader:
            n, start = start, reader.line_num + 1
            if not row or not any(cell.strip() for cell in row):
                out.blank_lines += 1
                continue
            raw = delimiter.join(row)
            if len(row) != len(names):
                out.rejects.append(Reject(out.source, n, f"row has {len(row)} fields, the header has {len(names)}",
                                          text=raw))
                continue
            rec = {k: v for k, v in zip(names, row) if k}
            try:
                out.entries.append(_table_entry(rec, n))
            except _Bad as e:
                out.rejects.append(Reject(out.source, n, str(e), rec.get("id") or None, raw))
    except csv.Error as e:  # the csv module cannot resynchronise after a broken quote
        out.rejects.append(Reject(out.source, start, f"bad {kind} row: {e}"))


def _table_entry(rec: dict[str, str], n: int) -> PromptEntry:
    obj: dict[str, Any] = {}
    for key in REQUEST_FIELDS:
        cell = rec.get(key, "").strip()
        if cell == "":
            continue
        try:
            obj[key] = json.loads(cell) if key != "stop" or cell.startswith("[") else cell
        except json.JSONDecodeError:
            if key != "stop":
                raise _Bad(f"{key} must be a number, got {cell!r}") from None
            obj[key] = cell  # a stop string that starts with "[", as written
    prompt = rec.get("prompt", "")
    return PromptEntry(id=_id(rec.get("id") or None, n), line=n, prompt=_check_prompt(prompt),
                       **_fields(obj, max_tokens_key="max_new_tokens"))


def _prompt_or_messages(prompt: Any, messages: Any) -> tuple[str | None, tuple[dict, ...] | None]:
    if prompt is not None and messages is not None:
        raise _Bad("has both `prompt` and `messages`; give one")
    if messages is not None:
        return None, _check_messages(messages)
    if prompt is None:
        raise _Bad("has neither `prompt` nor `messages` (nor MT-Bench's `turns`)")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI completions accept a one-element list
    return _check_prompt(prompt), None


def _check_prompt(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise _Bad(f"`prompt` must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise _Bad("`prompt` is empty")
    return prompt


def _check_messages(messages: Any) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise _Bad("`messages` must be a non-empty list of {\"role\": ..., \"content\": ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _Bad(f"messages[{i}] must be an object with a string `role`")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text parts can be run
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _Bad(f"messages[{i}].content has a part that is not text; only text is supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _Bad(f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": content})
    if not any(m["content"].strip() for m in out):
        raise _Bad("`messages` has no text")
    return tuple(out)


def _fields(obj: dict, max_tokens_key: str) -> dict[str, Any]:
    checks = {"max_new_tokens": (max_tokens_key, lambda v: _int(v, max_tokens_key, lo=1)),
              "temperature": ("temperature", lambda v: _number(v, "temperature", lo=0.0)),
              "top_p": ("top_p", lambda v: _number(v, "top_p", lo=0.0, hi=1.0, lo_open=True)),
              "top_k": ("top_k", lambda v: _int(v, "top_k", lo=0)),
              "seed": ("seed", lambda v: _int(v, "seed", lo=0)), "stop": ("stop", _stop)}
    return {k: None if obj.get(key) is None else check(obj[key]) for k, (key, check) in checks.items()}


def _int(v: Any, name: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _Bad(f"{name} must be a whole number, got {v!r}")
    if v < lo:
        raise _Bad(f"{name} must be at least {lo}, got {v!r}")
    return int(v)


def _number(v: Any, name: str, lo: float, hi: float | None = None, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad(f"{name} must be a number, got {v!r}")
    if v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
        bounds = f"in ({lo}, {hi}]" if hi is not None else f"at least {lo}"
        raise _Bad(f"{name} must be {bounds}, got {v!r}")
    return float(v)


def _stop(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise _Bad("stop must be a string or a list of non-empty strings")
    return tuple(v)


def _id(v: Any, n: int) -> str:
    if v is None:
        return str(n)
    if isinstance(v, bool) or not isinstance(v, (str, int)) or (isinstance(v, str) and not v.strip()):
        raise _Bad(f"id must be a non-empty string or a number, got {v!r}")
    return str(v)


def _reject_duplicates(out: PromptSet) -> None:
    first: dict[str, int] = {}

    def why(e: PromptEntry) -> str | None:
        if e.id in first:
            return f"duplicate id {e.id!r} (first used on line {first[e.id]})"
        first[e.id] = e.line
        return None

    _set_aside(out, why, ensure_ascii=False)


def bad_lines_error(prompts: PromptSet, rejects_file: str, skip: str = "pass --skip-bad") -> UsageError | None:
    """Every front end's rule: a file with bad lines runs nothing until the user chooses to `skip` them."""
    n = len(prompts.rejects)
    if not n:
        return None
    if not prompts.entries:
        return UsageError(f"no prompt in {prompts.source} can be run ({n} bad)", "fix the lines listed above")
    return UsageError(f"{n} bad line{'s' if n > 1 else ''} in {prompts.source}, nothing was run",
                      f"fix {'them' if n > 1 else 'it'}, or {skip} to run the rest (rejects go to {rejects_file})")


def reject_lines(rejects: Iterable[Reject], limit: int = 20) -> Iterable[str]:
    rejects = list(rejects)
    yield from map(str, rejects[:limit])
    if len(rejects) > limit:
        yield f"... and {len(rejects) - limit} more bad lines"
