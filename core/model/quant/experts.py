"""The routed experts of one layer held quantized (`ExpertScheme`: w13 or w1/w3, and w2, each in its own
`Format`), and how they compute: on the bytes as stored (the C int4 and GGUF kernels, torch's weight-only
kernels over a prepacked copy) at small batch, else an expert expanded into a reused buffer for a matmul.
Legend: E = experts, D = hidden, I = expert intermediate, n = tokens routed to the expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.model.cpu import gguf_blocks, gguf_token, int4
from core.model.quant.expand import Workspace, expand_into
from core.model.quant.formats import (DEFAULT_INT4_GROUP, KERNEL_ROWS, NATIVE_GGUF_ROWS, NATIVE_INT4_ROWS, Format,
                                      quantize)


@dataclass(frozen=True)
class Matrix:
    name: str  # w13 | w1 | w3 | w2
    fmt: Format
    n: int  # output rows
    k: int  # inputs


@dataclass(frozen=True)
class ExpertScheme:
    up: tuple[Matrix, ...]  # gate rows then up rows
    down: Matrix

    @classmethod
    def uniform(cls, fmt: Format, hidden: int, inter: int) -> "ExpertScheme":
        fmt.check(2 * inter, hidden, "the experts' gate/up projection")
        fmt.check(hidden, inter, "the experts' down projection")
        return cls((Matrix("w13", fmt, 2 * inter, hidden),), Matrix("w2", fmt, hidden, inter))

    @property
    def matrices(self) -> tuple[Matrix, ...]:
        return (*self.up, self.down)

    def parts(self, experts: int):
        """(entry name, dtype name, shape) of every stored tensor, experts stacked first."""
        return [(f"{m.name}.{p.suffix}", p.dtype, (experts, *p.shape)) for m in self.matrices for p in m.fmt.parts(m.n, m.k)]

    def bits_per_weight(self) -> float:
        return 8 * sum(m.fmt.nbytes(m.n, m.k) for m in self.matrices) / sum(m.n * m.k for m in self.matrices)

    @property
    def label(self) -> str:
        return "/".join(sorted({m.fmt.label for m in self.matrices}))


class QuantExperts:
    """One layer's quantized experts over views `parts` ({"w13.q": [E, ...], ...}) on one device."""

    def __init__(self, scheme: ExpertScheme, parts: dict[str, torch.Tensor], dtype: torch.dtype,
                 scratch: dict | None = None):
        self.scheme, self.parts, self.dtype = scheme, parts, dtype
        first = next(iter(parts.values()))
        self.num_experts, self.device = first.shape[0], first.device
        # shared by the layers of a model: one expert's expansion and its workspaces, per device
        self.scratch = {} if scratch is None else scratch
        self.workspace: Workspace = self.scratch.setdefault(("workspace", str(self.device)), Workspace(self.device))
        self.packed: dict[str, list] | None = None  # per matrix, per expert: the CPU kernel's layout
        self.native = False  # int4 on core.model.cpu.int4's kernel: `parts` are its operands as they are
        self.blocks = False  # GGUF blocks on core.model.cpu.gguf_blocks' kernel: the file's bytes as they are
        self.kernel_rows = KERNEL_ROWS
        self._key = {m.name: f"{m.name}.{m.fmt.parts(m.n, m.k)[0].suffix}" for m in scheme.matrices}

    def __len__(self) -> int:
        return self.num_experts

    def matrix_parts(self, m: Matrix, e: int) -> dict[str, torch.Tensor]:
        return {p.suffix: self.parts[f"{m.name}.{p.suffix}"][e] for p in m.fmt.parts(m.n, m.k)}

    def up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, D] -> [n, 2I] (gate, then up)."""
        if len(self.scheme.up) == 1:
            return self._linear(self.scheme.up[0], e, x)
        return torch.cat([self._linear(m, e, x) for m in self.scheme.up], -1)

    def down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """h [n, I] -> [n, D]."""
        return self._linear(self.scheme.down, e, h)

    def in_one_call(self, h: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
        """The tokens' k experts (SwiGLU) weighed and summed in one C call (GGUF up to gguf_token.TOKENS tokens,
        int4 at one); None where it does not run."""
        if self.blocks and len(self.scheme.up) == 1:
            if h.shape[0] > gguf_token.TOKENS:
                return None
            up, down = self.scheme.up[0], self.scheme.down
            args = (h, idx, weights, (up.fmt.name, self.parts["w13.raw"]), (down.fmt.name, self.parts["w2.raw"]))
            out = gguf_token.moe(*args)  # Q8_0 and K-quant rows dotted in place: the same result, faster
            return out if out is not None else gguf_blocks.moe(*args)
        group = self.scheme.down.fmt.group
        if h.shape[0] != 1 or not self.native or self.kernel_rows < 1 or not int4.runs(h.dtype, *(m.k for m in self.scheme.matrices),
                                                                      group=group):
            return None
        p = self.parts
        return int4.moe(h, idx, weights, (p["w13.q"], p["w13.sz"]), (p["w2.q"], p["w2.sz"]), group)

    def _linear(self, m: Matrix, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.blocks and x.shape[0] <= self.kernel_rows:
            raw = self.parts[f"{m.name}.raw"][e]
            y = torch.empty((x.shape[0], raw.shape[0]), dtype=x.dtype) if x.shape[0] <= gguf_token.ROWS else None
            if y is not None and gguf_token.linear(m.fmt.name, x, raw, y):  # an expert's few rows (batched decode):
                return y  # the blocks dotted in place, the same values
            return gguf_blocks.linear(m.fmt.name, x, raw, out=y)  # declined: the same buffer, no second one
        if self.native and x.shape[0] <= self.kernel_rows and int4.runs(x.dtype, m.k, group=m.fmt.group):
            return int4.linear(x, self.parts[f"{m.name}.q"][e], self.parts[f"{m.name}.sz"][e], m.fmt.group)
        if self.packed is not None and (x.shape[0] <= self.kernel_rows or self._key[m.name] not in self.parts):
            return _kernel_linear(m.fmt, x, self.packed[m.name][e])
        return F.linear(x, self.expand(m, e))

    def expand(self, m: Matrix, e: int) -> torch.Tensor:
        """Expert e's matrix m in the compute dtype, in a buffer reused by every layer and step."""
        return expand_into(self.workspace, m.fmt, self.matrix_parts(m, e), m.n, m.k, self.dtype)

    def pack_cpu(self) -> bool:
        """Ready the experts for a CPU kernel where format and shapes allow (torch's get each expert prepacked)."""
        if self.device.type == "cpu" and all(gguf_blocks.runs(m.fmt.name, self.dtype, m.k)
                                              for m in self.scheme.matrices):
            self.blocks = True
            self.kernel_rows = NATIVE_GGUF_ROWS
            return True
        if self._native_ok():
            self.native = True
            self.kernel_rows = NATIVE_INT4_ROWS
            return True
        if not all(cpu_kernel_ok(m.fmt, m.n, m.k, self.dtype) for m in self.scheme.matrices):
            return False
        self.packed = {m.name: [_kernel_pack(m.fmt, self.matrix_parts(m, e), self.dtype) for e in range(len(self))]
                       for m in self.scheme.matrices}
        return True

    def _native_ok(self) -> bool:
        """int4 gate/up as one matrix and down, each at a group the C kernel takes, and the kernel here."""
        up, down = self.scheme.up, self.scheme.down
        return (self.device.type == "cpu" and len(up) == 1 and up[0].name == "w13" and
                all(m.fmt.name == "int4" for m in self.scheme.matrices) and up[0].fmt == down.fmt and
                int4.runs(self.dtype, up[0].k, down.k, group=down.fmt.group))

    def detach_parts(self, copy: bool = True) -> None:
        """After packing, stop reading the flat buffer so it can go (torch's int4 layout cannot expand: those
        experts always take its kernel). `copy=False`: the parts stay views, so a load never holds them twice."""
        if self.native or self.blocks:
            if copy or not self.blocks:
                self.parts = {k: v.clone() for k, v in self.parts.items()}
            return
        kept = {}
        for m in self.scheme.matrices:
            if m.fmt.name == "int8":
                kept[f"{m.name}.q"] = torch.stack([p[0] for p in self.packed[m.name]])
                kept[f"{m.name}.scale"] = self.parts[f"{m.name}.scale"].clone()
                self.packed[m.name] = [(kept[f"{m.name}.q"][e], p[1]) for e, p in enumerate(self.packed[m.name])]
        self.parts = kept


