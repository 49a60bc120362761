"""Result writers: a record (`Result.to_dict()`, plus `turn` and OpenAI Batch fields) as JSONL, CSV or an OpenAI
Batch-style line. Files are renamed into place, so a reader never sees half a file; OS errors become MlightErrors.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

from core import platform
from core.errors import MlightError, UsageError

CSV_COLUMNS = ("id", "prompt", "output", "output_token_ids", "prompt_tokens", "output_tokens", "finish_reason",
               "seconds")  # the JSONL's order, as README lists it
EXTRA_COLUMNS = ("turn", "custom_id")  # appended when some record has them (multi-turn, OpenAI Batch input)
OUTPUT_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv"}


def output_format(path: str | Path) -> str:
    fmt = OUTPUT_FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise UsageError(f"cannot tell the output format of {path}", "end --out with .jsonl or .csv")
    return fmt


def openai_batch_record(record: dict, custom_id: str, endpoint: str | None, model: str) -> dict:
    chat = endpoint is None or "chat" in endpoint
    answer = {"message": {"role": "assistant", "content": record["output"]}} if chat else {"text": record["output"]}
    choice = {"index": 0, "finish_reason": record["finish_reason"], "logprobs": None, **answer}
    body = {
        "id": f"mlight-{custom_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": record["prompt_tokens"], "completion_tokens": record["output_tokens"],
                  "total_tokens": record["prompt_tokens"] + record["output_tokens"]},
    }
    return {**record, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": f"mlight-{custom_id}", "body": body}, "error": None}


def jsonl_line(record: dict) -> bytes:
    # ensure_ascii=False keeps emoji and right-to-left text readable; json escapes \n, \u2028 and friends
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


def write_jsonl(f: IO[bytes], records: Iterable[dict]) -> None:
    for r in records:
        f.write(jsonl_line(r))


def write_csv(f: IO[bytes], records: Iterable[dict]) -> None:
    """RFC 4180 quoting."""
    records = list(records)
    columns = list(CSV_COLUMNS) + [k for k in EXTRA_COLUMNS if any(k in r for r in records)]
    text = io.TextIOWrapper(f, encoding="utf-8", newline="", write_through=True)
    try:
        w = csv.writer(text, lineterminator="\r\n")
        w.writerow(columns)
        w.writerows([_cell(r.get(c)) for c in columns] for r in records)
        text.flush()
    finally:
        text.detach()  # leave f open for the caller's fsync


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, (list, dict)):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


WRITERS: dict[str, Callable[[IO[bytes], Iterable[dict]], None]] = {"jsonl": write_jsonl, "csv": write_csv}


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        platform.replace(tmp, path)
    except OSError as e:
        raise os_error(e, path) from e
    finally:
        with suppress(OSError):  # gone already: renamed into place
            tmp.unlink()
    fsync_dir(path.parent)


def write_records(path: Path, records: Iterable[dict], fmt: str | None = None) -> None:
    records = list(records)
    writer = WRITERS[fmt or output_format(path)]
    atomic_write(path, lambda f: writer(f, records))


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in `folder` survive power loss, where the OS allows it."""
    if not platform.can_fsync_dir():
        return  # Windows cannot open a folder; NTFS journals the rename itself
    with suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def os_error(e: OSError, path: Path, done: int | None = None) -> MlightError:
    kept = (f" ({done} finished result{'s' if done != 1 else ''} kept)"
            if done is not None else "")
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return MlightError(f"disk full while writing {path}{kept}",
                           "free some disk space and rerun the same command to finish")
    if platform.path_too_long(path):
        return UsageError(f"cannot write {path}: the path is {len(str(path))} characters, past Windows' limit of "
                          f"{platform.WINDOWS_MAX_PATH - 1}", "choose a shorter --out path, or enable long paths "
                          "(LongPathsEnabled) in Windows")
    if isinstance(e, PermissionError):
        if platform.is_windows():  # what Windows says when another program has the file open
            return MlightError(f"cannot write {path}: it is open in another program (or permission is denied)"
                               f"{kept}", "close the program that has it open (an editor, Excel) and rerun the "
                               "same command")
        return UsageError(f"cannot write {path}: permission denied", "choose another --out or fix the permissions")
    return MlightError(f"cannot write {path}: {e.strerror or e}{kept}", "check the disk and rerun the same command")
