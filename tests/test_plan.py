"""The policy search: the paper's findings as assertions, memory that fits, clear budget errors, speed."""

import dataclasses
import json
import time

import pytest

from core.plan import planner
from core.errors import BudgetError, UsageError
from core.plan.hardware import detect, preset
from core.plan.planner import Budget, Workload, plan, predict, validate
from core.plan.policy import Policy, Prediction
from core.plan.presets import preset_names, preset_spec, resolve_spec

MIXTRAL = preset_spec("mixtral-8x7b")
MTBENCH = Workload(prompt_len=77, gen_len=128)


@pytest.mark.parametrize("gpu", ["t4", "l4"])
def test_mixtral_on_t4_and_l4_puts_decode_attention_on_cpu_and_ffn_on_gpu(gpu):
    policy, pred = plan(MIXTRAL, preset(gpu), MTBENCH)
    assert policy.attention_on == "cpu" and policy.ffn_on == "gpu"
    assert policy.gpu_kv_fraction == 0.0
    assert 0.0 <= policy.gpu_weight_fraction < 0.5  # most experts are streamed: they cannot fit
    assert policy.batch_size >= 512 and policy.expert_batch_size >= policy.micro_batch_size
    assert pred.tokens_per_s > 0 and pred.decode_tokens_per_s > pred.tokens_per_s * 0.9


def test_plan_time_for_mixtral_on_t4_is_under_half_a_second():
    plan(MIXTRAL, preset("t4"), MTBENCH)  # warm imports (pulp)
    # CPU seconds, not wall: on a box shared by a few jobs the wall clock measures the queue for a
    # core; the planner's own work (this thread) plus CBC's (its child processes) is what it costs
    best = min(_cpu_seconds(lambda: plan(MIXTRAL, preset("t4"), MTBENCH)) for _ in range(3))
    assert 0.0 < best < 0.5, best


def _cpu_seconds(fn) -> float:
    t, c = time.thread_time(), _children_cpu()
    fn()
    return time.thread_time() - t + _children_cpu() - c


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (CBC); 0 where the OS does not say (Windows)."""
    try:
        import resource
    except ImportError:
        return 0.0
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@pytest.mark.parametrize("gpu", ["t4", "l4"])
def test_faster_pcie_never_lowers_throughput_and_moves_weights_off_the_gpu(gpu):
    results = [plan(MIXTRAL, preset(gpu).with_link(g), MTBENCH) for g in (4, 8, 16, 32, 64, 128)]
    tps = [pred.tokens_per_s for _, pred in results]
    rw = [pol.gpu_weight_fraction for pol, _ in results]
    assert all(b >= a * 0.999 for a, b in zip(tps, tps[1:])), tps
    assert all(b <= a + 1e-9 for a, b in zip(rw, rw[1:])), rw  # paper Fig. 10
    assert rw[-1] < rw[0]


def test_more_cpu_memory_never_lowers_throughput():
    hw = preset("l4")
    # from 120 GB: the runtime keeps all 93 GB of weights in host memory (the GPU holds copies)
    tps = [plan(MIXTRAL, hw, MTBENCH, Budget.for_hardware(hw, cpu_gb=gb))[1].tokens_per_s
           for gb in (120, 150, 192, 256, 384)]
    assert all(b >= a * 0.999 for a, b in zip(tps, tps[1:])), tps
    assert tps[-1] > 1.5 * tps[0]  # KV capacity limits the batch


def test_more_gpu_memory_never_lowers_throughput_and_keeps_more_weights_resident():
    hw = preset("l4")
    out = [plan(MIXTRAL, hw, MTBENCH, Budget.for_hardware(hw, gpu_gb=gb)) for gb in (14, 24, 40, 80)]
    tps = [p.tokens_per_s for _, p in out]
    assert all(b >= a * 0.999 for a, b in zip(tps, tps[1:])), tps
    assert out[-1][0].gpu_weight_fraction > out[0][0].gpu_weight_fraction


def state_copies(model, ranks: int) -> int:
    """Copies of each sequence's attention state `ranks` ranks keep: one where it splits with the heads, one a
    rank for MLA's latent (it serves every head) and where attention stays whole (core.model.shard)."""
    from core.model.shard import plan_shard

    return 1 if ranks == 1 or plan_shard(model, 0, ranks).split_attention and model.mla is None else ranks


