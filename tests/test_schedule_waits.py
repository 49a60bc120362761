"""Event waits of a step's graph (issue 42, defect 3): a dependency on another resource is one event wait
(CudaExecutor: a stream's `wait_event`, or CPU attention's host wait), so a layer's tasks may ask for at most
3n + p of them — D1 before attention, attention's copy, D2 before post-attention, and the weight pages' buffer
— never one per (micro-batch, page) pair: at the H200's policy (32 micro-batches, 32 pages) every
post-attention waiting on every page of its layer was 1,152 waits a layer.

What happens before what is test_schedule_dataflow's and test_schedule_buffers' (unchanged by fewer waits);
the waits the emulated device really sees are test_launch_budget's."""

from __future__ import annotations

import collections

import pytest

from core.runtime import schedule
from core.runtime.cuda_executor import STREAMS
from core.runtime.schedule import decode_step

PLACEMENTS = [("cpu", "gpu"), ("gpu", "gpu")]


def waits_per_layer(tasks) -> dict[int, int]:
    """Event waits as CudaExecutor issues them, by the layer of the task that waits: a dependency on a device
    stream's task from another resource (an in-order queue needs none; one on CPU attention, a host task, is
    the launching thread's own wait for it to finish)."""
    res = {t.id: t.resource for t in tasks}
    out: collections.Counter = collections.Counter()
    for t in tasks:
        out[t.layer] += sum(res[d] != t.resource and res[d] in STREAMS for d in t.deps)
    return out


def bound(attention_on: str, n: int, pages: int) -> int:
    """3n + p with CPU attention (the contract); attention on the GPU moves the state both ways (a KV load
    and a store per micro-batch: 4n + p)."""
    return (4 if attention_on == "gpu" else 3) * n + pages


@pytest.mark.parametrize("attention_on,ffn_on", PLACEMENTS)
@pytest.mark.parametrize("name", ["cgopipe", "s4"])  # S3 is one chain by design: each task waits for the last
@pytest.mark.parametrize("n,pages,g", [(1, 1, 1), (4, 4, 1), (6, 3, 2), (8, 16, 1), (32, 32, 1), (32, 32, 4)])
def test_a_layer_waits_at_most_3n_plus_p_times(name, attention_on, ffn_on, n, pages, g):
    tasks = decode_step(name, num_layers=3, num_micro_batches=n, pages_per_layer=pages,
                        micro_batches_per_expert_batch=g, attention_on=attention_on, ffn_on=ffn_on)
    for layer, waits in waits_per_layer(tasks).items():
        assert waits <= bound(attention_on, n, pages), (layer, waits)


def test_post_attention_waits_for_one_page_at_most():
    """The storm itself: each post-attention waits on at most one weight page (the h2d queue is in order)."""
    tasks = decode_step("cgopipe", num_layers=3, num_micro_batches=32, pages_per_layer=32)
    kind = {t.id: t.kind for t in tasks}
    for t in tasks:
        if t.kind == "post_attn":
            assert sum(kind[d] == "weight_page" for d in t.deps) <= 1, t.name


def test_prefill_waits_are_bounded_too():
    tasks = schedule.prefill(num_layers=3, num_micro_batches=8, pages_per_layer=16)
    for layer, waits in waits_per_layer(tasks).items():
        assert waits <= 3 * 8 + 16, (layer, waits)
