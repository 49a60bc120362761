"""Tensor-parallel shards: what one of `size` ranks holds and reads. Attention splits by query heads (a rank keeps
the KV heads they use, a copy per query head where groups fall unevenly), MLA by heads, linear attention by value
heads, the MoE FFN along every expert's intermediate dimension (each rank streams 1/size of every layer whatever the
routing); unknown tensors keep attention whole. A rank's model is a ModelSpec (`local_spec`); outputs sum over ranks.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

from core.errors import UsageError
from core.model.spec import ModelSpec

# canonical tensors this module knows how to split, or keeps whole (norms, routers, gates, biases)
_ATTENTION = {"qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "sinks",
              "q", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b",  # latent (MLA)
              "lin_in", "conv", "dt_bias", "A_log", "gnorm", "lin_out"}  # linear (Gated DeltaNet)
_KNOWN = _ATTENTION | {"ln1", "ln1_b", "ln2", "ln2_b", "router", "router_bias", "e_bias", "shared_w13", "shared_w2",
                      "shared_gate", "w13", "b13", "w2", "b2", "dense_w13", "dense_w2"}


def chunk(n: int, size: int, rank: int) -> tuple[int, int]:
    """[a, b) of rank's near-equal contiguous part of range(n); the first n % size ranks get one more."""
    base, extra = divmod(n, size)
    a = rank * base + min(rank, extra)
    return a, a + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    split_attention: bool  # False: every rank computes all heads (a family this module cannot split)
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]  # global KV head of each local one; repeats where a rank expands GQA
    kv_owned: tuple[bool, ...]  # per local KV head: the copy that counts in a norm over all KV heads
    inter: tuple[int, int]  # [a, b) of each expert's intermediate dimension
    shared: tuple[int, int]  # [a, b) of the shared expert's
    dense: tuple[int, int] = (0, 0)  # [a, b) of a dense MLP layer's (DeepSeek's first layers)
    lin_v_heads: tuple[int, ...] = ()  # linear attention: this rank's value heads
    lin_k_heads: tuple[int, ...] = ()  # global key head of each local one (repeats as kv_heads does)

    def selections(self, spec: ModelSpec, layer: int = 0) -> dict[str, tuple[int, list[int]]]:
        """Layer `layer`'s tensor -> (dim, full indices this rank keeps, in local order); absent: kept whole."""
        hd, q, kv = spec.head_dim, spec.q_size, spec.kv_size
        names = spec.layer_shapes(layer)
        sel: dict[str, tuple[int, list[int]]] = {}
        if self.split_attention and spec.layer_type(layer) == "linear":
            sel.update(self._linear(spec))
        elif self.split_attention and spec.mla is not None:
            m = spec.mla
            rows = (0, [h * hd + t for h in self.q_heads for t in range(hd)])  # hd = dn + dr
            sel["q_b" if m.q_lora_rank else "q"] = rows
            up = m.qk_nope_dim + m.v_head_dim
            sel["kv_b"] = (0, [h * up + t for h in self.q_heads for t in range(up)])
            sel["o"] = (1, [h * m.v_head_dim + t for h in self.q_heads for t in range(m.v_head_dim)])
        elif self.split_attention:
            qr = [h * hd + t for h in self.q_heads for t in range(hd)]
            kr = [g * hd + t for g in self.kv_heads for t in range(hd)]
            gate = [q + 2 * kv + r for r in qr] if spec.attn_gate else []  # Qwen3-Next's output gate rows
            sel["qkv"] = (0, qr + [q + r for r in kr] + [q + kv + r for r in kr] + gate)
            if "qkv_bias" in names:
                sel["qkv_bias"] = sel["qkv"]
            if spec.qk_norm == "full":
                sel["q_norm"], sel["k_norm"] = (0, qr), (0, kr)
            if "sinks" in names:
                sel["sinks"] = (0, list(self.q_heads))
            sel["o"] = (1, qr)
        for name, dim, width, (a, b) in (("w13", 1, spec.expert_intermediate, self.inter),
                                         ("shared_w13", 0, spec.shared_intermediate, self.shared),
                                         ("dense_w13", 0, spec.dense_intermediate, self.dense)):
            if name in names:  # gate rows then up rows; the down projection's matching columns
                sel[name] = (dim, list(range(a, b)) + list(range(width + a, width + b)))
                down = name.replace("13", "2")
                sel[down] = (len(names[down]) - 1, list(range(a, b)))
        if "b13" in names:
            sel["b13"] = (1, sel["w13"][1])
        return sel

    def _linear(self, spec: ModelSpec) -> dict[str, tuple[int, list[int]]]:
        # lin_in's rows are [q, k, v, z, b, a], conv's [q, k, v]
        la = spec.linear
        kd, vd, Hv = la.key_dim, la.value_dim, la.num_v_heads
        q = [g * la.k_head_dim + t for g in self.lin_k_heads for t in range(la.k_head_dim)]
        v = [h * la.v_head_dim + t for h in self.lin_v_heads for t in range(la.v_head_dim)]
        heads = list(self.lin_v_heads)
        conv = q + [kd + r for r in q] + [2 * kd + r for r in v]
        gates = [2 * kd + 2 * vd + h for h in heads] + [2 * kd + 2 * vd + Hv + h for h in heads]
        return {"lin_in": (0, conv + [2 * kd + vd + r for r in v] + gates), "conv": (0, conv),
                "dt_bias": (0, heads), "A_log": (0, heads), "lin_out": (1, v)}

    def leader_only(self, spec: ModelSpec, layer: int = 0) -> list[str]:
        """Biases added after a sum over the ranks: only rank 0 keeps them (the others hold zeros)."""
        names = spec.layer_shapes(layer)
        return [n for n in ("b2",) + (("o_bias",) if self.split_attention else ()) if n in names]


