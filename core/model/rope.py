"""Rotary position embeddings: cos/sin tables built once, applied by position. Full or partial (the first `dim` dims
of a head), halves (Llama) or interleaved pairs (DeepSeek, written back as [rotated evens, rotated odds]: q·k is the
same while q and k share the layout), YaRN and LongRoPE, whose scale depends on the length of the forward call a
token belongs to (transformers' PhimoeRotaryEmbedding). Legend: T = tokens, H = heads, P = positions, r = rotated dims.
"""

from __future__ import annotations

import math
import weakref

import torch

from core.model.spec import RopeSpec


def inv_freq(r: RopeSpec, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] in fp32, cos/sin scale) for a rotation over `dim` dims."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = r.theta ** exponents
    if r.kind == "default":
        return 1.0 / base, 1.0
    if r.kind == "yarn":
        return _yarn(r, dim, base, max_position)
    if r.kind == "longrope":
        factors = torch.tensor(r.short_factor, dtype=torch.float32)
        if factors.numel() != dim // 2:
            raise ValueError(f"LongRoPE short_factor has {factors.numel()} entries, the head rotates {dim // 2} pairs")
        return 1.0 / (factors * base), 1.0
    raise ValueError(f"unknown RoPE kind {r.kind!r}")


def _yarn(r: RopeSpec, dim: int, base: torch.Tensor, max_position: int) -> tuple[torch.Tensor, float]:
    factor = r.factor or max_position / r.original_max

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if r.attention_factor is not None:
        attention = r.attention_factor
    elif r.mscale and r.mscale_all_dim:
        attention = mscale(factor, r.mscale) / mscale(factor, r.mscale_all_dim)
    else:
        attention = mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return dim * math.log(r.original_max / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    freq = (1.0 / (factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate
    return freq, attention


class Rope:
    def __init__(self, r: RopeSpec, dim: int, max_positions: int, dtype: torch.dtype, device="cpu",
                 model_max_position: int | None = None):
        self.dim, self.pairs = dim, r.pairs
        freq, attention = inv_freq(r, dim, model_max_position or max_positions)
        angles = torch.arange(max_positions).float()[:, None] * freq[None, :]  # [P, r/2]
        scales = [attention]
        self.switch = 0  # LongRoPE: tokens in calls longer than this use the second table
        if r.kind == "longrope" and r.short_mscale is not None:
            scales = [r.short_mscale, r.long_mscale if r.long_mscale is not None else r.short_mscale]
            self.switch = r.original_max
        half = angles if r.pairs else torch.cat((angles, angles), dim=-1)  # pairs: one angle per pair
        self.cos = torch.cat([(half.cos() * s) for s in scales]).to(dtype).to(device)  # [P·tables, r or r/2]
        self.sin = torch.cat([(half.sin() * s) for s in scales]).to(dtype).to(device)
        # rotate_half's sign per half [2, 1]: folded into the halves' sin in one exact product
        self.sign = torch.tensor([[-1.0], [1.0]], dtype=dtype, device=device)
        self.positions = max_positions
        # per live positions tensor (a decode step's micro-batches each have theirs): [a weak reference to it,
        # its version, call_lengths, its version, cos, sin, the halves' forms]; an entry goes with its tensor, or
        # when `keep` newer ones came after it
        self._kept: dict[int, list] = {}
        self._keep = 1

    @property
    def keep(self) -> int:  # a decode step's runner sets its micro-batches' count; a prefill's, 1
        return self._keep

    @keep.setter
    def keep(self, n: int) -> None:
        self._keep = max(1, n)
        while len(self._kept) > self._keep:
            self._kept.pop(next(iter(self._kept)), None)  # the oldest

    def tables(self, positions: torch.Tensor, call_lengths: torch.Tensor | None = None):
        """(cos, sin) [T, 1, r or r/2] at `positions` [T]; `call_lengths` [T]: each token's call's (LongRoPE). Kept per
        live, unchanged positions tensor: a step gathers twice per micro-batch, not per layer."""
        kept = self._entry(positions, call_lengths)
        return kept[4], kept[5]

    def _entry(self, positions: torch.Tensor, call_lengths: torch.Tensor | None) -> list:
        key = id(positions)
        kept = self._kept.get(key)
        if (kept is None or kept[0]() is not positions or kept[1] != positions._version or kept[2] is not call_lengths
                or (call_lengths is not None and kept[3] != call_lengths._version)):
            rows = positions  # LongRoPE's: in the second table where the token's call is longer than `switch`
            if self.switch and call_lengths is not None:
                rows = positions + self.positions * (call_lengths > self.switch).to(positions.dtype)
            entries = self._kept
            while entries and len(entries) >= self._keep:
                entries.pop(next(iter(entries)), None)  # the oldest
            gone = weakref.ref(positions, lambda _, key=key: entries.pop(key, None))
            kept = entries[key] = [gone, positions._version, call_lengths,
                                   None if call_lengths is None else call_lengths._version,
                                   self.cos[rows][:, None, :], self.sin[rows][:, None, :], None]
        return kept

    def _halves(self, positions: torch.Tensor, call_lengths: torch.Tensor | None):
        """(cos, ±sin) [T, 1, 2, r/2]: rotate_half's sign folded into sin, once per kept entry."""
        kept = self._entry(positions, call_lengths)
        if kept[6] is None:
            cos, sin = kept[4], kept[5]
            T = cos.shape[0]
            sign = self.sign.to(sin.device)
            if self.pairs:  # one angle per pair: the same for the even and the odd row (a broadcast view)
                kept[6] = (cos[:, :, None, :].expand(T, 1, 2, cos.shape[-1]), sin[:, :, None, :] * sign)
            else:  # cos and sin are [angles, angles]
                half = cos.shape[-1] // 2
                kept[6] = (cos.view(T, 1, 2, half), sin.view(T, 1, 2, half) * sign)
        return kept[6]

    def joins_in_c(self, x: torch.Tensor) -> bool:
        """Whether core.model.cpu.row_ops.rope_join may rotate these heads (it checks its other conditions itself)."""
        return (not self.pairs and x.dtype == self.cos.dtype and x.dtype in (torch.bfloat16, torch.float32)
                and x.device.type == "cpu")

    def apply(self, x: torch.Tensor, positions: torch.Tensor, call_lengths: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H, hd], positions [T] -> x with its first `dim` dims rotated, both layouts as halves X [T, H, 2, r/2]:
        X·cos + swap(X)·(±sin), the reference's roundings (a·(−s) is −(a·s) exactly) in four ops. `out` [T, H, r]
        (last stride 1): only the rotated dims, written there (a slice of the payload); x[..., :r] itself in halves."""
        cos, sin = self._halves(positions, call_lengths)
        d = self.dim
        rot, rest = (x, None) if d == x.shape[-1] else (x[..., :d], x[..., d:])
        T, H = rot.shape[:2]
        halves = rot.unflatten(-1, (d // 2, 2)).transpose(-1, -2) if self.pairs else rot.unflatten(-1, (2, d // 2))
        swapped = halves.flip(-2) * sin  # before `out` is written: it may be x
        if out is not None and self.pairs and out.data_ptr() == x.data_ptr():
            raise ValueError("the pairs layout cannot rotate in place")
        dst = (out.unflatten(-1, (2, d // 2)) if out is not None
               else torch.empty((T, H, 2, d // 2), dtype=x.dtype, device=x.device))
        torch.mul(halves, cos, out=dst)
        dst.add_(swapped)
        if out is not None:
            return out
        dst = dst.view(T, H, d)  # [T, H, r]: pairs come out as [rotated evens, rotated odds]
        return dst if rest is None else torch.cat((dst, rest), dim=-1)


def for_spec(spec, max_positions: int, dtype: torch.dtype, device="cpu") -> Rope:
    return Rope(spec.rope, spec.rope_dim, max_positions, dtype, device, model_max_position=spec.max_position)
