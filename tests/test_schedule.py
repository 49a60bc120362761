"""The decode step's task graph: the paper's CGOPipe order, FlexGen-style S4, serial S3, prefill."""

import dataclasses
from collections import Counter

import pytest

from core.runtime import schedule
from core.plan.policy import Policy
from core.runtime.schedule import Task, decode_step
from core.telemetry import RESOURCES
from test_schedule_buffers import ancestors


def _by(tasks, **kw):
    return [t for t in tasks if all(getattr(t, k) == v for k, v in kw.items())]


def _one(tasks, **kw):
    found = _by(tasks, **kw)
    assert len(found) == 1, (kw, found)
    return found[0]


def _valid(tasks):
    assert [t.id for t in tasks] == list(range(len(tasks)))
    for t in tasks:
        assert t.resource in RESOURCES and t.resource == schedule.RESOURCE_OF[t.kind]
        assert all(0 <= d < t.id for d in t.deps)


@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("n,pages,g", [(1, 1, 1), (4, 4, 1), (6, 3, 2), (5, 7, 5), (8, 8, 8)])
def test_every_schedule_has_every_task_once(name, n, pages, g):
    L = 3
    tasks = decode_step(name, num_layers=L, num_micro_batches=n, pages_per_layer=pages, micro_batches_per_expert_batch=g)
    _valid(tasks)
    count = Counter(t.kind for t in tasks)
    for kind in ("pre_attn", "d1", "cpu_attn", "d2", "post_attn"):
        assert count[kind] == L * n
    assert count["ffn"] == L * n // g and count["weight_page"] == L * pages
    for i in range(L):
        assert sorted(t.page for t in _by(tasks, kind="weight_page", layer=i)) == list(range(pages))


def test_cgopipe_sends_page_j_of_the_next_layer_right_after_d2_of_micro_batch_j():
    tasks = decode_step("cgopipe", num_layers=3, num_micro_batches=4, pages_per_layer=4)
    h2d = [t for t in tasks if t.resource == "h2d"]
    for i in range(3):
        for j in range(4):
            d2 = _one(h2d, kind="d2", layer=i, micro_batch=j)
            nxt = h2d[h2d.index(d2) + 1]
            assert (nxt.kind, nxt.layer, nxt.page) == ("weight_page", (i + 1) % 3, j)


def test_cgopipe_runs_cpu_attention_two_micro_batches_ahead():
    tasks = decode_step("cgopipe", num_layers=2, num_micro_batches=4, pages_per_layer=4)
    gpu = [(t.kind, t.layer, t.micro_batch) for t in tasks if t.resource == "compute"]
    # prologue: two pre-attentions of layer 0 before any post-attention
    assert gpu[:2] == [("pre_attn", 0, 0), ("pre_attn", 0, 1)]
    # after PostAttn(i, j) (and its FFN) comes PreAttn(i, j+2), wrapping into the next layer
    i = gpu.index(("post_attn", 0, 2))
    assert gpu[i + 1:i + 3] == [("ffn", 0, 2), ("pre_attn", 1, 0)]
    i = gpu.index(("post_attn", 0, 1))
    assert gpu[i + 1:i + 3] == [("ffn", 0, 1), ("pre_attn", 0, 3)]


def test_gpu_waits_for_a_layers_last_page_before_its_first_micro_batch():
    tasks = decode_step("cgopipe", num_layers=3, num_micro_batches=4, pages_per_layer=4)
    post = _one(tasks, kind="post_attn", layer=1, micro_batch=0)
    anc = ancestors(tasks)  # dependencies and the in-order queues (one wait covers a queue's earlier tasks)
    assert all(anc[post.id] >> t.id & 1 for t in _by(tasks, kind="weight_page", layer=1))


def test_pages_reuse_the_double_buffer_only_after_the_layer_before_is_done():
    tasks = decode_step("cgopipe", num_layers=4, num_micro_batches=2, pages_per_layer=2)
    last_ffn_layer0 = _one(tasks, kind="ffn", layer=0, micro_batch=1)
    anc = ancestors(tasks)
    for p in _by(tasks, kind="weight_page", layer=2):
        assert anc[p.id] >> last_ffn_layer0.id & 1


def test_expert_batches_gather_their_micro_batches():
    tasks = decode_step("cgopipe", num_layers=2, num_micro_batches=6, pages_per_layer=6,
                        micro_batches_per_expert_batch=3)
    ffn = _one(tasks, kind="ffn", layer=0, micro_batch=3)
    posts = {_one(tasks, kind="post_attn", layer=0, micro_batch=j).id for j in (3, 4, 5)}
    assert set(ffn.deps) == posts
    # the next layer's micro-batch 4 waits for that expert batch
    assert ffn.id in _one(tasks, kind="pre_attn", layer=1, micro_batch=4).deps


def test_s4_queues_the_whole_next_layer_before_the_hidden_states():
    tasks = decode_step("s4", num_layers=3, num_micro_batches=4, pages_per_layer=4)
    h2d = [t for t in tasks if t.resource == "h2d"]
    first_d2 = h2d.index(_one(h2d, kind="d2", layer=1, micro_batch=0))
    assert [t.kind for t in h2d[first_d2 - 4:first_d2]] == ["weight_page"] * 4
    assert all(t.layer == 2 for t in h2d[first_d2 - 4:first_d2])
    gpu = [(t.kind, t.micro_batch) for t in tasks if t.resource == "compute" and t.layer == 0]
    assert gpu[:3] == [("pre_attn", 0), ("post_attn", 0), ("ffn", 0)]  # no look-ahead


