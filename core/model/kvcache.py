"""The attention state, preallocated in CPU memory, one row per batch slot: `KVStore` K and V `[S, Hkv, Tmax, hd]`
or a ring `[S, Hkv, W, hd]` (position p at p mod W); `LatentStore` `[S, Tmax, R + dr]` (MLA); `LinearStore` an fp32
recurrent state `[S, Hv, dk, dv]` and the last K−1 conv inputs `[S, conv, K−1]`.
Legend: S = slots, R = latent rank, dr = rope dims, K = conv kernel.
"""

from __future__ import annotations

import collections
import math
import mmap

import torch

from core.model.attention import attention_runs, padding_mask
from core.model.cpu import native, row_ops
from core.model.spec import ModelSpec


def untouched_zeros(shape, dtype) -> torch.Tensor:
    """Zeros whose pages the OS maps on first touch: a cache is sized for its longest request in every slot
    while a request touches its own length. Private, so Linux does not make it shared memory; small pages,
    since a row's heads lie ~0.4 MB apart."""
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # Windows: no flags
    m = mmap.mmap(-1, n, **private)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where THP is "always", as RHEL and Fedora set it
        m.madvise(mmap.MADV_NOHUGEPAGE)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # page-aligned; the mapping lives as long as the tensor
    return raw.view(dtype).view(shape)


