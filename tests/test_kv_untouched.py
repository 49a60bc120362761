"""A run's state cache is made without writing it: the runner sizes every slot for the longest request (the
784M Mixtral's 4x prompts: 256 slots x 1,704 tokens, 3.6 GB), and torch.zeros faulted in every page of it
(5.9 s on two Zen 5 threads before the first token) while a slot's request touches its own length."""

from __future__ import annotations

import psutil
import pytest
import torch

from core.model.kvcache import KVStore, LatentStore, untouched_zeros

MB = 1 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_a_large_store_costs_no_memory_until_its_rows_are_written():
    k = torch.randn(100, 8, 128).to(torch.bfloat16)
    store = KVStore(1, 8, 128, 1024, torch.bfloat16)
    store.write_prompt(0, k, k)  # the write's own first-call allocations, out of the figures below
    before = _rss()
    store = KVStore(64, 8, 128, 1024, torch.bfloat16)  # 2 x 128 MiB
    made = _rss() - before
    size = store.k.nbytes + store.v.nbytes
    assert size == 256 * MB
    assert made < 0.05 * size, f"making the store took {made / MB:.0f} MiB of {size / MB:.0f}"
    # a 100-token prompt touches its slot's first 100 positions of each head (16 x 25 kB), not the slot's 4 MiB
    store.write_prompt(5, k, k)
    grew = _rss() - before - made
    assert grew < 1 * MB, f"one prompt's rows took {grew / MB:.1f} MiB"
    assert torch.equal(store.k[5, :, :100], k.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("shape", [(3, 5, 7, 2), (2, 0, 4)])
def test_the_store_reads_zeros_and_is_aligned_like_torchs_own(dtype, shape):
    t = untouched_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % 64 == 0  # torch's own CPU allocator's alignment
    assert not t.any()
    lat = LatentStore(4, 24, 33, dtype)
    assert lat.lat.data_ptr() % 64 == 0 and not lat.lat.any()


def test_past_a_rows_length_the_store_holds_zeros_after_a_shorter_request_is_written():
    # masked positions still enter p @ v (0 x v): untouched memory must read 0, never NaN
    store = KVStore(4, 2, 64, 4096, torch.float32)
    store.write_prompt(1, torch.ones(10, 2, 64), torch.ones(10, 2, 64))
    assert torch.isfinite(store.v).all() and not store.v[1, :, 10:].any() and not store.k[0].any()
