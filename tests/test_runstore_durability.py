"""The run store's durability promise, checked at the system call: every finished result is fsynced,
with its bytes already in the file, before `append` returns; the manifest likewise before the run
file appears under its name; a result seen twice on resume keeps its last copy."""

from __future__ import annotations

import json
import os
import time

import pytest

from core.io.runstore import RunStore
from core.model.quant.formats import DEFAULT_INT4_GROUP

MANIFEST = {"model": {"source": "m", "config_sha256": "c"}, "prompts": {"sha256": "p"}, "settings": {"t": 0},
            "policy": {"batch": 4}}


def rec(i, output="o") -> dict:
    return {"id": str(i), "prompt": f"p{i}", "output": output, "output_token_ids": [1], "prompt_tokens": 1,
            "output_tokens": 1, "finish_reason": "length", "seconds": 0.1}


class FsyncSpy:
    """os.fsync, recording (inode, size) of each file it syncs and whether `watch` exists then; then
    syncing for real."""

    def __init__(self, monkeypatch, watch=None):
        self.calls: list[tuple[int, int]] = []
        self.watched: list[bool] = []
        real = os.fsync

        def fsync(fd):
            st = os.fstat(fd)
            self.calls.append((st.st_ino, st.st_size))
            self.watched.append(watch is not None and watch.exists())
            return real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


def test_every_append_is_fsynced_with_its_bytes_before_it_returns(tmp_path, monkeypatch):
    spy = FsyncSpy(monkeypatch)
    with RunStore(tmp_path / "o.jsonl") as st:
        st.start(MANIFEST)
        ino = os.stat(st.run_path).st_ino
        for i in range(4):
            spy.calls.clear()
            st.append(rec(i))
            size = os.stat(st.run_path).st_size
            assert (ino, size) in spy.calls, f"append {i}: no fsync of the run file holding the record"
            assert json.loads(st.run_path.read_text(encoding="utf-8").splitlines()[-1]) == rec(i)


def test_the_manifest_is_fsynced_before_the_run_file_takes_its_name(tmp_path, monkeypatch):
    out = tmp_path / "o.jsonl"
    spy = FsyncSpy(monkeypatch, watch=out.with_name("o.jsonl.run.jsonl"))
    with RunStore(out) as st:
        st.start(MANIFEST)
        manifest_size = os.stat(st.run_path).st_size
        ino = os.stat(st.run_path).st_ino
        first = spy.calls.index((ino, manifest_size))  # the manifest, synced whole...
        assert spy.watched[first] is False  # ...under its temporary name, before the rename
        lines = st.run_path.read_text(encoding="utf-8").splitlines()
        assert len(lines) == 1 and json.loads(lines[0])["mlight_run"] == 1


def test_resume_keeps_the_last_copy_of_a_result_seen_twice(tmp_path):
    out = tmp_path / "o.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        st.append(rec(1, "first"))
        st.append(rec(2))
        st.append(rec(1, "second"))
    with RunStore(out) as st:
        st.start(MANIFEST)
        assert st.resumed and list(st.done) == ["1", "2"] and st.done["1"]["output"] == "second"


@pytest.mark.parametrize("quantize, group, dense, added", [
    ("int4", None, "int8", {"quantize": "int4", "group_size": DEFAULT_INT4_GROUP, "quantize_dense": "int8"}),
    ("int4", 64, None, {"quantize": "int4", "group_size": 64}),
    ("int8", None, None, {"quantize": "int8"}),
    ("none", 64, "int8", {}),  # unquantized: the settings as given
    (None, None, None, {}),
])
def test_a_manifest_names_the_model_prompts_settings_policy_and_quantization(tmp_path, quantize, group, dense, added):
    """The manifest's keys are what a later run compares to resume (the CLI's and the app's): each one spelled as
    the resume reads it, a quantized format part of the settings, a split GGUF's every part in the fingerprint."""
    from core.io.prompts import read_prompts
    from core.io.runstore import manifest

    model = tmp_path / "m"
    model.mkdir()
    for part in ("w-00001-of-00002.gguf", "w-00002-of-00002.gguf"):
        (model / part).write_bytes(b"x" * (10 + len(part)))
    (tmp_path / "p.txt").write_text("hello\nworld\n")
    prompts = read_prompts(tmp_path / "p.txt")
    settings, policy = {"max_new_tokens": 8}, {"batch_size": 4}
    m = manifest(model / "w-00001-of-00002.gguf", "owner/w", prompts, settings, policy, quantize, group, dense)
    assert set(m) == {"model", "prompts", "settings", "policy", "prompts_file", "started"}
    assert m["model"]["source"] == "owner/w"
    assert m["model"]["weights"] == {"w-00001-of-00002.gguf": 31, "w-00002-of-00002.gguf": 31}  # both parts
    assert m["prompts"] == {"sha256": prompts.sha256, "format": "txt"} and m["prompts_file"] == prompts.source
    assert m["settings"] == {**settings, **added} and m["policy"] == policy
    assert time.strptime(m["started"], "%Y-%m-%dT%H:%M:%S%z")


def test_the_ledger_is_best_effort_a_replicas_part_keeps_none_and_a_store_releases_twice(tmp_path, monkeypatch):
    """A finished run's ledger entry (how a rerun says "already done") is the whole output's, never a data-parallel
    replica's part; a failure to write it loses nothing; releasing the lock twice, or after its file went, is fine."""
    from core.io import runstore

    with RunStore(tmp_path / "a.jsonl", part="part-1-of-2") as part:
        part.start(MANIFEST)
        part.append(rec(1))
        part.finish([rec(1)])
    assert (tmp_path / "a.jsonl").exists() and not part.ledger_path.exists()
    with RunStore(tmp_path / "a.jsonl") as whole:  # the whole output's finish keeps one
        whole.start(MANIFEST, restart=True)
        whole.finish([rec(1)])
    assert json.loads(whole.ledger_path.read_text())["results"] == 1

    whole = RunStore(tmp_path / "b.jsonl")
    real = runstore.atomic_write

    def full_disk(path, write):
        if path == whole.ledger_path:
            raise OSError(28, "No space left on device")
        return real(path, write)

    monkeypatch.setattr(runstore, "atomic_write", full_disk)
    with whole:
        whole.start(MANIFEST)
        whole.append(rec(2))
        whole.finish([rec(2)])
        whole.lock_path.unlink()  # gone before the release removes it
    assert json.loads((tmp_path / "b.jsonl").read_text())["id"] == "2" and not whole.ledger_path.exists()
    whole.release()


def test_finishing_after_the_run_file_went_missing_still_writes_the_output(tmp_path):
    """The run file removed under a running store (by hand, or by a rank that merged first): finishing still writes
    every result to the output and leaves no run file, rather than failing at the removal."""
    out = tmp_path / "o.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        for i in range(3):
            st.append(rec(i))
        st.close()
        st.run_path.unlink()
        st.finish([rec(i) for i in range(3)])
    assert [json.loads(line)["id"] for line in out.read_text(encoding="utf-8").splitlines()] == ["0", "1", "2"]
    assert not st.run_path.exists()