@pytest.mark.parametrize("attention_on", ["cpu", "gpu"])
def test_s3_is_one_chain(attention_on):
    tasks = decode_step("s3", num_layers=2, num_micro_batches=3, pages_per_layer=2, attention_on=attention_on)
    for prev, t in zip(tasks, tasks[1:]):
        assert prev.id in t.deps


def test_everything_resident_means_no_weight_pages():
    tasks = decode_step("cgopipe", num_layers=2, num_micro_batches=3, pages_per_layer=3, streamed=False)
    assert not _by(tasks, kind="weight_page")


def test_gpu_attention_loads_kv_instead_of_shipping_hidden_states():
    for name in schedule.SCHEDULES:
        tasks = decode_step(name, num_layers=2, num_micro_batches=3, pages_per_layer=3, attention_on="gpu")
        _valid(tasks)
        kinds = Counter(t.kind for t in tasks)
        assert kinds["kv_load"] == kinds["gpu_attn"] == 6 and not kinds["d1"] and not kinds["cpu_attn"]


def test_cpu_only_is_a_chain_on_the_cpu():
    tasks = decode_step("cgopipe", num_layers=2, num_micro_batches=2, ffn_on="cpu")
    _valid(tasks)
    assert {t.resource for t in tasks} == {"compute", "cpu_attn"}  # "compute" is the dense work on the CPU
    for prev, t in zip(tasks, tasks[1:]):
        assert prev.id in t.deps


def test_for_policy_matches_the_policy_shape():
    p = Policy(batch_size=12, micro_batch_size=3, expert_batch_size=6, gpu_weight_fraction=0.5, pages_per_layer=5)
    tasks = schedule.for_policy(p, num_layers=2)
    kinds = Counter(t.kind for t in tasks)
    assert kinds["cpu_attn"] == 8 and kinds["ffn"] == 4 and kinds["weight_page"] == 10
    # every expert resident: nothing streams, so no weight pages
    resident = schedule.for_policy(dataclasses.replace(p, gpu_weight_fraction=1.0), num_layers=2)
    assert not [t for t in resident if t.kind == "weight_page"] and len(resident) == len(tasks) - 10
    # attention where the policy puts it: on the GPU each micro-batch's KV loads, attends there and stores back
    gpu = Counter(t.kind for t in schedule.for_policy(dataclasses.replace(p, attention_on="gpu"), num_layers=2))
    assert gpu["gpu_attn"] == gpu["kv_load"] == gpu["kv_store"] == 8 and not gpu["cpu_attn"]


def test_prefill_streams_the_next_layer_and_stores_kv():
    tasks = schedule.prefill(num_layers=3, num_micro_batches=2, pages_per_layer=2)
    _valid(tasks)
    kinds = Counter(t.kind for t in tasks)
    assert kinds == {"prefill": 6, "kv_store": 6, "weight_page": 8}  # 3 layers' pages, then layer 0's again
    first = _one(tasks, kind="prefill", layer=1, micro_batch=0)
    anc = ancestors(tasks)
    assert all(anc[first.id] >> t.id & 1 for t in _by(tasks, kind="weight_page", layer=1))
    # the next decode step's layer 0 arrives during the last layer, into the half layer 1 is done with
    nxt = [t for t in _by(tasks, kind="weight_page", layer=0) if t.id > first.id]
    assert len(nxt) == 2 and all(anc[t.id] >> _one(tasks, kind="prefill", layer=1, micro_batch=1).id & 1 for t in nxt)
    assert Counter(t.kind for t in schedule.prefill(num_layers=1, num_micro_batches=2, pages_per_layer=2)) == {
        "prefill": 2, "kv_store": 2, "weight_page": 2}  # one layer: it is still in place for the decode


@pytest.mark.parametrize("n", [1, 2, 5])
def test_a_prefill_waits_for_the_store_two_prefills_before_it(n):
    """At most two micro-batches' state await the link at once, whatever the number of micro-batches (the
    planner counts two): the store of the prefill two places earlier in the GPU's order precedes each."""
    tasks = schedule.prefill(num_layers=3, num_micro_batches=n, pages_per_layer=2)
    order = [t for t in tasks if t.kind == "prefill"]
    assert [(t.layer, t.micro_batch) for t in order] == [(i, j) for i in range(3) for j in range(n)]
    for p, t in enumerate(order):
        stores = [d for d in t.deps if tasks[d].kind == "kv_store"]
        if p < 2:
            assert not stores
        else:
            assert [(tasks[d].layer, tasks[d].micro_batch) for d in stores] == [(order[p - 2].layer,
                                                                                 order[p - 2].micro_batch)]


def test_bad_shapes_and_names_are_refused():
    with pytest.raises(ValueError):
        decode_step("s5", num_layers=1, num_micro_batches=1)
    with pytest.raises(ValueError):
        decode_step("cgopipe", num_layers=1, num_micro_batches=4, micro_batches_per_expert_batch=3)
    with pytest.raises(ValueError):
        Task(0, "ffn", "compute", 0, deps=(0,))
    with pytest.raises(ValueError):
        Task(0, "ffn", "tpu", 0)
