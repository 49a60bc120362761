"""The CUDA executor's own code, run over the emulated device: right tokens, no hang, no leak.

`CudaExecutor` (setup, stream waits, event timing, failure handling) and the pipeline's device code
run here exactly as on a GPU, over `EmulatedCuda`, whose streams run later than the host launches
and whose copies land late. Tokens must equal transformers' for every family, schedule and paging;
removing one copy's event wait must break them (the dependencies are load-bearing); a failure at a
worker's setup, at a wait or in a task must come back as TaskFailed within seconds.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import threading
import time
import weakref

import pytest
import torch

from checkpoints import FAMILIES, NEW_FAMILIES, reference_greedy
from core.model.cpu.threads import allowed_cores, split, worker_setup
from core.model.families import load_spec
from core.runtime import schedule as sched
from core.runtime.cuda_executor import CudaExecutor
from core.runtime.device_emulated import EmulatedCuda
from core.runtime.engine import Engine, Request
from core.runtime.executors import Stalled, TaskFailed, ThreadedExecutor

PROMPTS = ["Hi", "Compose an engaging travel blog post about a recent trip to Hawaii.", "x y z",
           "What is the capital of France? Answer in one word please, and explain.", "Draft an email.",
           "Tell me a story about a cat"]
MAX_NEW = (4, 6, 3, 5, 7, 4)
MiB = 1 << 20


def requests(n=6):
    return [Request(id=f"r{i}", prompt=PROMPTS[i], max_new_tokens=MAX_NEW[i]) for i in range(n)]


def tokens(engine, reqs=None, batch=4, micro=2):
    return {r.id: r.output_token_ids for r in engine.generate(reqs or requests(), batch_size=batch,
                                                               micro_batch_size=micro)}


def emulated(jitter=0.0005, **kw):
    rng = random.Random(0)
    return EmulatedCuda(kw.pop("memory_bytes", 256 * MiB), copy_delay=lambda: rng.random() * jitter, **kw)


@pytest.fixture
def hf_reference(checkpoint_factory):
    """family -> {request id: transformers' greedy tokens}, each computed once a session (reference_greedy's
    memo: test_graphs asks for the same references)."""
    from core.runtime.loading import load_tokenizer

    def get(family):
        path = checkpoint_factory(family)
        tok = load_tokenizer(path)
        return {r.id: reference_greedy(path, tok(r.prompt).input_ids, r.max_new_tokens) for r in requests()}

    return get


# paging: every expert streamed in one page; three pages with some experts resident on the device
# (1 and 3 in alternate layers); the same with the first half of the layers' attention state kept on
# the device (S4's r_c: K/V, window ring, MLA latent or linear-attention state, by family)
PAGINGS = {"streamed": (1, (0, 0), False), "paged+resident": (3, (1, 3), False),
           "paged+resident+state": (3, (1, 3), True)}
# the old five: every schedule × the first two pagings; issue 14's seven (CI time): one paging per schedule
NEW_PAGING = {"cgopipe": "streamed", "s3": "paged+resident", "s4": "paged+resident+state"}
RUNS = [(f, s, p) for f in FAMILIES for s in NEW_PAGING for p in PAGINGS
        if (p == NEW_PAGING[s] if f in NEW_FAMILIES else not PAGINGS[p][2])]


@pytest.mark.parametrize("family,schedule,paging", RUNS)
def test_cuda_executor_on_the_emulated_device_matches_transformers(checkpoint_factory, hf_reference, family,
                                                                     schedule, paging):
    dev = emulated()
    path = checkpoint_factory(family)
    pages, resident, state_on_gpu = PAGINGS[paging]
    L = load_spec(path).num_layers
    engine = Engine.load(path, device=dev, executor="cuda", schedule=schedule, pages_per_layer=pages,
                         resident_experts=tuple(resident[i % 2] for i in range(L)))
    if state_on_gpu:
        engine.config = dataclasses.replace(engine.config, kv_gpu_layers=L // 2)
    engine.eos_ids = set()
    try:
        assert tokens(engine) == hf_reference(family)
    finally:
        engine.close()
    assert dev.stats["staged_copies"] == 0  # every transfer of a step was one asynchronous copy
    assert dev.stats["spin_waits"] == 0  # host waits sleep (finding 14)


@pytest.mark.parametrize("removed", ["host waits for D1", "gpu stream waits for D2"])
def test_without_one_copy_event_wait_the_tokens_are_wrong(checkpoint_factory, hf_reference, monkeypatch, removed):
    """Mutation: the waits are what make the late copies safe. Drop the CPU attention thread's wait on
    its D1 copy, or the compute stream's wait on D2, and stale buffers are read."""
    dev = EmulatedCuda(256 * MiB, copy_delay=0.002)
    engine = Engine.load(checkpoint_factory("mixtral"), device=dev, executor="cuda", schedule="cgopipe",
                         resident_experts=(0, 0))
    engine.eos_ids = set()
    ex = engine.executor()
    if removed == "host waits for D1":
        real = dev.host_wait
        monkeypatch.setattr(dev, "host_wait", lambda ev, cancel=None, **kw: None if
                            threading.current_thread().name == "mlight-cpu_attn" else real(ev, cancel, **kw))
    else:
        gpu = ex.streams["compute"]
        monkeypatch.setattr(gpu, "wait_event", lambda ev: None)
    try:
        assert tokens(engine) != hf_reference("mixtral")
    finally:
        engine.close()


