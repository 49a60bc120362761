"""core.model.moe_align against a pure-python reference of the seam's layout, over random routings."""

from __future__ import annotations

import pytest
import torch

from core.model.moe_align import moe_align, padded_slots


def reference(ids: list[list[int]], E: int, BM: int):
    """The layout spelled out: pairs by expert ascending, each run padded to BM with the sentinel P."""
    P = sum(len(r) for r in ids)
    flat = [e for r in ids for e in r]
    S = padded_slots(P, E, BM)
    sorted_ids, block_expert = [], []
    for e in range(E):
        run = [p for p, x in enumerate(flat) if x == e]
        if not run:
            continue
        run += [P] * (-len(run) % BM)
        sorted_ids += run
        block_expert += [e] * (len(run) // BM)
    n = len(sorted_ids)
    assert n <= S
    return sorted_ids + [P] * (S - n), block_expert + [-1] * ((S - n) // BM), n


@pytest.mark.parametrize("E", [8, 64, 256])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("BM", [16, 64])
def test_alignment_equals_the_reference(E, k, BM):
    g = torch.Generator().manual_seed(E * 100 + k * 10 + BM)
    for T in (1, 2, 3, 7, 16, 33, 64):
        skewed = torch.randint(0, min(E, 3 * k), (T, 1), generator=g)  # a few busy experts: long runs
        for ids in (torch.rand(T, E, generator=g).topk(k, -1).indices,  # distinct experts per token
                    (skewed + torch.arange(k)) % E):
            want = reference(ids.tolist(), E, BM)
            sorted_ids, block_expert, n_padded = moe_align(ids, E, BM)
            assert sorted_ids.dtype == block_expert.dtype == n_padded.dtype == torch.int32
            assert sorted_ids.tolist() == want[0] and block_expert.tolist() == want[1], (T, ids.tolist())
            assert n_padded.tolist() == [want[2]]


def test_it_needs_no_host_sync_and_runs_on_meta_tensors():
    """Static shapes: the output sizes follow from T, k, E and BM alone (meta tensors have no data to read)."""
    ids = torch.empty(5, 2, dtype=torch.int64, device="meta")
    sorted_ids, block_expert, n_padded = moe_align(ids, 128, 16)
    S = padded_slots(10, 128, 16)
    assert S == 160 and sorted_ids.shape == (S,) and block_expert.shape == (S // 16,) and n_padded.shape == (1,)
