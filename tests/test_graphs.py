"""CUDA graphs, proven on the emulated device: its capture mode refuses what real capture forbids, a captured
segment replays to the eager tokens (transformers' for every family), a segment that cannot be captured runs
eagerly with one warning, and "auto" turns graphs on only where the launches would outlast the link."""

from __future__ import annotations

import threading

import pytest
import torch

from checkpoints import FAMILIES
from test_cuda_executor import hf_reference, tokens  # noqa: F401 - the parity run's requests and references
from core.runtime.device import CaptureError
from core.runtime.device_emulated import EmulatedCuda
from core.runtime.engine import Engine, Request
from core.runtime.graphs import Graphs, choose
from core.telemetry import WarningEvent

MiB = 1 << 20


def on_stream(dev, fn):
    """fn() as launched work on a compute stream (where capture happens); its result or exception."""
    stream, out = dev.stream("gpu", compute=True), {}

    def work():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    dev.launch(stream, work)
    stream.synchronize()
    dev.release_stream(stream)
    if "error" in out:
        raise out["error"]
    return out.get("value")


def forbidden(dev, x, host):
    """Each thing real capture forbids, as one call over a device tensor `x` [4] (and a pinned host one)."""
    ev, pageable = dev.event(), torch.ones(4)
    other = dev.stream("other")
    return {
        "device sync": dev.synchronize,
        "event sync": ev.synchronize,
        "event query": ev.query,
        "host wait": lambda: dev.host_wait(ev),
        "stream wait": lambda: dev.current_stream().wait_event(ev),
        "launch elsewhere": lambda: dev.launch(other, lambda: None),
        "to_host": lambda: dev.to_host(x),
        "empty": lambda: dev.empty((4,), torch.float32),
        "zeros": lambda: dev.zeros((4,), torch.float32),
        "to_device": lambda: dev.to_device(pageable),
        "tensor": lambda: dev.tensor([1, 2]),
        "pageable copy": lambda: dev.copy(x, pageable),
        ".item()": lambda: (x.sum() + 1).item(),
        ".tolist()": lambda: (x * 2).tolist(),
        ".cpu()": lambda: (x * 2).cpu(),
        ".numpy()": lambda: (x * 2).numpy(),
        "truth": lambda: bool((x > 0).all()),
        "int": lambda: int(x[0]),
        "nonzero": lambda: torch.nonzero(x > 1),
        "mask index": lambda: x[x > 1],
        "repeat_interleave": lambda: torch.repeat_interleave(x.long()),
        "unique": lambda: torch.unique(x),
    }


def test_the_capture_mode_refuses_each_thing_real_capture_forbids():
    dev = EmulatedCuda(64 * MiB, wait_seconds=5)
    x = dev.to_device(torch.arange(4.0))
    host = torch.ones(4)
    dev.pin(host)
    cases = forbidden(dev, x, host)
    dev.event().record(dev.stream("s"))  # an event recorded outside any capture
    for name, call in cases.items():
        with pytest.raises(CaptureError):
            on_stream(dev, lambda: dev.capture(call))
        call()  # outside a capture each is allowed
    assert dev.stats["capture_refusals"] == len(cases)
    # what capture allows: ops whose outputs are the graph's pool, copies between device or pinned memory
    on_stream(dev, lambda: dev.capture(lambda: (torch.softmax(x, 0), dev.copy(x, host), x.topk(2))))


def test_capture_runs_nothing_and_replay_writes_where_capture_returned():
    """A GPU's capture enqueues nothing: the buffers it writes stay as they were. A replay computes into the
    capture's own output tensors, which the caller keeps (its static outputs)."""
    dev = EmulatedCuda(64 * MiB, wait_seconds=5)
    x, acc = dev.to_device(torch.ones(4)), dev.to_device(torch.zeros(4))
    host = torch.full((4,), 3.0)
    dev.pin(host)

    def segment():
        acc.add_(x)
        dev.copy(x, host)
        return x * 2

    graph, out = on_stream(dev, lambda: dev.capture(segment))
    assert acc.tolist() == [0.0] * 4 and x.tolist() == [1.0] * 4  # untouched by the capture
    on_stream(dev, lambda: dev.replay(graph))
    assert acc.tolist() == [1.0] * 4 and out.tolist() == [6.0] * 4  # replayed into the captured output
    host.fill_(5.0)
    on_stream(dev, lambda: dev.replay(graph))
    assert acc.tolist() == [4.0] * 4 and out.tolist() == [10.0] * 4


