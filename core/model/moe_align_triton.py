"""core.model.moe_align in Triton: one launch of one program (the torch form is about 15 kernels), walking the pairs
a chunk of C at a time three times (counts, run starts, slots): O(P·E + P·C), microseconds for a decode step.
Legend: moe_align's.
"""

from __future__ import annotations

import functools
import os

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

PAIRS_A_STEP = 64  # pairs a step


def moe_align(topk_ids, num_experts: int, block_m: int):
    """topk_ids [T, k] -> (sorted_ids int32 [S], block_expert int32 [S // BM], n_padded int32 [1]), one launch."""
    import torch

    from core.model.moe_align import padded_slots

    P = topk_ids.numel()
    S = padded_slots(P, num_experts, block_m)
    i32 = dict(dtype=torch.int32, device=topk_ids.device)
    sorted_ids, block_expert, n_padded = torch.empty(S, **i32), torch.empty(S // block_m, **i32), torch.empty(1, **i32)
    _kernel(os.environ.get("TRITON_INTERPRET") == "1")[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, n_padded, P, S, num_experts, BM=block_m,
        BLOCK_E=triton.next_power_of_2(max(num_experts, 2)), C=PAIRS_A_STEP)
    return sorted_ids, block_expert, n_padded


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    """Jitted on first launch (TRITON_INTERPRET is read when a function is decorated)."""
    return triton.jit(_align)


if triton is not None:
    _SUM, _MAX = tl.standard._sum_combine, tl.standard._elementwise_max  # see core.model.router_triton

    def _align(ids_ptr, sorted_ptr, block_expert_ptr, n_padded_ptr, P, S, E, BM: tl.constexpr,
               BLOCK_E: tl.constexpr, C: tl.constexpr):
        e = tl.arange(0, BLOCK_E)
        c = tl.arange(0, C)
        counts = tl.full((BLOCK_E,), 0, tl.int32)
        for p0 in range(0, P, C):
            x = tl.load(ids_ptr + p0 + c, mask=p0 + c < P, other=-1).to(tl.int32)
            counts += tl.reduce((x[:, None] == e[None, :]).to(tl.int32), 0, _SUM)
        padded = (counts + (BM - 1)) // BM * BM
        ends = tl.associative_scan(padded, 0, _SUM)
        starts = ends - padded
        total = tl.reduce(padded, 0, _SUM)
        tl.store(n_padded_ptr, total)
        for s0 in range(0, S, C):  # the sentinel everywhere first
            tl.store(sorted_ptr + s0 + c, tl.full((C,), 0, tl.int32) + P, mask=s0 + c < S)
        for b0 in range(0, S // BM, C):  # a block's expert: how many runs end at or before its first slot
            b = b0 + c
            first = b * BM
            ex = tl.reduce(((ends[None, :] <= first[:, None]) & (e[None, :] < E)).to(tl.int32), 1, _SUM)
            tl.store(block_expert_ptr + b, tl.where(first < total, ex, -1), mask=b < S // BM)
        tl.debug_barrier()  # the fill lands before the pairs overwrite it
        seen = tl.full((BLOCK_E,), 0, tl.int32)  # each expert's pairs in earlier chunks
        earlier = c[None, :] < c[:, None]  # [C, C]: j before i
        for p0 in range(0, P, C):
            live = p0 + c < P
            x = tl.load(ids_ptr + p0 + c, mask=live, other=-1).to(tl.int32)
            hit = x[:, None] == e[None, :]  # [C, E]
            base = tl.reduce(tl.where(hit, (starts + seen)[None, :], 0), 1, _SUM)
            rank = tl.reduce(((x[None, :] == x[:, None]) & earlier).to(tl.int32), 1, _SUM)
            tl.store(sorted_ptr + base + rank, (p0 + c).to(tl.int32), mask=live)
            seen += tl.reduce(hit.to(tl.int32), 0, _SUM)
