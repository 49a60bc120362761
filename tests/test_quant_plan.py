"""The planner counts bytes per weight of the expert format; --quantize auto picks the least lossy format that fits."""

from __future__ import annotations

import json

import pytest

from core.errors import BudgetError
from core.model.quant.formats import Format, quantized_spec
from core.plan import hrm, planner
from core.plan.hardware import preset
from core.plan.presets import resolve_spec
from core.plan.quantize import choose

WORK = planner.Workload(77, 128)


def test_quantized_spec_counts_bits_per_weight():
    m = resolve_spec("mixtral-8x7b")
    q = quantized_spec(m, Format("int4", 64))
    assert q.expert_format == "int4-g64" and q.expert_bits == pytest.approx(4.5)
    assert q.expert_bytes == pytest.approx(m.expert_bytes * 4.5 / 16, rel=1e-6)
    assert q.num_params == m.num_params and q.active_params == m.active_params  # parameters are parameters
    assert q.total_bytes == m.nonexpert_bytes + m.num_layers * m.num_experts * q.expert_bytes
    D, I = m.hidden_size, m.expert_intermediate  # int8: one fp32 scale per output row of each matrix
    assert quantized_spec(m, Format("int8")).expert_bits == pytest.approx(8 + 32 * (2 * I + D) / (3 * D * I))


def test_memory_and_link_shrink_with_the_format():
    """RAM for experts, the double buffer, resident experts and each streamed page: all in the format's bytes;
    the device expands nothing (its fused kernel dequantizes in place)."""
    m, hw = resolve_spec("mixtral-8x7b"), preset("t4")
    q = quantized_spec(m, Format("int4", 64))
    pol = planner.Policy(256, 64, 64, "cpu", "gpu", gpu_weight_fraction=0.1, pages_per_layer=4)
    g0, c0 = planner.memory_use(m, pol, WORK)
    g1, c1 = planner.memory_use(q, pol, WORK)
    ratio = q.expert_bytes / m.expert_bytes
    for name in ("weight_double_buffer", "resident_experts"):
        assert g1[name] == pytest.approx(g0[name] * ratio, rel=1e-3)
    assert c1["experts"] == pytest.approx(c0["experts"] * ratio, rel=1e-3)
    assert g0["dequant_scratch"] == g1["dequant_scratch"] == 0  # the fused path dequantizes inside its kernel
    r = hrm.effective_rates(hw)
    kw = dict(batch=256, micro_batch=64, expert_batch=64, attention_on="cpu", ffn_on="gpu", gpu_weight_fraction=0.0,
              gpu_kv_fraction=0.0, context=100, pages=4)
    t0, t1 = hrm.decode_tasks(m, r, **kw), hrm.decode_tasks(q, r, **kw)
    assert t1["weight_page"].seconds == pytest.approx(t0["weight_page"].seconds * ratio, rel=0.01)
    # expanding on the device costs GPU traffic that bf16 experts do not have
    assert hrm.moe_ffn(q, 64, expand=True).bytes > hrm.moe_ffn(q, 64).bytes


def test_int4_plan_predicts_a_speedup_on_a_t4():
    m, hw = resolve_spec("mixtral-8x7b"), preset("t4")
    c = choose(m, hw, WORK, planner.Budget.for_hardware(hw), "int4")
    assert c.quantize == "int4" and c.baseline is not None and c.speedup > 1.5
    assert c.prediction.cpu_breakdown["experts"] < 0.3 * c.baseline.cpu_breakdown["experts"]


@pytest.mark.parametrize("cpu_gb,want", [(200, "none"), (64, "int8"), (40, "int4")])
def test_auto_takes_the_least_lossy_format_that_fits(cpu_gb, want):
    m, hw = resolve_spec("mixtral-8x7b"), preset("t4")
    c = choose(m, hw, WORK, planner.Budget.for_hardware(hw, cpu_gb=cpu_gb), "auto")
    assert c.quantize == want
    if want != "none":
        assert "not fit" in c.why and "least lossy" in c.why
        assert all(c.tried[q].startswith("does not fit") for q in ("none", "int8")[:("none", "int8", "int4").index(want)])


