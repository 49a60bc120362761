"""The collectives of a tensor-parallel engine, in the same order on every rank; the group's first rank samples, so none
disagrees about which requests finish (that would hang a collective). A rank that fails a step (out of GPU memory)
`drain`s it with zeros; all learn the step's `outcome` before using its tokens, and retry with the same smaller batch or
stop together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.errors import MlightError


class GroupOutOfMemory(MlightError):
    agreed = True  # raised alike on every rank, once they agreed


@dataclass(frozen=True)
class Outcome:
    stop: bool  # some rank was asked to stop
    slots: int  # the batch every rank continues with (smaller than now: some rank ran out of memory)
    failed_rank: int  # a rank (of the job) that ran out of memory, or -1


class TensorParallel:
    def __init__(self, group, device: str | torch.device = "cpu"):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = torch.device(device)  # where NCCL wants its tensors; the CPU for gloo
        self._src = dist.get_global_rank(group, 0)
        self.issued = 0  # all-reduces issued so far (the step's are counted from its start)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.issued += 1  # counted as it starts: one in flight on another thread when a step fails is issued
        dist.all_reduce(t, group=self.group)
        return t

    def drain(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Take part, with zeros, in the all-reduces of a step this rank could not finish."""
        for shape, dtype in shapes:
            self.all_reduce(torch.zeros(shape, dtype=dtype, device=self.device))

    def outcome(self, stop: bool, slots: int, want: int) -> Outcome:
        """After each step, on every rank: `want` is the batch this rank can go on with (`slots` unless OOM)."""
        t = torch.tensor([int(stop), dist.get_rank() + 1 if want < slots else 0, -want], dtype=torch.int64,
                         device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)  # any stop, a failed rank, the least batch
        return Outcome(bool(t[0]), int(-t[2]), int(t[1]) - 1)

    def tokens(self, toks: list[int]) -> list[int]:  # the leader's, on every rank
        t = torch.tensor(toks, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=self._src, group=self.group)
        return t.tolist()


class ShardOps:
    """A rank's sums of the partial O projection (when heads are split) and FFN outputs; OLMoE's norm over all heads."""

    def __init__(self, tp: TensorParallel, shard, full_spec):
        self.tp, self.shard, self.q_size, self.kv_size = tp, shard, full_spec.q_size, full_spec.kv_size
        self.ffn_out = tp.all_reduce  # every rank holds a slice of every expert
        self.full_norm = None
        if shard.split_attention and full_spec.qk_norm == "full":
            hd = full_spec.head_dim
            # [local kv size] 1.0 where this rank's copy of a KV head counts (one held by several ranks counts once)
            self.k_owned = torch.tensor([float(o) for o in shard.kv_owned for _ in range(hd)], device=tp.device)
            self.full_norm = self._full_qk_norm

    def _full_qk_norm(self, q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float):
        """RMSNorm over all heads' q (and k) where this rank holds some: the sums of squares add over the group."""
        q32, k32 = q.float(), k.float()
        ss = torch.stack([q32.pow(2).sum(-1), (k32.pow(2) * self.k_owned.to(k32.device)).sum(-1)], dim=-1)
        self.tp.all_reduce(ss)  # [T, 2]
        q32 = q32 * torch.rsqrt(ss[:, :1] / self.q_size + eps)
        k32 = k32 * torch.rsqrt(ss[:, 1:] / self.kv_size + eps)
        return wq * q32.to(q.dtype), wk * k32.to(k.dtype)

    def attention_out(self, t: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(t) if self.shard.split_attention else t


def step_collectives(runner) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The all-reduces a PipelineRunner's current step issues, in order, as (shape, dtype)."""
    D, dt = runner.spec.hidden_size, runner.w.math_dtype
    norm = runner._full_norm is not None  # OLMoE: sums of squares [tokens, 2] in fp32 before the attention
    attn = runner.tp.shard.split_attention  # else the attention output is whole on every rank: no sum
    out = []
    if runner._pre is not None:
        tasks, _ = runner._graph("prefill", len(runner._pre))
        for t in tasks:
            if t.kind == "prefill":
                T = sum(runner._pre[t.micro_batch].lens)
                out += ([((T, 2), torch.float32)] if norm else []) + ([((T, D), dt)] if attn else []) + [((T, D), dt)]
        return out
    mbs = runner._step
    tasks, _ = runner._graph("decode", len(mbs))
    for t in tasks:
        if t.kind == "pre_attn" and norm:
            out.append(((mbs[t.micro_batch].B, 2), torch.float32))
        elif t.kind == "post_attn" and attn:
            out.append(((mbs[t.micro_batch].B, D), dt))
        elif t.kind == "ffn":
            out.append(((sum(m.B for m in mbs[t.micro_batch:t.micro_batch + runner._group_size(t)]), D), dt))
    return out
