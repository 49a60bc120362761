"""Memory as planned, measured on the emulated device: the planner neither lies nor wastes.

Plans for a small Mixtral-shaped model run on an `EmulatedCuda` whose memory is the plan's GPU
budget; the device counts everything the runtime allocates (weights, buffers, and every activation
its tasks create). The runtime's peak must not pass the plan's `gpu_bytes`, and the plan must not be
more than 10 % above that peak. Page-locked host bytes must be what the plan says, exactly. An
out-of-memory retry and a second run must peak where one run does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoints import make_checkpoint
from core.io.workloads import build_prompts
from core.model.families import load_spec
from core.plan.hardware import preset
from core.plan.planner import Budget, Workload, plan, predict
from core.plan.policy import Policy
from core.runtime.device_emulated import EmulatedCuda
from core.runtime.engine import Engine, Request
from core.telemetry import WarningEvent

MiB = 1 << 20


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tmp_path_factory):
    """Weights large enough to matter next to activations (≈ 14 MB in fp32), small enough to run in a second.
    fp32 runs the fused expert path, bf16 the fused one in decode and grouped_mm in long prefills (as CUDA does)."""
    dt = getattr(torch, request.param)
    path = make_checkpoint("mixtral", tmp_path_factory.mktemp(f"mem-{request.param}"), dtype=dt, hidden_size=128,
                           intermediate_size=256, num_hidden_layers=4, num_local_experts=8, num_attention_heads=8,
                           num_key_value_heads=2)
    return path, load_spec(path), Engine.load(path, device="cpu").tokenizer


def workload(tokenizer, n: int, prompt_len: int, gen: int):
    prompts = build_prompts(tokenizer, [prompt_len] * n)
    longest = max(len(tokenizer(p).input_ids) for p in prompts)
    return prompts, Workload(prompt_len=longest, gen_len=gen, max_prompt_len=longest, num_requests=n)


def run(path, policy, prompts, gen, memory_bytes, copy_delay=0.0):
    dev = EmulatedCuda(memory_bytes, copy_delay=copy_delay)
    engine = Engine.load(path, device=dev, policy=policy)
    engine.eos_ids = set()
    pinned = []
    real = engine.runner

    def spy(*a, **kw):
        r = real(*a, **kw)
        pinned.append(dev.pinned_bytes)
        return r

    engine.runner = spy
    out = {r.id: r.output_token_ids for r in engine.generate(
        [Request(id=str(i), prompt=p, max_new_tokens=gen) for i, p in enumerate(prompts)])}
    engine.close()
    return dev, out, pinned


def check(dev, pred, pinned):
    peak = dev.max_memory_allocated()
    assert peak <= pred.gpu_bytes, \
        f"the runtime used {peak:,} bytes of the device; the plan said {pred.gpu_bytes:,}"
    assert pred.gpu_bytes <= 1.1 * peak, f"the plan reserved {pred.gpu_bytes:,} bytes for a {peak:,}-byte peak"
    assert pinned == [pred.pinned_bytes]  # page-locked at the exact size, no rounding


# a slow CPU makes the GPU placements win, so the sweep exercises streaming, residency and the plan's
# own batch, micro-batch and expert-batch choices
# (the middle one at 18 MiB: the fused expert path holds a 960-token prefill's gate/up for all its pairs at once,
# where the fp32 loop it replaced held one expert's share — 3.4 MB more, and at 16 MiB the GPU placement no longer fits)
SWEEP = [(12, 16, 24, 6), (18, 24, 40, 5), (24, 32, 16, 4)]  # GPU MiB, requests, prompt tokens, new tokens


@pytest.mark.parametrize("gpu_mib,n,prompt_len,gen", SWEEP)
def test_planned_policies_peak_within_their_plan(model, gpu_mib, n, prompt_len, gen):
    path, spec, tok = model
    prompts, w = workload(tok, n, prompt_len, gen)
    hw = dataclasses.replace(preset("t4"), gpu_mem_bytes=gpu_mib * MiB, cpu_flops=2e10, cpu_bw=2e10)
    policy, pred = plan(spec, hw, w, Budget(gpu_mib * MiB, 1 << 30))
    assert policy.ffn_on == "gpu"
    dev, _, pinned = run(path, policy, prompts, gen, gpu_mib * MiB)  # the budget is the device's memory
    check(dev, pred, pinned)


# policies the search rarely picks for this model: attention and part of the KV cache on the GPU, expert
# batches over several micro-batches, many pages, a decode-heavy batch
POLICIES = [Policy(64, 4, 64, "cpu", "gpu", 0.25, 0.0, 16), Policy(16, 4, 8, "gpu", "gpu", 0.5, 0.5, 4),
            Policy(16, 8, 16, "gpu", "gpu", 0.0, 0.0, 2)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"N{p.batch_size}-mu{p.micro_batch_size}-{p.attention_on}")
def test_given_policies_peak_within_their_prediction(model, policy):
    path, spec, tok = model
    prompts, w = workload(tok, policy.batch_size, 16, 6)
    pred = predict(policy, spec, preset("t4"), w)
    dev, _, pinned = run(path, policy, prompts, 6, 1 << 30)
    check(dev, pred, pinned)


def test_a_lagging_link_does_not_lift_the_prefill_peak_past_the_plan(model):
    """The 16-micro-batch policy with device→host copies that lag (up to 3 ms each, as on a loaded box):
    each prefill used to wait only for its own micro-batch's store two layers back, so the state of up to
    2 × 16 micro-batches sat on the GPU awaiting the link (4.4 % over the plan, bf16). The plan counts two."""
    import random

    path, spec, tok = model
    policy = POLICIES[0]
    prompts, w = workload(tok, policy.batch_size, 16, 1)
    pred = predict(policy, spec, preset("t4"), w)
    rng = random.Random(0)
    dev, _, pinned = run(path, policy, prompts, 1, 1 << 30, copy_delay=lambda: rng.random() * 0.003)
    check(dev, pred, pinned)


def test_an_out_of_memory_retry_peaks_where_one_run_does(model, monkeypatch, task_fault):
    """Finding 4: the retry built its runner while the failed step's traceback still held the old one,
    so the device held both: on a device with room for one, the rebuild itself ran out of memory."""
    path, spec, tok = model
    prompts, _ = workload(tok, 8, 16, 5)
    policy = Policy(8, 4, 4, "cpu", "gpu", 0.0, 0.0, 2)
    clean, want, _ = run(path, policy, prompts, 5, 1 << 30)
    room = int(1.2 * clean.max_memory_allocated())  # one batch-8 runner fits, two do not
    dev = EmulatedCuda(room)
    engine = Engine.load(path, device=dev, policy=policy)
    engine.eos_ids = set()
    fired = []

    def fault(task):
        if task.kind == "ffn" and task.layer == 2 and not fired:
            fired.append(task)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    task_fault(fault)
    events = []
    got = {r.id: r.output_token_ids for r in engine.generate(
        [Request(id=str(i), prompt=p, max_new_tokens=5) for i, p in enumerate(prompts)], on_event=events.append)}
    engine.close()
    assert fired and got == want
    assert any(isinstance(e, WarningEvent) and "batch 4" in e.message for e in events)
    assert dev.max_memory_allocated() <= 1.05 * clean.max_memory_allocated()  # the streams' interleaving moves it a little


def test_a_batch_too_big_for_the_device_halves_until_it_fits(model):
    path, spec, tok = model
    prompts, _ = workload(tok, 16, 16, 4)
    big = Policy(16, 4, 16, "cpu", "gpu", 0.0, 0.0, 1)
    full, want, _ = run(path, big, prompts, 4, 1 << 30)
    half, _, _ = run(path, Policy(8, 4, 8, "cpu", "gpu", 0.0, 0.0, 1), prompts, 4, 1 << 30)
    need, fits = full.max_memory_allocated(), half.max_memory_allocated()
    assert need > fits
    dev = EmulatedCuda((need + fits) // 2)
    engine = Engine.load(path, device=dev, policy=big)
    engine.eos_ids = set()
    events = []
    got = {r.id: r.output_token_ids for r in engine.generate(
        [Request(id=str(i), prompt=p, max_new_tokens=4) for i, p in enumerate(prompts)], on_event=events.append)}
    engine.close()
    assert got == want and dev.stats["ooms"] >= 1
    assert [e.message for e in events if isinstance(e, WarningEvent)][-1].startswith("out of GPU memory; continuing")


def test_dense_layers_hold_no_experts_in_the_plan_or_the_run(checkpoint_factory):
    """DeepSeek's first layer is a dense MLP: r_w is a share of the routed experts only, the runtime keeps
    exactly those on the device, and what it page-locks (the MoE layers' streamed experts) is the plan's."""
    from core.plan.policy import expert_split

    path = checkpoint_factory("deepseek_v2")  # 3 layers, layer 0 dense, 8 experts each in layers 1 and 2
    spec = load_spec(path)
    assert expert_split(0.25, 3, 8, dense=[0]) == [0, 2, 2]  # 0.25 × 16 routed experts, none in layer 0
    tok = Engine.load(path, device="cpu").tokenizer
    policy = Policy(16, 4, 16, "cpu", "gpu", 0.25, 0.0, 2)
    prompts, w = workload(tok, policy.batch_size, 16, 4)
    pred = predict(policy, spec, preset("t4"), w)
    dev, _, pinned = run(path, policy, prompts, 4, 1 << 30)
    assert pinned == [pred.pinned_bytes]
    assert pred.gpu_breakdown["resident_experts"] == 4 * spec.expert_bytes


def test_no_room_at_batch_one_is_a_user_error_not_a_traceback(checkpoint_factory):
    """Building the runner runs out of device memory with a batch of one: nothing smaller to retry, so the
    user gets an MlightError (one line from the CLI) saying what does not fit and what to do."""
    from core.errors import GpuMemoryError

    engine = Engine.load(checkpoint_factory("mixtral"), device=EmulatedCuda(1 << 30))
    tried = []

    def no_room(slots, *a, **kw):
        tried.append(slots)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    engine.runner = no_room
    with pytest.raises(GpuMemoryError, match="batch of one.*fixed GPU buffers") as info:
        list(engine.generate([Request(id=str(i), prompt="hello world", max_new_tokens=2) for i in range(2)],
                             batch_size=2))
    engine.close()
    assert tried == [2, 1]  # halved first, gave up only at one
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
    assert "--gpu-mem" in str(info.value) and "CPU" in str(info.value)


# every family's token mixer and expert layout: sliding window and sinks with expert biases (gpt-oss), MLA
# (DeepSeek), linear attention (Qwen3-Next), qk-norm (OLMoE, Qwen3, GLM), LongRoPE (Phi); part resident,
# attention on the CPU or the GPU with half the state there
FAMILY_POLICIES = [Policy(8, 2, 4, "cpu", "gpu", 0.25, 0.0, 2), Policy(8, 4, 8, "gpu", "gpu", 0.5, 0.5, 2)]


@pytest.mark.parametrize("family,dtype", [("olmoe", "float32"), ("gpt_oss", "float32"), ("gpt_oss", "bfloat16"),
                                          ("deepseek_v2", "float32"), ("glm4_moe", "float32"),
                                          ("qwen3_next", "float32"), ("qwen3_next", "bfloat16"), ("phimoe", "float32")])
def test_every_mixer_peaks_within_its_prediction_and_pins_what_the_plan_says(checkpoint_factory, tmp_path, family,
                                                                              dtype):
    """The prefill term was written for grouped-query attention and the plain SwiGLU: the newer mixers'
    prefills (MLA's expanded heads, linear attention's chunk systems, windowed attention with sinks in
    blocks) and the experts' slot-table form (all of its parts' outputs and their join; gpt-oss's clamped
    activation's four arrays) went up to 14 % past it. Page-locked bytes missed the expert biases between the
    resident experts and the streamed ones, and (bf16) the alignment of each micro-batch's staging buffer."""
    from checkpoints import make_checkpoint

    path = (checkpoint_factory(family) if dtype == "float32" else
            make_checkpoint(family, tmp_path / family, dtype=getattr(torch, dtype)))
    spec = load_spec(path)
    tok = Engine.load(path, device="cpu").tokenizer
    for policy in FAMILY_POLICIES:
        prompts, w = workload(tok, policy.batch_size, 40, 4)
        pred = predict(policy, spec, preset("t4"), w)
        dev, _, pinned = run(path, policy, prompts, 4, 1 << 30)
        peak = dev.max_memory_allocated()
        assert peak <= pred.gpu_bytes, f"{policy}: the runtime used {peak:,} bytes; the plan said {pred.gpu_bytes:,}"
        assert pred.gpu_bytes <= 1.3 * peak, f"{policy}: the plan reserved {pred.gpu_bytes:,} bytes for {peak:,}"
        assert pinned == [pred.pinned_bytes], policy


# quantized experts: resident and streamed as their packed integers and scales, expanded one at a time
QUANT_POLICIES = [Policy(8, 2, 4, "cpu", "gpu", 0.25, 0.0, 2), Policy(8, 4, 8, "gpu", "gpu", 0.5, 0.5, 2),
                  Policy(16, 4, 16, "cpu", "gpu", 0.0, 0.0, 2)]


@pytest.fixture(scope="module", params=[("mixtral", "bfloat16"), ("qwen3_moe", "float32")], ids=lambda p: p[0])
def quant_model(request, tmp_path_factory):
    """A Mixtral-shaped model in bf16 (the expansion goes through a float32 chunk) and a Qwen3-MoE-shaped
    one in fp32 (expanded straight into the output), both with int4's group 32 dividing every K."""
    family, dtype = request.param
    shape = (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_local_experts=8)
             if family == "mixtral" else dict(hidden_size=128, moe_intermediate_size=128, num_hidden_layers=3,
                                               num_experts=8))
    path = make_checkpoint(family, tmp_path_factory.mktemp(f"q-{family}"), dtype=getattr(torch, dtype), **shape)
    return path, Engine.load(path, device="cpu").tokenizer


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_experts_peak_within_their_plan_and_pin_what_it_says(quant_model, quantize):
    """The plan counted quantized experts' memory as if they were plain: what is page-locked with the
    streamed experts (the resident experts' w2 at the compute dtype, where the runtime's layer buffer holds
    every quantized part after the w13 integers: pinned int8 3,512,320 planned vs 2,746,368), the slot
    table's bmm intermediates of all experts at once (they run one by one), and a float32 workspace the
    fp32 expansion never makes: GPU peaks 25–46 % under the plan. The planner's own policy too, within
    the same 1.1: its 384-token prefill micro-batch peaks in the GQA prefill, whose term summed the input
    norm's fp32 arrays with the QKV phase's although one is freed before the other (1.105 here before)."""
    from core.model.quant.formats import parse_choice, quantized_spec

    path, tok = quant_model
    spec = quantized_spec(load_spec(path), parse_choice(quantize, 32))
    prompts, w = workload(tok, 16, 24, 4)
    hw = dataclasses.replace(preset("t4"), gpu_mem_bytes=6 * MiB, cpu_flops=2e10, cpu_bw=2e10)
    planned, _ = plan(spec, hw, w, Budget(6 * MiB, 1 << 30))
    # the planner's own policy where it uses the GPU (at this budget it may now keep the FFN on the CPU, whose
    # device use — embeddings and logits — the plan does not count: see the closing note of issue 42's session)
    own = [(planned, 1.1)] if planned.ffn_on == "gpu" else []
    for policy, slack in [(p, 1.1) for p in QUANT_POLICIES] + own:
        prompts, w = workload(tok, policy.batch_size, 24, 4)
        pred = predict(policy, spec, preset("t4"), w)
        dev = EmulatedCuda(1 << 30)
        engine = Engine.load(path, device=dev, policy=policy, quantize=quantize, group_size=32, use_cache=False)
        assert engine.spec == spec
        engine.eos_ids = set()
        pinned, real = [], engine.runner

        def spy(*a, **kw):
            r = real(*a, **kw)
            pinned.append(dev.pinned_bytes)
            return r

        engine.runner = spy
        list(engine.generate([Request(id=str(i), prompt=p, max_new_tokens=4) for i, p in enumerate(prompts)]))
        engine.close()
        peak = dev.max_memory_allocated()
        assert peak <= pred.gpu_bytes, f"{policy}: the runtime used {peak:,} bytes; the plan said {pred.gpu_bytes:,}"
        assert pred.gpu_bytes <= slack * peak, f"{policy}: the plan reserved {pred.gpu_bytes:,} bytes for {peak:,}"
        assert pinned == [pred.pinned_bytes], policy