class _Store:
    names: tuple[str, ...] = ()
    token_axes: tuple = ()  # per tensor: the axis of cached tokens, or None (a fixed-size state)
    window = 0

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in self.names)

    def over(self, tensors) -> "_Store":
        """A store of this kind whose tensors are `tensors` (a device ring buffer, host staging): nothing allocated."""
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        for n, t in zip(self.names, tensors):
            setattr(view, n, t)
        return view

    def shapes(self, rows: int, tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor of a store of `rows` rows with room for `tokens` tokens."""
        out = []
        for t, axis in zip(self.tensors, self.token_axes):
            shape = [rows, *t.shape[1:]]
            if axis is not None:
                shape[axis] = self.kept(tokens)
            out.append((tuple(shape), t.dtype))
        return out

    def new_shapes(self, rows: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((rows, *(d for a, d in enumerate(t.shape[1:], 1) if a != axis)), t.dtype)
                for t, axis in zip(self.tensors, self.token_axes)]

    def kept(self, lengths):
        return lengths

    def put_new(self, rows, parts) -> None:
        self.write(rows.slots, rows.positions, *parts)

    def write_prompt(self, slot: int, *parts: torch.Tensor) -> None:
        """A whole prompt's state for one slot: each part at positions [0, L) of its tensor's row."""
        for t, part, axis in zip(self.tensors, parts, self.token_axes):
            (t[slot] if axis is None else t[slot].narrow(axis - 1, 0, part.shape[axis - 1])).copy_(part)

    def move(self, src: int, dst: int, tokens: int) -> None:
        """Row `src`'s state (its first `tokens` tokens) into row `dst` (SlotTable.compact)."""
        n = self.kept(tokens)
        for t, axis in zip(self.tensors, self.token_axes):
            if axis is None:
                t[dst].copy_(t[src])
            elif n:
                t[dst].narrow(axis - 1, 0, n).copy_(t[src].narrow(axis - 1, 0, n))


class KVStore(_Store):
    """K and V per token, for every token ("kv") or in a ring of the last `window` ("window")."""

    kind = "kv"
    names = ("k", "v")
    token_axes = (2, 2)

    def __init__(self, slots: int, heads: int, head_dim: int, max_tokens: int, dtype, window: int = 0,
                 alloc=untouched_zeros):
        self.window = window if window and window < max_tokens else 0
        cap = self.window or max_tokens
        if self.window:
            self.kind = "window"
        self.k = alloc((slots, heads, cap, head_dim), dtype)
        self.v = alloc((slots, heads, cap, head_dim), dtype)

    def new_entries(self, rows) -> tuple:
        at, every = self.index(rows.positions), torch.arange(rows.B, device=self.k.device)
        return self.k[every, :, at], self.v[every, :, at]

    def write_rows(self, rows: "Rows", k: torch.Tensor, v: torch.Tensor) -> None:
        """`write` by one flat index a step on a contiguous host store (in C where built: cold rows' misses overlap)."""
        hd = self.k.shape[-1]
        if self.k.device.type != "cpu" or not (self.k.is_contiguous() and self.v.is_contiguous()):
            return self.write(rows.slots, rows.positions, k, v)
        at = self.write_index(rows)
        if row_ops.kv_write(self.k, self.v, k, v, at):
            return
        self.k.view(-1, hd).index_copy_(0, at, k.reshape(-1, hd).to(self.k.dtype))
        self.v.view(-1, hd).index_copy_(0, at, v.reshape(-1, hd).to(self.v.dtype))

    def write_index(self, rows: "Rows") -> torch.Tensor:
        """Flat row of each new (slot, head, position) [B·heads], once per step for every store of this shape."""
        def make():
            _, heads, cap, _ = self.k.shape
            first = (rows.slots * heads * cap + self.index(rows.positions))[:, None]
            return (first + torch.arange(heads, device=first.device)[None, :] * cap).reshape(-1)

        return rows.memo(("kv_rows", self.k.shape, self.window), make)

    def index(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % self.window if self.window else positions

    def kept(self, lengths):
        if not self.window:
            return lengths
        return lengths.clamp(max=self.window) if isinstance(lengths, torch.Tensor) else min(lengths, self.window)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """One token per slot: k, v [B, Hkv, hd] at (slots[b], positions[b]), in the store's dtype."""
        at = self.index(positions)
        self.k[slots, :, at] = k.to(self.k.dtype)
        self.v[slots, :, at] = v.to(self.v.dtype)

    def write_prompt(self, slot: int, k: torch.Tensor, v: torch.Tensor):
        """A whole prompt for one slot: k, v [L, Hkv, hd] at positions [0, L) (the last W in a ring)."""
        L = k.shape[0]
        start = max(0, L - self.window) if self.window else 0
        at = torch.arange(start, L, device=self.k.device) % self.window if start else slice(0, L)
        self.k[slot][:, at] = k[start:].transpose(0, 1).to(self.k.dtype)
        self.v[slot][:, at] = v[start:].transpose(0, 1).to(self.v.dtype)


class LatentStore(_Store):
    """MLA: the normed KV latent and the roped key of every token, side by side."""

    kind = "latent"
    names = ("lat",)
    token_axes = (1,)

    def __init__(self, slots: int, width: int, max_tokens: int, dtype, alloc=untouched_zeros):
        self.lat = alloc((slots, max_tokens, width), dtype)

    def new_entries(self, rows) -> tuple:
        return (self.lat[torch.arange(rows.B, device=self.lat.device), rows.positions],)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, lat: torch.Tensor):
        self.lat[slots, positions] = lat.to(self.lat.dtype)


class LinearStore(_Store):
    """Gated DeltaNet: recurrent state (fp32) and conv state, fixed size per sequence."""

    kind = "linear"
    names = ("rec", "conv")
    token_axes = (None, None)

    def __init__(self, slots: int, spec: ModelSpec, dtype, alloc=untouched_zeros):
        la = spec.linear
        self.rec = alloc((slots, la.num_v_heads, la.k_head_dim, la.v_head_dim), torch.float32)
        self.conv = alloc((slots, la.conv_dim, la.conv_kernel - 1), dtype)

    def new_entries(self, rows) -> tuple:
        # the whole state of each row: a linear layer rewrites all of it every token
        return self.rec[:rows.B].clone(), self.conv[:rows.B].clone()

    def put_new(self, rows, parts) -> None:
        rows.put(self.rec, parts[0])
        rows.put(self.conv, parts[1])


def load_rows(src, dst, rows, cached: int) -> int:
    """Copy `rows`' state (`cached` tokens each at most) from `src` into dst's first rows; returns the bytes moved."""
    moved = 0
    tokens = src.kept(cached)
    for a, b, axis in zip(src.tensors, dst.tensors, src.token_axes):
        if axis is not None and tokens == 0:
            continue
        part, b = rows.take(a), b[:rows.B]
        if axis is not None:  # along the token axis only the first `tokens` entries
            part, b = part.narrow(axis, 0, tokens), b.narrow(axis, 0, tokens)
        b.copy_(part)
        moved += part.numel() * a.element_size()
    return moved


def layer_store(spec: ModelSpec, i: int, slots: int, max_tokens: int, dtype, alloc=untouched_zeros):
    """Layer i's store; `alloc(shape, dtype)` puts it elsewhere than host memory. Zeros, not empty: masked
    positions still enter p @ v (as 0 × v), and 0 × NaN is NaN."""
    st = spec.layer_state(i)
    if st.kind == "linear":
        return LinearStore(slots, spec, dtype, alloc)
    if st.kind == "latent":
        return LatentStore(slots, st.token_elems, max_tokens, dtype, alloc)
    return KVStore(slots, spec.num_kv_heads, spec.head_dim, max_tokens, dtype, window=st.window, alloc=alloc)


class KVCache:
    """Every layer's store (None for the first `gpu_layers`); pageable: hundreds of GB is too much to pin."""

    def __init__(self, spec: ModelSpec, slots: int, max_tokens: int, dtype: torch.dtype, gpu_layers: int = 0):
        self.layers = [None if i < gpu_layers else layer_store(spec, i, slots, max_tokens, dtype)
                       for i in range(spec.num_layers)]
        self.slots, self.max_tokens = slots, max_tokens

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers if s is not None for t in s.tensors)


