"""Tensors out of safetensors files without pickles or a second copy: the header is parsed before anything is
allocated (a truncated shard is caught), each tensor copied from a memory-mapped window of its own.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import ModelError

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_GRANULARITY = mmap.ALLOCATIONGRANULARITY  # mmap offsets must be multiples of it (64 KiB on Windows)


@dataclass(frozen=True)
class TensorInfo:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelError(f"{path.name} is not a safetensors file (too short)", "download the model again")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100_000_000):
                raise ModelError(f"{path.name} has a corrupt header", "download the model again")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path.name}: {e}", "the shard is damaged; download the model again") from e
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_DTYPES[meta["dtype"]]
            start, end = (base + int(o) for o in meta["data_offsets"])
            shape = tuple(int(s) for s in meta["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"{path.name} has a corrupt entry for {name}", "download the model again") from e
        if end > size:
            raise ModelError(
                f"{path.name} is truncated: {name} ends at byte {end} but the file has {size} bytes",
                "the download was interrupted; download the model again",
            )
        out[name] = TensorInfo(path, dtype, shape, start, end)
    return out


class Checkpoint:
    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shards():
            self.tensors.update(_read_header(shard))

    def _shards(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, KeyError, ValueError) as e:
                raise ModelError(f"cannot read {index.name}: {e}", "download the model again") from e
            shards = [self.dir / name for name in sorted(set(weight_map.values()))]
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise ModelError(
                    f"shard {missing[0]} listed in {index.name} is missing from {self.dir}"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                    "finish the download (mlight download resumes it) or copy the missing files",
                )
            return shards
        shards = sorted(self.dir.glob("*.safetensors"))
        if shards:
            return shards
        if any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pt")):
            raise ModelError(f"{self.dir} only has pickle weights (.bin/.pt); mlight never loads pickles",
                             "use a checkpoint that ships .safetensors files")
        raise ModelError(f"{self.dir} has no .safetensors files", "give the folder holding the model's weights")

    def keys(self) -> set[str]:
        return set(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"the checkpoint in {self.dir} has no tensor {name}",
                             "it is incomplete or not the architecture its config.json names") from None

    def copy_into(self, name: str, dest: torch.Tensor, view: tuple[int, ...] | None = None,
                  transpose: bool = False, select: tuple | None = None, fit: bool = False,
                  narrow: tuple[int, int, int] | None = None) -> None:
        """Tensor `name` into `dest` (dtype converted) through its own mmap window; the options as families' `Piece`,
        `narrow` = (dim, start, length): only that slice (a tensor-parallel rank's part)."""
        t = self.info(name)
        count = (t.end - t.start) // t.dtype.itemsize
        if not count:
            return
        aligned = t.start - t.start % _GRANULARITY
        with open(t.path, "rb") as f:
            # ACCESS_COPY: a writable private map (torch.frombuffer wants writable) that never writes back.
            mm = mmap.mmap(f.fileno(), t.end - aligned, access=mmap.ACCESS_COPY, offset=aligned)
        try:
            src = torch.frombuffer(mm, dtype=t.dtype, count=count, offset=t.start - aligned).view(view or t.shape)
            if transpose:
                src = src.transpose(-1, -2)
            if select is not None:
                src = src[select]
            if fit and narrow is not None and src.numel() != dest.numel():
                src, narrow = _fit_narrowed(src, dest.shape, narrow), None
            if fit and src.numel() == dest.numel():
                src = src.reshape(dest.shape)
            if narrow is not None:
                src = src.narrow(*narrow)
            if tuple(src.shape) != tuple(dest.shape):
                raise ModelError(f"tensor {name} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}",
                                 "the config.json does not match the weights")
            dest.copy_(src)
            del src
        finally:
            mm.close()


def _fit_narrowed(src: torch.Tensor, shape, narrow: tuple[int, int, int]) -> torch.Tensor:
    """A selection `src` fitted to the whole piece, then narrowed (per-head rows a rank keeps): where the piece's
    first dim merges src's first two, only the kept rows are gathered."""
    dim, start, length = narrow
    if dim == 0 and src.dim() == len(shape) + 1 and tuple(src.shape[2:]) == tuple(shape[1:]):
        rows = torch.arange(start, start + length)
        return src[rows // src.shape[1], rows % src.shape[1]]
    full = list(shape)
    full[dim] = -1
    return src.reshape(full).narrow(dim, start, length)