CASES = [(m, h) for m in preset_names() for h in ("t4", "l4", "2xt4", "a100-80g")]


@pytest.mark.parametrize("model,hw", CASES)
def test_every_plan_fits_its_budget(model, hw):
    """The plan fits when counted independently of the planner: the weights where the policy puts them,
    the 2×layer double buffer of streamed experts, a KV cache with room for every slot at the longest
    request. Only the activations are taken from the planner (its estimate of them)."""
    spec, machine = preset_spec(model), preset(hw)
    work = dataclasses.replace(MTBENCH, max_prompt_len=2 * MTBENCH.prompt_len)  # MT-Bench's longest is ~2x
    try:
        policy, pred = plan(spec, machine, work)
    except BudgetError:
        assert spec.total_bytes > 0.8 * machine.cpu_mem_bytes  # only models larger than the host
        return
    budget = Budget.for_hardware(machine)
    gpu_limit, cpu_limit = budget.gpu_bytes * planner.GPU_USABLE, budget.cpu_bytes * planner.CPU_USABLE
    r_w, r_c = policy.gpu_weight_fraction, policy.gpu_kv_fraction
    experts, layer = spec.total_expert_bytes, spec.layer_expert_bytes
    # what every slot keeps for the longest request: K/V, windows, latents or linear states, by layer kind
    # (on every tensor-parallel rank, for attention whose heads cannot be split)
    kv = policy.batch_size * spec.state_bytes(work.longest_prompt + work.gen_len) * state_copies(
        spec, policy.tensor_parallel)
    if policy.ffn_on == "cpu":
        cpu_need = spec.total_bytes + kv
        assert pred.gpu_bytes == 0
    else:
        gpu_need = (spec.total_bytes - experts) + r_w * experts + 2 * (1 - r_w) * layer + r_c * kv \
            + pred.gpu_breakdown["activations"]
        cpu_need = (1 - r_w) * experts + (1 - r_c) * kv
        assert gpu_need <= gpu_limit, f"{model} on {hw}: needs {gpu_need:,.0f} GPU bytes, {gpu_limit:,.0f} usable"
        assert pred.gpu_bytes >= gpu_need - 2, "the planner counts less GPU memory than the policy needs"
    assert cpu_need <= cpu_limit, f"{model} on {hw}: needs {cpu_need:,.0f} CPU bytes, {cpu_limit:,.0f} usable"
    assert pred.cpu_bytes >= cpu_need - 2, "the planner counts less CPU memory than the policy needs"
    assert validate(policy, spec, machine, work, budget) == []


def test_a_budget_nothing_fits_in_names_the_shortfall():
    hw = preset("t4")
    with pytest.raises(BudgetError) as e:
        plan(MIXTRAL, hw, MTBENCH, Budget.for_hardware(hw, gpu_gb=4, cpu_gb=40))
    msg = str(e.value)
    assert "nothing fits" in msg and "over" in msg and "bytes" in msg and "--gpu-mem" in msg
    # the shortfall it names is real: that many bytes more would be needed
    over = [int(x.replace(",", "")) for x in __import__("re").findall(r"\(([\d,]+) bytes\) over", msg)]
    assert over and all(o > 0 for o in over)


