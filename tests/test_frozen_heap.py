"""A run keeps the garbage collector off the objects that existed before it, and only while it runs.

Seen through `Engine.generate` on a tiny Mixtral, with `gc.get_freeze_count()` (objects in the permanent
generation that collections skip) and weak references to reference cycles (collected or not):
- while a run steps, every object made before it is frozen; when the run ends, or is closed early, none is;
- a cycle made during the run is collected during the run; one made before it and dropped during it waits
  for the first collection after the run (it is not lost);
- runs that overlap share one freeze, thawed when the last ends.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from core.runtime.engine import Engine, Request
from core.runtime.frozen_heap import frozen_heap
from core.telemetry import StepDone


@pytest.fixture(scope="module")
def engine(checkpoint_factory):
    e = Engine.load(checkpoint_factory("mixtral"))
    e.eos_ids = set()
    yield e
    e.close()


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def requests(n: int = 3, tokens: int = 4) -> list[Request]:
    return [Request(id=str(i), prompt="a b c", max_new_tokens=tokens) for i in range(n)]


def test_a_run_freezes_the_objects_made_before_it_and_thaws_them_when_it_ends(engine):
    gc.collect()
    before = len(gc.get_objects())
    seen = []

    def on_event(e):
        if isinstance(e, StepDone):
            seen.append(gc.get_freeze_count())

    out = list(engine.generate(requests(), batch_size=3, on_event=on_event))
    assert len(out) == 3 and len(seen) >= 4
    assert min(seen) >= before * 0.9  # gc.get_objects() also lists the objects gc.collect() has not yet run over
    assert gc.get_freeze_count() == 0


def test_cycles_made_during_a_run_are_collected_in_it_and_older_ones_right_after(engine):
    old = Node()
    old_ref = weakref.ref(old)
    got = {}

    def on_event(e):
        if isinstance(e, StepDone) and "new" not in got:
            nonlocal old
            old = None  # an object from before the run becomes garbage during it
            new = Node()
            got["new"] = weakref.ref(new)
            del new
            gc.collect()
            got["new_alive"] = got["new"]() is not None
            got["old_alive"] = old_ref() is not None

    list(engine.generate(requests(2), batch_size=2, on_event=on_event))
    assert got["new_alive"] is False  # the run's own garbage: collected during the run
    assert got["old_alive"] is True  # frozen with the heap: skipped while the run runs
    gc.collect()
    assert old_ref() is None  # thawed: the first collection after the run frees it


def test_a_run_closed_early_thaws_the_heap(engine):
    it = engine.generate(requests(4, tokens=8), batch_size=2)
    next(it)
    assert gc.get_freeze_count() > 0
    it.close()
    assert gc.get_freeze_count() == 0


def test_overlapping_runs_share_one_freeze_thawed_by_the_last(engine):
    first = engine.generate(requests(2, tokens=6), batch_size=1)
    second = engine.generate(requests(2, tokens=6), batch_size=1)
    next(first)
    next(second)
    list(first)
    assert gc.get_freeze_count() > 0  # the second run still runs
    list(second)
    assert gc.get_freeze_count() == 0


def test_frozen_heap_thaws_when_its_body_raises():
    with pytest.raises(ValueError):
        with frozen_heap():
            assert gc.get_freeze_count() > 0
            raise ValueError("the run failed")
    assert gc.get_freeze_count() == 0