# ---- never hang: each failure point gives TaskFailed, quickly -----------------------------------------
def graph():
    return sched.decode_step("cgopipe", num_layers=2, num_micro_batches=2, pages_per_layer=2)


def run_bounded(ex, tasks, fn, limit=20.0):
    """ex.run in a thread, so that a hang fails the test instead of hanging it; (error, seconds)."""
    out = {}

    def target():
        t0 = time.perf_counter()
        try:
            ex.run(tasks, fn)
        except BaseException as e:  # noqa: BLE001
            out["err"] = e
        out["s"] = time.perf_counter() - t0

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(limit)
    assert not th.is_alive(), f"the executor hung for {limit} s"
    return out.get("err"), out["s"]


def device_work(dev):
    x = dev.to_device(torch.ones(8))

    def fn(task):
        if task.resource == "compute":
            (x * 2).sum()

    return fn


def test_a_worker_that_cannot_start_fails_the_step_with_its_cause():
    dev = emulated()

    def fault(point):
        if point == "set_device" and threading.current_thread().name == "mlight-h2d":
            raise RuntimeError("injected: no such device")

    dev.fault = fault
    ex = CudaExecutor(dev)
    err, secs = run_bounded(ex, graph(), device_work(dev))
    ex.close()
    assert isinstance(err, TaskFailed) and "h2d worker could not start" in str(err)
    assert "injected: no such device" in str(err.__cause__.__cause__) and secs < 5
    err, secs = run_bounded(ex, graph(), device_work(dev))  # and it stays refused, at once
    assert isinstance(err, TaskFailed) and secs < 1


@pytest.mark.parametrize("point", ["wait_event", "host_wait"])
def test_a_failing_wait_fails_the_step_with_its_cause(point):
    dev = emulated()
    fired = []

    def fault(p):
        if p == point and threading.current_thread().name.startswith("mlight-") and not fired:
            fired.append(p)
            raise RuntimeError(f"injected {p} failure")

    dev.fault = fault
    ex = CudaExecutor(dev)
    err, secs = run_bounded(ex, graph(), device_work(dev))
    assert fired and isinstance(err, TaskFailed) and f"injected {point}" in str(err.__cause__) and secs < 5
    err, _ = run_bounded(ex, graph(), device_work(dev))  # the executor recovers for the next step
    ex.close()
    assert err is None