COVER_RATIO = 2  # attend over a gapped batch's covering rows while they are at most this many times its rows


class Rows:
    """One decode micro-batch's rows in the stores, built once per step on the host so no layer syncs a device.
    `move` puts the host tensors where the state lives (`device`). On the host, gapped slots are attended in place
    over their covering rows (a gap's row with a zero query, its output dropped): a gather copies K and V again."""

    def __init__(self, slots: list[int], positions: list[int], move=None, device=None):
        self.B = len(slots)
        self.device = device
        slots, positions = list(slots), list(positions)
        slots_t, positions_t = torch.tensor(slots), torch.tensor(positions)
        move = move or (lambda t: t)
        self.slots, self.positions, self.lengths = move(slots_t), move(positions_t), move(positions_t + 1)
        self.span = (min(positions) + 1, max(positions) + 1)
        lo = slots[0]
        contiguous = slots == list(range(lo, lo + len(slots)))
        self.sel = slice(lo, lo + len(slots)) if contiguous else None
        self._host_lengths = [p + 1 for p in positions]
        self.cover = None  # (covering rows, each slot's row in them, their lengths on the host)
        n = slots[-1] - lo + 1
        if not contiguous and device is None and slots == sorted(slots) and n <= COVER_RATIO * self.B:
            at = [s - lo for s in slots]
            lengths = [1] * n
            for a, length in zip(at, self._host_lengths):
                lengths[a] = length
            self.cover = (slice(lo, lo + n), torch.tensor(at), lengths)
        self._kept: dict[int, tuple] = {}
        self._plans: dict[tuple, "RowPlan"] = {}
        self._memo: dict = {}
        self._q: torch.Tensor | None = None  # queries at their covering rows, zeros in the gaps

    def memo(self, key, make):
        """`make()` once per key for these rows (what every layer of a step would compute alike)."""
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = make()
        return got

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This micro-batch's rows of a store tensor (a view when the slots are contiguous)."""
        return t[self.sel] if self.sel is not None else t.index_select(0, self.slots)

    def put(self, t: torch.Tensor, value: torch.Tensor) -> None:
        if self.sel is not None:
            t[self.sel] = value
        else:
            t.index_copy_(0, self.slots, value.to(t.dtype))

    def kept(self, store) -> tuple[torch.Tensor, tuple[int, int], torch.Tensor | None]:
        """(lengths, (min, max) on the host, padding mask or None) of what `store` holds for these rows."""
        window = getattr(store, "window", 0)
        if window not in self._kept:
            lengths = store.kept(self.lengths)
            span = (min(self.span[0], window), min(self.span[1], window)) if window else self.span
            pad = padding_mask(lengths, span[1]) if span[0] < span[1] else None
            self._kept[window] = (lengths, span, pad)
        return self._kept[window]

    def plan(self, store, widened: bool) -> "RowPlan":
        """How decode attention reads KV `store` for these rows: in place, in runs (attention_runs), or gathered."""
        key = (store.window, widened)
        if key not in self._plans:
            self._plans[key] = self._plan(store, widened)
            if store.k.device.type == "cpu":
                store.write_index(self)  # the step's KV write index too, outside the tasks
        return self._plans[key]

    def _plan(self, store, widened: bool) -> "RowPlan":
        if self.cover is None:
            host = [] if self.sel is None else [store.kept(n) for n in self._host_lengths]
            return RowPlan(self.sel, None, *self.kept(store), attention_runs(host, store.k.shape[2], widened), {})
        rows, at, host = self.cover
        host = [store.kept(n) for n in host]
        lengths = torch.tensor(host)
        span = (min(host), max(host))
        pad = padding_mask(lengths, span[1]) if span[0] < span[1] else None
        return RowPlan(rows, at, lengths, span, pad, attention_runs(host, store.k.shape[2], widened), {})

    def native_split(self, store) -> tuple:
        """(kept lengths as a tensor and a list, the requests split over threads) for the C decode attention."""
        def make():
            host = [store.kept(n) for n in self._host_lengths]
            return self.kept(store)[0], host, native.cuts(host, max(1, min(torch.get_num_threads(), len(host))))

        return self.memo(("native", store.window), make)

    def covering_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, ...] at this batch's rows of its covering range, zeros in the gaps (one buffer a step)."""
        rows, at, _ = self.cover
        if self._q is None or self._q.dtype != q.dtype:
            self._q = q.new_zeros((rows.stop - rows.start, *q.shape[1:]))
        return self._q.index_copy_(0, at, q)


# How decode attention reads one store for a micro-batch: `rows` in place (None: gathered), `at`, `runs`, and
# `memo`, what it builds once per step for these rows (its padding masks)
RowPlan = collections.namedtuple("RowPlan", "rows at lengths span pad runs memo")