def test_user_policy_validation_reports_bytes_over():
    hw = preset("t4")
    big = Policy(batch_size=8192, micro_batch_size=512, expert_batch_size=512, gpu_weight_fraction=0.5,
                 pages_per_layer=16)
    over = validate(big, MIXTRAL, hw, MTBENCH)
    where = {o.where: o for o in over}
    assert set(where) == {"gpu", "cpu"}
    g = where["gpu"]
    assert g.over == g.needed - g.limit > 0 and g.limit == int(Budget.for_hardware(hw).gpu_bytes * planner.GPU_USABLE)
    assert f"{g.over:,} bytes" in str(g) and "resident_experts" in str(g)
    fitting, _ = plan(MIXTRAL, hw, MTBENCH)
    assert validate(fitting, MIXTRAL, hw, MTBENCH) == []


def test_gpu_policy_on_a_cpu_only_machine_is_refused(monkeypatch):
    cpu_only = dataclasses.replace(preset("t4"), name="cpu", gpu_name=None, gpu_count=0)
    with pytest.raises(UsageError, match="no"):
        validate(Policy(1, 1, 1), MIXTRAL, cpu_only, MTBENCH)


def test_cpu_only_machine_gets_a_cpu_only_plan():
    cpu_only = dataclasses.replace(preset("t4"), name="cpu", gpu_name=None, gpu_count=0)
    policy, pred = plan(preset_spec("olmoe-1b-7b"), cpu_only, MTBENCH)
    assert (policy.attention_on, policy.ffn_on, policy.gpu_weight_fraction) == ("cpu", "cpu", 0.0)
    assert pred.gpu_bytes == 0 and pred.tokens_per_s > 0
    assert "CPU" in pred.bottleneck_text


def test_a_runs_smaller_last_wave_is_predicted_as_it_runs():
    """Defect: 256 requests at a batch of 228 were predicted as if every wave held 228 (tokens a second of full
    waves), where the run's second wave holds 28 and its steps cost nearly as much for an eighth of the tokens:
    the demo's decode ran 15-26 % under its prediction, and the planner picked 228 over 256 for it."""
    cpu_only = dataclasses.replace(preset("t4"), name="cpu", gpu_name=None, gpu_count=0)
    spec = preset_spec("olmoe-1b-7b")
    cpu = lambda b, m: Policy(batch_size=b, micro_batch_size=m, expert_batch_size=m, attention_on="cpu",  # noqa: E731
                              ffn_on="cpu", gpu_weight_fraction=0.0)
    n = 32
    work = lambda r: Workload(prompt_len=77, gen_len=n, max_prompt_len=418, num_requests=r)  # noqa: E731
    got = predict(cpu(228, 228), spec, cpu_only, work(256))
    long, short = work(256).longest_first(228)  # the full wave holds the longest prompts (the next test)
    full, last = predict(cpu(228, 228), spec, cpu_only, long), predict(cpu(28, 28), spec, cpu_only, short)
    seconds = lambda q: q.prefill_seconds + (n - 1) * q.step_seconds  # noqa: E731
    assert got.tokens_per_s == pytest.approx(256 * n / (seconds(full) + seconds(last)), rel=1e-9)
    assert got.decode_tokens_per_s == pytest.approx(256 / (full.step_seconds + last.step_seconds), rel=1e-9)
    assert got.tokens_per_s < 0.95 * full.tokens_per_s  # the 28's steps cost more a token
    # a last wave over several micro-batches: as few of at most the policy's size as hold it (100 + 56 -> 2 of 78)
    two = predict(cpu(200, 100), spec, cpu_only, work(356))
    long, short = work(356).longest_first(200)
    rest = predict(cpu(156, 78), spec, cpu_only, short)
    assert two.tokens_per_s == pytest.approx(356 * n / (seconds(predict(cpu(200, 100), spec, cpu_only, long))
                                                        + seconds(rest)), rel=1e-9)
    # ... and the planner weighs it: 600 requests of Mixtral on the CPU alone were planned at 584 a wave (full waves
    # of 584 priced best), whose 16-request last wave costs more than waves of 600
    policy, pred = plan(MIXTRAL, cpu_only, Workload(prompt_len=77, gen_len=n, max_prompt_len=418, num_requests=600))
    assert 600 % policy.batch_size == 0
    assert pred.tokens_per_s > predict(cpu(584, 292), MIXTRAL, cpu_only, Workload(prompt_len=77, gen_len=n,
                                                                                  max_prompt_len=418,
                                                                                  num_requests=600)).tokens_per_s
    # whole waves, or requests not known: as before
    assert predict(cpu(128, 64), spec, cpu_only, work(256)).tokens_per_s == pytest.approx(
        predict(cpu(128, 64), spec, cpu_only, work(128)).tokens_per_s, rel=0.02)