@pytest.mark.parametrize("point", ["launch", "copy", "alloc"])
def test_a_failing_launch_copy_or_allocation_fails_the_step_with_its_cause(point):
    """The device calls a task makes: a launch (on the worker), a copy and an allocation (in launched work,
    on the stream, surfacing at the next sync). Each fails the step quickly; the next step runs."""
    dev = emulated()
    host = torch.ones(8)
    dev.pin(host)
    dbuf = dev.empty(8, torch.float32)
    fired = []

    def fault(p):
        if p == point and not fired and threading.current_thread().name.startswith(("mlight-", "emulated-")):
            fired.append(threading.current_thread().name)
            raise RuntimeError(f"injected {p} failure")

    def fn(task):
        if task.resource == "h2d":
            dev.copy(dbuf, host)
        elif task.resource == "compute":
            dev.empty(8, torch.float32).copy_(dbuf)

    ex = CudaExecutor(dev)
    dev.fault = fault
    err, secs = run_bounded(ex, graph(), fn)
    assert fired and isinstance(err, TaskFailed) and secs < 5
    assert f"injected {point} failure" in str(err.__cause__)
    err, _ = run_bounded(ex, graph(), fn)
    ex.close()
    assert err is None


def test_a_task_failing_on_the_device_fails_the_step_naming_it():
    dev = emulated()
    ex = CudaExecutor(dev)
    work = device_work(dev)

    def fn(task):
        if task.kind == "post_attn" and task.layer == 1:
            raise ValueError("injected task failure")  # on the emulated stream's thread, after launch
        work(task)

    err, secs = run_bounded(ex, graph(), fn)
    ex.close()
    assert isinstance(err, TaskFailed) and "post_attn layer=1" in str(err)
    assert isinstance(err.__cause__, ValueError) and secs < 5


def test_a_failing_dependency_wait_in_the_threaded_executor_fails_the_step(monkeypatch):
    """Finding 2: the wait sat outside the worker's try; an error there killed the thread and hung run()."""
    ex = ThreadedExecutor(("compute", "cpu_attn", "h2d", "d2h"))
    real = ThreadedExecutor._wait_deps

    def wait(self, step, task):
        if task.kind == "cpu_attn":
            raise RuntimeError("injected wait failure")
        return real(self, step, task)

    monkeypatch.setattr(ThreadedExecutor, "_wait_deps", wait)
    err, secs = run_bounded(ex, graph(), lambda t: None)
    ex.close()
    assert isinstance(err, TaskFailed) and "cpu_attn" in str(err) and secs < 5


def test_a_stalled_step_fails_and_the_stuck_executor_says_so():
    dev = emulated()
    ex = CudaExecutor(dev, stall_seconds=0.5)
    release = threading.Event()

    def fn(task):
        if task.kind == "cpu_attn":
            release.wait(30)  # a host task that never returns

    err, secs = run_bounded(ex, graph(), fn)
    assert isinstance(err, TaskFailed) and isinstance(err.__cause__, Stalled) and secs < 5
    err, secs = run_bounded(ex, graph(), fn)
    release.set()
    ex.close()
    assert isinstance(err, TaskFailed) and "stuck" in str(err) and secs < 1


# ---- what a step leaves behind ------------------------------------------------------------------------
def test_timing_events_are_pooled_and_the_step_syncs_once():
    """Finding 13: two fresh events per stream task per step, each synchronised, were thousands per step."""
    dev = emulated()
    ex = CudaExecutor(dev)
    tasks = graph()
    stream_tasks = sum(t.resource in ("compute", "h2d", "d2h") for t in tasks)
    host_waits = sum(1 for t in tasks if t.resource == "cpu_attn" for d in t.deps if tasks[d].resource != "cpu_attn")
    for step in range(3):
        syncs = dev.stats["host_syncs"]
        busy = ex.run(tasks, device_work(dev))
        # the step's one (issue 42: the streams join on the device first), plus the attention's own waits
        assert dev.stats["host_syncs"] - syncs == 1 + host_waits
        assert busy["compute"] > 0
    ex.close()
    assert dev.stats["events_created"] <= 2 * stream_tasks + 3 * 3  # the pool, plus wait_stream's markers


