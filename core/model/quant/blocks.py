"""Block formats decoded with torch: GGUF's Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, and gpt-oss's MXFP4.

The float32 arithmetic of the `gguf` package's reference decoder in its order (bit for bit the same),
on any device. Layouts (per block):
  Q8_0  d f16 | q int8[32]                                  y = q·d
  Q4_0  d f16 | q[16] (low nibbles: 0..15, high: 16..31)    y = (q − 8)·d
  Q4_K  d f16 | dmin f16 | 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32 | q[128]
        sub-block j: y = d·sc_j · q − dmin·m_j; 64 values per 32 bytes, low nibbles first
  Q5_K  as Q4_K with qh[32] (the fifth bits) before q[128]
  Q6_K  ql[128] | qh[64] | sc int8[16] | d f16               y = d·sc · (q − 32), 16 values per scale
  MXFP4 e u8 | q[16] (low nibbles: 0..15, high: 16..31)     y = 2^(e−128) · {0,1,2,3,4,6,8,12, −…}[q]
gpt-oss MXFP4 instead interleaves (even k in the low nibble) and keeps exponents apart, biased 127.
"""

from __future__ import annotations

import torch

from core.model.quant.formats import GGUF_BLOCKS, Format

_MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _const(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table on `device`, kept: made per call it was a host-to-device copy per expert decoded."""
    key = (values, dtype, str(device))
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor, width: int) -> torch.Tensor:
    """q [n, m, width] -> [n, m, 2, width]: low nibbles, then high."""
    return torch.stack([q & 15, q >> 4], -2)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K/Q5_K block -> 8 six-bit scales and 8 mins, as float32 [n, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc.float(), mn.float()


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b):
    q = _nibbles(b[:, None, 2:], 16).reshape(b.shape[0], 32).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    ds, dm = (d * sc)[..., None], (dmin * mn)[..., None]
    q = _nibbles(b[:, 16:].reshape(n, 4, 32), 32).reshape(n, 8, 32).float()
    return (ds * q - dm).reshape(n, 256)


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    ds, dm = (d * sc)[..., None], (dmin * mn)[..., None]
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = _nibbles(qs.reshape(n, 4, 32), 32).reshape(n, 8, 32)
    hi = torch.stack([(qh >> i) & 1 for i in range(8)], 1)  # [n, 8, 32]: bit i is sub-block i's fifth bit
    q = (ql | (hi << 4)).float()
    return (ds * q - dm).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
    ds = (_f16(d) * sc.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    lo = _nibbles(ql.reshape(n, 2, 64), 64).reshape(n, 8, 32)
    hi = torch.stack([(qh.reshape(n, 2, 32) >> s) & 3 for s in (0, 2, 4, 6)], 2).reshape(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (ds * q).reshape(n, 256)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e − 128) as float32, built from its bits like ggml (subnormal for e < 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, _const(0x00200000, torch.int32, e.device) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4_gguf(b):
    n = b.shape[0]
    d = _e8m0_half(b[:, :1])
    idx = _nibbles(b[:, None, 1:], 16).reshape(n, 32).long()
    lut = _const(_MXFP4_DOUBLED, torch.int8, b.device)
    return d * lut[idx].float()


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4_gguf}


def decode_gguf(name: str, raw: torch.Tensor) -> torch.Tensor:
    """GGUF blocks raw [..., bytes] (uint8) -> float32 [..., values]."""
    bs, ts = GGUF_BLOCKS[name]
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, ts)
    return _DECODERS[name](blocks).reshape(*lead, raw.shape[-1] // ts * bs)


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss MXFP4: blocks [..., G, 16] uint8, scales [..., G] uint8 (biased 127) -> float32 [..., G·32]."""
    lut = _const(_E2M1, torch.float32, blocks.device)
    vals = lut[torch.stack([blocks & 15, blocks >> 4], -1).long()]  # [..., G, 16, 2]: even k low
    vals = vals.reshape(*blocks.shape[:-1], 32)
    out = torch.ldexp(vals, scales.to(torch.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1)


def decode(fmt: Format, parts: dict) -> torch.Tensor:
    if fmt.name == "mxfp4":
        return decode_mxfp4(parts["blocks"], parts["scales"])
    return decode_gguf(fmt.name, parts["raw"])