def test_with_equal_prompts_the_last_wave_holds_only_the_requests_left():
    """Defect: without a spread (no --max-prompt-len) the last wave was priced as every request: 3000 requests at
    2200 a wave were predicted with 5200 requests' prompt tokens and 302 tokens/s, more than a full wave's 263."""
    policy = Policy(2200, 100, 200, "cpu", "gpu", 0.0234375, 0.0, 22)
    work = Workload(prompt_len=77, gen_len=128, num_requests=3000)
    got = predict(policy, MIXTRAL, preset("t4"), work)
    full = predict(policy, MIXTRAL, preset("t4"), dataclasses.replace(work, num_requests=2200))
    last = predict(dataclasses.replace(policy, batch_size=800),  # 8 micro-batches of 100, as last_wave deals them
                   MIXTRAL, preset("t4"), dataclasses.replace(work, num_requests=800))
    assert got.prompt_tokens == 3000 * 77 and got.decode_steps == 2 * 127
    seconds = lambda q: q.prefill_seconds + 127 * q.step_seconds  # noqa: E731
    assert got.tokens_per_s == pytest.approx(3000 * 128 / (seconds(full) + seconds(last)), rel=1e-9)


def test_a_runs_full_waves_hold_its_longest_prompts_and_its_last_wave_the_shortest():
    """Defect: a run's waves were all priced at the workload's mean prompt, but the engine admits the longest
    prompts first: 256 requests of mean 308 at 204 a wave ran a first wave of mean 366 (its prefill 2.34-2.73 s
    against 1.92 predicted, its decode attention 16 % over) and a last of mean 79 (prefill 0.107 s against 0.556)."""
    from core.io.workloads import target_lengths

    for s, top, n, k in [(308, 1672, 256, 204), (77, 418, 256, 228), (77, 418, 600, 584), (308, 1672, 256, 128)]:
        work = Workload(prompt_len=s, gen_len=32, max_prompt_len=top, num_requests=n)
        long, short = work.longest_first(k)
        got = sorted(target_lengths(n, mean=s, max_len=top), reverse=True)  # what `mlight bench` runs
        a, b = got[:k], got[k:]
        assert (long.num_requests, short.num_requests, long.longest_prompt) == (k, n - k, top)
        assert long.prompt_len == pytest.approx(sum(a) / k, rel=0.02)
        assert short.prompt_len == pytest.approx(sum(b) / len(b), rel=0.07)
        assert long.prompt_sq_mean == pytest.approx(sum(x * x for x in a) / k, rel=0.1)  # the spread clipped at top
        assert short.prompt_sq_mean == pytest.approx(sum(x * x for x in b) / len(b), rel=0.1)
        assert short.longest_prompt == pytest.approx(b[0], abs=2)
        # the parts keep the workload's prompt tokens
        assert k * long.prompt_len + (n - k) * short.prompt_len == pytest.approx(n * s, rel=0.01)
    same = Workload(prompt_len=100, gen_len=8, num_requests=10)  # equal prompts: both parts the same
    assert same.longest_first(8) == (same, same)
    unknown = Workload(prompt_len=77, gen_len=8, max_prompt_len=418)
    assert unknown.longest_first(8) == (unknown, unknown)

    cpu_only = dataclasses.replace(preset("t4"), name="cpu", gpu_name=None, gpu_count=0)
    spec = preset_spec("olmoe-1b-7b")
    policy = Policy(batch_size=204, micro_batch_size=68, expert_batch_size=68, attention_on="cpu", ffn_on="cpu")
    work = Workload(prompt_len=308, gen_len=32, max_prompt_len=1672, num_requests=256)
    got = predict(policy, spec, cpu_only, work)
    mean = predict(policy, spec, cpu_only, dataclasses.replace(work, num_requests=204))  # a wave at the mean
    assert got.prefill_seconds > 1.15 * mean.prefill_seconds  # the first wave's 366-token prompts
    assert got.step_seconds > mean.step_seconds  # and their longer contexts
    # the run's sums, every wave's: what a measured run's busy seconds fold back against
    long, short = work.longest_first(204)
    first = predict(policy, spec, cpu_only, long)
    tail = predict(dataclasses.replace(policy, batch_size=52, micro_batch_size=52, expert_batch_size=52), spec,
                   cpu_only, short)
    assert got.decode_steps == 2 * 31 and got.prompt_tokens == 204 * long.prompt_len + 52 * short.prompt_len
    for key in ("gpu", "cpu_attn"):
        assert got.decode_busy[key] == pytest.approx(first.decode_busy[key] + tail.decode_busy[key], rel=1e-9)
        assert first.decode_busy[key] == pytest.approx(31 * spec.num_layers * first.layer_seconds[key], rel=1e-9)
    assert got.prefill_busy["gpu"] == pytest.approx(
        spec.num_layers * (first.prefill_layer_seconds["gpu"] + tail.prefill_layer_seconds["gpu"]), rel=1e-9)


