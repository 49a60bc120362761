"""One quantized matrix expanded into the compute dtype, per expert per layer per step: so nothing allocates after the
first call (output, chunks, even scalar operands live in a `Workspace`). The arithmetic is `formats.dequantize`'s op
for op in float32, rounded once: bit for bit the reference's. Legend: n = rows, k = inputs, g = int4 group, r = chunk rows.
"""

from __future__ import annotations

import math

import torch

from core.model.quant.blocks import _nibbles, expand_blocks
from core.model.quant.formats import CHUNK_ELEMS_CPU, CHUNK_ELEMS_DEVICE, Format


class Workspace:
    """Buffers for expanding matrices, by role and shape, on one device: made on first use, then reused."""

    def __init__(self, device, chunk_elems: int | None = None, consts: dict | None = None):
        self.device = torch.device(device)
        self.chunk_elems = chunk_elems or (CHUNK_ELEMS_CPU if self.device.type == "cpu" else CHUNK_ELEMS_DEVICE)
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._consts = self._bufs if consts is None else consts  # `consts`: shared with other workspaces
        self.allocations = 0  # buffers made so far (tests: stays put once every shape has been seen)

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The output buffer of one shape (a whole expert matrix), kept for every later call."""
        key = (role, shape, dtype)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty(shape, dtype=dtype, device=self.device)
            self.allocations += 1
        return buf

    def chunk(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view of one flat buffer per role, shared by every shape (grown only for a larger chunk)."""
        numel = math.prod(shape)
        buf = self._bufs.get((role, dtype))
        if buf is None or buf.numel() < numel:
            buf = self._bufs[(role, dtype)] = torch.empty(numel, dtype=dtype, device=self.device)
            self.allocations += 1
        return buf[:numel].view(shape)

    def const(self, value, dtype: torch.dtype) -> torch.Tensor:
        """A 0-dim tensor holding `value`: an operand that costs no allocation per op."""
        key = ("const", value, dtype)
        t = self._consts.get(key)
        if t is None:
            t = self._consts[key] = torch.tensor(value, dtype=dtype, device=self.device)
            self.allocations += 1
        return t

    def rows(self, n: int, k: int) -> int:
        return max(1, min(n, self.chunk_elems // k))


def expand_into(ws: Workspace, fmt: Format, parts: dict[str, torch.Tensor], n: int, k: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The matrix `parts` stand for ([n, k], one expert) in `dtype`, in the workspace's output buffer."""
    out = ws.get("out", (n, k), dtype)
    if out.device.type == "cpu" and "raw" in parts:  # GGUF blocks: the C decoder's values are these, bit for bit
        from core.model.cpu import gguf_blocks

        if gguf_blocks.runs(fmt.name, dtype, k):
            return gguf_blocks.dequantize(fmt.name, parts["raw"], out)
    rows = ws.rows(n, k)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        dst = out[r0:r1]
        # float32 values are computed in `dst` itself when it is float32, else in the workspace
        w = dst if dst.dtype == torch.float32 else ws.chunk("f32", (r1 - r0, k), torch.float32)
        if fmt.name == "int8":
            w.copy_(parts["q"][r0:r1])
            w.mul_(parts["scale"][r0:r1, None])  # fp32 scale: same dtype, so no promoted copy of either side
        elif fmt.name == "int4":
            _int4(ws, parts, r0, r1, k, fmt.group, w)
        else:
            expand_blocks(ws, fmt, parts, r0, r1, w)
        if w is not dst:
            dst.copy_(w)
    return out


def _int4(ws, parts, r0, r1, k, g, w):
    r = r1 - r0
    pairs = w.view(r, k // 2, 2)
    _nibbles(ws, parts["q"][r0:r1], pairs[..., 0], pairs[..., 1])  # even k: low nibble
    sz = ws.chunk("sz", (r, k // g, 2), torch.float32)
    sz.copy_(parts["sz"][r0:r1])
    groups = w.view(r, k // g, g)
    groups.sub_(ws.const(8.0, torch.float32)).mul_(sz[..., 0:1]).add_(sz[..., 1:2])
