"""The quantized cache: a checkpoint quantized once, kept as safetensors in `<cache>/quantized/<key>/`, mapped after.
Written under a temporary name and committed under the entry's file lock: an interrupted load leaves nothing trusted,
and the second of two writers drops its copy (never replacing a file a reader may have mapped).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import tempfile
from pathlib import Path

import filelock
import torch

from core import platform
from core.errors import MlightError
from core.model.safetensors_io import ST_DTYPES

VERSION = 1  # bump when the flat-buffer layout of quantized layers changes
_ST_DTYPE = {dtype: name for name, dtype in ST_DTYPES.items()}
_SAMPLE = 1 << 20  # bytes hashed at each of three places in a shard


def cache_root() -> Path:
    return platform.cache_dir() / "quantized"


def fingerprint(model_dir: Path) -> str:
    """A content hash of a checkpoint folder without reading all of it: config.json and per weight file its
    size, header and 1 MiB from its start, middle and end (a Hugging Face cache's blob name where it has one)."""
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    for f in sorted(model_dir.iterdir()):
        if f.name == "config.json" or f.suffix in (".safetensors", ".gguf"):
            h.update(f.name.encode())
            real = f.resolve()
            if real.parent.name == "blobs":
                h.update(real.name.encode())
                continue
            size = real.stat().st_size
            h.update(str(size).encode())
            with open(real, "rb") as fh:
                for at in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                    fh.seek(at)
                    h.update(fh.read(_SAMPLE))
    return h.hexdigest()


class CacheEntry:
    def __init__(self, model_dir: Path, what: dict):
        h = hashlib.sha256(fingerprint(model_dir).encode())
        h.update(json.dumps({**what, "version": VERSION}, sort_keys=True).encode())
        self.key = h.hexdigest()[:24]
        self.dir = cache_root() / self.key
        self.file = self.dir / "model.safetensors"
        self.what = what
        self.source = str(model_dir)

    @property
    def complete(self) -> bool:
        return self.file.is_file() and (self.dir / "meta.json").is_file()

    def writer(self, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], align: int = 8) -> "StreamWriter":
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _cache_error(self.dir, e) from e
        return StreamWriter(self, tensors, align)

    def _write_meta(self) -> None:
        meta = {"source": self.source, "version": VERSION, **self.what}
        platform.write_whole(self.dir / "meta.json", json.dumps(meta, indent=1, sort_keys=True))


class StreamWriter:
    """A safetensors file written tensor by tensor in a fixed order, its header computed up front."""

    def __init__(self, entry: CacheEntry, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], align: int):
        """`align`: each tensor starts at a multiple of it in the file, so kernels with aligned loads read mapped
        tensors in place; the gaps are `__pad.<i>` tensors, so the file stays plain safetensors."""
        self.entry, self.path, self.tmp, self.fh = entry, entry.file, None, None
        header, off, self.pads = {}, 0, {}
        for name, dtype, shape in tensors:
            if off % align:
                gap = align - off % align
                self.pads[name] = f"__pad.{len(self.pads)}"
                header[self.pads[name]] = {"dtype": "U8", "shape": [gap], "data_offsets": [off, off + gap]}
                off += gap
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        self.order = list(header)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % align)  # data starts aligned too
        self.sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()}
        self.next = 0
        try:  # a name of its own: another process may be writing this entry too
            fd, tmp = tempfile.mkstemp(prefix=self.path.stem + ".", suffix=".tmp", dir=self.path.parent)
            self.tmp, self.fh = Path(tmp), os.fdopen(fd, "wb")
            self.fh.write(struct.pack("<Q", len(raw)) + raw)
        except OSError as e:
            self.abort()
            raise _cache_error(self.tmp or self.path, e) from e

    def write(self, name: str, t: torch.Tensor) -> None:
        if name in self.pads and self.order[self.next] == self.pads[name]:
            self._put(bytes(self.sizes[self.pads[name]]))
            self.next += 1
        if self.order[self.next] != name:
            raise RuntimeError(f"cache writer expected {self.order[self.next]}, got {name}")
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != self.sizes[name]:
            raise RuntimeError(f"cache writer: {name} has {data.nbytes} bytes, expected {self.sizes[name]}")
        self._put(memoryview(data))
        self.next += 1

    def _put(self, data) -> None:
        try:
            self.fh.write(data)
        except OSError as e:
            self.abort()
            raise _cache_error(self.tmp, e) from e

    def commit(self) -> None:
        if self.next != len(self.order):
            raise RuntimeError("cache writer closed before every tensor was written")
        try:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            with filelock.FileLock(self.entry.dir / "entry.lock"):
                if not self.entry.complete:  # else: an identical entry is there, maybe mapped by a reader
                    platform.replace(self.tmp, self.path)
                    self.entry._write_meta()
        except (OSError, filelock.Timeout) as e:
            raise _cache_error(self.path, e) from e
        finally:
            self.abort()

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, kind, *_) -> None:  # kept only when the block ran through
        if kind is None:
            self.commit()
        else:
            self.abort()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            if self.fh is not None:
                self.fh.close()
            if self.tmp is not None:
                self.tmp.unlink(missing_ok=True)


def _cache_error(where: Path, e: BaseException) -> MlightError:
    return MlightError(f"cannot write the quantized cache at {where}: {e}",
                       "free disk space, or set MLIGHT_CACHE_DIR to a writable folder")
