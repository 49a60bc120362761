"""The GPU path's review findings (issue 10), one test each where the CPU can show it.

Findings shown elsewhere: 1 (a bare "cuda" device) test_device_emulated.py; 2 (never hang), 3 (a
finished step's buffers), 13 (timing events), 14 (blocking waits) test_cuda_executor.py; 4 (OOM retry),
7 (exact pinning) and 11 (memory as planned) test_gpu_memory.py; 8 (D1 as one contiguous copy) and 9
(S4's KV through pinned staging) by `staged_copies == 0` in test_cuda_executor.py's parity runs;
6 and 19 (gpu_check.py) test_bench_scripts.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_checkpoint
from test_schedule_buffers import ancestors
from core.model import attention
from core.model.limits import FUSED_MAX_TOKENS
from core.model.moe import device_experts, experts
from core.plan import hrm
from core.plan.hardware import gpu_compute_dtype, preset
from core.plan.planner import Workload, plan, predict
from core.plan.policy import Policy
from core.plan.presets import preset_spec
from core.runtime import schedule as sched
from core.runtime.device_emulated import EmulatedCuda
from core.runtime.engine import Engine, Request

MIXTRAL = preset_spec("mixtral-8x7b")
PROMPTS = ["Hi", "Compose an engaging travel blog post about Hawaii.", "x y z", "What is 2+2? Explain.",
           "Draft an email to a colleague.", "Tell me a story about a cat and a dog"]


def tokens(engine, batch=4, micro=2, n=6, new=5):
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=new) for i, p in enumerate(PROMPTS[:n])]
    return {r.id: r.output_token_ids for r in engine.generate(reqs, batch_size=batch, micro_batch_size=micro)}


# ---- 5: tests and benchmarks choose their device -------------------------------------------------------
def test_the_suite_runs_on_the_cpu_even_where_cuda_is_present(checkpoint_factory, monkeypatch):
    """On a CUDA machine Engine.load defaulted to CUDA, so "CPU" references silently ran there (and hung)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = Engine.load(checkpoint_factory("mixtral"))  # conftest sets MLIGHT_DEVICE=cpu for the suite
    assert engine.dev.kind == "cpu" and engine.config.device == "cpu" and engine.config.executor == "sequential"
    monkeypatch.setenv("MLIGHT_DEVICE", "emulated")
    engine = Engine.load(checkpoint_factory("mixtral"))
    assert engine.dev.kind == "emulated" and engine.config.executor == "cuda"


# ---- 10: no host sync in the FFN where a sync-free form exists ---------------------------------------
def _routing(T, E=8, k=2, D=32, I=48, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(T)
    h = torch.randn(T, D, generator=g).to(dtype)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g).to(dtype) / 5, torch.randn(E, D, I, generator=g).to(dtype) / 5
    top, idx = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), k)
    return [x.to(device) for x in (h, w13, w2, top.to(dtype), idx)]


@pytest.mark.parametrize("T", [FUSED_MAX_TOKENS, FUSED_MAX_TOKENS + 40])
@pytest.mark.parametrize("grouped", [False, True])
def test_the_device_ffn_reads_nothing_back_at_any_size(grouped, T):
    """On the meta device any read-back raises: the fused and grouped forms never need one, decode-sized or
    not. The old fallback read the expert counts back (`.tolist()`) in every FFN task beyond decode sizes."""
    h, w13, w2, top, idx = _routing(T, device="meta", dtype=torch.bfloat16)
    out = device_experts(h, [dict(w13=w13[:3], w2=w2[:3]), dict(w13=w13[3:], w2=w2[3:])], top, idx, grouped=grouped)
    assert out.shape == h.shape
    with pytest.raises((RuntimeError, NotImplementedError)):  # the old form, on the same operands
        experts(h, w13, w2, top, idx, grouped=False)


