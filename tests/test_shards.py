"""Data parallelism's bookkeeping without processes: the split, the per-replica run files, the merge."""

from __future__ import annotations

import pytest

from core.io.prompts import PromptEntry
from core.io.runstore import RunStore
from core.io.shards import merge, other_parts, part_name, shard_entries

ENTRIES = [PromptEntry(id=f"p{i}", line=i + 1, prompt=f"prompt {i}") for i in range(11)]


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 11, 12])
def test_every_prompt_goes_to_exactly_one_replica_the_same_way_every_time(replicas):
    parts = [shard_entries(ENTRIES, r, replicas) for r in range(replicas)]
    ids = [e.id for p in parts for e in p]
    assert sorted(ids) == sorted(e.id for e in ENTRIES) and len(ids) == len(ENTRIES)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced in count
    assert parts == [shard_entries(list(ENTRIES), r, replicas) for r in range(replicas)]
    with pytest.raises(ValueError):
        shard_entries(ENTRIES, replicas, replicas)


def test_merge_restores_every_record_and_names_the_missing():
    parts = [{e.id: {"id": e.id} for e in shard_entries(ENTRIES, r, 3)} for r in range(3)]
    done, missing = merge(ENTRIES, parts)
    assert list(done) != [e.id for e in ENTRIES] and set(done) == {e.id for e in ENTRIES} and missing == []
    _, missing = merge(ENTRIES, parts[:2])
    assert missing == [e.id for e in shard_entries(ENTRIES, 2, 3)]


def test_each_replica_has_its_own_run_file_and_lock_and_one_replica_the_plain_ones(tmp_path):
    out = tmp_path / "my results.jsonl"
    plain, part = RunStore(out, part=part_name(0, 1)), RunStore(out, part=part_name(1, 4))
    assert plain.run_path.name == "my results.jsonl.run.jsonl" and plain.lock_path.name == "my results.jsonl.lock"
    assert part.run_path.name == "my results.jsonl.dp1of4.run.jsonl" and part.lock_path.name == "my results.jsonl.dp1of4.lock"
    with RunStore(out, part="dp0of4"), RunStore(out, part="dp1of4"):  # replicas never share a lock
        pass
    part.run_path.write_text("{}\n", encoding="utf-8")
    assert other_parts(out, 4) == [] and other_parts(out, 2) == [part.run_path] and other_parts(out, 1) == [part.run_path]
