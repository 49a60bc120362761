"""The CGOPipe runtime on the CPU: every executor and schedule gives the sequential engine's tokens.

The threaded executor runs each resource on its own thread with real copies between "device" and
"host" buffers and experts streamed through the 2×layer buffer, so a missing dependency in the
graph or a buffer reused too early shows up here as different tokens. Repeated over micro-batch
counts, page counts and odd prompt lengths to shake out races.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from core.runtime.engine import Engine, Request
from core.runtime.executors import TaskFailed

PROMPTS = ["Hi", "Compose an engaging travel blog post about a recent trip to Hawaii.", "x y z",
           "What is the capital of France? Answer in one word please, and explain.", "Draft an email.",
           "Describe a vivid character in two paragraphs, with strong imagery.", "ok", "Tell me a story about a cat"]


def requests(n=8, max_new=(5, 9, 3, 7, 11, 4, 6, 8)):
    return [Request(id=f"r{i}", prompt=PROMPTS[i % len(PROMPTS)], max_new_tokens=max_new[i % len(max_new)])
            for i in range(n)]


def tokens(engine, reqs, batch, micro):
    return {r.id: r.output_token_ids for r in engine.generate(reqs, batch_size=batch, micro_batch_size=micro)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Qwen2-MoE has the most parts to get wrong (shared expert and its gate). Three layers: with two,
    # layer i+1 and layer i-1 are the same layer, and a page written too early would go unnoticed.
    from checkpoints import make_checkpoint

    return make_checkpoint("qwen2_moe", tmp_path_factory.mktemp("pipeline-model"), num_hidden_layers=3)


@pytest.fixture(scope="module")
def reference(model):
    engine = Engine.load(model)  # the plain CPU chain, no copies
    engine.eos_ids = set()
    return {(b, m): tokens(engine, requests(), b, m) for b, m in [(4, 1), (4, 2), (6, 3), (8, 2), (3, 1)]}


@pytest.mark.parametrize("executor", ["sequential", "threaded"])
@pytest.mark.parametrize("schedule", ["cgopipe", "s3", "s4"])
@pytest.mark.parametrize("pages,resident", [(1, 0), (3, 0), (2, 1), (1, None)])
def test_every_executor_and_schedule_gives_the_same_tokens(model, reference, executor, schedule, pages, resident):
    engine = Engine.load(model, executor=executor, schedule=schedule, pages_per_layer=pages, resident_layers=resident)
    engine.eos_ids = set()
    try:
        for b, m in [(4, 2), (6, 3)]:
            assert tokens(engine, requests(), b, m) == reference[(b, m)], f"batch {b} micro {m}"
    finally:
        engine.close()


@pytest.mark.parametrize("round_", range(6))
def test_threaded_cgopipe_is_race_free(model, reference, round_, task_fault):
    """Many steps with paging and expert batches over two micro-batches, with random delays on the
    compute thread to widen every race window: tokens never change."""
    pages = (1, 2, 3, 5, 2, 4)[round_]
    engine = Engine.load(model, executor="threaded", schedule="cgopipe", pages_per_layer=pages, resident_layers=0,
                         expert_group=2 if round_ % 2 else 1)
    engine.eos_ids = set()
    rng = random.Random(round_)
    task_fault(lambda task: time.sleep(rng.random() * 0.002) if rng.random() < 0.2 else None)
    try:
        for (b, m), want in reference.items():
            assert tokens(engine, requests(), b, m) == want
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["mixtral", "dbrx", "qwen3_moe", "olmoe"])
def test_threaded_matches_sequential_for_every_family(checkpoint_factory, family):
    path = checkpoint_factory(family)
    plain, threaded = Engine.load(path), Engine.load(path, executor="threaded", pages_per_layer=2, resident_layers=0)
    plain.eos_ids = threaded.eos_ids = set()
    try:
        assert tokens(threaded, requests(7), 4, 2) == tokens(plain, requests(7), 4, 2)
    finally:
        threaded.close()


def test_attention_thread_failure_surfaces_with_its_cause(model, task_fault):
    engine = Engine.load(model, executor="threaded", resident_layers=0)
    calls = []

    def fault(task):
        if task.kind == "cpu_attn" and task.layer == 1:
            calls.append(threading.current_thread().name)
            raise ValueError("injected attention fault")

    task_fault(fault)
    done = []
    worker = threading.Thread(target=lambda: done.append(_run_expecting_failure(engine)))
    worker.start()
    worker.join(timeout=60)
    engine.close()
    assert not worker.is_alive(), "the failure hung the engine"
    err = done[0]
    assert isinstance(err, TaskFailed) and "cpu_attn layer=1" in str(err)
    assert isinstance(err.__cause__, ValueError) and "injected" in str(err.__cause__)
    assert calls and calls[0] == "mlight-cpu_attn"  # it really ran on the attention worker thread


def _run_expecting_failure(engine):
    try:
        list(engine.generate(requests(4), batch_size=4, micro_batch_size=2))
    except TaskFailed as e:
        return e
    return None


def test_out_of_memory_replans_with_a_smaller_batch(model, reference, task_fault):
    """An OOM in a step halves the batch and carries on; finished results are kept, tokens unchanged."""
    from core.telemetry import WarningEvent

    engine = Engine.load(model, executor="threaded", schedule="cgopipe", resident_layers=0)
    engine.eos_ids = set()
    fired = []

    def fault(task):
        if task.kind == "ffn" and task.layer == 1 and len(fired) < 1 and task.micro_batch == 1:
            fired.append(task)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    task_fault(fault)
    events = []
    got = {r.id: r.output_token_ids for r in engine.generate(requests(), batch_size=4, micro_batch_size=2,
                                                               on_event=events.append)}
    engine.close()
    assert fired
    assert got == reference[(4, 2)]
    assert any(isinstance(e, WarningEvent) and "with batch 2," in e.message for e in events)


def test_telemetry_reports_busy_time_and_bytes(model):
    from core.telemetry import RESOURCES, StepDone

    engine = Engine.load(model, executor="threaded", pages_per_layer=2, resident_layers=0)
    events = []
    list(engine.generate(requests(4), batch_size=4, micro_batch_size=2, on_event=events.append))
    engine.close()
    decode = [e for e in events if isinstance(e, StepDone) and e.kind == "decode"]
    assert decode and set(decode[0].busy) <= set(RESOURCES)
    assert all(e.bytes_h2d >= engine.spec.num_layers * engine.spec.layer_expert_bytes for e in decode)
    assert all(e.bytes_d2h > 0 and e.busy["cpu_attn"] > 0 and e.busy["h2d"] > 0 for e in decode)
