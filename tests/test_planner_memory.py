"""The planner's memory accounting against bytes computed by hand, and against what the engine allocates.

A small Mixtral-shaped model whose sizes are worked out below line by line. The planner's totals
(`predict(...).gpu_bytes / cpu_bytes`) are affine in the weight and KV fractions, so differences
between two policies isolate one term exactly, whatever the activation estimate is:
- GPU(r_w = 1) − GPU(r_w = 0) = all experts − the 2×layer double buffer of streamed experts;
- GPU(r_c = 1) − GPU(r_c = 0) = the whole KV cache: every slot of the batch sized for the longest
  prompt plus the generation (the engine gives each slot room for any waiting request).
"""

from __future__ import annotations

import dataclasses

import pytest

from core.model.spec import ModelSpec
from core.plan.hardware import preset
from core.plan.planner import Budget, Workload, predict, validate
from core.plan.policy import Policy

SPEC = ModelSpec(architecture="MixtralForCausalLM", family="mixtral", num_layers=4, hidden_size=64, num_heads=8,
                 num_kv_heads=2, head_dim=8, vocab_size=1000, num_experts=8, top_k=2, expert_intermediate=128,
                 dtype="bfloat16")
# By hand (bf16: 2 bytes an element):
EXPERT = 3 * 64 * 128 * 2  # gate, up, down: 49_152
LAYER_EXPERTS = 8 * EXPERT  # 393_216
EXPERTS = 4 * LAYER_EXPERTS  # 1_572_864
LAYER_DENSE = (64 + (64 + 2 * 16) * 64 + 64 * 64 + 64 + 8 * 64) * 2  # ln1, qkv, o, ln2, router: 21_760
GLOBALS = (1000 * 64 + 64 + 1000 * 64) * 2  # embed, final norm, lm_head: 256_128
NON_EXPERT = 4 * LAYER_DENSE + GLOBALS  # 343_168
KV_TOKEN = 4 * 2 * (2 * 8) * 2  # layers × (K, V) × kv heads·head dim × 2 bytes: 256

WORK = Workload(prompt_len=100, gen_len=28, max_prompt_len=200)
HW = preset("t4")


def test_hand_computed_sizes_of_the_small_model():
    assert (EXPERT, LAYER_EXPERTS, EXPERTS, NON_EXPERT, KV_TOKEN) == (49_152, 393_216, 1_572_864, 343_168, 256)
    assert SPEC.expert_bytes == EXPERT and SPEC.layer_expert_bytes == LAYER_EXPERTS
    assert SPEC.total_expert_bytes == EXPERTS and SPEC.nonexpert_bytes == NON_EXPERT
    assert SPEC.total_bytes == NON_EXPERT + EXPERTS and SPEC.kv_bytes_per_token == KV_TOKEN


def mem(policy: Policy, work: Workload = WORK) -> tuple[int, int]:
    p = predict(policy, SPEC, HW, work)
    assert p.gpu_bytes == sum(p.gpu_breakdown.values()) and p.cpu_bytes == sum(p.cpu_breakdown.values())
    return p.gpu_bytes, p.cpu_bytes


BASE = Policy(batch_size=16, micro_batch_size=4, expert_batch_size=8, attention_on="cpu", ffn_on="gpu",
              gpu_weight_fraction=0.0, pages_per_layer=4)


def test_streamed_experts_take_a_two_layer_buffer_on_the_gpu():
    g0, c0 = mem(BASE)
    g1, c1 = mem(dataclasses.replace(BASE, gpu_weight_fraction=1.0))
    assert g1 - g0 == EXPERTS - 2 * LAYER_EXPERTS  # all experts resident, no buffer vs a 2-layer buffer
    assert c0 - c1 >= EXPERTS  # the streamed experts live in CPU memory
    for r_w in (0.25, 0.5, 0.75):  # in between: r_w of the experts resident, 2 layers of the rest streamed
        g, _ = mem(dataclasses.replace(BASE, gpu_weight_fraction=r_w))
        assert g - g0 == pytest.approx(r_w * EXPERTS - r_w * 2 * LAYER_EXPERTS, abs=2)
    # and the GPU holds every non-expert weight, plus activations that grow with the micro-batch
    assert g1 > NON_EXPERT + EXPERTS


