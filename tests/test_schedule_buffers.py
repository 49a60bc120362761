"""Every schedule's task graph orders each reuse of a shared buffer after the last read of what it held.

The runtime (core.runtime.pipeline) reuses buffers across layers: the two halves of the 2×layer expert
buffer (layer m's pages overwrite layer m−2's half), per-micro-batch host/device staging buffers
(D1 → CPU attention, CPU attention → D2, D2 → post-attention), and with attention on the GPU two KV
buffers per micro-batch by layer parity. A graph is safe when, for each reuse, every reader of the old
contents happens before the new writer, where "happens before" is what every executor guarantees:
a dependency, or an earlier task on the same resource (one queue per resource, run in list order).
A missing edge is a race the threaded runtime may or may not hit; here it fails deterministically.
"""

from __future__ import annotations

import itertools

import pytest

from core.runtime import schedule
from core.runtime.schedule import decode_step

SHAPES = [  # (layers, micro-batches, pages per layer, micro-batches per expert batch)
    (2, 1, 1, 1), (3, 2, 2, 1), (4, 4, 4, 1), (4, 4, 3, 2), (5, 6, 6, 3), (3, 6, 2, 6), (4, 3, 5, 1),
]


def ancestors(tasks) -> list[int]:
    """Bitset per task: every task that finishes before it starts (dependencies and same-queue order)."""
    anc: list[int] = []
    last_on: dict[str, int] = {}
    for t in tasks:
        preds = list(t.deps)
        if t.resource in last_on:
            preds.append(last_on[t.resource])
        bits = 0
        for d in preds:
            bits |= anc[d] | (1 << d)
        anc.append(bits)
        last_on[t.resource] = t.id
    return anc


def _before(anc, a: int, b: int) -> bool:
    return bool(anc[b] >> a & 1)


def _ids(tasks, kind, layer, mb=None):
    return [t.id for t in tasks if t.kind == kind and t.layer == layer and (mb is None or t.micro_batch == mb)]


def _expert_buffer_races(tasks, L: int, reader: str) -> list[str]:
    """Pages of layer m overwrite the half that held layer m−2 (the next step's layer 0: layer L−2's);
    every `reader` task of that layer must be done first."""
    anc = ancestors(tasks)
    first_use = min(t.id for t in tasks if t.layer == 0 and t.kind in ("pre_attn", "prefill", "kv_load"))
    bad = []
    for p in (t for t in tasks if t.kind == "weight_page"):
        nxt_step = p.layer == 0 and p.id > first_use  # prefetched for the next step
        old = L - 2 if nxt_step else p.layer - 2
        if old < 0 or (nxt_step and L < 2):
            continue  # the half held a layer of the previous step: that step is over
        for r in _ids(tasks, reader, old):
            if not _before(anc, r, p.id):
                bad.append(f"{p.name} may overwrite layer {old}'s experts before {tasks[r].name} reads them")
    return bad


def _step(name, attention_on, L, n, pages, g):
    return decode_step(name, num_layers=L, num_micro_batches=n, pages_per_layer=pages,
                       micro_batches_per_expert_batch=g, attention_on=attention_on)


@pytest.mark.parametrize("attention_on", ["cpu", "gpu"])
@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("L,n,pages,g", SHAPES)
def test_weight_pages_wait_for_the_layer_whose_buffer_half_they_overwrite(name, attention_on, L, n, pages, g):
    tasks = _step(name, attention_on, L, n, pages, g)
    assert any(t.kind == "weight_page" for t in tasks)
    assert _expert_buffer_races(tasks, L, "ffn") == []


@pytest.mark.parametrize("L,n,pages", [(2, 1, 1), (3, 2, 2), (5, 3, 4)])
def test_prefill_pages_wait_for_the_layer_whose_buffer_half_they_overwrite(L, n, pages):
    tasks = schedule.prefill(num_layers=L, num_micro_batches=n, pages_per_layer=pages)
    assert _expert_buffer_races(tasks, L, "prefill") == []


# (writer, reader) of each per-micro-batch buffer that the next layer's writer reuses
STAGING = {
    "cpu": [("d1", "cpu_attn"), ("cpu_attn", "d2"), ("d2", "post_attn")],  # qkv_h[j], o_h[j], o_d[j]
    "gpu": [("kv_load", "gpu_attn")],  # kv_d[(layer parity, j)]: layer i reuses layer i−2's
}


@pytest.mark.parametrize("attention_on", ["cpu", "gpu"])
@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("L,n,pages,g", SHAPES)
def test_staging_buffers_are_rewritten_only_after_their_last_read(name, attention_on, L, n, pages, g):
    tasks = _step(name, attention_on, L, n, pages, g)
    anc = ancestors(tasks)
    gap = 2 if attention_on == "gpu" else 1  # KV buffers alternate by layer parity
    bad = []
    for (writer, reader), j, i in itertools.product(STAGING[attention_on], range(n), range(L - gap)):
        (w_next,) = _ids(tasks, writer, i + gap, j)
        for r in _ids(tasks, reader, i, j):
            if not _before(anc, r, w_next):
                bad.append(f"{tasks[w_next].name} may overwrite what {tasks[r].name} still reads")
    assert bad == []


@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("L,n,pages,g", SHAPES)
def test_kv_ring_buffers_are_reloaded_only_after_the_attention_two_positions_back(name, L, n, pages, g):
    """Attention on the GPU: micro-batch position p = i·n + j loads the CPU-held KV into ring buffer
    p mod 2 (core.runtime.pipeline), which position p − 2's attention reads: that load waits for it."""
    tasks = _step(name, "gpu", L, n, pages, g)
    anc = ancestors(tasks)
    bad = []
    for p in range(2, L * n):
        (load,) = _ids(tasks, "kv_load", *divmod(p, n))
        for r in _ids(tasks, "gpu_attn", *divmod(p - 2, n)):
            if not _before(anc, r, load):
                bad.append(f"{tasks[load].name} may overwrite the KV {tasks[r].name} still reads")
    assert bad == []


def test_the_check_sees_a_missing_buffer_dependency():
    """The checker itself: drop the buffer-free edge of one page and it must report the race."""
    tasks = decode_step("s4", num_layers=4, num_micro_batches=2, pages_per_layer=2)
    page = next(t for t in tasks if t.kind == "weight_page" and t.layer == 3)
    cut = [t if t.id != page.id else schedule.Task(t.id, t.kind, t.resource, t.layer, t.micro_batch, t.page, ())
           for t in tasks]
    assert _expert_buffer_races(tasks, 4, "ffn") == []
    assert any("weight_page(3,p" in r for r in _expert_buffer_races(cut, 4, "ffn"))
