"""--quantize-dense through the quantized cache: the second load maps what the first one wrote (no
quantizing, the same logits bit for bit), quantizing a large weight keeps its float32 temporaries to a
block of rows, and the dense weights' bf16 bytes are not kept beside their quantized copies."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from checkpoints import make_checkpoint
from core.model.quant import dense
from core.model.quant.dense import QuantWeight, pack_rows
from core.model.quant.formats import Format
from core.runtime.engine import Engine, Request
from core.telemetry import Progress
from test_engine_parity import PROMPTS


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_checkpoint("mixtral", tmp_path_factory.mktemp("q-dense-cache"))


def _logits(engine):
    ids = engine.prompt_token_ids(Request(id="0", prompt=PROMPTS[0]))
    runner = engine.runner(slots=1, micro_batch_size=1, max_tokens=len(ids) + 2)
    logits, _ = runner.prefill([ids], [0], [[0]])
    step, _ = runner.decode([[int(logits[0].argmax())]], [[0]], [[len(ids)]])
    return logits.clone(), step.clone()


def _quantized(engine):
    w = engine.weights
    return [t for lw in w.layers for t in lw.tensors.values() if isinstance(t, QuantWeight)] + [
        t for t in w.globals.values() if isinstance(t, QuantWeight)]


@pytest.mark.parametrize("quant,dense_fmt", [("int4", True), ("int8", "int8")])
def test_the_second_load_maps_the_cached_dense_weights_and_computes_the_same(mixtral, quant, dense_fmt, monkeypatch,
                                                                             tmp_path):
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path / "cache ✓"))
    seen = []
    first = Engine.load(mixtral, quantize=quant, group_size=32, quantize_dense=dense_fmt, device="cpu",
                        progress=seen.append)
    want = _logits(first)
    assert any(isinstance(e, Progress) and e.what.startswith("quantizing dense weights") for e in seen)
    first.close()
    calls = []
    real = dense.pack_rows
    monkeypatch.setattr(dense, "pack_rows", lambda *a: calls.append(a) or real(*a))
    seen.clear()
    second = Engine.load(mixtral, quantize=quant, group_size=32, quantize_dense=dense_fmt, device="cpu",
                         progress=seen.append)
    assert calls == []  # nothing quantized again
    assert any(isinstance(e, Progress) and e.what == "loading quantized dense weights (cached)" for e in seen)
    held = _quantized(second)
    assert len(held) == 2 * second.spec.num_layers + 1  # qkv and o of every layer, and the LM head
    # every kernel tensor is a view of the one mapped file, not a copy of it
    (entry,) = [p for p in (tmp_path / "cache ✓" / "quantized").iterdir()
                if json.loads((p / "meta.json").read_text(encoding="utf-8")).get("dense")]
    size = (entry / "model.safetensors").stat().st_size
    ptrs = [t.data_ptr() for q in held for t in q.kernel if isinstance(t, torch.Tensor)]
    assert max(ptrs) - min(ptrs) < size
    # aligned as the kernels' vector loads want them (8-byte aligned, the int8 kernel crashed on a larger model)
    assert all(p % dense.KERNEL_ALIGN == 0 for p in ptrs)
    got = _logits(second)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    second.close()
    monkeypatch.setattr(dense, "pack_rows", real)
    third = Engine.load(mixtral, quantize=quant, group_size=32, quantize_dense=dense_fmt, device="cpu",
                        use_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(_logits(third), want))  # the cache changed nothing
    third.close()


def test_quantized_dense_weights_replace_their_bf16_bytes(mixtral):
    """The CPU-only mode kept every projection's bf16 bytes in the layer's dense buffer beside its
    quantized copy: a model with quantized dense weights held more RAM than one without."""
    plain = Engine.load(mixtral, quantize="int4", group_size=32, device="cpu", use_cache=False)
    quant = Engine.load(mixtral, quantize="int4", group_size=32, quantize_dense=True, device="cpu", use_cache=False)
    spec = plain.spec
    proj = sum(lw.tensors[n].numel() for lw in plain.weights.layers for n in ("qkv", "o")) + spec.vocab_size * spec.hidden_size
    kernel = sum(q.held_bytes for q in _quantized(quant))
    assert plain.weights.nbytes - quant.weights.nbytes == proj * spec.dtype_bytes - kernel  # float out, int4 in
    plain.close()
    quant.close()


def test_row_blocks_pack_bit_for_bit_as_the_whole_matrix():
    from core.model.quant.experts import _kernel_pack
    from core.model.quant.formats import quantize

    g = torch.Generator().manual_seed(0)
    for n in (48, 272, 592):  # tails of the 64-row tiles and of the 256-row blocks
        for fmt in (Format("int8"), Format("int4", 32), Format("int4", 128)):
            w = torch.randn(n, 256, generator=g).to(torch.bfloat16)
            whole = _kernel_pack(fmt, quantize(fmt, w), torch.bfloat16)
            assert all(torch.equal(a, b) for a, b in zip(whole[:2], pack_rows(w, fmt)[:2])), (n, fmt)


PEAK = """
import resource, sys, torch
from core.model.quant.dense import quantize_dense
from core.model.quant.formats import Format
w = torch.empty(4096, 8192, dtype=torch.bfloat16).normal_()  # 64 MB, and no float32 copy made on the way
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
q = quantize_dense(w, Format("int4", 64))
held = sum(t.numel() * t.element_size() for t in q.kernel if isinstance(t, torch.Tensor))
print(held, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="ru_maxrss is POSIX")
def test_quantizing_a_large_weight_holds_its_result_and_a_block_of_rows():
    """Whole-matrix quantization made a float32 copy of the weight, its groups and its int32 nibbles at
    once: 4096 x 8192 grew peak RSS by ≈ 400 MB for 18 MB of int4."""
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True, timeout=300)
    held, grew = map(int, out.stdout.split())
    assert grew <= 1.1 * held + 48 * 2**20, (held, grew)