def test_one_event_record_per_stream_task():
    """Issue 42, defect 3: a start and an end event per task were two host calls each of a launch-bound step's
    (224 tasks a layer at the H200's policy). The end event, which other streams wait on anyway, is the only
    one: a step records one per stream task, plus the step's origin, the streams' waits on the caller, and the
    join the host waits on once."""
    dev = emulated()
    ex = CudaExecutor(dev)
    tasks = graph()
    stream_tasks = sum(t.resource in ("compute", "h2d", "d2h") for t in tasks)
    try:
        for _ in range(2):
            before = dev.stats["event_records"]
            ex.run(tasks, device_work(dev))
            assert dev.stats["event_records"] - before == stream_tasks + 1 + 3 + 1
    finally:
        ex.close()


def test_busy_time_leaves_out_a_stream_waiting_for_a_host_task():
    """A task's start is inferred (its launch, its stream's previous task, its dependencies' ends), not
    timed: the GPU's busy seconds are its kernels', not the CPU attention it waited 60 ms for."""

    class T:
        def __init__(self, i, resource, deps=()):
            self.id, self.resource, self.deps, self.kind, self.layer = i, resource, deps, resource, 0

    dev = emulated()
    ex = CudaExecutor(dev)

    def fn(task):
        time.sleep(0.06 if task.resource == "cpu_attn" else 0.02)

    try:
        busy = ex.run([T(0, "compute"), T(1, "cpu_attn", (0,)), T(2, "compute", (1,))], fn)
        spans = ex.times[:6]
    finally:
        ex.close()
    assert 0.04 <= busy["compute"] < 0.06, busy  # two 20 ms kernels; a timer from the first launch would say ≥ 100 ms
    assert spans[2] >= spans[1] and spans[4] >= spans[3] - 1e-6  # attention after the first, the second after it


def test_attention_leaves_a_core_to_the_threads_feeding_the_gpu():
    """Finding 14, the cores: on a 4-vCPU T4 box the GPU's feeders get one core, attention three."""
    assert [split(list(range(c)), "cuda") for c in (1, 2, 4)] == [([0], [0]), ([0], [1]), ([0], [1, 2, 3])]
    assert worker_setup("cuda", cores=[0, 1, 2, 3]).threads == 3


@pytest.mark.skipif(len(allowed_cores()) < 2 or not hasattr(os, "sched_setaffinity"),
                    reason="needs two cores and per-thread affinity (Linux)")
def test_the_cuda_executor_keeps_attention_off_the_cores_feeding_the_device(checkpoint_factory):
    """The engine's thread governor would otherwise give torch every free core, attention's team included."""
    engine = Engine.load(checkpoint_factory("mixtral"), device=emulated(), executor="cuda", resident_layers=0)
    try:
        tokens(engine)
        pinned = engine._executor.placement.pinned
        assert set(pinned) == {"compute", "h2d", "d2h", "cpu_attn"} and pinned["h2d"] == pinned["compute"]
        assert not set(pinned["compute"]) & set(pinned["cpu_attn"])
        assert engine.threads.fixed == len(pinned["cpu_attn"])
    finally:
        engine.close()


@pytest.mark.parametrize("executor", ["threaded", "cuda"])
def test_a_finished_generate_leaves_nothing_alive(checkpoint_factory, executor):
    """Finding 3: workers kept the last step, and through it the runner and its device buffers, until
    their next task; a second generate() then sat on top of the first one's memory."""
    dev = emulated() if executor == "cuda" else "cpu"
    engine = Engine.load(checkpoint_factory("qwen2_moe"), device=dev, executor=executor, schedule="cgopipe",
                         resident_layers=0)
    engine.eos_ids = set()
    made = []
    real = engine.runner

    def spy(*a, **kw):
        r = real(*a, **kw)
        made.append(weakref.ref(r))
        return r

    engine.runner = spy
    first = tokens(engine)
    gc.collect()
    assert made and all(r() is None for r in made), "a runner outlived its generate()"
    if executor == "cuda":
        peak = dev.max_memory_allocated()
        assert dev.memory_allocated() == 0
        dev.reset_peak_memory_stats()
        assert tokens(engine) == first
        # the second run peaks where the first did (not on top of it); the streams' interleaving moves
        # the peak by a few activations between runs
        assert abs(dev.max_memory_allocated() - peak) <= 0.05 * peak
    engine.close()


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_experts_stream_and_stay_resident_in_part(tmp_path, quantize):
    """Quantized pages carry their bytes; a layer's resident experts and its streamed ones are two parts of
    the same QuantExperts computation: tokens equal the host's threaded run of the same quantized model."""
    from checkpoints import make_checkpoint

    path = make_checkpoint("mixtral", tmp_path / "q", hidden_size=64, intermediate_size=128, num_hidden_layers=3)
    ref = Engine.load(path, device="cpu", executor="threaded", quantize=quantize, use_cache=False, resident_layers=0)
    ref.eos_ids = set()
    want = tokens(ref)
    ref.close()
    dev = emulated()
    engine = Engine.load(path, device=dev, executor="cuda", quantize=quantize, use_cache=False,
                         resident_experts=(1, 3, 4), pages_per_layer=2)
    engine.eos_ids = set()
    try:
        assert tokens(engine) == want
    finally:
        engine.close()
    assert dev.stats["staged_copies"] == 0


