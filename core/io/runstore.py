"""The run store (files and contract: docs/CONTRACTS.md, Batch I/O): an interrupted `mlight run` resumes without
losing or repeating work; a kill leaves at worst a torn last line, cut off on resume. Also the run loop every
front end shares: `prepare_requests`, `run_pending`, `finish_run`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import filelock

from core import platform
from core.errors import MlightError, UsageError
from core.io import turns
from core.io.prompts import PromptSet, reject_too_long
from core.io.results import atomic_write, jsonl_line, openai_batch_record, os_error, write_records
from core.telemetry import EventSink, ignore

MANIFEST_KEY = "mlight_run"
MANIFEST_VERSION = 1
# manifest sections that must match to resume; "policy" (batch sizes, executor) may change freely
IDENTITY = {"model": "another model", "prompts": "another prompts file", "settings": "other generation settings"}


def model_fingerprint(model_dir: str | Path, source: str | None = None) -> dict[str, Any]:
    """What identifies a checkpoint cheaply: config.json's hash and the weight files' names and sizes."""
    model_dir = Path(model_dir)
    cfg = model_dir / "config.json"
    weights = {}
    files = sorted(model_dir.iterdir()) if model_dir.is_dir() else [model_dir] if model_dir.is_file() else []
    if model_dir.suffix.lower() == ".gguf":  # a GGUF file: its split siblings too
        from core.model.gguf.files import find_gguf

        with suppress(MlightError):
            files = find_gguf(model_dir) or files
    for p in files:
        if p.suffix in (".safetensors", ".gguf") or p.name.endswith(".safetensors.index.json"):
            try:
                weights[p.name] = p.stat().st_size
            except OSError:
                weights[p.name] = None
    try:
        config_sha = hashlib.sha256(cfg.read_bytes()).hexdigest()
    except OSError:
        config_sha = None
    return {"source": source or str(model_dir), "config_sha256": config_sha, "weights": weights}


def manifest(model_dir: str | Path, model_name: str, prompts: PromptSet, settings: dict, policy: dict,
             quantize: str | None = None, group_size: int | None = None, dense: str | None = None) -> dict:
    """A run's manifest, the same from `mlight run` and the app, so either resumes the other's unfinished run.
    A quantized format is part of the settings (other weights, other tokens); absent when unquantized."""
    if quantize and quantize != "none":
        from core.model.quant.formats import DEFAULT_INT4_GROUP

        settings = {**settings, "quantize": quantize,
                    **({"group_size": group_size or DEFAULT_INT4_GROUP} if quantize == "int4" else {}),
                    **({"quantize_dense": dense} if dense else {})}
    return {"model": model_fingerprint(model_dir, model_name),
            "prompts": {"sha256": prompts.sha256, "format": prompts.format}, "settings": settings, "policy": policy,
            "prompts_file": prompts.source, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def parse_run_file(data: bytes) -> tuple[dict | None, dict[str, dict]]:
    """(manifest or None, finished records by id); a record seen twice keeps its last copy."""
    manifest, records = None, {}
    for i, raw in enumerate(data[:data.rfind(b"\n") + 1].splitlines()):
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # only a crash can tear a line; its request is simply run again
        if i == 0:
            manifest = obj if isinstance(obj, dict) and obj.get(MANIFEST_KEY) == MANIFEST_VERSION else None
            if manifest is None:
                return None, {}
        elif isinstance(obj, dict) and "id" in obj:
            records[str(obj["id"])] = obj
    return manifest, records


@dataclass
class RunStore:
    out: Path
    done: dict[str, dict] = field(default_factory=dict)  # id -> finished record, in finish order
    resumed: bool = False
    part: str = ""  # a data-parallel replica's tag (core.io.shards.part_name): its own run file and lock
    finished: dict | None = None  # OUT holds this very job's finished output: its manifest file, nothing to do
    manifest: dict | None = None
    _lock: filelock.BaseFileLock | None = None
    _file: Any = None

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        stem = self.out.name + (f".{self.part}" if self.part else "")
        self.run_path = self.out.with_name(stem + ".run.jsonl")
        self.lock_path = self.out.with_name(stem + ".lock")
        self.rejected_path = self.out.with_name(self.out.name + ".rejected.jsonl")

    @property
    def ledger_path(self) -> Path:
        key = hashlib.sha256(str(self.out.resolve()).encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return platform.cache_dir() / "finished-runs" / f"{key}.json"

    def check_writable(self) -> None:
        """Refuse early, before any model is loaded, an output that cannot be written."""
        parent = self.out.parent
        if self.out.is_dir():
            raise UsageError(f"--out {self.out} is a folder", "give a file name ending in .jsonl or .csv")
        if not parent.exists():
            raise UsageError(f"output folder {parent} does not exist", "create it first or choose another --out")
        if not parent.is_dir():
            raise UsageError(f"output folder {parent} is not a folder", "choose another --out")
        if not os.access(parent, os.W_OK):
            raise UsageError(f"cannot write to {parent}: permission denied", "choose another --out")

    def acquire(self) -> None:
        self.check_writable()
        lock = filelock.FileLock(self.lock_path, timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise UsageError(f"another mlight run is writing {self.out} (lock {self.lock_path.name} is held)",
                             "wait for it to finish, or choose another --out") from None
        except PermissionError:
            raise UsageError(f"cannot write to {self.out.parent}: permission denied", "choose another --out") from None
        except OSError as e:
            raise os_error(e, self.lock_path) from e
        self._lock = lock

    def release(self) -> None:
        self.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
            # filelock re-checks the inode after locking, so removing the file cannot let two runs in; it fails
            # where another run holds it now (Windows), or it is gone already
            with suppress(OSError):
                self.lock_path.unlink()

    def __enter__(self) -> RunStore:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def start(self, manifest: dict, restart: bool = False) -> None:
        """Resume the run file if it belongs to this run, else start one. Call with the lock held."""
        manifest = {MANIFEST_KEY: MANIFEST_VERSION, **manifest}
        self.manifest = manifest
        if self.run_path.exists():
            old, records = self._load()
            if old is None and not restart:
                raise UsageError(f"{self.run_path.name} is not a run file mlight can read (its first line is not a "
                                 "manifest)", "move it away, or pass --restart to replace it")
            if not restart:
                diff = [label for key, label in IDENTITY.items() if old.get(key) != manifest.get(key)]
                if diff:
                    raise UsageError(
                        f"{self.run_path.name} holds an unfinished run ({len(records):,} result"
                        f"{'s' if len(records) != 1 else ''}) made with {' and '.join(diff)}",
                        "rerun with --restart to discard them and start over, or choose another --out")
                self.done = records
                self.resumed = True
                self._open_append()
                return
            self._remove(self.run_path)
        elif self.out.exists() and not restart:
            self.finished = None if self.part else self._finished_as(manifest)  # replicas: the merge decides
            if self.finished is not None:
                return  # the same job, already done: nothing to run, nothing to write
            raise UsageError(f"{self.out} already exists", "pass --restart to replace it, or choose another --out")
        # the ledger entry describes an output this run replaces; unlinking fails where there is none, or the
        # cache is read-only: a stale entry cannot match a new OUT's sha256 anyway
        with suppress(OSError):
            self.ledger_path.unlink()
        self.done = {}
        atomic_write(self.run_path, lambda f: f.write(jsonl_line(manifest)))
        self._open_append()

    def _finished_as(self, manifest: dict) -> dict | None:
        """OUT's manifest file when it says OUT is this job's untouched output, else None."""
        try:
            old = json.loads(self.ledger_path.read_text(encoding="utf-8"))
            same_out = old.get("output") == str(self.out.resolve()) and old.get("output_sha256") == _sha256(self.out)
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(old, dict) or old.get(MANIFEST_KEY) != MANIFEST_VERSION or not same_out:
            return None
        return old if all(old.get(key) == manifest.get(key) for key in IDENTITY) else None

    def _load(self) -> tuple[dict | None, dict[str, dict]]:
        """A torn last line (killed mid-write) is cut off."""
        try:
            data = self.run_path.read_bytes()
        except OSError as e:
            raise os_error(e, self.run_path) from e
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(self.run_path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        return parse_run_file(data)

    def _open_append(self) -> None:
        try:
            self._file = open(self.run_path, "ab")
        except OSError as e:
            raise os_error(e, self.run_path) from e

    def append(self, record: dict) -> None:
        """Durable before it returns."""
        line = jsonl_line(record)
        f = self._file
        pos = f.tell()
        try:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:
            with suppress(OSError):  # leave no torn line behind, so the run file stays clean for the resume
                f.truncate(pos)
                f.flush()
            raise os_error(e, self.run_path, done=len(self.done)) from e
        self.done[str(record["id"])] = record

    def finish(self, records: Iterable[dict], rejects: Iterable[dict] = (), fmt: str | None = None) -> None:
        self.close()
        rejects = list(rejects)
        try:
            write_records(self.out, records, fmt)
            if rejects:
                write_records(self.rejected_path, rejects, "jsonl")
            elif self.rejected_path.exists():
                self._remove(self.rejected_path)  # stale, from an earlier run on this output
        except MlightError as e:
            if self.done:
                n = len(self.done)
                raise MlightError(f"{e.problem} ({n} finished result{'s' if n != 1 else ''} kept in "
                                  f"{self.run_path.name})", e.hint) from e
            raise
        self._write_ledger(len(records))
        self._remove(self.run_path)

    def drop_run_file(self) -> None:
        self.close()
        self._remove(self.run_path)

    def _write_ledger(self, results: int) -> None:
        """Best effort: without the ledger a rerun is refused as an existing output, which loses nothing."""
        if self.manifest is None or self.part:
            return
        path = self.ledger_path
        with suppress(OSError, MlightError):
            info = {**self.manifest, "results": results, "output": str(self.out.resolve()),
                    "output_sha256": _sha256(self.out)}
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: f.write(jsonl_line(info)))

    def abandon(self) -> None:
        """An error before any result: the run file holds nothing worth keeping."""
        self.close()
        if not self.done and self.run_path.exists():
            self._remove(self.run_path)

    def close(self) -> None:
        if self._file is not None:
            with suppress(OSError):
                self._file.close()
            self._file = None

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            with suppress(FileNotFoundError):
                platform.remove(path)
        except OSError as e:
            raise os_error(e, path) from e


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare_requests(engine, prompts: PromptSet, defaults: dict[str, Any]) -> dict[str, Any]:
    """Engine Requests by id; entries the engine cannot take move to `prompts.rejects`. A later turn gets
    empty answers here (its shortest conversation); `run_pending` puts the real ones in."""
    from core.runtime.engine import Request

    requests = {e.id: Request(**e.request_kwargs(defaults, answers=("",) * len(e.earlier)))
                for e in prompts.entries}
    reject_too_long(prompts, lambda e: len(engine.prompt_token_ids(requests[e.id])), engine.context_length)
    return {e.id: requests[e.id] for e in prompts.entries}


def run_pending(engine, prompts: PromptSet, store: RunStore, requests: dict[str, Any], *,
                batch_size: int | None = None, micro_batch_size: int | None = None, on_event: EventSink = ignore,
                should_stop: Callable[[], bool] | None = None,
                on_result: Callable[[dict], None] | None = None) -> bool:
    """Generate every entry the run file lacks, one wave per turn, saving each result as it finishes. True
    when every entry is done; False when `should_stop` ended it early."""
    for wave in turns.waves(prompts.entries):
        kept = {e.id for e in prompts.entries}  # an earlier wave may have set a later turn aside
        pending = [e for e in wave if e.id in kept and e.id not in store.done]
        if not pending:
            continue
        entries = {e.id: e for e in pending}
        wave_requests = turns.wave_requests(engine, prompts, pending, requests, store.done, on_event)
        for result in engine.generate(wave_requests, batch_size=batch_size, micro_batch_size=micro_batch_size,
                                      on_event=on_event, should_stop=should_stop):
            record = result.to_dict()
            if entries[result.id].turn is not None:  # a multi-turn question's records say which turn they are
                record["turn"] = entries[result.id].turn
            store.append(record)
            if on_result is not None:
                on_result(record)
        if should_stop is not None and should_stop():  # stopped in this wave: the next needs its answers
            break
    return all(e.id in store.done for e in prompts.entries)


def final_records(prompts: PromptSet, done: dict[str, dict], model_name: str) -> list[dict]:
    if prompts.is_openai_batch:
        return [openai_batch_record(done[e.id], e.custom_id, e.endpoint, model_name) for e in prompts.entries]
    return [done[e.id] for e in prompts.entries]


def finish_run(store: RunStore, prompts: PromptSet, model_name: str, fmt: str | None = None) -> list[dict]:
    records = final_records(prompts, store.done, model_name)
    store.finish(records, [r.to_dict() for r in prompts.rejects], fmt)
    return records