def test_num_requests_caps_the_batch():
    policy, _ = plan(MIXTRAL, preset("l4"), Workload(77, 128, num_requests=80))
    assert policy.batch_size <= 80


def test_fast_fractions_agree_with_the_cbc_lp():
    d, r = planner.hrm.dims(MIXTRAL), planner.hrm.effective_rates(preset("t4"))
    budget = Budget.for_hardware(preset("t4"))
    g, c = budget.gpu_bytes * planner.GPU_USABLE, budget.cpu_bytes * planner.CPU_USABLE
    for place, n, mu, beta in [(("cpu", "gpu"), 2048, 128, 256), (("cpu", "gpu"), 512, 64, 64),
                               (("cpu", "gpu"), 36, 36, 36), (("gpu", "gpu"), 64, 32, 64)]:
        lin = planner._linearise(d, r, MTBENCH, place, n, mu, beta)
        fast = planner._best_fractions(lin, d.layers, MTBENCH.gen_len, g, c, place[0] == "gpu")
        lp = planner.solve_fractions_lp(lin, d.layers, MTBENCH.gen_len, g, c, place[0] == "gpu")
        assert (fast is None) == (lp is None)
        if fast is None:
            continue
        if place[0] == "cpu":  # both exact: same optimum
            assert lp[0] == pytest.approx(fast[0], rel=1e-5)
        else:  # the joint LP can only improve on the grid over r_c
            assert lp[0] <= fast[0] * (1 + 1e-6)


def test_micro_batch_candidates_are_the_papers():
    assert planner.micro_batch_sizes(200) == [1, 2, 3, 4, 36, 68, 100, 132, 164, 196]


