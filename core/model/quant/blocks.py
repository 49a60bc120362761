"""Block formats decoded with torch on any device (GGUF's Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, and gpt-oss's
MXFP4), in the float32 arithmetic and order of the `gguf` package's reference decoder: bit for bit. Per block:
  Q8_0  d f16 | q int8[32]                                  y = q·d
  Q4_0  d f16 | q[16] (low nibbles: 0..15, high: 16..31)    y = (q − 8)·d
  Q4_K  d f16 | dmin f16 | 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32 | q[128]
        sub-block j: y = d·sc_j · q − dmin·m_j; 64 values per 32 bytes, low nibbles first
  Q5_K  as Q4_K with qh[32] (the fifth bits) before q[128]
  Q6_K  ql[128] | qh[64] | sc int8[16] | d f16               y = d·sc · (q − 32), 16 values per scale
  MXFP4 e u8 | q[16] (low nibbles: 0..15, high: 16..31)     y = 2^(e−128) · {0,1,2,3,4,6,8,12, −…}[q]
gpt-oss MXFP4 instead interleaves (even k in the low nibble) and keeps exponents apart, biased 127. Every op writes
into a `Workspace` chunk, so expanding an expert (quant.expand) allocates nothing after a format's first call.
Legend: n = blocks in the chunk, r = rows, G = 32-value groups of a row.
"""

from __future__ import annotations

import torch

from core.model.quant.formats import GGUF_BLOCKS, Format

U8, I32, F32 = torch.uint8, torch.int32, torch.float32
_MXFP4_F32 = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)  # doubled e2m1
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# per device, `decode`'s lookup tables and scalars: made per call they were a host-to-device copy per expert
_CONSTS: dict[str, dict] = {}


def expand_blocks(ws, fmt: Format, parts: dict[str, torch.Tensor], r0: int, r1: int, out: torch.Tensor) -> None:
    """Rows r0..r1 of a block-format matrix into `out` (float32 [r, k], contiguous)."""
    if fmt.name == "mxfp4":
        _gpt_oss_mxfp4(ws, parts["blocks"][r0:r1], parts["scales"][r0:r1], out)
        return
    bs, ts = GGUF_BLOCKS[fmt.name]
    b = parts["raw"][r0:r1].reshape(-1, ts)
    _DECODERS[fmt.name](ws, b, out.view(-1, bs))


def _f16(ws, b, at: int, role: str) -> torch.Tensor:
    """The fp16 at byte `at` of each block as float32 [n, 1]."""
    raw = ws.chunk(role + ".u8", (b.shape[0], 2), U8)
    raw.copy_(b[:, at:at + 2])
    d = ws.chunk(role, (b.shape[0], 1), F32)
    d.copy_(raw.view(torch.float16))
    return d