def _kv_heads(num_heads: int, num_kv_heads: int, q_heads: range) -> list[int]:
    """The KV (key) heads a rank's query (value) heads read, one per local KV head."""
    group = num_heads // num_kv_heads
    needed = [h // group for h in q_heads]
    uses = {g: needed.count(g) for g in needed}
    if len(set(uses.values())) == 1:
        return list(uses)  # whole groups of equal size: local GQA
    return needed  # uneven groups: one KV copy per query head


def plan_shard(spec: ModelSpec, rank: int, size: int) -> Shard:
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a group of {size}")
    linear = spec.linear if "linear" in spec.layer_types else None
    limit = min(spec.expert_intermediate, spec.num_heads, spec.shared_intermediate or spec.num_heads,
                spec.dense_intermediate or spec.num_heads, linear.num_v_heads if linear else spec.num_heads)
    if size > limit:
        heads = f"{spec.num_heads} attention heads" + (f", {linear.num_v_heads} linear-attention heads" if linear else "")
        raise UsageError(f"--tensor-parallel {size} is more than this model can be split into (at most {limit}: "
                         f"{heads}, expert width {spec.expert_intermediate})", f"use at most {limit} ranks")
    split = all(set(spec.layer_shapes(i)) <= _KNOWN for i in range(spec.num_layers))
    if split:
        qa, qb = chunk(spec.num_heads, size, rank)
        kv = _kv_heads(spec.num_heads, spec.num_kv_heads, range(qa, qb))
        seen = {g for r in range(rank)
                for g in _kv_heads(spec.num_heads, spec.num_kv_heads, range(*chunk(spec.num_heads, size, r)))}
        owned, firsts = [], set()
        for g in kv:
            owned.append(g not in seen and g not in firsts)
            firsts.add(g)
        q_heads = tuple(range(qa, qb))
    else:
        q_heads, kv, owned = tuple(range(spec.num_heads)), list(range(spec.num_kv_heads)), [True] * spec.num_kv_heads
    shared = chunk(spec.shared_intermediate, size, rank) if spec.shared_intermediate else (0, 0)
    dense = chunk(spec.dense_intermediate, size, rank) if spec.dense_intermediate else (0, 0)
    lin_v, lin_k = (), ()
    if linear and split:
        va, vb = chunk(linear.num_v_heads, size, rank)
        lin_v, lin_k = tuple(range(va, vb)), tuple(_kv_heads(linear.num_v_heads, linear.num_k_heads, range(va, vb)))
    return Shard(rank, size, split, q_heads, tuple(kv), tuple(owned), chunk(spec.expert_intermediate, size, rank),
                 shared, dense, lin_v, lin_k)


def local_spec(spec: ModelSpec, shard: Shard) -> ModelSpec:
    changes = dict(expert_intermediate=shard.inter[1] - shard.inter[0],
                   shared_intermediate=shard.shared[1] - shard.shared[0],  # (0, 0) where the model has none
                   dense_intermediate=shard.dense[1] - shard.dense[0])
    if shard.split_attention:
        changes.update(num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads))
    if shard.lin_v_heads:
        changes["linear"] = dataclasses.replace(spec.linear, num_v_heads=len(shard.lin_v_heads),
                                                num_k_heads=len(shard.lin_k_heads))
    return dataclasses.replace(spec, **changes)


# copy `length` rows from `src_start` along `src_dim` of the source to `dst_start` along `dst_dim` of dst_index
Cut = collections.namedtuple("Cut", "dst_index dst_dim dst_start src_dim src_start length")


def cuts(index: tuple, full_shape: tuple[int, ...], dim: int, keep: list[int]) -> list[Cut]:
    """The runs of a piece at `index` of a `full_shape` tensor that a rank keeping `keep` along `dim` copies."""
    ints_before = sum(1 for i in index[:dim] if isinstance(i, int))
    if dim < len(index) and isinstance(index[dim], int):
        if index[dim] not in keep:
            return []
        local = list(index)
        local[dim] = keep.index(index[dim])
        return [Cut(tuple(local), -1, 0, -1, 0, 0)]  # the whole piece, at its local position
    lo, hi = 0, full_shape[dim]
    if dim < len(index):
        lo, hi, _ = index[dim].indices(full_shape[dim])
    pairs = [(p, g - lo) for p, g in enumerate(keep) if lo <= g < hi]
    base = list(index)
    if dim < len(index):  # the piece's slot along `dim` becomes the local positions it fills
        base[dim] = slice(None)
    runs: list[Cut] = []
    for p, s in pairs:
        last = runs[-1] if runs else None
        if last is not None and p == last.dst_start + last.length and s == last.src_start + last.length:
            runs[-1] = last._replace(length=last.length + 1)
        else:
            runs.append(Cut(tuple(base), dim - ints_before, p, dim - ints_before, s, 1))
    return runs
