"""A GGUF file's quantized dense projections held as its blocks on the CPU: expanded, Q4_K_M's attention would take
16 bits a weight instead of 4.5. Up to NATIVE_GGUF_ROWS tokens run on cpu.gguf_blocks' kernel, more a chunk of rows
expanded at a time; a projection fused from tensors of different formats is one segment per run of one format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.model.cpu import gguf_blocks, gguf_token
from core.model.cpu.kernels import LinearOnlyWeight
from core.model.quant.expand import Workspace, expand_into
from core.model.quant.formats import NATIVE_GGUF_ROWS, Format

CHUNK_ELEMS = 1 << 22  # weights expanded at a time above NATIVE_GGUF_ROWS tokens (8 MB of bf16)
_workspace: dict[str, Workspace] = {}


@dataclass(frozen=True)
class Segment:
    """Output rows [r0, r1) of a projection: `raw` uint8 [r1 - r0, bytes a row] in GGUF format `kind`."""

    r0: int
    r1: int
    kind: str
    raw: torch.Tensor


def merged(segments: list[Segment]) -> list[Segment]:
    """Adjacent segments of one format joined into one (q, k and v of one type: one kernel call, not three)."""
    out: list[Segment] = []
    for s in sorted(segments, key=lambda s: s.r0):
        if out and out[-1].kind == s.kind and out[-1].r1 == s.r0:
            p = out.pop()
            s = Segment(p.r0, s.r1, s.kind, torch.cat([p.raw, s.raw]))
        out.append(s)
    return out


class BlockWeight(LinearOnlyWeight):
    """A [N, K] weight held only as the GGUF file's blocks, in segments of output rows."""

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, segments: list[Segment]):
        obj = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu", requires_grad=False)
        obj.segments = merged(segments)
        if [(s.r0, s.r1) for s in obj.segments][:1] != [(0, obj.segments[0].r1)] or obj.segments[-1].r1 != shape[0] \
                or any(a.r1 != b.r0 for a, b in zip(obj.segments, obj.segments[1:])):
            raise ValueError(f"segments {[(s.r0, s.r1) for s in obj.segments]} do not cover {shape[0]} rows")
        return obj

    @property
    def held_bytes(self) -> int:
        return sum(s.raw.numel() for s in self.segments)

    @property
    def kinds(self) -> list[str]:
        return [s.kind for s in self.segments]

    def linear(self, x, bias):
        N, K = self.shape
        x2 = x.reshape(-1, K)
        y = torch.empty((x2.shape[0], N), dtype=x.dtype)
        if x2.shape[0] <= NATIVE_GGUF_ROWS:
            for s in self.segments:  # one Q8_0 or K-quant row: its blocks dotted in place (the same values)
                if not gguf_token.linear(s.kind, x2, s.raw, y[:, s.r0:s.r1]):
                    gguf_blocks.linear(s.kind, x2, s.raw, out=y[:, s.r0:s.r1])
        else:
            ws = _workspace.setdefault("cpu", Workspace("cpu"))
            rows = max(1, CHUNK_ELEMS // K)
            for s in self.segments:
                fmt = Format(s.kind)
                for a in range(0, s.r1 - s.r0, rows):
                    b = min(s.r1 - s.r0, a + rows)
                    w = expand_into(ws, fmt, {"raw": s.raw[a:b]}, b - a, K, x.dtype)
                    y[:, s.r0 + a:s.r0 + b].copy_(F.linear(x2, w))
        y = y.view(*x.shape[:-1], N)
        return y if bias is None else y.add_(bias)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole weight expanded ([N, K] in `dtype`, default its own): for a path without the kernel."""
        out = torch.empty(tuple(self.shape), dtype=dtype or self.dtype)
        ws = Workspace("cpu")
        for s in self.segments:
            out[s.r0:s.r1].copy_(expand_into(ws, Format(s.kind), {"raw": s.raw}, s.r1 - s.r0, self.shape[1], out.dtype))
        return out

    def __repr__(self) -> str:
        return f"BlockWeight(shape={tuple(self.shape)}, dtype={self.dtype}, {'/'.join(self.kinds)})"
