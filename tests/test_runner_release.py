"""A run gives its runner back: after `generate`, the device holds what it held before, with no collection
needed, so the next run on the same engine (the app keeps it between runs) has the device to itself.

Before, the runner's task table held its own bound methods (a reference cycle): the runner waited for the
cyclic collector, and the next run froze it into the permanent generation (core.runtime.frozen_heap) with
its device buffers; at a memory cap that fits one runner the second run failed with "out of GPU memory with
a batch of one request"."""

from __future__ import annotations

import gc

import pytest

from core.runtime.device_emulated import EmulatedCuda
from core.runtime.engine import Engine, Request

MiB = 1 << 20


@pytest.fixture
def no_collection():
    """No automatic collection between the runs (a full one is rare in a long-lived process: thresholds)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


def _run(engine) -> list[int]:
    [r] = engine.generate([Request(id="a", prompt="Hello there", max_new_tokens=3)], batch_size=1)
    return r.output_token_ids


def test_two_runs_in_a_row_at_a_cap_that_fits_one_runner(checkpoint_factory, no_collection):
    path = checkpoint_factory("mixtral")
    probe = EmulatedCuda(1 << 30)
    engine = Engine.load(path, device=probe, executor="cuda", resident_experts=(1, 1))
    engine.eos_ids = set()
    base = probe.memory_allocated()
    want = _run(engine)
    runner = probe.max_memory_allocated() - base
    engine.close()
    assert runner > 0

    dev = EmulatedCuda(1 << 30)
    engine = Engine.load(path, device=dev, executor="cuda", resident_experts=(1, 1))
    engine.eos_ids = set()
    before = dev.memory_allocated()
    dev.total = before + int(1.5 * runner)  # room for one runner, not two
    try:
        assert _run(engine) == want
        assert dev.memory_allocated() == before  # the runner and its buffers are gone, by reference counting
        assert _run(engine) == want
        assert dev.memory_allocated() == before
    finally:
        engine.close()
