"""Block alignment of routed pairs, as vLLM's and SGLang's fused MoE read it: pair p = t·k + j (token t's j-th
choice), each expert's run padded to a multiple of BM with the sentinel P. Static shapes, nothing read back: a CUDA
graph can capture it. Legend: T = tokens, k = experts per token, E = experts, BM = block rows, S = slots, P = T·k.
"""

from __future__ import annotations

import torch

from core.model.limits import fused_slots as padded_slots  # the planner sizes it too


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, k] -> (sorted_ids int32 [S], block_expert int32 [S // BM], n_padded int32 [1]): pair ids
    by expert, padded with the sentinel P; each block's expert, −1 from n_padded on; the padded length used."""
    P = topk_ids.numel()
    dev = topk_ids.device
    S = padded_slots(P, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    # index_add, not bincount: bincount sizes its output by the data (a host sync on a GPU)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)).div_(block_m, rounding_mode="floor").mul_(block_m)
    ends = torch.cumsum(padded, 0)  # each expert's padded run ends here
    order = torch.argsort(flat, stable=True)  # pairs by expert, in pair order within one
    sorted_e = flat.index_select(0, order)
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in `order`
    slot = (ends - padded).index_select(0, sorted_e) + torch.arange(P, device=dev) - first.index_select(0, sorted_e)
    sorted_ids = torch.full((S,), P, dtype=torch.int32, device=dev)
    sorted_ids.index_copy_(0, slot, order.to(torch.int32))
    starts = torch.arange(0, S, block_m, device=dev)
    n_padded = ends[-1:]
    # the expert whose padded run holds a block's first slot: how many runs end at or before it
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(starts < n_padded, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert, n_padded.to(torch.int32)
