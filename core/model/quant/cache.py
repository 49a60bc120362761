"""The quantized cache: a checkpoint quantized once, kept as safetensors in the user cache, memory-mapped after.

Layout of one entry, `<cache>/quantized/<key>/`: `model.safetensors` holding `embed`, `norm`, `lm_head`
in the compute dtype and `layers.<i>`, each layer's whole flat buffer as bytes (dense weights and
quantized experts exactly as `core.model.weights` lays them out), and `meta.json` saying what it is.
The key hashes the checkpoint's content (`fingerprint`), the expert scheme, the compute dtype and
this layout's version, so a changed checkpoint or format never reads a stale entry.

The file is written front to back while the loader quantizes layer by layer (the header is known
up front: every size follows from the spec), under a temporary name renamed into place when
complete, so an interrupted first load leaves nothing that a later load would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from core.errors import MlightError

VERSION = 1  # bump when the flat-buffer layout of quantized layers changes
_ST_DTYPE = {torch.uint8: "U8", torch.int8: "I8", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float32: "F32", torch.float64: "F64"}
_SAMPLE = 1 << 20  # bytes hashed at each of three places in a shard


def cache_root() -> Path:
    from core.model.demo import cache_dir

    return cache_dir() / "quantized"


def fingerprint(model_dir: Path) -> str:
    """A content hash of a checkpoint folder without reading all of it: config.json, and per weight file its
    size, its safetensors header and 1 MiB from its start, middle and end. Files in a Hugging Face cache are
    named by their content hash already (blobs/<sha256>); that name is used instead of sampling."""
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


def entry_key(model_dir: Path, what: dict) -> str:
    h = hashlib.sha256(fingerprint(model_dir).encode())
    h.update(json.dumps({**what, "version": VERSION}, sort_keys=True).encode())
    return h.hexdigest()[:24]


class CacheEntry:
    """One quantized checkpoint in the cache."""

    def __init__(self, model_dir: Path, what: dict):
        self.key = entry_key(model_dir, what)
        self.dir = cache_root() / self.key
        self.file = self.dir / "model.safetensors"
        self.what = what
        self.source = str(model_dir)

    @property
    def complete(self) -> bool:
        return self.file.is_file() and (self.dir / "meta.json").is_file()

    def writer(self, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> "StreamWriter":
        self.dir.mkdir(parents=True, exist_ok=True)
        return StreamWriter(self.file, tensors, on_commit=self._write_meta)

    def _write_meta(self) -> None:
        meta = {"source": self.source, "version": VERSION, **self.what}
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.dir / "meta.json")


class StreamWriter:
    """A safetensors file written tensor by tensor in a fixed order, its header computed up front."""

    def __init__(self, path: Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], on_commit=None):
        self.path, self.tmp = path, path.with_suffix(".tmp")
        self.order = [name for name, _, _ in tensors]
        header, off = {}, 0
        for name, dtype, shape in tensors:
            n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-aligned
        self.sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()}
        self.next = 0
        self.on_commit = on_commit
        try:
            self.fh = open(self.tmp, "wb")
            self.fh.write(struct.pack("<Q", len(raw)) + raw)
        except OSError as e:
            raise MlightError(f"cannot write the quantized cache at {self.tmp}: {e}",
                              "free disk space or set MLIGHT_CACHE_DIR to a writable folder") from e

    def write(self, name: str, t: torch.Tensor) -> None:
        if self.order[self.next] != name:
            raise RuntimeError(f"cache writer expected {self.order[self.next]}, got {name}")
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != self.sizes[name]:
            raise RuntimeError(f"cache writer: {name} has {data.nbytes} bytes, expected {self.sizes[name]}")
        try:
            self.fh.write(memoryview(data))
        except OSError as e:
            self.abort()
            raise MlightError(f"cannot write the quantized cache at {self.tmp}: {e}",
                              "free disk space or set MLIGHT_CACHE_DIR to a writable folder") from e
        self.next += 1

    def commit(self) -> None:
        if self.next != len(self.order):
            raise RuntimeError("cache writer closed before every tensor was written")
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.path)
        if self.on_commit:
            self.on_commit()

    def abort(self) -> None:
        try:
            self.fh.close()
            self.tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
