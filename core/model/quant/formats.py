"""Weight formats: what a quantized matrix W [N, K] stores (expert stacks add a leading E), what a weight costs, and
float references. Dtypes are names, so the planner sizes formats without importing torch.
- int8: `q` int8 [N, K], `scale` fp32 [N]; W ≈ q · scale.
- int4: `q` uint8 [N, K/2] (even k low), `sz` bf16 [N, K/g, 2]; W ≈ (q − 8) · scale + zero, torch's int4
  kernels' convention, so the kernel and the dequantizing path read the same numbers.
- mxfp4 (gpt-oss): `blocks` uint8 [N, K/32, 16], `scales` uint8 [N, K/32] (e8m0).
- GGUF blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4): `raw` uint8 [N, K/block · type_size], the file's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.errors import UsageError

QUANTIZE_CHOICES = ("none", "int8", "int4", "auto")
INT4_GROUPS = (32, 64, 128)  # torch's int4 kernels take 32, 64, 128 (and 256)
DEFAULT_INT4_GROUP = 64
# GGUF block formats decoded on the fly (kept as-is in RAM and on the wire): block size, bytes per block
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
               "MXFP4": (32, 17)}
# Expanding a quantized matrix goes a chunk of rows at a time through a float32 workspace (expand.py)
CHUNK_ELEMS_CPU = 1 << 18  # 1 MB: the expanded rows are read back from L2
CHUNK_ELEMS_DEVICE = 1 << 23  # 32 MB: a Mixtral expert's up projection in 14 chunks of a few launches each
# Tokens on one expert above which a kernel loses to expand-then-matmul (torch's int8, mlight's C int4 and GGUF
# block kernels); here so that the planner, which never imports torch, prices what the engine runs
KERNEL_ROWS = 16
NATIVE_INT4_ROWS = 128
NATIVE_GGUF_ROWS = 128
_ITEMSIZE = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Part:
    suffix: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Format:
    """A weight-only format. `group`: inputs sharing one scale (0 for int8's per-channel scale)."""

    name: str
    group: int = 0

    def __post_init__(self):
        if self.name == "int4" and self.group not in INT4_GROUPS:
            raise UsageError(f"int4 group size {self.group} is not supported", f"use one of {INT4_GROUPS}")
        if self.name not in ("int8", "int4", "mxfp4") and self.name not in GGUF_BLOCKS:
            raise UsageError(f"unknown weight format {self.name!r}", "use int8 or int4")

    @property
    def label(self) -> str:
        return f"int4-g{self.group}" if self.name == "int4" else self.name

    @classmethod
    def from_label(cls, label: str) -> Format | None:
        """The Format `label` names; None for "none" and mixed GGUF formats (e.g. "Q4_K/Q6_K")."""
        if label.startswith("int4-g"):
            return cls("int4", int(label[len("int4-g"):]))
        return cls(label) if label in ("int8", "mxfp4", *GGUF_BLOCKS) else None

    def check(self, n: int, k: int, what: str = "a matrix") -> None:
        """Refuse shapes the format cannot hold: K must be a whole number of groups (and of byte pairs)."""
        b = (GGUF_BLOCKS[self.name][0] if self.name in GGUF_BLOCKS
             else {"int4": self.group, "mxfp4": 32}.get(self.name, 1))
        if k % max(b, 2 if self.name == "int4" else 1):
            raise UsageError(f"{what} has {k} inputs, not a multiple of the {self.label} block of {b}",
                             f"use another group size ({', '.join(map(str, INT4_GROUPS))}) or --quantize int8"
                             if self.name == "int4" else "the checkpoint's shapes do not fit its own format; is it damaged?")

    def parts(self, n: int, k: int) -> tuple[Part, ...]:
        if self.name == "int8":
            return Part("q", "int8", (n, k)), Part("scale", "float32", (n,))
        if self.name == "int4":
            return Part("q", "uint8", (n, k // 2)), Part("sz", "bfloat16", (n, k // self.group, 2))
        if self.name == "mxfp4":
            return Part("blocks", "uint8", (n, k // 32, 16)), Part("scales", "uint8", (n, k // 32))
        bs, ts = GGUF_BLOCKS[self.name]
        return (Part("raw", "uint8", (n, k // bs * ts)),)

    def nbytes(self, n: int, k: int) -> int:
        return sum(p.nbytes for p in self.parts(n, k))


def workspace_bytes(fmt: Format, shapes, compute_bytes: int, chunk_elems: int = CHUNK_ELEMS_DEVICE) -> int:
    """Device bytes a `Workspace` (quant.expand) holds once matrices of these (n, k) shapes in `fmt` were
    expanded: an output per shape and the chunk buffers (block formats: a float32 chunk, its bytes, scales)."""
    shapes = sorted(set(shapes))
    out = sum(n * k for n, k in shapes) * compute_bytes
    if fmt.name not in ("int8", "int4"):
        e = max(min(n * k, chunk_elems) for n, k in shapes)
        return out + e * 4 + e // 2 + e // 32 * 2 * 4
    chunks = [max(1, min(n, chunk_elems // k)) * k for n, k in shapes]  # Workspace.rows × k
    f32 = 0 if compute_bytes == 4 else max(chunks) * 4
    if fmt.name == "int8":
        return out + f32
    return out + f32 + max(chunks) // 2 + max(chunks) // fmt.group * 2 * 4 + 1 + 1 + 4  # + 15, 4 (uint8), 8.0


def parse_choice(quantize: str | None, group: int | None = None) -> Format | None:
    """`--quantize` (none | int8 | int4; auto is the planner's) and `--group-size` as a Format, or None."""
    if quantize in (None, "none"):
        return None
    if quantize == "int8":
        return Format("int8")
    if quantize == "int4":
        return Format("int4", group or DEFAULT_INT4_GROUP)
    raise UsageError(f"unknown --quantize {quantize!r}", f"use one of {', '.join(QUANTIZE_CHOICES)}")


def fit_group(fmt: Format, *dims: int) -> Format:
    """int4 with the largest group no larger than asked that divides every K the experts have."""
    if fmt.name != "int4" or all(d % fmt.group == 0 for d in dims):
        return fmt
    for g in sorted(INT4_GROUPS, reverse=True):
        if g <= fmt.group and all(d % g == 0 for d in dims):
            return Format("int4", g)
    raise UsageError(f"int4 needs the hidden and expert sizes ({', '.join(map(str, dims))}) to be multiples of 32",
                     "use --quantize int8 for this model")


def quantized_spec(spec, fmt: Format | None):
    """The ModelSpec with its experts stored in `fmt` (sizes, and so every byte the planner counts, follow)."""
    import dataclasses

    if fmt is None:
        return spec
    D, I = spec.hidden_size, spec.expert_intermediate
    fmt = fit_group(fmt, D, I)
    bits = 8 * (fmt.nbytes(2 * I, D) + fmt.nbytes(D, I)) / (3 * D * I)
    return dataclasses.replace(spec, expert_format=fmt.label, expert_bits=bits)


def quantize(fmt: Format, w):
    """W [..., N, K] (any float dtype) -> {suffix: tensor} in `fmt` (int8 and int4 only): the loader's quantizer."""
    import torch

    w = w.float()
    if fmt.name == "int8":
        scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
        return {"q": q, "scale": scale}
    if fmt.name != "int4":
        raise ValueError(f"cannot quantize to {fmt.name}")
    g = fmt.group
    wg = w.reshape(*w.shape[:-1], w.shape[-1] // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    # the stored (bf16) scale and zero are the ones dequantization will use: round with them
    scale = ((hi - lo) / 15).clamp_min(1e-20).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((wg - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(w.shape)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return {"q": packed, "sz": torch.stack([scale, zero], -1).to(torch.bfloat16)}


def dequantize(fmt: Format, parts: dict, dtype=None):
    """The float32 (or `dtype`) matrix a format's parts stand for: the reference every kernel is tested against."""
    import torch

    if fmt.name == "int8":
        w = parts["q"].float() * parts["scale"].float()[..., None]
    elif fmt.name == "int4":
        q = parts["q"]
        nib = torch.stack([q & 15, q >> 4], -1).reshape(*q.shape[:-1], q.shape[-1] * 2).float()
        sz = parts["sz"].float()
        g = nib.shape[-1] // sz.shape[-2]
        nib = nib.reshape(*nib.shape[:-1], sz.shape[-2], g)
        w = ((nib - 8) * sz[..., 0:1] + sz[..., 1:2]).reshape(*q.shape[:-1], -1)
    else:
        from core.model.quant.blocks import decode

        w = decode(fmt, parts)
    return w if dtype is None else w.to(dtype)