# ---- never hang on the device: every host wait on device work has a deadline ---------------------------
def hang_on(dev, point, when):
    """A fault that blocks (a hung kernel or copy) on an emulated stream's thread while `when(label)` holds;
    returns the gate that releases it (set it at the end, so that the stream's thread ends)."""
    gate = threading.Event()
    gate.hung = threading.Event()

    def fault(p):
        if p == point and threading.current_thread().name.startswith("emulated-") and when(dev.running()):
            gate.hung.set()
            gate.wait(30)

    dev.fault = fault
    return gate


def is_task(kind, layer):
    return lambda label: getattr(label, "kind", None) == kind and label.layer == layer


@pytest.mark.parametrize("hang", ["kernel", "copy"])
def test_a_hung_kernel_or_copy_fails_the_step_naming_it_within_the_device_deadline(hang):
    """Launch-time stalls were caught; work that hangs once launched was not: the step's end waited on the
    streams' last events with no deadline, and generate() hung. The executor's own stall limit (600 s) is
    not what catches it here: the device's wait_seconds is."""
    dev = emulated(wait_seconds=0.5)
    host = torch.ones(8)
    dev.pin(host)
    dbuf = dev.empty(8, torch.float32)
    work = device_work(dev)

    def fn(task):
        if task.resource == "h2d":
            dev.copy(dbuf, host)
        work(task)

    if hang == "kernel":
        gate, stuck = hang_on(dev, "kernel", is_task("ffn", 1)), "the compute stream has not finished ffn layer=1"
    else:
        gate, stuck = hang_on(dev, "copy", lambda label: True), "the h2d stream has not finished"
    ex = CudaExecutor(dev)
    try:
        err, secs = run_bounded(ex, graph(), fn)
        assert isinstance(err, TaskFailed) and isinstance(err.__cause__, Stalled), err
        assert stuck in str(err) and "it started" in str(err) and "0.5 s" in str(err)
        assert secs < 5  # the deadline, plus the failure's grace
        err, secs = run_bounded(ex, graph(), fn)  # the stream is stuck: further steps are refused at once
        assert isinstance(err, TaskFailed) and "stuck" in str(err) and secs < 1
    finally:
        gate.set()
        ex.close()


def test_generate_with_a_hung_kernel_fails_within_seconds(checkpoint_factory, task_fault):
    """The headline: the GPU path never hangs. A kernel of the second layer's FFN never returns; generate()
    raises a TaskFailed naming it, in about the device's deadline."""
    dev = emulated(wait_seconds=1.0)
    engine = Engine.load(checkpoint_factory("mixtral"), device=dev, executor="cuda", resident_layers=0)
    gate = threading.Event()
    hung = []

    def fault(task):  # the injected fault runs inside the launched work: on the stream's thread here
        if task.kind == "ffn" and task.layer == 1 and threading.current_thread().name == "emulated-compute":
            hung.append(task)
            gate.wait(30)

    task_fault(fault)
    out = {}

    def target():
        t0 = time.perf_counter()
        try:
            tokens(engine)
        except BaseException as e:  # noqa: BLE001
            out["err"] = e
        out["s"] = time.perf_counter() - t0

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(20)
    try:
        assert not th.is_alive(), "generate() hung on a hung kernel"
        assert hung and isinstance(out.get("err"), TaskFailed), out
        assert "ffn layer=1" in str(out["err"]) and "1 s" in str(out["err"]) and out["s"] < 8
    finally:
        gate.set()
        engine.close()