def _neighbours(p: Policy):
    """Policies one step away from p in each integer and continuous choice."""
    mu, n_mb, g = p.micro_batch_size, p.num_micro_batches, p.micro_batches_per_expert_batch
    for n2 in {max(1, n_mb - 1), n_mb + 1, max(1, n_mb // 2), 2 * n_mb}:
        for g2 in {1, g, n2}:
            if n2 % g2 == 0:
                yield dataclasses.replace(p, batch_size=n2 * mu, expert_batch_size=g2 * mu, pages_per_layer=n2)
    for g2 in (g // 2, 2 * g):
        if g2 >= 1 and n_mb % g2 == 0:
            yield dataclasses.replace(p, expert_batch_size=g2 * mu)
    for r_w in (p.gpu_weight_fraction - 0.02, p.gpu_weight_fraction + 0.02):
        if 0 <= r_w <= 1 and p.ffn_on == "gpu":
            yield dataclasses.replace(p, gpu_weight_fraction=r_w)


@pytest.mark.parametrize("gpu", ["t4", "l4"])
def test_prediction_is_self_consistent(gpu):
    """The reported figures follow from each other, and the search ranked policies by the same
    prediction it reports: no fitting neighbour of the chosen policy is predicted to be faster."""
    hw = preset(gpu)
    policy, pred = plan(MIXTRAL, hw, MTBENCH)
    n, N = MTBENCH.gen_len, policy.batch_size
    assert pred.tokens_per_s == pytest.approx(N * n / (pred.prefill_seconds + (n - 1) * pred.step_seconds), rel=1e-9)
    assert pred.decode_tokens_per_s == pytest.approx(N / pred.step_seconds, rel=1e-9)
    assert pred.prefill_tokens_per_s == pytest.approx(N * MTBENCH.prompt_len / pred.prefill_seconds, rel=1e-9)
    assert pred.bottleneck in pred.layer_seconds
    top = max(pred.layer_seconds, key=pred.layer_seconds.get)  # the pipeline bound with the link busy most of it: h2d
    assert pred.bottleneck == top or (top, pred.bottleneck) == ("pipeline", "h2d") \
        and pred.layer_seconds["h2d"] >= pred.layer_seconds["pipeline"] / 2
    # a decode step is at least the layers' bottleneck resource, and not much more (the LM head)
    layers = MIXTRAL.num_layers * pred.layer_seconds[pred.bottleneck]
    assert layers <= pred.step_seconds <= 1.2 * layers
    assert pred.gpu_bytes == sum(pred.gpu_breakdown.values()) and pred.cpu_bytes == sum(pred.cpu_breakdown.values())
    checked = 0
    for other in _neighbours(policy):
        if validate(other, MIXTRAL, hw, MTBENCH) == []:
            checked += 1
            assert predict(other, MIXTRAL, hw, MTBENCH).tokens_per_s <= pred.tokens_per_s * (1 + 1e-6), other
    assert checked >= 3


def test_policy_and_prediction_json_round_trip():
    policy, pred = plan(MIXTRAL, preset("l4"), MTBENCH)
    assert Policy.from_json(policy.to_json()) == policy
    assert Prediction.from_dict(json.loads(json.dumps(pred.to_dict()))) == pred


@pytest.mark.parametrize("bad", [
    dict(batch_size=10, micro_batch_size=3, expert_batch_size=3),  # N not a multiple of μ
    dict(batch_size=12, micro_batch_size=3, expert_batch_size=9),  # expert batch does not divide N
    dict(batch_size=4, micro_batch_size=2, expert_batch_size=2, attention_on="tpu"),
    dict(batch_size=4, micro_batch_size=2, expert_batch_size=2, gpu_weight_fraction=1.5),
    dict(batch_size=4, micro_batch_size=2, expert_batch_size=2, attention_on="gpu", ffn_on="cpu"),
    dict(batch_size=4, micro_batch_size=2, expert_batch_size=2, gpu_kv_fraction=0.5),  # KV on GPU, attention on CPU
    dict(batch_size=0, micro_batch_size=1, expert_batch_size=1),
])
def test_policy_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        Policy(**bad)


def test_policy_from_dict_names_unknown_fields():
    with pytest.raises(ValueError, match="bogus"):
        Policy.from_dict({"batch_size": 1, "micro_batch_size": 1, "expert_batch_size": 1, "bogus": 3})


def test_workload_refuses_nonsense():
    with pytest.raises(UsageError):
        Workload(0, 10)
    with pytest.raises(UsageError):
        Workload(100, 10, max_prompt_len=50)


def test_budget_defaults_to_detected_free_memory():
    hw = dataclasses.replace(preset("l4"), gpu_mem_free_bytes=10 * 2**30, cpu_mem_available_bytes=50 * 10**9)
    b = Budget.for_hardware(hw)
    assert (b.gpu_bytes, b.cpu_bytes) == (10 * 2**30, 50 * 10**9)
    assert Budget.for_hardware(hw, gpu_gb=8, cpu_gb=64) == Budget(8 * 10**9, 64 * 10**9)


# ---- model resolution ------------------------------------------------------------------------------
PUBLISHED_BILLIONS = {"mixtral-8x7b": 46.7, "mixtral-8x22b": 140.6, "dbrx": 131.6, "qwen3-30b-a3b": 30.5,
                      "olmoe-1b-7b": 6.9, "qwen1.5-moe-a2.7b": 14.3, "gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8,
                      "deepseek-v2-lite": 15.7, "deepseek-v3": 671.0, "glm-4.5-air": 106.0, "qwen3-next-80b-a3b": 80.0,
                      "qwen3.5-35b-a3b": 35.0, "phi-3.5-moe": 41.9}


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_bundled_presets_have_their_published_sizes(name):
    spec = resolve_spec(name)
    assert spec.num_params / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.02)


def test_state_per_sequence_follows_each_layers_kind():
    """The KV-capacity term: sliding layers stop at their window, linear layers keep a fixed state, MLA
    keeps one latent per token — so at long contexts these models keep far less than full K/V would."""
    oss, ds, nxt = resolve_spec("gpt-oss-20b"), resolve_spec("deepseek-v3"), resolve_spec("qwen3-next-80b-a3b")
    full_kv = lambda s, t: s.num_layers * 2 * s.num_kv_heads * s.head_dim * s.dtype_bytes * t  # noqa: E731
    # gpt-oss: half the layers hold at most 128 tokens
    assert oss.state_bytes(100) == full_kv(oss, 100)
    assert oss.state_bytes(10_000) == pytest.approx(full_kv(oss, 10_000) / 2 + full_kv(oss, 128) / 2)
    # MLA: 512 + 64 numbers per token and layer instead of 2·128 heads·192
    assert ds.state_bytes(1000) == ds.num_layers * 576 * 2 * 1000
    # Qwen3-Next: 36 linear layers hold 32·128·128 fp32 + a 3-token conv state whatever the length
    fixed = 36 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2)
    assert nxt.state_bytes(0) == fixed and nxt.state_bytes(1000) == fixed + 12 * 2 * 2 * 256 * 2 * 1000


def test_model_from_folder_and_from_the_hf_cache(tmp_path, monkeypatch):
    from core.assets import CONFIGS

    cfg = (CONFIGS / "olmoe-1b-7b" / "config.json").read_text()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(cfg)
    assert resolve_spec(str(folder)).family == "olmoe"

    import huggingface_hub.constants as hc

    snap = tmp_path / "hub" / "models--acme--tiny-moe" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(cfg)
    (tmp_path / "hub" / "models--acme--tiny-moe" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-moe" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_spec("acme/tiny-moe").num_experts == 64

    from core.errors import ModelError

    with pytest.raises(ModelError, match="presets"):
        resolve_spec("acme/not-cached")


def test_detected_machine_plans_without_error(roomy_ram):
    hw = detect()
    assert hw.cpu_mem_available_bytes == roomy_ram.available  # the planner's budget is what is free
    policy, pred = plan(preset_spec("olmoe-1b-7b"), hw, Workload(32, 16))
    assert pred.tokens_per_s > 0 and policy.batch_size >= 1


def test_one_list_of_schedules():
    """The schedules are named once (core.plan.policy): the engine, the schedule builder and the CLI use that tuple,
    and the app's choices are it with "auto" beside it."""
    from app.commands import bench, run
    from app.tui.screens import plan as screen
    from core.plan import policy
    from core.runtime import engine, schedule

    assert schedule.SCHEDULES is engine.SCHEDULES is bench.SCHEDULES is run.SCHEDULES is policy.SCHEDULES
    assert {v for v, *_ in screen.SCHEDULES} - {screen.AUTO} == set(policy.SCHEDULES)