def test_auto_refuses_what_not_even_int4_fits():
    m, hw = resolve_spec("mixtral-8x7b"), preset("t4")
    with pytest.raises(BudgetError, match="CPU memory"):
        choose(m, hw, WORK, planner.Budget.for_hardware(hw, cpu_gb=12), "auto")


def test_plan_cli_prints_format_and_speedup(capsys):
    from app.cli import main

    assert main(["plan", "--model", "mixtral-8x7b", "--hardware", "t4", "--prompt-len", "77", "--gen-len", "128",
                 "--quantize", "int4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quantize"]["format"] == "int4-g64" and out["quantize"]["speedup"] > 1.5
    assert out["prediction"]["gpu_breakdown"]["dequant_scratch"] == 0
    assert main(["plan", "--model", "mixtral-8x7b", "--hardware", "t4", "--prompt-len", "77", "--gen-len", "128",
                 "--quantize", "auto", "--cpu-mem", "64"]) == 0
    text = capsys.readouterr().out
    assert "experts in int8" in text and "least lossy" in text and "does not fit this budget" in text


def test_cpu_int4_rate_is_the_probes_where_measured_else_the_share():
    """The HRM's quantized-expert CPU rate: the probe's measured int4 kernel FLOP/s when the machine has
    one (HardwareSpec.cpu_matmul["int4"]), else CPU_KERNEL_FLOPS × the matmul rate."""
    import dataclasses

    m = quantized_spec(resolve_spec("mixtral-8x7b"), Format("int4", 64))
    hw = preset("t4")
    kw = dict(batch=256, micro_batch=256, expert_batch=256, attention_on="cpu", ffn_on="cpu", gpu_weight_fraction=0.0,
              gpu_kv_fraction=0.0, context=100)

    def ffn(h):
        r = hrm.effective_rates(h)
        return r, hrm.decode_tasks(m, r, **kw)["ffn"].seconds

    r0, t0 = ffn(hw)
    assert r0.kernel_flops("int4") == pytest.approx(hrm.CPU_KERNEL_FLOPS["int4"] * r0.cpu_flops)
    slow = 0.05 * r0.cpu_flops  # far below the fallback: the FFN turns compute-bound on the measured rate
    r1, t1 = ffn(dataclasses.replace(hw, cpu_matmul={"int4": slow}))
    r2, t2 = ffn(dataclasses.replace(hw, cpu_matmul={"int4": slow / 2}))
    _, t3 = ffn(dataclasses.replace(hw, cpu_matmul={"int4": slow / 4}))
    assert r1.kernel_flops("int4") == slow and t1 > t0
    assert t3 - t2 == pytest.approx(2 * (t2 - t1), rel=1e-6)  # seconds in proportion to 1 / the rate


def test_probe_measures_the_quantized_kernels(monkeypatch):
    import torch

    from core.model.quant import experts
    from core.plan.hardware import CPU_MATMUL_PROBES

    small = experts.kernel_probe
    monkeypatch.setattr(experts, "kernel_probe", lambda name, rows: small(name, rows=rows, n=256, k=256))
    for name in ("int8", "int4", "int8@1", "int4@1"):
        assert CPU_MATMUL_PROBES[name](0.0) > 1e6  # FLOP/s of one timed call (a tiny one: call overhead rules)
    for name in ("int8", "int4"):
        run, flops = small(name, rows=4, n=64, k=128)
        assert run().shape == (4, 64) and run().dtype == torch.bfloat16 and flops == 2 * 4 * 64 * 128


def test_one_row_rate_decides_batch_one_and_calibrated_costs_defer_to_it():
    """At one token the kernel's cost is expanding every weight (its one-row rate, "int4@1"); a machine with
    calibrated CPU costs (measured on its dtype's matmuls) still takes quantized experts from the kernels."""
    import dataclasses

    from core.plan.cpu_cost import CpuCosts

    m = quantized_spec(resolve_spec("mixtral-8x7b"), Format("int4", 64))
    base = hrm.effective_rates(preset("t4"))
    kw = dict(batch=1, micro_batch=1, expert_batch=1, attention_on="cpu", ffn_on="cpu", gpu_weight_fraction=0.0,
              gpu_kv_fraction=0.0, context=100)
    slow = 1e-3 * base.cpu_flops  # far below any bandwidth bound: the kernel decides
    costs = CpuCosts("bfloat16", flop_s=1e-12, weight_s=1e-12, expert_weight_s=1e-12, task_s=1e-5)
    for c in (base.cpu_costs, costs):
        t = [hrm.decode_tasks(m, dataclasses.replace(base, cpu_costs=c, cpu_kernel_flops=(("int4", 1e15), ("int4@1", x))),
                              **kw)["ffn"].seconds for x in (slow, slow / 2)]
        # halving the one-row rate adds one more pass over the two touched experts' weights, 2 FLOP each
        extra = m.top_k * 2 * 3 * m.hidden_size * m.expert_intermediate / slow
        assert t[1] - t[0] == pytest.approx(extra, rel=1e-3), c


def test_int8_experts_with_many_rows_are_priced_as_the_engine_runs_them():
    """The engine expands an int8 expert that more than KERNEL_ROWS tokens chose and multiplies it in the
    compute dtype (core.model.quant.experts); the HRM prices that — expansion bytes written and read, the
    matmul at the CPU's rate — not the int8 kernel, whose rate then no longer matters. int4 always runs
    its kernel. With the uncalibrated and calibrated CPU costs."""
    import dataclasses

    from core.model.quant.formats import KERNEL_ROWS
    from core.plan.cpu_cost import CpuCosts

    base = hrm.effective_rates(preset("t4"))
    costs = CpuCosts("bfloat16", flop_s=1e-12, weight_s=1e-12, expert_weight_s=1e-12, task_s=1e-5)
    kw = dict(attention_on="cpu", ffn_on="cpu", gpu_weight_fraction=0.0, gpu_kv_fraction=0.0, context=100)
    for fmt in (Format("int8"), Format("int4", 64)):
        m = quantized_spec(resolve_spec("mixtral-8x7b"), fmt)
        q = "int8" if fmt.name == "int8" else "int4"

        def ffn(batch, rate, c):
            r = dataclasses.replace(base, cpu_costs=c, cpu_kernel_flops=((q, rate), (f"{q}@1", rate)))
            return hrm.decode_tasks(m, r, batch=batch, micro_batch=batch, expert_batch=batch, **kw)["ffn"].seconds

        few, many = 4, 32 * m.num_experts // m.top_k  # ≈ 1 and 32 rows an expert
        assert few * m.top_k / m.num_experts <= KERNEL_ROWS < many * m.top_k / m.num_experts
        for c in (base.cpu_costs, costs):
            assert ffn(few, 1e9, c) > 1.5 * ffn(few, 2e9, c)  # the kernel's rate decides
            if fmt.name == "int8":
                assert ffn(many, 1e9, c) == ffn(many, 2e9, c)  # expanded: the kernel plays no part
                expand = hrm.roofline_seconds(hrm.moe_ffn(m, many, expand=True), base.cpu_flops, base.cpu_bw)
                assert ffn(many, 1e9, c) >= expand
            else:
                assert ffn(many, 1e9, c) > 1.5 * ffn(many, 2e9, c)


@pytest.mark.parametrize("int4_speed,warned", [(0.7, True), (1.8, False)])
def test_an_asked_format_slower_than_the_unquantized_plan_says_so(monkeypatch, int4_speed, warned):
    """int4 at batch 64 in CPU mode runs ≈ 0.7x bf16 (bench/quant_cpu.py): where bf16 fits too, the plan's
    why says the format buys memory there, not speed (auto never picks it then: bf16 fits)."""
    import types

    m, hw = resolve_spec("mixtral-8x7b"), preset("t4")

    def plan(spec, *a, **k):
        return "policy", types.SimpleNamespace(tokens_per_s=100.0 * (int4_speed if spec.expert_format != "none" else 1))

    monkeypatch.setattr(planner, "plan", plan)
    c = choose(m, hw, WORK, planner.Budget.for_hardware(hw), "int4")
    assert c.quantize == "int4" and c.speedup == pytest.approx(int4_speed)
    assert ("predicted faster at this batch (0.70x)" in c.why) == warned, c.why
    assert choose(m, hw, WORK, planner.Budget.for_hardware(hw), "auto").quantize == "none"
