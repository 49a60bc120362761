"""The quantized cache's writer: two writers of one entry both end with a whole entry; failures are MlightErrors."""

from __future__ import annotations

import threading

import pytest
import torch

from core.errors import MlightError
from core.model.quant import cache as qcache
from core.model.quant.cache import CacheEntry
from core.model.safetensors_io import Checkpoint

TENSORS = {"embed": torch.arange(12, dtype=torch.float32).reshape(3, 4), "layers.0": torch.arange(40, dtype=torch.uint8)}


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "model ✓"
    d.mkdir()
    (d / "config.json").write_text("{}", encoding="utf-8")
    return d


def _writer(entry):
    w = entry.writer([(n, t.dtype, tuple(t.shape)) for n, t in TENSORS.items()])
    for n, t in TENSORS.items():
        w.write(n, t)
    return w


def _check_whole(entry):
    assert entry.complete
    ckpt = Checkpoint(entry.dir)
    for n, t in TENSORS.items():
        got = torch.empty_like(t)
        ckpt.copy_into(n, got)
        assert torch.equal(got, t)
    assert not list(entry.dir.glob("*.tmp"))  # neither writer left its temporary file


def test_two_writers_of_one_entry_both_end_with_a_whole_entry(model_dir):
    """Both quantize at once (both files open before either commits), then both commit: with one shared
    temporary name the second commit found its file renamed away (FileNotFoundError)."""
    a, b = CacheEntry(model_dir, {"scheme": "int8"}), CacheEntry(model_dir, {"scheme": "int8"})
    wa, wb = _writer(a), _writer(b)
    wa.commit()
    wb.commit()
    _check_whole(a)
    _check_whole(b)


def test_writers_in_threads_commit_once(model_dir):
    entries = [CacheEntry(model_dir, {"scheme": "int4"}) for _ in range(4)]
    errors = []

    def work(e):
        try:
            _writer(e).commit()
        except BaseException as ex:  # noqa: BLE001 - reported below
            errors.append(ex)

    threads = [threading.Thread(target=work, args=(e,)) for e in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    _check_whole(entries[0])


def test_a_failed_commit_is_a_user_error(model_dir, monkeypatch):
    entry = CacheEntry(model_dir, {"scheme": "int8"})
    w = _writer(entry)

    def denied(src, dst):
        raise PermissionError(13, "Access is denied", str(dst))

    monkeypatch.setattr(qcache.os, "replace", denied)
    monkeypatch.setattr("core.platform.replace", denied)
    with pytest.raises(MlightError, match="cannot write the quantized cache.*MLIGHT_CACHE_DIR") as info:
        w.commit()
    assert isinstance(info.value.__cause__, PermissionError)
    assert not entry.complete and not list(entry.dir.glob("*.tmp"))