def test_the_wait_for_the_steps_logits_is_bounded(checkpoint_factory):
    """The logits wait was a stream synchronise with no deadline. Here the caller's stream (on CUDA the default
    stream, where the logits' kernels queue) is one whose work hangs: the wait raises DeviceStalled."""
    from core.runtime.device import DeviceStalled

    dev = emulated(wait_seconds=0.5)
    engine = Engine.load(checkpoint_factory("mixtral"), device=dev, executor="cuda", resident_layers=0)
    runner = engine.runner(2, 2, 16, lambda e: None)
    caller = dev.stream("default")
    gate = threading.Event()
    dev.launch(caller, lambda: gate.wait(30), label="a hung kernel")
    x = dev.to_device(torch.randn(2, engine.spec.hidden_size, dtype=engine.weights.dtype))
    real = dev.current_stream
    dev.current_stream = lambda: caller
    out = {}

    def target():
        try:
            runner._logits([x], "logits_dec")
        except BaseException as e:  # noqa: BLE001
            out["err"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(10)
    try:
        assert not th.is_alive(), "the logits' wait hung"
        assert isinstance(out.get("err"), DeviceStalled) and "logits" in str(out["err"])
    finally:
        dev.current_stream = real
        gate.set()
        engine.close()


def test_a_failed_step_does_not_wait_forever_for_a_stream_that_hangs():
    """After a failure the executor drains the device before buffers go; a stream hung meanwhile made that
    drain (the emulated device's, like torch.cuda.synchronize) wait forever."""
    dev = emulated(wait_seconds=0.5)
    host = torch.ones(8)
    dev.pin(host)
    dbuf = dev.empty(8, torch.float32)
    # layer 1's first page hangs (no task waits on it before the second micro-batch's attention fails)
    gate = hang_on(dev, "copy", lambda label: label.kind == "weight_page" and label.layer == 1 and label.page == 0)

    def fn(task):
        if task.resource == "h2d":
            dev.copy(dbuf, host)
        if task.kind == "cpu_attn" and task.layer == 0 and task.micro_batch == 1:
            assert gate.hung.wait(5)
            raise ValueError("injected host task failure")

    ex = CudaExecutor(dev)
    try:
        err, secs = run_bounded(ex, graph(), fn)
        assert isinstance(err, TaskFailed) and "injected host task failure" in str(err) and secs < 5
        err, secs = run_bounded(ex, graph(), fn)
        assert isinstance(err, TaskFailed) and "did not drain" in str(err) and "h2d" in str(err) and secs < 1
    finally:
        gate.set()
        ex.close()


def test_an_expert_batch_on_a_device_keeps_its_inputs_in_device_memory(checkpoint_factory, hf_reference, monkeypatch):
    """The CPU mode's reused host buffers (core.model.moe.Scratch) are host memory: an expert batch of two
    micro-batches on a device concatenates its inputs where they are (a host `out=` for CUDA tensors is a
    device mismatch on a real GPU, which the emulated device's host-backed tensors cannot show)."""
    from core.model.moe import Scratch

    def host_only(self, *a, **kw):
        raise AssertionError("a device's FFN asked the host scratch for a buffer")

    monkeypatch.setattr(Scratch, "get", host_only)
    dev = emulated()
    engine = Engine.load(checkpoint_factory("mixtral"), device=dev, executor="cuda", schedule="cgopipe",
                         expert_group=2)
    engine.eos_ids = set()
    try:
        assert tokens(engine) == hf_reference("mixtral")  # batch 4 in micro-batches of 2: one expert batch of 2
    finally:
        engine.close()