@pytest.mark.parametrize("T", [1, 7, FUSED_MAX_TOKENS, 300])
@pytest.mark.parametrize("split", [0, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("biased", [False, True])
def test_every_device_ffn_form_matches_the_reference(T, split, dtype, biased):
    """The fast device forms against the plain loop, over sizes, splits, dtypes, biases and gpt-oss's activation."""
    from core.model.moe import clamped_swiglu

    h, w13, w2, top, idx = _routing(T, dtype=dtype)
    b13, b2 = (torch.randn(8, w13.shape[1]).to(dtype), torch.randn(8, w2.shape[1]).to(dtype)) if biased else (None, None)
    act = clamped_swiglu(1.702, 7.0) if biased else None
    ref = experts(h, w13, w2, top, idx, grouped=False, b13=b13, b2=b2, act=act)
    parts = []
    for lo, hi in ((0, split), (split, 8)):
        if hi > lo:
            parts.append(dict(w13=w13[lo:hi], w2=w2[lo:hi], **(dict(b13=b13[lo:hi], b2=b2[lo:hi]) if biased else {})))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)  # bf16 rounding
    for grouped in (False, True):
        torch.testing.assert_close(device_experts(h, parts, top, idx, grouped=grouped, act=act), ref, **tol)


# ---- 12: the host's cost per task, in the search -----------------------------------------------------
def test_tiny_micro_batches_are_host_bound_and_the_search_avoids_them():
    """Each task costs host time, one task after another (the GIL): μ = 4 over 256 requests is ~320 tasks
    a layer. With all experts resident (an A100) the GPU would take 11 ms a layer; the host takes more,
    and the prediction must say so rather than promise the GPU's speed."""
    hw, w = preset("a100-80g"), Workload(77, 128)
    r = hrm.effective_rates(hw)
    tiny = Policy(batch_size=256, micro_batch_size=4, expert_batch_size=256, gpu_weight_fraction=1.0)
    pred = predict(tiny, MIXTRAL, hw, w)
    tasks = hrm.decode_tasks(MIXTRAL, r, batch=256, micro_batch=4, expert_batch=256, attention_on="cpu", ffn_on="gpu",
                             gpu_weight_fraction=1.0, gpu_kv_fraction=0.0, context=w.decode_context, pages=1)
    per_layer = sum(c.per_layer for c in tasks.values())
    assert per_layer > 300 and pred.bottleneck == "host"
    assert pred.step_seconds >= MIXTRAL.num_layers * per_layer * (hrm.TASK_SECONDS + hrm.OP_SECONDS)
    assert pred.layer_seconds["host"] > 3 * pred.layer_seconds["gpu"]
    policy, chosen = plan(MIXTRAL, hw, w)  # the search weighs the same term
    assert policy.micro_batch_size >= 36 and chosen.bottleneck != "host"


def test_the_host_op_counts_are_the_runtimes(checkpoint_factory, monkeypatch):
    """HRM's per-kind op counts against the ops each task really issues (counted on the emulated device). The
    emulated device's tensors are the host's, where a decode step's norms, RoPE and cache writes would run as
    C row ops (core.model.cpu.row_ops); on a real GPU they are torch ops, which is what HOST_OPS counts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from core.model.cpu import row_ops

    monkeypatch.setattr(row_ops, "library", lambda: None)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    seen: dict[str, list[int]] = {}
    for schedule in ("cgopipe", "s4"):
        engine = Engine.load(checkpoint_factory("qwen2_moe"), device=EmulatedCuda(1 << 30), executor="cuda",
                             schedule=schedule, resident_layers=0)
        real = engine.runner

        def spy(*a, **kw):
            r = real(*a, **kw)
            for kind, fn in list(r._fns.items()):
                def counted(runner, t, fn=fn, kind=kind):
                    with Count() as c:
                        fn(runner, t)
                    seen.setdefault(kind, []).append(c.n)
                r._fns[kind] = counted
            return r

        engine.runner = spy
        tokens(engine, n=4, new=3)
        engine.close()
    from core.model.cpu import native

    for kind in ("pre_attn", "post_attn", "ffn", "gpu_attn", "cpu_attn", "kv_load"):
        mean = sum(seen[kind]) / len(seen[kind])
        ops = 23 if kind == "cpu_attn" and native.library() is None else hrm.HOST_OPS[kind]  # torch ops, no C kernel
        assert 0.7 * mean <= ops <= 1.3 * mean, (kind, mean)


# ---- 15: the first decode after a prefill does not load layer 0 synchronously ----------------------------
def test_a_prefill_leaves_layer_0_prefetched(checkpoint_factory):
    engine = Engine.load(checkpoint_factory("mixtral"), device=EmulatedCuda(1 << 30), executor="cuda",
                         schedule="cgopipe", resident_layers=0)
    engine.eos_ids = set()
    runners = []
    real = engine.runner
    engine.runner = lambda *a, **kw: runners.append(real(*a, **kw)) or runners[-1]
    got = tokens(engine, batch=2, micro=1)  # six requests through two slots: several prefills
    engine.close()
    assert got == tokens(Engine.load(checkpoint_factory("mixtral"), device="cpu"), batch=2, micro=1)
    assert [r.layer0_loads for r in runners] == [0]  # prefills load layer 0 in their graph, and leave it


# ---- 16: one-layer models, attention on the GPU ---------------------------------------------------------
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("schedule,attention_on", [("cgopipe", "cpu"), ("s4", "cpu"), ("s3", "cpu"),
                                                    ("cgopipe", "gpu"), ("s4", "gpu"), ("s3", "gpu")])
def test_every_reader_of_a_layer_waits_for_that_layers_pages(L, schedule, attention_on):
    """A page listed before its layer's first use fills the half that layer reads this step: every
    reader of the layer's experts must come after it (S4 with GPU attention and one layer did not)."""
    tasks = sched.decode_step(schedule, num_layers=L, num_micro_batches=2, pages_per_layer=2,
                              attention_on=attention_on)
    first_use = min(t.id for t in tasks if t.layer == 0 and t.kind in ("pre_attn", "kv_load"))
    anc = ancestors(tasks)  # dependencies and the in-order queues
    for page in (t for t in tasks if t.kind == "weight_page" and (t.layer > 0 or t.id < first_use)):
        for reader in (t for t in tasks if t.kind in ("post_attn", "ffn") and t.layer == page.layer):
            if reader.id > page.id or page.layer > 0:
                assert anc[reader.id] >> page.id & 1, f"{reader.name} may read while {page.name} copies"


def test_a_one_layer_model_under_s4_with_slow_copies_is_right(tmp_path):
    path = make_checkpoint("mixtral", tmp_path / "one", num_hidden_layers=1)
    want = tokens(Engine.load(path, device="cpu"))
    engine = Engine.load(path, device=EmulatedCuda(1 << 30, copy_delay=0.003), executor="cuda", schedule="s4",
                         resident_layers=0)
    engine.eos_ids = set()
    try:
        assert tokens(engine) == want
    finally:
        engine.close()


# ---- 17: torch 2.4, which pyproject allows, has no enable_gqa ----------------------------------------------
def test_prefill_attention_without_enable_gqa(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 8, 16, generator=g), torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    want = attention.prefill_attention(q, k, v, 0.25)
    real = F.scaled_dot_product_attention

    def torch_2_4(*a, **kw):
        if "enable_gqa" in kw:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'")
        return real(*a, **kw)

    monkeypatch.setattr(attention, "SDPA_GQA", False)
    monkeypatch.setattr(F, "scaled_dot_product_attention", torch_2_4)
    torch.testing.assert_close(attention.prefill_attention(q, k, v, 0.25), want)


# ---- 18: no bf16 tensor cores before SM80: bf16 checkpoints compute in fp16 --------------------------------
def test_a_t4_computes_a_bf16_checkpoint_in_fp16(tmp_path):
    from core.telemetry import WarningEvent

    assert gpu_compute_dtype(torch.bfloat16, (7, 5)) == torch.float16
    assert gpu_compute_dtype(torch.bfloat16, (8, 0)) == torch.bfloat16 == gpu_compute_dtype(torch.bfloat16, None)
    path = make_checkpoint("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    events = []
    t4 = Engine.load(path, device=EmulatedCuda(1 << 30, capability=(7, 5), name="Tesla T4"), executor="cuda",
                     resident_layers=0, progress=events.append)
    t4.eos_ids = set()
    assert t4.weights.dtype == torch.float16
    assert any(isinstance(e, WarningEvent) and "float16" in e.message for e in events)
    want = tokens(Engine.load(path, device="cpu", dtype="float16"))
    try:
        assert tokens(t4) == want
    finally:
        t4.close()


def test_fp16_overflow_is_refused_with_a_way_out(tmp_path):
    from safetensors.torch import load_file, save_file

    from core.errors import ModelError

    path = make_checkpoint("mixtral", tmp_path / "big-values", dtype=torch.bfloat16)
    shard = next(path.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = next(n for n in tensors if "experts.0.w1" in n or "experts.0.gate_proj" in n or "w1" in n)
    tensors[name][0, 0] = 1e6  # fine in bf16, infinite in fp16
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="float16"):
        Engine.load(path, device=EmulatedCuda(1 << 30, capability=(7, 5)), executor="cuda")