def test_a_replay_that_would_not_issue_the_captured_kernels_is_refused():
    """The emulation runs the Python again at each replay, where a GPU replays what it captured: the replay
    must issue the same kernels over the same memory, or what passes here would be wrong on a GPU."""
    dev = EmulatedCuda(64 * MiB, wait_seconds=5)
    w = dev.to_device(torch.ones(4))
    cache: dict = {}

    def cached(x):  # Python state: the product is computed at capture only
        if "w2" not in cache:
            cache["w2"] = w * 2
        return (cache["w2"] + x,)

    held = {"x": dev.to_device(torch.ones(4))}

    def stale(x):  # reads this step's tensor, not the graph's static input
        return (held["x"] * 2,)

    for fn in (cached, stale):
        x = dev.to_device(torch.ones(4))
        graph, _ = on_stream(dev, lambda: dev.capture(lambda: fn(x)))
        held["x"] = dev.to_device(torch.ones(4))  # the next step's
        with pytest.raises(CaptureError, match="diverged|kernels where"):
            on_stream(dev, lambda: dev.replay(graph))
    ok, _ = on_stream(dev, lambda: dev.capture(lambda: (w * 2 + x,)))
    on_stream(dev, lambda: dev.replay(ok))  # the same kernels over the same memory


def test_capture_outside_launched_work_is_refused():
    dev = EmulatedCuda(64 * MiB, wait_seconds=5)
    with pytest.raises(CaptureError):
        dev.capture(lambda: None)


def test_a_segment_warms_up_captures_replays_and_falls_back_with_one_warning():
    dev = EmulatedCuda(64 * MiB, wait_seconds=5)
    warnings: list = []
    graphs = Graphs(dev, warn=warnings.append)
    w = dev.to_device(torch.tensor([2.0, 3.0]))
    calls = []

    def scale(x):
        calls.append(threading.current_thread().name)
        return (x * w,)

    for step in range(4):
        x = dev.to_device(torch.tensor([1.0, float(step)]))
        (y,) = on_stream(dev, lambda: graphs.run("scale", 0, 0, scale, (x,)))
        assert y.tolist() == [2.0, 3.0 * step]
    assert (graphs.captures, graphs.replays, dev.stats["graphs_captured"]) == (1, 3, 1)
    assert len(calls) == 5  # warm-up, capture, and the replays (the emulation runs the Python again)

    def syncs(x):
        return (x * float(x.sum()),)

    for step in range(3):
        x = dev.to_device(torch.tensor([1.0, 2.0]))
        (y,) = on_stream(dev, lambda: graphs.run("sync", 0, 0, syncs, (x,)))
        assert y.tolist() == [3.0, 6.0]
    assert graphs.refused.keys() == {"sync"} and len(warnings) == 1
    assert "sync segment runs without CUDA graphs" in warnings[0].message and "host" in warnings[0].message


def test_auto_turns_graphs_on_only_where_launches_outlast_the_link():
    """The issue's numbers: 40 eager ops a micro-batch and layer at 25 µs each, against the layer's experts
    over a 55 GB/s link."""
    mixtral_bf16 = 3 * 4096 * 14336 * 2 * 8  # a layer's 8 experts streamed: 2.8 GB, 51 ms
    qwen3_int4 = 3 * 2048 * 768 * 128 // 2 + 3 * 2048 * 768 * 128 // 64  # 128 int4 experts (+ scales): 0.3 GB
    pays, why = choose("auto", micro_batches=8, streamed_bytes_per_layer=mixtral_bf16, h2d_bytes_per_s=55e9)
    assert not pays and "8.00 ms" in why and "51.25 ms" in why and "do not pay" in why
    assert choose("auto", micro_batches=32, streamed_bytes_per_layer=mixtral_bf16, h2d_bytes_per_s=55e9)[0]
    pays, why = choose("auto", micro_batches=8, streamed_bytes_per_layer=qwen3_int4, h2d_bytes_per_s=55e9)
    assert pays and "8.00 ms" in why
    assert choose("auto", micro_batches=1, streamed_bytes_per_layer=0, h2d_bytes_per_s=55e9)[0]  # all resident
    assert choose("on", micro_batches=1, streamed_bytes_per_layer=1e12, h2d_bytes_per_s=1)[0]
    assert not choose("off", micro_batches=99, streamed_bytes_per_layer=0, h2d_bytes_per_s=1)[0]


