"""The collectives a tensor-parallel engine calls, over one torch.distributed group.

Every rank of the group runs the same engine over its shard (core.model.shard) and the same step
graph, so it issues these calls in the same order: the pipeline's dense tasks all run on one
resource's queue, in graph order. The group's first rank samples; the others take its tokens, so
the ranks can never disagree about which requests finish (a disagreement would hang a collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TensorParallel:
    """`size` ranks sharing one model; this one is `rank` of them."""

    def __init__(self, group, device: str | torch.device = "cpu"):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = torch.device(device)  # where NCCL wants its tensors; the CPU for gloo
        self._src = dist.get_global_rank(group, 0)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place (partial O-projection or FFN outputs)."""
        dist.all_reduce(t, group=self.group)
        return t

    def tokens(self, toks: list[int]) -> list[int]:
        """The leader's sampled tokens, on every rank."""
        t = torch.tensor(toks, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=self._src, group=self.group)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any (a stop request seen by one rank stops all)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


class FullQKNorm:
    """RMSNorm over all heads' q (and k) when each rank holds only some heads (OLMoE's qk-norm):
    the sums of squares are added over the group. A KV head held by several ranks counts once."""

    def __init__(self, tp: TensorParallel, q_size: int, kv_size: int, k_owned: torch.Tensor):
        self.tp, self.q_size, self.kv_size = tp, q_size, kv_size
        self.k_owned = k_owned  # [local kv size] 1.0 where this rank's copy counts, else 0.0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float):
        q32, k32 = q.float(), k.float()
        ss = torch.stack([q32.pow(2).sum(-1), (k32.pow(2) * self.k_owned.to(k32.device)).sum(-1)], dim=-1)
        self.tp.all_reduce(ss)  # [T, 2]
        q32 = q32 * torch.rsqrt(ss[:, :1] / self.q_size + eps)
        k32 = k32 * torch.rsqrt(ss[:, 1:] / self.kv_size + eps)
        return wq * q32.to(q.dtype), wk * k32.to(k.dtype)


class ShardOps:
    """What the pipeline does differently on one rank of a tensor-parallel group: sum the partial
    outputs of the O projection (when heads are split) and of the FFN; OLMoE's norm over all heads."""

    def __init__(self, tp: TensorParallel, shard, full_spec):
        self.tp, self.shard = tp, shard
        self.full_norm = None
        if shard.split_attention and full_spec.qk_norm == "full":
            hd = full_spec.head_dim
            owned = torch.tensor([float(o) for o in shard.kv_owned for _ in range(hd)], device=tp.device)
            self.full_norm = FullQKNorm(tp, full_spec.q_size, full_spec.kv_size, owned)

    def attention_out(self, t: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(t) if self.shard.split_attention else t

    def ffn_out(self, t: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(t)
