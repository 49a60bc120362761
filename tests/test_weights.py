"""Loading safetensors checkpoints into paged layer buffers: sharded, damaged, and within 1.1x RSS."""

from __future__ import annotations

import gc

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import hf_model, make_checkpoint
from core.errors import ModelError
from core.model.families import load_spec
from core.model.weights import LayerLayout, load_weights

ROOT = Path(__file__).resolve().parent.parent


def test_layer_views_live_in_one_paged_buffer(checkpoint_factory):
    path = checkpoint_factory("mixtral")
    spec = load_spec(path)
    w = load_weights(path, spec, pages_per_layer=3)
    ref = hf_model(path).state_dict()
    lw = w.layers[1]
    layout = LayerLayout.for_spec(spec, 0)
    assert len(lw.pages) == 3 and sum(p.numel() for p in lw.pages) == layout.expert_numel
    assert layout.expert_numel * lw.flat.element_size() >= spec.layer_expert_bytes
    assert all(p.untyped_storage().data_ptr() == lw.flat.untyped_storage().data_ptr() for p in lw.pages)
    for name, t in lw.tensors.items():
        assert t.untyped_storage().data_ptr() == lw.flat.untyped_storage().data_ptr(), name
    # experts stacked [E, 2I, D] / [E, D, I] with the checkpoint's values in place
    fused = ref["model.layers.1.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(lw["w13"], fused, rtol=0, atol=0)
    torch.testing.assert_close(lw["w2"], ref["model.layers.1.mlp.experts.down_proj"], rtol=0, atol=0)
    torch.testing.assert_close(w.globals["embed"], ref["model.embed_tokens.weight"], rtol=0, atol=0)
    # the same layout gives views over any other buffer of that size (the GPU double buffer)
    other = torch.zeros(layout.expert_numel, dtype=lw.flat.dtype)
    for page, (a, b) in zip(lw.pages, layout.page_bounds(3)):
        other[a:b].copy_(page)
    assert torch.equal(layout.expert_views(other)["w13"], lw["w13"])
    assert torch.equal(layout.expert_views(other)["w2"], lw["w2"])


def test_sharded_checkpoint_loads_the_same(tmp_path, checkpoint_factory):
    single = checkpoint_factory("qwen2_moe")
    sharded = make_checkpoint("qwen2_moe", tmp_path / "sharded ckpt é", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    spec = load_spec(single)
    a, b = load_weights(single, spec), load_weights(sharded, spec)
    for la, lb in zip(a.layers, b.layers):
        assert all(torch.equal(la[n], lb[n]) for n in la.tensors)


@pytest.fixture
def sharded_copy(tmp_path, checkpoint_factory):
    src = make_checkpoint("mixtral", tmp_path / "src", max_shard_size="60KB")
    return src


def test_missing_shard_is_named(sharded_copy):
    index = json.loads((sharded_copy / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (sharded_copy / victim).unlink()
    with pytest.raises(ModelError, match=f"shard {victim} listed in model.safetensors.index.json is missing"):
        load_weights(sharded_copy, load_spec(sharded_copy))


def test_truncated_shard_is_named(sharded_copy):
    victim = sorted(sharded_copy.glob("*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=f"{victim.name} is truncated"):
        load_weights(sharded_copy, load_spec(sharded_copy))


def test_corrupt_header_and_pickles_and_missing_tensor(tmp_path, checkpoint_factory):
    src = checkpoint_factory("olmoe")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelError, match="corrupt header"):
        load_weights(bad, load_spec(bad))
    (bad / "model.safetensors").unlink()
    (bad / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ModelError, match="never loads pickles"):
        load_weights(bad, load_spec(bad))
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the config promises a layer the weights do not have
    other = tmp_path / "other"
    shutil.copytree(src, other)
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="no tensor model.layers.2"):
        load_weights(other, load_spec(other))


# VmHWM is this process's own high-water mark; ru_maxrss would carry over the parent's size from fork.
RSS_PROBE = """
import sys, psutil
sys.path.insert(0, {root!r})
from core.model.families import load_spec
from core.model.weights import load_weights
spec = load_spec({path!r})
before = psutil.Process().memory_info().rss
w = load_weights({path!r}, spec)
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(peak - before, w.nbytes)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc; the loader itself is portable")
def test_peak_rss_stays_within_1_1x_model_bytes(tmp_path):
    path = make_checkpoint("mixtral", tmp_path / "big", hidden_size=512, intermediate_size=1024,
                           num_hidden_layers=4, num_local_experts=8, num_attention_heads=8, num_key_value_heads=2)
    on_disk = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    assert on_disk >= 200e6
    out = subprocess.run([sys.executable, "-c", RSS_PROBE.format(root=str(ROOT), path=str(path))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown, model_bytes = map(int, out.stdout.split())
    assert model_bytes >= 200e6
    assert grown <= 1.1 * model_bytes, f"peak RSS grew {grown / 1e6:.0f} MB for a {model_bytes / 1e6:.0f} MB model"
    print(f"peak RSS growth {grown / 1e6:.1f} MB = {grown / model_bytes:.3f} x model bytes")


def test_pinning_failure_falls_back_to_pageable_memory_with_a_warning(checkpoint_factory):
    """Windows caps pinned memory: a refused pin must not stop the run, and says so once."""
    from core.runtime.device_emulated import EmulatedCuda
    from core.runtime.engine import Engine, Request
    from core.telemetry import WarningEvent

    path = checkpoint_factory("olmoe")
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=3) for i, p in enumerate(["Hello there", "x y"])]
    want = [r.output_token_ids for r in Engine.load(path, device="cpu").generate(reqs)]
    dev = EmulatedCuda(1 << 30, pin_limit_bytes=0)
    engine = Engine.load(path, device=dev, executor="cuda", resident_layers=0)
    events = []
    got = [r.output_token_ids for r in engine.generate(reqs, on_event=events.append)]
    engine.close()
    warnings = [e for e in events if isinstance(e, WarningEvent)]
    assert got == want and not engine.weights.pinned and dev.pinned_bytes == 0
    assert len(warnings) == 1 and "page-lock" in warnings[0].message
    assert dev.stats["staged_copies"] > 0  # the copies from pageable memory were staged, and still right


def test_layer_buffers_own_their_pages(checkpoint_factory):
    """So that a layer's streamed part can be page-locked without touching a neighbour's pages."""
    path = checkpoint_factory("mixtral")
    w = load_weights(path, load_spec(path))
    for lw in w.layers:
        start, size = lw.flat.data_ptr(), lw.flat.numel() * lw.flat.element_size()
        assert start % 4096 == 0
        assert all(other.flat.data_ptr() // 4096 != (start + size - 1) // 4096 for other in w.layers if other is not lw)

def _pinned_run(path, dev, reqs):
    """Tokens, warnings and the page-locked bytes while the runner was alive."""
    from core.runtime.engine import Engine
    from core.telemetry import WarningEvent

    engine = Engine.load(path, device=dev, executor="cuda", resident_layers=0)
    held, real = [], engine.runner

    def spy(*a, **kw):
        r = real(*a, **kw)
        held.append(dev.pinned_bytes)
        return r

    engine.runner = spy
    events = []
    got = [r.output_token_ids for r in engine.generate(reqs, on_event=events.append)]
    engine.close()
    gc.collect()
    assert dev.pinned_bytes == 0  # closed: nothing left page-locked (freed memory must not stay registered)
    return got, [e.message for e in events if isinstance(e, WarningEvent)], max(held)


def test_pinned_memory_stays_within_the_systems_budget_and_a_refusal_falls_back(checkpoint_factory, monkeypatch):
    """core.platform.pinned_budget: Windows (WDDM) lets a process page-lock half the RAM. Past the budget,
    or when the OS refuses, the rest stays pageable, the run is still right and says so once."""
    import types

    import psutil

    from core import platform
    from core.runtime.device_emulated import EmulatedCuda
    from core.runtime.engine import Engine, Request

    path = checkpoint_factory("olmoe")
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=3) for i, p in enumerate(["Hello there", "x y"])]
    want = [r.output_token_ids for r in Engine.load(path, device="cpu").generate(reqs)]
    got, warned, everything = _pinned_run(path, EmulatedCuda(1 << 30), reqs)
    assert got == want and not warned and everything > 0
    with monkeypatch.context() as m:  # a Windows box whose RAM is what this run page-locks
        m.setattr(platform, "SYSTEM", "windows")
        m.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=everything, available=everything))
        dev = EmulatedCuda(1 << 30)
    assert dev.pin_limit_bytes == everything // 2
    got, warned, held = _pinned_run(path, dev, reqs)
    assert got == want and 0 < held <= everything // 2 and dev.stats["staged_copies"] > 0
    assert len(warned) == 1 and "page-lock" in warned[0] and "lets a process page-lock" in warned[0]
    dev = EmulatedCuda(1 << 30)  # Linux: no cap, but the OS refuses every registration

    def refuse(point):
        if point == "pin":
            raise OSError("cudaErrorMemoryAllocation (injected)")

    dev.fault = refuse
    got, warned, held = _pinned_run(path, dev, reqs)
    assert got == want and held == 0 and len(warned) == 1 and "refused" in warned[0]
