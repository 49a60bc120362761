"""The decode step's KV write (KVStore.write_rows): the same cache as the two-index assignment, by one
flat index per step that every layer reuses, with no `index_put` (0.25 ms a call in a B = 256 step on
two threads: 16 calls a step on the 784M Mixtral) — by the C loop where it is built, else index_copy_."""

from __future__ import annotations

import pytest
import torch

from core.model.cpu import row_ops
from core.model.kvcache import KVStore, Rows


def _case(window=0, slots=(2, 0, 5, 3), dtype=torch.bfloat16, src_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = KVStore(6, 3, 8, 20, dtype, window=window)
    a.k.copy_(torch.randn(a.k.shape, generator=g))
    a.v.copy_(torch.randn(a.v.shape, generator=g))
    b = KVStore(6, 3, 8, 20, dtype, window=window)
    b.k.copy_(a.k)
    b.v.copy_(a.v)
    positions = [int(x) for x in torch.randint(0, 19, (len(slots),), generator=g)]
    rows = Rows(list(slots), positions)
    k = torch.randn(len(slots), 3, 8, generator=g).to(src_dtype or dtype)
    v = torch.randn(len(slots), 3, 8, generator=g).to(src_dtype or dtype)
    return a, b, rows, k, v


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("src_dtype", [None, torch.float32])  # fp32: the AVX2 CPU's widened math over a bf16 cache
def test_write_rows_equals_write(window, src_dtype):
    a, b, rows, k, v = _case(window, src_dtype=src_dtype)
    a.write(rows.slots, rows.positions, k, v)
    b.write_rows(rows, k, v)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_the_index_is_made_once_a_step_and_no_index_put_runs():
    _, b, rows, k, v = _case()
    b.write_rows(rows, k, v)  # the first layer makes the step's index
    with torch.autograd.profiler.profile(use_kineto=False) as prof:
        b.write_rows(rows, k.view(4, 3, 8), v)  # the next layer
    ops = [ev.name for ev in prof.function_events if ev.cpu_parent is None]
    copies = 0 if row_ops.library() is not None else 2  # the C loop (core.model.cpu.row_ops) runs no torch op
    assert "aten::index_put_" not in ops and ops.count("aten::index_copy_") == copies, ops
    assert not any(n in ops for n in ("aten::arange", "aten::mul", "aten::remainder")), ops


def test_a_strided_store_falls_back_to_write():
    a, b, rows, k, v = _case()
    b.k = torch.empty(6, 20, 3, 8, dtype=b.k.dtype).transpose(1, 2)  # not contiguous
    b.k.copy_(a.k)
    a.write(rows.slots, rows.positions, k, v)
    b.write_rows(rows, k, v)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
