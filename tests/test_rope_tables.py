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
