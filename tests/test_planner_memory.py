"""The planner's memory accounting against bytes computed by hand, and against what the engine allocates.

A small Mixtral-shaped model whose sizes are worked out below line by line. The planner names each
buffer the runtime allocates (`Prediction.gpu_breakdown` / `cpu_breakdown`), so each is checked alone,
whatever the activation estimate is:
- resident experts: r_w of all experts, in whole experts per layer; the streaming buffer: two halves
  of the experts a layer streams, (1 − r_w) of a layer each;
- the KV cache: every slot of the batch sized for the longest prompt plus the generation (the engine
  gives each slot room for any waiting request), r_c of it on the GPU in whole layers.
The runtime keeps every weight in host memory (the GPU holds copies), so CPU memory does not shrink
with r_w. (tests/test_gpu_memory.py measures the totals against an emulated GPU's peak.)
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


def parts(policy: Policy, work: Workload = WORK) -> tuple[dict, dict]:
    p = predict(policy, SPEC, HW, work)
    return p.gpu_breakdown, p.cpu_breakdown


BASE = Policy(batch_size=16, micro_batch_size=4, expert_batch_size=8, attention_on="cpu", ffn_on="gpu",
              gpu_weight_fraction=0.0, pages_per_layer=4)


def test_streamed_experts_take_a_two_layer_buffer_on_the_gpu():
    g0, c0 = mem(BASE)
    g1, c1 = mem(dataclasses.replace(BASE, gpu_weight_fraction=1.0))
    assert g1 - g0 == EXPERTS - 2 * LAYER_EXPERTS  # all experts resident, no buffer vs a 2-layer buffer
    cpu = parts(BASE)[1]  # host memory keeps every weight
    assert c0 == c1 and (cpu["non_expert_weights"], cpu["experts"]) == (NON_EXPERT, EXPERTS)
    for r_w in (0.25, 0.5, 0.75):  # in between: r_w of the experts resident, 2 × (1 − r_w) of a layer streamed
        g, _ = parts(dataclasses.replace(BASE, gpu_weight_fraction=r_w))
        assert g["resident_experts"] == r_w * EXPERTS and g["weight_double_buffer"] == 2 * (1 - r_w) * LAYER_EXPERTS
    # a share that is not whole experts in every layer: the buffer is sized for the layer streaming most
    g, _ = parts(dataclasses.replace(BASE, gpu_weight_fraction=9 / 32))  # 9 experts: 3, 2, 2, 2 per layer
    assert g["resident_experts"] == 9 * EXPERT and g["weight_double_buffer"] == 2 * 6 * EXPERT
    # and the GPU holds every non-expert weight, plus activations that grow with the micro-batch
    assert g1 > NON_EXPERT + EXPERTS


@pytest.mark.parametrize("longest,gen,batch", [(200, 28, 16), (100, 28, 16), (200, 60, 8)])
def test_the_kv_cache_has_room_for_every_slot_at_the_longest_request(longest, gen, batch):
    work = Workload(prompt_len=50, gen_len=gen, max_prompt_len=longest)
    gpu_attn = Policy(batch_size=batch, micro_batch_size=4, expert_batch_size=4, attention_on="gpu", ffn_on="gpu",
                      gpu_weight_fraction=1.0, gpu_kv_fraction=0.0)
    g0, c0 = parts(gpu_attn, work)
    g1, c1 = parts(dataclasses.replace(gpu_attn, gpu_kv_fraction=1.0), work)
    kv = batch * (longest + gen) * KV_TOKEN
    assert g1["kv_cache"] == pytest.approx(kv, abs=2) and c0["kv_cache"] == pytest.approx(kv, abs=2)
    assert g0["kv_cache"] == c1["kv_cache"] == 0
    # with the cache on the CPU, two micro-batches' worth of it are on the GPU at a time (a ring)
    assert g0["kv_buffers"] == 2 * 4 * (longest + gen) * KV_TOKEN // 4 and g1["kv_buffers"] == 0
    half, _ = parts(dataclasses.replace(gpu_attn, gpu_kv_fraction=0.5), work)  # two of four layers
    assert half["kv_cache"] == pytest.approx(kv / 2, abs=2)


def test_cpu_only_keeps_every_weight_and_the_kv_cache_in_cpu_memory():
    p = Policy(batch_size=16, micro_batch_size=4, expert_batch_size=4, attention_on="cpu", ffn_on="cpu")
    g, c = mem(p)
    assert g == 0 and c >= NON_EXPERT + EXPERTS + 16 * (200 + 28) * KV_TOKEN


def test_validate_refuses_a_gpu_budget_short_of_the_hand_counted_bytes():
    """Budget the GPU for exactly the hand count (weights, half the experts resident, the 2-layer buffer
    of the other half) plus the activations (what the GPU holds beyond the weights when every expert is
    resident): it fits; half a layer less: refused, naming the GPU."""
    policy = dataclasses.replace(BASE, gpu_weight_fraction=0.5)
    g, _ = parts(policy)
    acts = g["activations"] + g["staging"]  # beyond the weights: activations, D1/D2 buffers, RoPE tables
    assert acts > 0
    need = NON_EXPERT + EXPERTS // 2 + 2 * (LAYER_EXPERTS // 2) + acts
    ok = Budget(gpu_bytes=int(need / 0.86) + 2, cpu_bytes=10**12)
    assert validate(policy, SPEC, HW, WORK, ok) == []
    short = Budget(gpu_bytes=int((need - LAYER_EXPERTS // 2) / 0.86), cpu_bytes=10**12)
    (over,) = validate(policy, SPEC, HW, WORK, short)
    assert over.where == "gpu" and over.needed == pytest.approx(need, abs=2) and over.over > 0
    assert str(over).startswith("GPU memory: needs ") and str(over).endswith(f"({over.over:,} bytes) over")


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
    g1 = predict(dataclasses.replace(p, gpu_kv_fraction=1.0), engine.spec, HW, work).gpu_breakdown["kv_cache"]
    assert caches == [4 * (19 + 3) * engine.spec.kv_bytes_per_token]
    assert g1 == pytest.approx(caches[0], abs=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_only_plans_count_the_logits_buffers_the_runner_keeps(checkpoint_factory, monkeypatch, dtype):
    """In CPU-only mode the runner keeps a decode and a prefill logits buffer, fp32, a row per batch slot
    (reused every step); the plan's CPU memory names them at their bytes (at B = 256 and a 152k
    vocabulary they are 311 MB, which the plan once left out)."""
    from core.runtime.engine import Engine, Request

    engine = Engine.load(checkpoint_factory("mixtral"), dtype=dtype)
    held = []
    real = engine.runner

    def runner(*a, **kw):
        r = real(*a, **kw)
        held.append(sum(r.host[name].nbytes for name in ("logits_dec", "logits_pre")))
        return r

    monkeypatch.setattr(engine, "runner", runner)
    lengths, max_new = [7, 19, 12, 4, 9, 5], 3  # a request per slot: the runner sizes its slots for those it has
    reqs = [Request(id=str(n), prompt=" ".join(["a"] * n), max_new_tokens=max_new) for n in lengths]
    list(engine.generate(reqs, batch_size=6, micro_batch_size=3))
    work = Workload(prompt_len=sum(lengths) // len(lengths), gen_len=max_new, max_prompt_len=max(lengths))
    p = Policy(batch_size=6, micro_batch_size=3, expert_batch_size=3, attention_on="cpu", ffn_on="cpu")
    planned = predict(p, engine.spec, HW, work).cpu_breakdown["logits_buffers"]
    assert held == [2 * 6 * engine.spec.vocab_size * 4]
    assert planned == pytest.approx(held[0], abs=64)  # the arena aligns the second buffer


def test_activations_and_host_buffers_count_what_the_planner_documents():
    """Every named term beyond weights and KV, by hand for BASE (N 16, μ 4, expert batch 8, 4 pages;
    longest prompt 200 + 28 new tokens = 228 per slot; bf16, so grouped matmuls for the FFN):
    - GPU staging: each micro-batch's QKV (D1 source) and attention output (D2 target), RoPE tables;
    - activations, the larger of decode (every request's hidden state; one expert batch's normed input
      twice, routing, one hidden-state block of margin; the largest of the FFN's intermediates, a
      micro-batch's pre-attention or its fp32 logits; per-step ids) and prefill (every prompt's hidden
      states; a micro-batch's normed input, two layers' K/V and its ids; the largest of the FFN's
      intermediates, the pre-attention (the norm's fp32 arrays, then the QKV phase: never both) with one
      prompt's fp32 scores, the logits);
    - host: the pinned arena (D1/D2 buffers, decode and prefill logits), one micro-batch's fp32 attention
      scores. (tests/test_gpu_memory.py holds these against what an emulated GPU sees allocated.)"""
    D, q, kv, k, I, V, H, hd, N, mu, beta, T, s, dt = 64, 64, 16, 2, 128, 1000, 8, 8, 16, 4, 8, 228, 200, 2
    staging = N * (q + 2 * kv + q) * dt + 2 * T * hd * dt
    ffn = lambda t: t * k * 33 + t * k * (D + 3 * I) * dt  # noqa: E731 - ids and masks, then in, gate/up, product
    pre = lambda t: t * (D * (8 + dt) + 3 * (q + kv) * dt)  # noqa: E731 - decode: its arrays as one
    mix = lambda t: t * max(D * (8 + dt), D * dt + 3 * (q + kv) * dt)  # noqa: E731 - the norm, then the QKV phase
    logits = mu * (V * 4 + 3 * D * 4)
    decode = N * D * dt + beta * (3 * D * dt + 2 * k * (8 + dt)) + max(ffn(beta), pre(mu), logits) + N * (40 + T)
    tok = mu * s
    prefill = (N * s * D * dt + tok * (2 * D + 4 * kv) * dt + N * (2 * s + 1) * 8
               + max(ffn(tok), mix(tok) + H * s * s * 4, logits))
    assert (decode, prefill) == (28_800, 2_560_128)
    g, c = parts(BASE)
    assert g == {"non_expert_weights": NON_EXPERT, "resident_experts": 0, "weight_double_buffer": 2 * LAYER_EXPERTS,
                 "kv_cache": 0, "kv_buffers": 0, "staging": staging, "dequant_scratch": 0, "activations": prefill}
    scores = mu * H * T * 4
    assert c == {"non_expert_weights": NON_EXPERT, "experts": EXPERTS, "kv_cache": N * T * KV_TOKEN,
                 "pinned_staging": N * (q + 2 * kv + q) * dt + 2 * N * V * 4, "attention_workspace": scores}
    # CPU-only: everything in CPU memory, the CPU mode's own working-set estimate plus the scores
    cpu_acts = max(tok * (3 * D + q + 2 * kv + k * 3 * I) * dt,
                   (2 * N * D + 2 * mu * (q + 2 * kv) + beta * k * (3 * I + D)) * dt) + mu * V * dt
    # (+ one micro-batch's bf16 head output on its way into the fp32 logits buffers, decode and prefill)
    g, c = mem(Policy(batch_size=16, micro_batch_size=4, expert_batch_size=8, attention_on="cpu", ffn_on="cpu"))
    assert g == 0 and c == NON_EXPERT + EXPERTS + N * T * KV_TOKEN + cpu_acts + scores + 2 * N * V * 4


def test_the_searchs_linear_memory_model_is_the_accounting_at_whole_experts_and_kv_layers():
    """The policy search sizes memory as m0 + m_w·r_w + m_c·r_c on each side (`_memory_lin`). Where the
    fractions are whole experts a layer (r_w of 0, 1/4, 1/2, 1: 0, 2, 4, 8 of 8) and the KV cache is all
    on one side (r_c 0 or 1), that must be what `memory_use` counts (itself checked by hand above) — but
    where a layer is split between resident and streamed experts (r_w of 1/4, 1/2), which needs one more
    gate/up output (bf16's grouped matmuls) than the line through the whole layers says: there the
    accounting is above the line by at most that output, the same step at every split point (the search
    may then pick a fraction a little over the budget; plan() validates its policy and steps back)."""
    from core.plan import hrm
    from core.plan.planner import _memory_lin, memory_use

    d = hrm.dims(SPEC)
    split = set()
    for place in (("cpu", "gpu"), ("gpu", "gpu"), ("cpu", "cpu")):
        g0, gw, gc, c0, cw, cc = _memory_lin(d, WORK, place, 16, 4, 8)
        for r_w in (0.0, 0.25, 0.5, 1.0):
            for r_c in (0.0, 1.0):
                if (r_w and place[1] == "cpu") or (r_c and place[0] == "cpu"):
                    continue
                policy = Policy(16, 4, 8, *place, r_w, r_c, 4)
                g, c = (sum(x.values()) for x in memory_use(d, policy, WORK))
                under = g - (g0 + gw * r_w + gc * r_c)
                if place[1] == "cpu" or not 0 < r_w < 1:
                    assert under == pytest.approx(0, abs=3), (place, r_w, r_c)
                else:  # at most the prefill micro-batch's one more gate/up output (4 prompts of 200 tokens)
                    assert 0 <= under <= 4 * 200 * SPEC.top_k * SPEC.expert_intermediate * 2, (place, r_w, r_c)
                    split.add(round(under))
                assert c == pytest.approx(c0 + cw * r_w + cc * r_c, abs=3), (place, r_w, r_c)
    assert len(split) == 1  # one step, the same at every split fraction and in either placement


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


@pytest.mark.parametrize("mem, limits", [
    ((100, 400, 0, 50, 0, 0), (300, 1000)),  # GPU memory rising with r_w: an upper end
    ((0, 0, 0, 900, -600, 0), (1000, 500)),  # CPU memory falling with r_w (weights leaving the host): a lower end
    ((100, 400, 0, 900, -600, 0), (400, 600)),  # both: a window
    ((100, 400, 0, 900, -600, 0), (200, 500)),  # the window closed
    ((500, -400, 0, 900, -600, 0), (200, 500)),  # both falling: the higher lower end
    ((100, 0, 50, 900, 0, -100), (180, 850)),  # nothing depends on r_w, r_c shifts both: r_w stays 0
    ((100, 0, 50, 900, 0, -100), (120, 850)),  # … and GPU memory over its limit at this r_c
])
def test_the_r_w_interval_is_where_both_linear_memories_fit(mem, limits):
    """`_rw_interval`: the r_w values in [0, 1] for which m0 + m_w·r_w + m_c·r_c fits on both sides, against
    each r_w of a fine grid checked by the memories themselves."""
    from core.plan.planner import _rw_interval

    g0, gw, gc, c0, cw, cc = mem
    r_c = 0.5
    got = _rw_interval(mem, r_c, *limits)
    grid = [i / 1000 for i in range(0, 1001)]
    fits = [r for r in grid if g0 + gw * r + gc * r_c <= limits[0] and c0 + cw * r + cc * r_c <= limits[1]]
    if not gw and not cw:
        assert got == ((0.0, 0.0) if fits else None)
        return
    if not fits:
        assert got is None
        return
    assert got is not None
    lo, hi = got
    assert lo == pytest.approx(fits[0], abs=1e-3)
    assert hi == pytest.approx(fits[-1], abs=1e-3)