REQS = [("Hi", 5), ("Tell me a story about a cat", 6), ("x y z", 4)]


def _generate(path, graphs, events=None):
    dev = EmulatedCuda(256 * MiB)
    engine = Engine.load(path, device=dev, executor="cuda", resident_layers=0, pages_per_layer=2, graphs=graphs)
    engine.eos_ids = set()
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=n) for i, (p, n) in enumerate(REQS)]
    try:
        done = {r.id: r.output_token_ids for r in engine.generate(
            reqs, batch_size=3, micro_batch_size=2, on_event=(events if events is not None else []).append)}
        out = [done[r.id] for r in reqs]
    finally:
        engine.close()
    return out, engine, dev


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_captured_segments_give_transformers_tokens(checkpoint_factory, hf_reference, family):
    """The CUDA executor's parity run (test_cuda_executor: six requests, batch 4, micro-batch 2, every expert
    streamed) with every decode segment captured and replayed."""
    dev = EmulatedCuda(256 * MiB)
    engine = Engine.load(checkpoint_factory(family), device=dev, executor="cuda", resident_layers=0, graphs="on")
    engine.eos_ids = set()
    try:
        assert tokens(engine) == hf_reference(family)
    finally:
        engine.close()
    # pre-attention, post-attention and the experts of every layer and micro-batch, replayed step after step
    assert dev.stats["graphs_captured"] >= 2 * engine.spec.num_layers * 2
    assert dev.stats["graph_replays"] > dev.stats["graphs_captured"] and dev.stats["capture_refusals"] == 0
    # pre- and post-attention of 2 micro-batches × every layer, captured once (the second decode step of
    # each micro-batch size: 2, then 1 once the shortest request is done), replayed in the later ones
    assert dev.stats["graphs_captured"] >= 2 * 2 * engine.spec.num_layers and dev.stats["graph_replays"] > 0
    assert dev.stats["capture_refusals"] == 0


def test_a_segment_that_syncs_runs_eagerly_with_one_warning(checkpoint_factory, monkeypatch):
    """Capture fails where the segment reads device data on the host (a sync on a GPU): the run goes on eagerly,
    to the same tokens, and says why once."""
    from core.model import decoder

    path = checkpoint_factory("mixtral")
    want, _, _ = _generate(path, "off")
    real = decoder.pre_attn

    def peeking(spec, layer, w, x, *a, **kw):
        if not torch.isfinite(x).all():  # a host read of device data
            raise ValueError("not finite")
        return real(spec, layer, w, x, *a, **kw)

    monkeypatch.setattr(decoder, "pre_attn", peeking)
    events: list = []
    got, _, dev = _generate(path, "on", events)
    warnings = [e.message for e in events if isinstance(e, WarningEvent)]
    assert got == want
    refused = [w for w in warnings if "pre_attn segment runs without CUDA graphs" in w]
    assert len(refused) == 1 and "host read" in refused[0], warnings  # tried once, said once
    assert not any("post_attn" in w for w in warnings)  # the other segments are captured still


def test_graphs_off_and_auto_on_the_emulated_device_capture_nothing(checkpoint_factory):
    path = checkpoint_factory("mixtral")
    for setting in ("off", "auto"):
        _, engine, dev = _generate(path, setting)
        assert dev.stats["graphs_captured"] == 0 and engine.graphs_why