@pytest.mark.parametrize("longest,gen,batch", [(200, 28, 16), (100, 28, 16), (200, 60, 8)])
def test_the_kv_cache_has_room_for_every_slot_at_the_longest_request(longest, gen, batch):
    work = Workload(prompt_len=50, gen_len=gen, max_prompt_len=longest)
    gpu_attn = Policy(batch_size=batch, micro_batch_size=4, expert_batch_size=4, attention_on="gpu", ffn_on="gpu",
                      gpu_weight_fraction=1.0, gpu_kv_fraction=0.0)
    g0, c0 = mem(gpu_attn, work)
    g1, c1 = mem(dataclasses.replace(gpu_attn, gpu_kv_fraction=1.0), work)
    kv = batch * (longest + gen) * KV_TOKEN
    assert g1 - g0 == pytest.approx(kv, abs=2) and c0 - c1 == pytest.approx(kv, abs=2)


def test_cpu_only_keeps_every_weight_and_the_kv_cache_in_cpu_memory():
    p = Policy(batch_size=16, micro_batch_size=4, expert_batch_size=4, attention_on="cpu", ffn_on="cpu")
    g, c = mem(p)
    assert g == 0 and c >= NON_EXPERT + EXPERTS + 16 * (200 + 28) * KV_TOKEN


