"""`--quantize-dense`: attention projections, shared experts and the LM head (read in full at every decode step)
held for torch's CPU weight-only kernels behind F.linear. `DenseCache`'s key names the CPU kernel, since int4's
packed layout differs between AVX2 and AVX-512 builds.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from core.model.cpu.kernels import LinearOnlyWeight
from core.model.quant.cache import CacheEntry
from core.model.quant.dense_spec import kernel_takes
from core.model.quant.experts import _kernel_linear, _kernel_pack, cpu_kernel_ok
from core.model.quant.formats import Format, quantize

ROWS = 256  # rows quantized and packed at a time: a multiple of the int4 layout's 64-row tiles
KERNEL_ALIGN = 64  # the kernels' vector loads want their operands aligned: so are the cached tensors in the file


class QuantWeight(LinearOnlyWeight):
    """A [N, K] weight held only as int8/int4 in the CPU kernel's prepacked layout."""

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, fmt: Format, kernel: tuple):
        obj = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu", requires_grad=False)
        obj.fmt, obj.kernel = fmt, kernel
        return obj

    @property
    def held_bytes(self) -> int:
        """Bytes the kernel's layout holds (the wrapper's own numel × itemsize is the bf16 weight's)."""
        return sum(t.numel() * t.element_size() for t in self.kernel if isinstance(t, torch.Tensor))

    def linear(self, x, bias):
        y = _kernel_linear(self.fmt, x.reshape(-1, x.shape[-1]), self.kernel).view(*x.shape[:-1], self.shape[0])
        return y if bias is None else y.add_(bias)

    def __repr__(self) -> str:
        return f"QuantWeight(shape={tuple(self.shape)}, dtype={self.dtype}, {self.fmt.label})"


def takes(w: torch.Tensor, fmt: Format) -> bool:
    n, k = w.shape
    return kernel_takes(fmt, n, k) and cpu_kernel_ok(fmt, n, k, w.dtype)


def kernel_layout(fmt: Format, n: int, k: int, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if fmt.name == "int8":
        return [("q", torch.int8, (n, k)), ("scale", dtype, (n,))]
    return [("packed", torch.uint8, (n, k // 2)), ("sz", dtype, (k // fmt.group, n, 2))]


def pack_rows(w: torch.Tensor, fmt: Format) -> tuple:
    """`w` quantized and packed, ROWS rows at a time so the float32 temporaries stay near a megabyte."""
    n, k = w.shape
    out = [torch.empty(shape, dtype=dt) for _, dt, shape in kernel_layout(fmt, n, k, w.dtype)]
    for r in range(0, n, ROWS):
        part = _kernel_pack(fmt, quantize(fmt, w[r:r + ROWS]), w.dtype)
        out[0][r:r + ROWS].copy_(part[0])
        (out[1][:, r:r + ROWS] if fmt.name == "int4" else out[1][r:r + ROWS]).copy_(part[1])  # int4's: [K/g, N, 2]
    return tuple(out) + ((fmt.group,) if fmt.name == "int4" else ())


def quantize_dense(w: torch.Tensor, fmt: Format) -> torch.Tensor:
    if not takes(w, fmt):
        return w
    return QuantWeight(w.shape, w.dtype, fmt, pack_rows(w.contiguous(), fmt))


class DenseCache:
    """One checkpoint's quantized dense weights in the user cache, mapped, or written in the order of `names`."""

    def __init__(self, model_dir: Path, fmt: Format, dtype: torch.dtype, names: list[tuple[str, int, int]],
                 key: dict):
        self.fmt, self.dtype = fmt, dtype
        self.entry = CacheEntry(Path(model_dir), {"dense": fmt.label, "dtype": str(dtype), "kernel":
                                                  torch.backends.cpu.get_cpu_capability(),
                                                  "torch": torch.__version__.split("+")[0], **key})
        self.mapped = _map(self.entry.file) if self.entry.complete else None
        self.writer = None
        if self.mapped is None:
            self.writer = self.entry.writer([(f"{name}.{s}", dt, shape) for name, n, k in names
                                             for s, dt, shape in kernel_layout(fmt, n, k, dtype)], align=KERNEL_ALIGN)

    @property
    def cached(self) -> bool:
        return self.mapped is not None

    def weight(self, name: str, w: torch.Tensor) -> torch.Tensor:
        if self.mapped is not None:
            kernel = tuple(self.mapped[f"{name}.{s}"] for s, _, _ in kernel_layout(self.fmt, *w.shape, w.dtype))
            return QuantWeight(w.shape, w.dtype, self.fmt, kernel + ((self.fmt.group,) if self.fmt.name == "int4" else ()))
        q = quantize_dense(w, self.fmt)
        for (s, _, _), t in zip(kernel_layout(self.fmt, *w.shape, w.dtype), q.kernel):
            self.writer.write(f"{name}.{s}", t)
        return q

    def __enter__(self) -> "DenseCache":
        return self

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.__exit__(*exc)
            self.writer = None


def _map(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a view of one private (copy-on-write) map: read on touch, never written."""
    from core.model.safetensors_io import _read_header

    infos = _read_header(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    out = {}
    for name, t in infos.items():
        count = (t.end - t.start) // torch.empty((), dtype=t.dtype).element_size()
        out[name] = torch.frombuffer(mm, dtype=t.dtype, count=count, offset=t.start).view(t.shape)
        if out[name].data_ptr() % KERNEL_ALIGN:  # not written by this version's writer: a copy, never a crash
            out[name] = out[name].clone()
    return out


def dense_cache(model_dir: Path, spec, fmt: Format | None, dtype: torch.dtype, key: dict | None = None):
    from core.model.quant.dense_spec import quantized_matrices, with_dense

    if fmt is None or not cpu_kernel_ok(fmt, 16, max(fmt.group, 2), dtype):
        return None
    names = [(f"layers.{i}.{name}" if i >= 0 else name, n, k)
             for i, name, n, k in quantized_matrices(with_dense(spec, fmt))]
    return DenseCache(model_dir, fmt, dtype, names, key or {}) if names else None
