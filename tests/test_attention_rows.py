"""Decode attention over a micro-batch's rows of a KV store (core.model.attention.decode_over_rows),
each way Rows.plan reads them, against a per-request float64 reference (tolerance 1e-5 in fp32,
2e-2 from a bf16 cache): contiguous rows in place, slots with gaps over their covering rows, runs of
neighbouring rows each read to its own longest length, gathered rows; sliding windows; the widened
path (bf16 cache, fp32 math) and bf16 math itself. Each case also asserts the reading it meant to exercise was taken.
"""

from __future__ import annotations

import pytest
import torch

from core.model import attention, kvcache
from core.model.attention import attention_runs, decode_over_rows
from core.model.cpu.kernels import Widen
from core.model.kvcache import KVStore, Rows

from test_attention import reference

S, Hq, Hkv, hd, TMAX = 12, 8, 2, 16, 40


def _store(dtype, window=0, seed=0):
    st = KVStore(S, Hkv, hd, TMAX, dtype, window=window)
    g = torch.Generator().manual_seed(seed)
    for t in st.tensors:  # every row filled, the gaps too (stale requests' K/V)
        t.copy_(torch.randn(t.shape, generator=g))
    return st


def _expected(q, st, slots, lengths, scale):
    k = st.k.index_select(0, torch.tensor(slots)).double()
    v = st.v.index_select(0, torch.tensor(slots)).double()
    kept = st.kept(torch.tensor(lengths))
    return reference(q.double(), k, v, kept, scale)  # a ring holds its last W tokens at p mod W: all of them


CASES = {  # name: (slots, lengths) — lengths are the tokens cached, the new one included
    "contiguous": ([2, 3, 4, 5], [9, 30, 3, 17]),
    "covering": ([1, 2, 4, 6], [6, 18, 4, 12]),
    "gathered": ([0, 5, 11], [7, 3, 25]),
    "runs": (list(range(8)), [33, 31, 30, 32, 3, 2, 4, 3]),
    "covering runs": ([0, 1, 2, 3, 5, 6, 7, 9], [35, 33, 36, 34, 2, 3, 4, 3]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,window,widened", [(torch.float32, 0, False), (torch.float32, 10, False),
                                                  (torch.bfloat16, 0, False), (torch.bfloat16, 0, True)])
def test_each_reading_matches_the_float64_reference(case, dtype, window, widened, monkeypatch):
    monkeypatch.setattr(attention, "RUN_ROWS", 2)
    slots, lengths = CASES[case]
    st = _store(dtype, window)
    widen = Widen(torch.float32) if widened else None
    rows = Rows(slots, [n - 1 for n in lengths])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(slots), Hq, hd, generator=g).to(dtype if widen is None else torch.float32)
    plan = rows.plan(st, widen is not None)
    assert (plan.rows is None) == (case == "gathered")
    assert (plan.at is not None) == case.startswith("covering")
    if case.endswith("runs") and not window:  # (a window of 10 makes every run alike)
        assert plan.runs
    got = decode_over_rows(q, st, rows, hd ** -0.5, widen=widen)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), _expected(q, st, slots, lengths, hd ** -0.5), rtol=tol, atol=tol)


def test_sparse_slots_are_gathered_not_covered(monkeypatch):
    """Past COVER_RATIO times the rows in use the covering range would read mostly gaps."""
    assert Rows([0, 5], [3, 4]).cover is None and Rows([0, 2], [3, 4]).cover is not None
    monkeypatch.setattr(kvcache, "COVER_RATIO", 0)
    assert Rows([0, 2], [3, 4]).cover is None


def test_runs_are_taken_only_where_they_read_less():
    assert attention_runs([20, 19, 18, 17, 3, 3, 2, 2], 24, rows=2) == [
        (0, 2, (19, 20)), (2, 4, (17, 18)), (4, 6, (3, 3)), (6, 8, (2, 2))]
    assert attention_runs([20, 3, 19, 2, 18, 3, 17, 2], 24, rows=2) == []  # every run as long as all
    assert attention_runs([20, 3, 2], 24, rows=2) == []  # too few rows for two runs
    # a call reading whole rows in place (3 · longest ≥ row) costs a row a request, whatever the lengths
    assert attention_runs([9, 9, 8, 8], 24, rows=2) == [] and attention_runs([9, 9, 2, 2], 24, rows=2)