def test_validate_refuses_a_gpu_budget_short_of_the_hand_counted_bytes():
    """Budget the GPU for exactly the hand count (weights, half the experts resident, the 2-layer buffer
    of the other half) plus the activations (what the GPU holds beyond the weights when every expert is
    resident): it fits; half a layer less: refused, naming the GPU."""
    acts = mem(dataclasses.replace(BASE, gpu_weight_fraction=1.0))[0] - (NON_EXPERT + EXPERTS)
    assert acts > 0
    policy = dataclasses.replace(BASE, gpu_weight_fraction=0.5)
    need = NON_EXPERT + EXPERTS // 2 + 2 * (LAYER_EXPERTS // 2) + acts
    ok = Budget(gpu_bytes=int(need / 0.86) + 2, cpu_bytes=10**12)
    assert validate(policy, SPEC, HW, WORK, ok) == []
    short = Budget(gpu_bytes=int((need - LAYER_EXPERTS // 2) / 0.86), cpu_bytes=10**12)
    (over,) = validate(policy, SPEC, HW, WORK, short)
    assert over.where == "gpu" and over.needed == pytest.approx(need, abs=2) and over.over > 0


def test_the_planned_kv_cache_is_what_the_engine_allocates(checkpoint_factory, monkeypatch):
    """The engine sizes its KV cache as `slots × (longest prompt + max new tokens)`; the planner's KV
    term for the same batch and workload must be those bytes."""
    from core.runtime.engine import Engine, Request

    engine = Engine.load(checkpoint_factory("mixtral"))
    caches = []
    real = engine.runner

    def runner(*a, **kw):
        r = real(*a, **kw)
        caches.append(r.cache.nbytes)
        return r

    monkeypatch.setattr(engine, "runner", runner)
    lengths, max_new = [7, 19, 12, 4], 3
    reqs = [Request(id=str(n), prompt=" ".join(["a"] * n), max_new_tokens=max_new) for n in lengths]
    list(engine.generate(reqs, batch_size=4, micro_batch_size=2))
    work = Workload(prompt_len=sum(lengths) // len(lengths), gen_len=max_new, max_prompt_len=max(lengths))
    p = Policy(batch_size=4, micro_batch_size=2, expert_batch_size=2, attention_on="gpu", ffn_on="gpu",
               gpu_weight_fraction=1.0)
    g0 = predict(p, engine.spec, HW, work).gpu_bytes
    g1 = predict(dataclasses.replace(p, gpu_kv_fraction=1.0), engine.spec, HW, work).gpu_bytes
    assert caches == [4 * (19 + 3) * engine.spec.kv_bytes_per_token]
    assert g1 - g0 == pytest.approx(caches[0], abs=2)


def test_activations_and_host_buffers_count_what_the_planner_documents():
    """The estimate beyond weights and KV, by hand for BASE (N 16, μ 4, expert batch 8; longest prompt
    200, 28 new tokens): prefill holds μ whole prompts at the longest length (hidden ×3, QKV, k experts'
    SwiGLU rows); decode holds N hidden states ×2, one micro-batch's QKV ×2 and one expert batch's
    intermediates; plus a micro-batch's fp32 logits. The CPU keeps two pinned pages in flight, every
    request's QKV and attention output, and one micro-batch's fp32 attention scores."""
    D, qkv, q, k, I, V, H, N, mu, beta = 64, 64 + 2 * 16, 64, 2, 128, 1000, 8, 16, 4, 8
    prefill = mu * 200 * (3 * D + qkv + k * 3 * I) * 2  # 1_689_600
    decode = (2 * N * D + 2 * mu * qkv + beta * k * (3 * I + D)) * 2  # 19_968
    acts = max(prefill, decode) + mu * V * 4
    assert acts == 1_705_600
    g, c = mem(BASE)
    assert g == NON_EXPERT + 2 * LAYER_EXPERTS + acts
    scores = mu * H * (200 + 28) * 4
    staging = 2 * LAYER_EXPERTS // 4  # 4 pages a layer, two in flight
    assert c == EXPERTS + 16 * (200 + 28) * KV_TOKEN + staging + N * (qkv + q) * 2 + scores
    # CPU-only: everything in CPU memory, the attention scores with the activations
    g, c = mem(Policy(batch_size=16, micro_batch_size=4, expert_batch_size=8, attention_on="cpu", ffn_on="cpu"))
    assert g == 0 and c == NON_EXPERT + EXPERTS + 16 * (200 + 28) * KV_TOKEN + acts + scores


def test_a_policy_that_needs_exactly_the_usable_bytes_fits_and_one_byte_more_does_not():
    g, c = mem(BASE)
    fits = next(b for b in range(int(g / 0.86) - 3, int(g / 0.86) + 4) if int(b * 0.86) == g)
    assert validate(BASE, SPEC, HW, WORK, Budget(gpu_bytes=fits, cpu_bytes=10**12)) == []
    (over,) = validate(BASE, SPEC, HW, WORK, Budget(gpu_bytes=fits - 2, cpu_bytes=10**12))
    assert over.where == "gpu" and over.needed == g and over.over == g - int((fits - 2) * 0.86) > 0
    cpu_fits = next(b for b in range(int(c / 0.8) - 3, int(c / 0.8) + 4) if int(b * 0.8) == c)
    assert validate(BASE, SPEC, HW, WORK, Budget(gpu_bytes=10**12, cpu_bytes=cpu_fits)) == []
    (over,) = validate(BASE, SPEC, HW, WORK, Budget(gpu_bytes=10**12, cpu_bytes=cpu_fits - 2))
    assert over.where == "cpu" and over.needed == c


def test_budgets_and_workloads_refuse_nonsense_at_the_boundaries():
    from core.errors import UsageError

    Budget(gpu_bytes=0, cpu_bytes=1)  # a machine without a GPU
    Workload(prompt_len=1, gen_len=1, max_prompt_len=1, num_requests=1)
    for bad in (lambda: Budget(-1, 1), lambda: Budget(0, 0), lambda: Workload(0, 1), lambda: Workload(1, 0),
                lambda: Workload(5, 1, max_prompt_len=4), lambda: Workload(1, 1, num_requests=0)):
        with pytest.raises(UsageError):
            bad()
