"""The block alignment's Triton kernel (core.model.moe_align_triton) against its torch form
(core.model.moe_align), which tests/test_moe_align.py holds to the seam's layout: equal outputs, in triton's
interpreter on the CPU, over random and skewed routings (long runs of one expert, a chunk boundary crossed)."""

from __future__ import annotations

import pytest
import torch

from core.model import moe_align_triton as kernel
from core.model.moe_align import moe_align
from matrix import cover

triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# every E, k and BM, and k = 8 with either block (its T = 33 pairs span several chunks); E and BM size the
# program's arrays and its scan, which runs the same lines at each
@pytest.mark.parametrize("E,k,BM", cover([(E, k, BM) for E in (8, 64, 128, 256) for k in (1, 2, 8) for BM in (16, 64)],
                                         [(8, 1, 16), (8, 8, 64), (64, 2, 64), (128, 8, 16), (256, 1, 64), (256, 2, 16)]))
def test_the_kernel_equals_the_torch_form(E, k, BM):
    g = torch.Generator().manual_seed(E * 100 + k * 10 + BM)
    for T in (1, 3, 16, 33):
        skewed = torch.randint(0, min(E, 3 * k), (T, 1), generator=g)
        for ids in (torch.rand(T, E, generator=g).topk(k, -1).indices, (skewed + torch.arange(k)) % E):
            got, want = kernel.moe_align(ids, E, BM), moe_align(ids, E, BM)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), (T, ids.tolist())


def test_pairs_past_one_chunk_keep_their_order_within_an_expert():
    """More pairs than a chunk, most on one expert: the running count carries each expert's rank across chunks."""
    ids = torch.tensor([[3, 1]] * 90 + [[0, 3]] * 10)
    assert ids.numel() > 2 * kernel.PAIRS_A_STEP
    for a, b in zip(kernel.moe_align(ids, 8, 16), moe_align(ids, 8, 16)):
        assert torch.equal(a, b)
