"""A layer's flat buffer holds no stale memory: the alignment gaps between its tensors are zeroed when the
buffer is made, so a scan of the whole buffer (loading._check_fp16_range, on a GPU that computes bf16 in fp16)
sees only weights and zeros. Before, the gaps were `torch.empty`'s leftovers, and a bf16 load refused at random
with "weights beyond float16's range"."""

from __future__ import annotations

import pytest
import torch

from core.model.families import load_spec
from core.model.quant.formats import parse_choice
from core.model.weights import LayerLayout, load_weights
from core.runtime.loading import _check_fp16_range


@pytest.fixture
def stale_memory(monkeypatch):
    """torch.empty of bytes (a buffer to be viewed as weights: page_aligned's) returning memory full of 0xFF
    (NaN as bf16), what a reused allocation can hold."""
    empty = torch.empty

    def poisoned(*shape, dtype=None, **kw):
        t = empty(*shape, dtype=dtype, **kw)
        if dtype == torch.uint8:
            t.fill_(0xFF)
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_a_loaded_layers_gaps_are_zero_and_pass_the_fp16_range_check(checkpoint_factory, stale_memory, quant):
    path = checkpoint_factory("qwen3_moe")
    spec = load_spec(path)
    w = load_weights(path, spec, dtype=torch.bfloat16, quant=parse_choice(quant), use_cache=False)
    for lw in w.layers:
        layout = lw.layout
        covered = torch.zeros(layout.numel, dtype=torch.bool)
        for name, t in lw.tensors.items():
            a = (t.data_ptr() - lw.flat.data_ptr()) // lw.flat.element_size()
            covered[a:a + t.numel() * t.element_size() // lw.flat.element_size()] = True
        gaps = lw.flat[~covered]
        assert gaps.numel() > 0, "the tiny shapes leave alignment gaps (else this test proves nothing)"
        assert (gaps.view(torch.uint8) == 0).all() if gaps.dtype == torch.uint8 else (gaps == 0).all()
    if quant is None:
        _check_fp16_range(w)  # raised "layer 0 has weights beyond float16's range" on the stale gaps


def test_the_buffer_zeroes_only_the_gaps():
    """Entries are left as allocated (filled by the load anyway): zeroing a whole layer would touch every page
    twice."""
    layout = LayerLayout((("a", 0, (3,)), ("b", 8, (2, 2))), 16, 8)
    flat = layout.buffer(torch.float32)
    flat[0:3].fill_(1.0)
    flat[8:12].fill_(2.0)
    assert flat[3:8].eq(0).all() and flat[12:16].eq(0).all()
    assert flat.data_ptr() % 4096 == 0
