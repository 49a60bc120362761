"""RoPE's cos/sin rows are gathered once a decode step, not in every layer: the same positions tensor
comes back for each layer (and for q and k); a changed one is gathered again."""

from __future__ import annotations

import torch

from core.model.rope import Rope
from core.model.spec import RopeSpec


def _gathers(fn) -> int:
    with torch.autograd.profiler.profile(use_kineto=False) as prof:
        fn()
    return sum(ev.name == "aten::index" for ev in prof.function_events if ev.cpu_parent is None)


def test_tables_are_gathered_once_for_the_same_positions_and_again_when_they_change():
    rope = Rope(RopeSpec(), 8, 64, torch.float32)
    x = torch.randn(3, 2, 8)
    pos = torch.tensor([5, 0, 17])
    want = rope.apply(x, pos.clone())  # another tensor: gathered afresh
    assert _gathers(lambda: rope.apply(x, pos)) == 2
    assert _gathers(lambda: torch.testing.assert_close(rope.apply(x, pos), want)) == 0  # the next layer
    pos.add_(1)  # the same tensor, changed in place: not the kept rows
    assert _gathers(lambda: torch.testing.assert_close(rope.apply(x, pos), rope.apply(x, pos.clone()))) == 4


def test_micro_batches_in_turn_each_gather_once_a_step_and_their_rows_go_with_them():
    """A decode step runs micro-batch 0, 1, 0, 1, … through the layers (issue 42, defect 4: keeping only the
    last call's rows missed every time). Each micro-batch's rows are gathered once a step; they are dropped
    with its positions tensor (the next step's micro-batches bring new ones)."""
    import gc
    import weakref

    rope = Rope(RopeSpec(), 8, 64, torch.float32)
    rope.keep = 2  # the decode step's micro-batches (core.runtime.pipeline sets it)
    x = torch.randn(3, 2, 8)
    pos = [torch.tensor([5, 0, 17]), torch.tensor([9, 2, 3])]
    want = [rope.apply(x, p.clone()) for p in pos]

    def step():
        for _layer in range(4):
            for j in (0, 1):
                torch.testing.assert_close(rope.apply(x, pos[j]), want[j])  # q
                torch.testing.assert_close(rope.apply(x, pos[j]), want[j])  # k

    assert _gathers(step) == 2 * 2  # cos and sin, once per micro-batch
    assert _gathers(step) == 0  # the same tensors, unchanged: still kept
    rope.keep = 1  # a prefill's: the last call's rows alone, so micro-batches in turn gather in every layer
    assert _gathers(step) == 2 * 4 * 2
    rope.keep = 2
    rows = weakref.ref(rope.tables(pos[0])[0])
    del pos[0]
    gc.collect()
    assert rows() is None