def kernel_probe(name: str, rows: int = 64, n: int = 2048, k: int = 1024, dtype: torch.dtype = torch.bfloat16):
    """(run, flops): one call of the CPU kernel for `name` on `rows` tokens as the engine calls it (one token on
    the C kernel: the fused call, two of four experts), for the hardware probe; RuntimeError where there is none."""
    fmt = Format("int4", DEFAULT_INT4_GROUP) if name == "int4" else Format(name)
    g = torch.Generator().manual_seed(0)
    if fmt.name == "int4" and rows == 1 and int4.runs(dtype, k, n // 2, group=fmt.group):
        E, D, I = 4, k, n // 2
        w13 = quantize(fmt, torch.randn(E, 2 * I, D, generator=g) / D ** 0.5)
        w2 = quantize(fmt, torch.randn(E, D, I, generator=g) / I ** 0.5)
        h, idx, wts = torch.randn(1, D, generator=g).to(dtype), torch.tensor([[1, 3]]), torch.tensor([[0.5, 0.5]])
        return (lambda: int4.moe(h, idx, wts, (w13["q"], w13["sz"]), (w2["q"], w2["sz"]), fmt.group)), 2.0 * 2 * 3 * D * I
    parts = quantize(fmt, torch.randn(n, k, generator=g) / k ** 0.5)
    x = torch.randn(rows, k, generator=g).to(dtype)
    if fmt.name == "int4" and int4.runs(dtype, k, group=fmt.group):  # as QuantExperts._linear on the C kernel
        if rows <= NATIVE_INT4_ROWS:
            return (lambda: int4.linear(x, parts["q"], parts["sz"], fmt.group)), 2.0 * rows * n * k
        ws = Workspace(torch.device("cpu"))
        return (lambda: F.linear(x, expand_into(ws, fmt, parts, n, k, dtype))), 2.0 * rows * n * k
    if not cpu_kernel_ok(fmt, n, k, dtype):
        raise RuntimeError(f"this torch has no CPU {name} kernel for {dtype}")
    packed = _kernel_pack(fmt, parts, dtype)
    return (lambda: _kernel_linear(fmt, x, packed)), 2.0 * rows * n * k


def cpu_kernel_ok(fmt: Format, n: int, k: int, dtype: torch.dtype) -> bool:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if fmt.name == "int8":
        return hasattr(torch.ops.aten, "_weight_int8pack_mm")
    if fmt.name == "int4":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and n % 16 == 0 and k % fmt.group == 0
    return False


def _kernel_pack(fmt: Format, parts: dict, dtype: torch.dtype):
    if fmt.name == "int8":
        return parts["q"], parts["scale"].to(dtype)
    q = parts["q"]
    nib = torch.stack([q & 15, q >> 4], -1).reshape(q.shape[0], -1).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nib, 1)
    sz = parts["sz"].transpose(0, 1).contiguous().to(dtype)  # the kernel wants [K/g, N, 2]
    return packed, sz, fmt.group


def _kernel_linear(fmt: Format, x: torch.Tensor, packed) -> torch.Tensor:
    x = x.contiguous()
    if fmt.name == "int8":
        return torch.ops.aten._weight_int8pack_mm(x, packed[0], packed[1])
    w, sz, g = packed
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, g, sz)
