"""Every schedule's task graph computes the model: each task once at its layer and micro-batch, and
each one after the tasks whose results it reads (happens-before as in test_schedule_buffers).

The data flow of one micro-batch through layer i: pre-attention → (D1 →) attention (→ D2) →
post-attention → its expert batch's FFN → layer i+1's pre-attention; an FFN also waits for the
layer's streamed weights. Schedules differ only in what overlaps, never in this.
"""

from __future__ import annotations

import itertools

import pytest

from core.runtime import schedule
from core.runtime.schedule import decode_step
from test_schedule_buffers import SHAPES, ancestors

PLACEMENTS = [("cpu", "gpu"), ("gpu", "gpu"), ("cpu", "cpu")]  # (attention_on, ffn_on)


def _chain(attention_on: str, ffn_on: str) -> list[str]:
    """Per (layer, micro-batch) kinds in data-flow order."""
    if ffn_on == "cpu":
        return ["pre_attn", "cpu_attn", "post_attn"]
    if attention_on == "gpu":
        return ["kv_load", "pre_attn", "gpu_attn", "post_attn"]
    return ["pre_attn", "d1", "cpu_attn", "d2", "post_attn"]


@pytest.mark.parametrize("attention_on,ffn_on", PLACEMENTS)
@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("L,n,pages,g", SHAPES)
def test_every_task_runs_once_after_what_it_reads(name, attention_on, ffn_on, L, n, pages, g):
    tasks = decode_step(name, num_layers=L, num_micro_batches=n, pages_per_layer=pages,
                        micro_batches_per_expert_batch=g, attention_on=attention_on, ffn_on=ffn_on)
    at = {}
    for t in tasks:
        key = (t.kind, t.layer, t.page if t.kind == "weight_page" else t.micro_batch)
        assert key not in at, f"{t.name} twice"
        at[key] = t.id
    chain = _chain(attention_on, ffn_on)
    cells = set(itertools.product(range(L), range(n)))
    for kind in chain + (["kv_store"] if attention_on == "gpu" and ffn_on == "gpu" else []):
        assert {(i, j) for (k, i, j) in at if k == kind} == cells, kind
    groups = range(0, n, g)
    assert {(i, j) for (k, i, j) in at if k == "ffn"} == set(itertools.product(range(L), groups))
    anc = ancestors(tasks)

    def before(a, b):
        assert anc[at[b]] >> at[a] & 1, f"{tasks[at[b]].name} may start before {tasks[at[a]].name} is done"

    for i, j in sorted(cells):
        steps = [(kind, i, j) for kind in chain]
        for a, b in zip(steps, steps[1:]):
            before(a, b)
        if attention_on == "gpu" and ffn_on == "gpu":
            before(("gpu_attn", i, j), ("kv_store", i, j))  # the store writes the token attention made
        first = j - j % g
        before(("post_attn", i, j), ("ffn", i, first))
        if i + 1 < L:
            before(("ffn", i, first), (chain[0], i + 1, j) if chain[0] == "pre_attn" else ("pre_attn", i + 1, j))
    if ffn_on == "gpu":
        first_use = min(at[(chain[0], 0, j)] for j in range(n))
        for i, j0 in itertools.product(range(L), groups):
            for p in range(pages):
                page = at[("weight_page", i, p)]
                if i > 0 or page < first_use:  # layer 0's later pages prefetch the next step
                    before(("weight_page", i, p), ("ffn", i, j0))


@pytest.mark.parametrize("ffn_on,streamed", [("gpu", True), ("gpu", False), ("cpu", True)])
@pytest.mark.parametrize("L,n,pages", [(1, 1, 1), (3, 2, 2), (4, 3, 5)])
def test_prefill_runs_each_layer_of_each_micro_batch_once_after_its_inputs(ffn_on, streamed, L, n, pages):
    tasks = schedule.prefill(num_layers=L, num_micro_batches=n, pages_per_layer=pages, ffn_on=ffn_on,
                             streamed=streamed)
    first0 = min((t.id for t in tasks if t.layer == 0 and t.kind == "prefill"), default=0)
    # layer 0's pages listed after its first prefill are the next decode step's, loaded ahead (finding 15)
    ahead = [t for t in tasks if t.kind == "weight_page" and t.layer == 0 and t.id > first0]
    at = {(t.kind, t.layer, t.page if t.kind == "weight_page" else t.micro_batch): t.id for t in tasks
          if t not in ahead}
    assert len(at) + len(ahead) == len(tasks)  # nothing twice
    assert sorted(t.page for t in ahead) == (list(range(pages)) if ffn_on == "gpu" and streamed and L > 1 else [])
    cells = set(itertools.product(range(L), range(n)))
    assert {(i, j) for (k, i, j) in at if k == "prefill"} == cells
    stores = {(i, j) for (k, i, j) in at if k == "kv_store"}
    loads = {(i, p) for (k, i, p) in at if k == "weight_page"}
    if ffn_on == "cpu":  # one chain on the CPU: the cache is written in place, nothing is copied
        assert not stores and not loads
        assert all(prev.id in t.deps for prev, t in zip(tasks, tasks[1:]))
        return
    assert stores == cells
    assert loads == (set(itertools.product(range(L), range(pages))) if streamed else set())
    anc = ancestors(tasks)
    for i, j in cells:
        here = at[("prefill", i, j)]
        assert anc[at[("kv_store", i, j)]] >> here & 1
        if i > 0:
            assert anc[here] >> at[("prefill", i - 1, j)] & 1
        for p in range(pages if streamed else 0):
            assert anc[here] >> at[("weight_page", i, p)] & 1
