"""Finding a model's GGUF file(s) and reading their metadata and tensor index; tensor bytes are read later straight
into their destination (`read_into`), so the file's pages never pile up as a second copy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.errors import ModelError

SPLIT = re.compile(r"^(?P<base>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$", re.IGNORECASE)


def _set_of(path: Path) -> list[Path]:
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    files = [path.with_name(f"{m['base']}-{i:05d}-of-{m['n']}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelError(f"{path.name} is part {int(m['i'])} of {n}, but {missing[0]} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                         "download every part of the split GGUF into the same folder")
    return files


def _base(path: Path) -> str:
    m = SPLIT.match(path.name)
    return m["base"] if m else path.stem


def find_gguf(path: str | Path) -> list[Path] | None:
    """The GGUF file(s) of `path` (a .gguf file or a folder holding one model's GGUF), None if it is not GGUF."""
    path = Path(path)
    if path.is_file():
        return _set_of(path) if path.suffix.lower() == ".gguf" else None
    if not path.is_dir():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if not found:
        return None
    sets = {_base(p): p for p in reversed(found)}  # each model's first file
    if len(sets) > 1:
        names = ", ".join(sorted(p.name if not SPLIT.match(p.name) else f"{b}-*-of-*.gguf" for b, p in sets.items()))
        raise ModelError(f"{path} holds {len(sets)} GGUF models ({names})", "give the one you want: --model FOLDER/FILE.gguf")
    first = next(iter(sets.values()))
    m = SPLIT.match(first.name)
    return _set_of(first.with_name(f"{m['base']}-00001-of-{m['n']}.gguf") if m else first)


@dataclass(frozen=True)
class TensorRef:
    name: str
    kind: str  # the GGML type's name: F32, F16, BF16, Q4_K, ...
    shape: tuple[int, ...]  # torch order: rows first, the contiguous (input) dimension last
    path: Path
    offset: int  # absolute byte offset of the data in `path`
    nbytes: int


class GGUFModel:
    def __init__(self, paths: list[Path]):
        from gguf import GGUFReader

        self.paths = paths
        self.fields: dict = {}
        self.tensors: dict[str, TensorRef] = {}
        for i, p in enumerate(paths):
            try:
                reader = GGUFReader(p)
            except Exception as e:  # the gguf package raises ValueError, struct errors, ...: all mean "not readable"
                raise ModelError(f"cannot read {p.name} as GGUF: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                                 "the file is damaged or not a GGUF file; download it again") from e
            if i == 0:
                self.fields = reader.fields
            size = p.stat().st_size
            for t in reader.tensors:
                ref = TensorRef(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())), p,
                                int(t.data_offset), int(t.n_bytes))
                if ref.offset + ref.nbytes > size:
                    raise ModelError(f"{p.name} is truncated: {t.name} ends past the end of the file",
                                     "the download was interrupted; download it again")
                self.tensors[t.name] = ref
            del reader  # its memory map is only needed while parsing

    @property
    def name(self) -> str:
        return _base(self.paths[0])

    def meta(self, key: str, default=None):
        f = self.fields.get(key)
        return default if f is None else f.contents()

    @property
    def arch(self) -> str:
        arch = self.meta("general.architecture")
        if not arch:
            raise ModelError(f"{self.paths[0].name} has no general.architecture", "the file is not a model GGUF")
        return arch

    def arch_meta(self, key: str, default=None):
        return self.meta(f"{self.arch}.{key}", default)


def read_into(ref: TensorRef, dest: torch.Tensor, start: int = 0) -> None:
    """Copy `dest.nbytes` bytes of tensor `ref`, from byte `start` of its data, into the contiguous CPU tensor `dest`."""
    n = dest.numel() * dest.element_size()
    if start + n > ref.nbytes:
        raise ModelError(f"GGUF tensor {ref.name} has {ref.nbytes} bytes, fewer than its shape needs",
                         "the file is damaged; download it again")
    buf = memoryview(dest.view(torch.uint8).reshape(-1).numpy()) if n else None
    with open(ref.path, "rb") as f:
        f.seek(ref.offset + start)
        if n and f.readinto(buf) != n:
            raise ModelError(f"{ref.path.name} ended while reading {ref.name}", "the file is damaged; download it again")


def read_float(ref: TensorRef) -> torch.Tensor:
    """The whole tensor expanded to float32 (dense weights: one at a time)."""
    from core.model.quant.blocks import decode_gguf
    from core.model.quant.formats import GGUF_BLOCKS

    raw = torch.empty(ref.nbytes, dtype=torch.uint8)
    read_into(ref, raw)
    floats = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    if ref.kind in floats:
        return raw.view(floats[ref.kind]).float().reshape(ref.shape)
    rows = raw.reshape(-1, ref.nbytes // math.prod(ref.shape[:-1])) if ref.shape else raw
    if ref.kind in GGUF_BLOCKS:
        return decode_gguf(ref.kind, rows).reshape(ref.shape)
    from gguf import GGMLQuantizationType, quants

    try:
        out = quants.dequantize(rows.numpy(), GGMLQuantizationType[ref.kind])
    except NotImplementedError as e:
        raise ModelError(f"GGUF tensor {ref.name} is {ref.kind}, which mlight cannot read",
                         "use a GGUF made with another quantization (Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0)") from e
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(ref.shape)