def _nibbles(ws, q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """q's low nibbles into `lo`, high into `hi` (any dtype: converted as copied)."""
    u = ws.chunk("nib", q.shape, U8)
    torch.bitwise_and(q, ws.const(15, U8), out=u)
    lo.copy_(u)
    torch.bitwise_right_shift(q, ws.const(4, U8), out=u)
    hi.copy_(u)


def _q8_0(ws, b, y):
    d = _f16(ws, b, 0, "d")
    y.copy_(b[:, 2:].view(torch.int8))
    y.mul_(d)


def _q4_0(ws, b, y):
    d = _f16(ws, b, 0, "d")
    _nibbles(ws, b[:, 2:], y[:, :16], y[:, 16:])
    y.sub_(ws.const(8.0, F32)).mul_(d)


def _scale_min_k4(ws, s, d, dmin):
    """The 8 six-bit scales and mins of a Q4_K/Q5_K block, times d and dmin: float32 [n, 8] each."""
    n = s.shape[0]
    a, c = ws.chunk("k4.a", (n, 4), U8), ws.chunk("k4.c", (n, 4), U8)
    out = []
    for role, lo4, f in (("k4.sc", s[:, 0:4], d), ("k4.mn", s[:, 4:8], dmin)):
        q = ws.chunk(role + ".u8", (n, 8), U8)
        torch.bitwise_and(lo4, ws.const(0x3F, U8), out=q[:, :4])
        if role == "k4.sc":
            torch.bitwise_and(s[:, 8:12], ws.const(0x0F, U8), out=a)
        else:
            torch.bitwise_right_shift(s[:, 8:12], ws.const(4, U8), out=a)
        torch.bitwise_right_shift(lo4, ws.const(2, U8), out=c)
        c.bitwise_and_(ws.const(0x30, U8))
        torch.bitwise_or(a, c, out=q[:, 4:])
        v = ws.chunk(role, (n, 8), F32)
        v.copy_(q)
        out.append(v.mul_(f)[..., None])
    return out


def _q4_k(ws, b, y):
    n = b.shape[0]
    ds, dm = _scale_min_k4(ws, b[:, 4:16], _f16(ws, b, 0, "d"), _f16(ws, b, 2, "dmin"))
    y4 = y.view(n, 4, 2, 32)
    _nibbles(ws, b[:, 16:].view(n, 4, 32), y4[:, :, 0], y4[:, :, 1])
    y.view(n, 8, 32).mul_(ds).sub_(dm)


def _q5_k(ws, b, y):
    n = b.shape[0]
    ds, dm = _scale_min_k4(ws, b[:, 4:16], _f16(ws, b, 0, "d"), _f16(ws, b, 2, "dmin"))
    q = ws.chunk("q5", (n, 8, 32), U8)
    q4 = q.view(n, 4, 2, 32)
    _nibbles(ws, b[:, 48:].view(n, 4, 32), q4[:, :, 0], q4[:, :, 1])
    bit = ws.chunk("q5.bit", (n, 32), U8)
    for i in range(8):  # bit i of qh is sub-block i's fifth bit
        torch.bitwise_right_shift(b[:, 16:48], ws.const(i, U8), out=bit)
        bit.bitwise_and_(ws.const(1, U8)).bitwise_left_shift_(ws.const(4, U8))
        q[:, i].bitwise_or_(bit)
    y3 = y.view(n, 8, 32)
    y3.copy_(q)
    y3.mul_(ds).sub_(dm)


def _q6_k(ws, b, y):
    n = b.shape[0]
    q = ws.chunk("q6", (n, 8, 32), U8)
    q4 = q.view(n, 2, 2, 64)
    _nibbles(ws, b[:, :128].view(n, 2, 64), q4[:, :, 0], q4[:, :, 1])
    two = ws.chunk("q6.hi", (n, 2, 32), U8)
    q24 = q.view(n, 2, 4, 32)
    for j in range(4):  # bits 2j, 2j+1 of qh are the high bits of sub-block 4h+j
        torch.bitwise_right_shift(b[:, 128:192].view(n, 2, 32), ws.const(2 * j, U8), out=two)
        two.bitwise_and_(ws.const(3, U8)).bitwise_left_shift_(ws.const(4, U8))
        q24[:, :, j].bitwise_or_(two)
    ds = ws.chunk("q6.ds", (n, 16), F32)
    ds.copy_(b[:, 192:208].view(torch.int8))
    ds.mul_(_f16(ws, b, 208, "d"))
    y.copy_(q.view(n, 256))
    y.sub_(ws.const(32.0, F32))
    y.view(n, 16, 16).mul_(ds[..., None])


def _e8m0_half(ws, e_u8: torch.Tensor) -> torch.Tensor:
    """2^(e − 128) as float32 [n, 1] from its bits (subnormal for e < 2)."""
    n = e_u8.shape[0]
    e = ws.chunk("e8.e", (n, 1), I32)
    e.copy_(e_u8)
    sub, norm = ws.chunk("e8.sub", (n, 1), I32), ws.chunk("e8.norm", (n, 1), I32)
    torch.bitwise_left_shift(ws.const(0x00200000, I32), e, out=sub)
    torch.sub(e, ws.const(1, I32), out=norm)
    norm.bitwise_left_shift_(ws.const(23, I32))
    small = ws.chunk("e8.small", (n, 1), torch.bool)
    torch.lt(e, ws.const(2, I32), out=small)
    torch.where(small, sub, norm, out=norm)
    return norm.view(F32)


def _mxfp4_gguf(ws, b, y):
    n = b.shape[0]
    d = _e8m0_half(ws, b[:, :1])
    idx = ws.chunk("mx.idx", (n, 32), torch.int64)
    _nibbles(ws, b[:, 1:], idx[:, :16], idx[:, 16:])
    torch.index_select(ws.const(_MXFP4_F32, F32), 0, idx.view(-1), out=y.view(-1))
    y.mul_(d)


def _gpt_oss_mxfp4(ws, blocks, scales, y):
    r, G = scales.shape
    idx = ws.chunk("mx.idx", (r, G, 16, 2), torch.int64)
    _nibbles(ws, blocks, idx[..., 0], idx[..., 1])  # even k in the low nibble
    torch.index_select(ws.const(_E2M1, F32), 0, idx.view(-1), out=y.view(-1))
    e = ws.chunk("mx.e", (r, G, 1), I32)
    e.copy_(scales[..., None])
    e.sub_(ws.const(127, I32))
    y3 = y.view(r, G, 32)
    torch.ldexp(y3, e, out=y3)


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4_gguf}


def _workspace(device) -> "Workspace":
    from core.model.quant.expand import Workspace

    return Workspace(device, consts=_CONSTS.setdefault(str(device), {}))


def decode_gguf(name: str, raw: torch.Tensor) -> torch.Tensor:
    """GGUF blocks raw [..., bytes] (uint8) -> float32 [..., values]."""
    bs, ts = GGUF_BLOCKS[name]
    out = torch.empty((*raw.shape[:-1], raw.shape[-1] // ts * bs), dtype=F32, device=raw.device)
    _DECODERS[name](_workspace(raw.device), raw.reshape(-1, ts), out.view(-1, bs))
    return out


def decode(fmt: Format, parts: dict) -> torch.Tensor:
    """The float32 matrix (any leading dims) a block format's parts stand for; gpt-oss MXFP4's: [..., G·32]."""
    if fmt.name != "mxfp4":
        return decode_gguf(fmt.name, parts["raw"])
    scales = parts["scales"]
    G = scales.shape[-1]
    out = torch.empty((*scales.shape, 32), dtype=F32, device=scales.device)
    _gpt_oss_mxfp4(_workspace(scales.device), parts["blocks"].reshape(-1, G, 16), scales.reshape(-1, G),
                   out.view(-1, G * 32))
    return out.view(*scales.shape[:-1], G * 32)
