"""The probe's CPU side: per-dtype matmul rates, the instruction set, `mlight hw` showing them, the
planner costing the CPU at the rate of the dtype that will actually run, and `mlight bench` on a
machine without a GPU never talking about one."""

from __future__ import annotations

import json
import pytest

from app.cli import main
from core.plan import hardware, hrm
from core.plan.hardware import HardwareSpec
from test_plan_cli import no_gpu  # noqa: F401 - the fixture: no NVML, an isolated cache dir


REAL_MEASURE = hardware._measure  # the no_gpu fixture stubs it
AVX2_BOX = {"cpu_flops": 1.1e11, "cpu_bw": 3e10, "cpu_isa": "avx2", "cpu_isa_hw": "avx512_bf16",
            "cpu_isa_limits": ["ONEDNN_MAX_CPU_ISA=AVX2"], "cpu_threads": 2,
            "cpu_matmul": {"float32": 1.1e11, "bfloat16": 9e9, "float16": 8e9}}


def test_probe_records_isa_and_per_dtype_rates_and_caches_them(no_gpu, monkeypatch):
    monkeypatch.setattr(hardware, "_measure", lambda hw, s: AVX2_BOX)
    hw = hardware.probe()
    assert (hw.cpu_isa, hw.cpu_isa_hw, hw.cpu_isa_limits, hw.cpu_threads) == ("avx2", "avx512_bf16",
                                                                               ("ONEDNN_MAX_CPU_ISA=AVX2",), 2)
    assert hw.cpu_rate("bfloat16") == 9e9 and hw.cpu_rate("int8") is None
    assert hw.cpu_math("bfloat16")[0] == "float32" and hw.cpu_math("float32")[0] == "float32"
    assert HardwareSpec.from_json(hw.to_json()) == hw
    assert hardware.cached_cpu_rates() == AVX2_BOX["cpu_matmul"]
    monkeypatch.setattr(hardware, "_measure", lambda hw, s: pytest.fail("the cache should answer"))
    again = hardware.probe()
    assert (again.cpu_matmul, again.cpu_isa, again.cpu_isa_limits) == (hw.cpu_matmul, hw.cpu_isa, hw.cpu_isa_limits)


def test_the_cache_is_per_isa_limit(no_gpu, monkeypatch):
    base = hardware.detect()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = hardware.probe_cache_path(base)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert hardware.probe_cache_path(base) != plain


def test_real_probe_measures_every_dtype_quickly(no_gpu):
    rates = REAL_MEASURE(hardware.detect(), seconds=0.01)
    assert set(rates["cpu_matmul"]) >= {"float32", "bfloat16"} and all(v > 1e7 for v in rates["cpu_matmul"].values())
    assert rates["cpu_isa"] and rates["cpu_threads"] >= 1
    assert rates["cpu_flops"] > 1e8 and rates["cpu_bw"] > 1e8  # the read buffer sized for this machine's cache


def test_the_bandwidth_probe_reads_past_the_last_level_cache(no_gpu, monkeypatch):
    """A 64 MiB buffer sat in a Xeon VM's 480 MB L3 and read 36-48 GB/s where memory gives 29 (256 MiB and 1 GiB:
    29-30, steady); desktop CPUs with stacked cache have 96-128 MB of it."""
    import torch

    MiB, GiB = 2**20, 2**30
    assert hardware.bandwidth_probe_bytes(llc=480 * MiB, available=24 * GiB) == 960 * MiB
    assert hardware.bandwidth_probe_bytes(llc=96 * MiB, available=24 * GiB) == 256 * MiB
    assert hardware.bandwidth_probe_bytes(llc=0, available=24 * GiB) == 256 * MiB  # the OS did not say
    assert hardware.bandwidth_probe_bytes(llc=480 * MiB, available=2 * GiB) == 256 * MiB  # an eighth of what is free
    assert hardware.bandwidth_probe_bytes(llc=480 * MiB, available=256 * MiB) == 64 * MiB
    made, ones = [], torch.ones
    monkeypatch.setattr(torch, "ones", lambda *a, **k: made.append(a) or ones(*a, **k))
    monkeypatch.setattr(hardware, "bandwidth_probe_bytes", lambda: 96 * MiB)
    assert REAL_MEASURE(hardware.detect(), seconds=0.01)["cpu_bw"] > 1e9
    assert (96 * MiB // 4,) in made


def test_hw_shows_the_isa_rates_and_the_compute_choice(no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(hardware, "_measure", lambda hw, s: AVX2_BOX)
    assert main(["hw"]) == 0
    out = capsys.readouterr().out
    assert "ISA      AVX2 (CPU has AVX-512 BF16; limited by ONEDNN_MAX_CPU_ISA=AVX2)" in out
    assert "float32 110, bfloat16 9, float16 8 GFLOP/s (measured, 2 threads)" in out
    assert "bf16 weights compute in float32: AVX2 (CPU has AVX-512 BF16; limited by ONEDNN_MAX_CPU_ISA=AVX2) has " \
           "no native bfloat16 matmul" in out
    from core.model.cpu import native, panel_linear, row_ops

    assert f"decode attention: {native.status()}" in out  # the fused C kernel, or why torch ops run
    assert f"norm, RoPE, cache write: {row_ops.status()}" in out
    assert "bf16 projections: torch's fp32 GEMMs (MKL on x86) over weights widened at load" in out  # fp32 math here
    assert panel_linear.status("float32") in out
    assert main(["hw", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cpu_matmul"]["bfloat16"] == 9e9 and data["cpu_isa"] == "avx2"


def _box(isa: str, bf16: float) -> HardwareSpec:
    base = hardware.preset("t4")
    return hardware._apply(base, {**AVX2_BOX, "cpu_isa": isa, "cpu_matmul": {"float32": 1e11, "bfloat16": bf16}})


def test_the_planner_costs_the_cpu_at_the_rate_of_the_dtype_that_runs():
    fast, slow = _box("avx512_bf16", 5e11), _box("avx2", 1e10)
    assert hrm.effective_rates(fast, "bfloat16").cpu_flops == 5e11
    assert hrm.effective_rates(slow, "bfloat16").cpu_flops == 1e11  # widened to fp32: the fp32 rate
    assert hrm.effective_rates(fast, "float32").cpu_flops == 1e11
    assert hrm.effective_rates(fast).cpu_flops == fast.cpu_flops  # no dtype: the fp32 figure, as before


def test_plan_says_which_dtype_the_cpu_computes_in(no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(hardware, "_measure", lambda hw, s: AVX2_BOX)
    assert main(["plan", "--model", "mixtral-8x7b", "--prompt-len", "77", "--gen-len", "16", "--cpu-mem", "200"]) == 0
    out = capsys.readouterr().out
    assert "CPU math          float32 for bfloat16 weights at 110 GFLOP/s (measured)" in out


def test_bench_on_a_cpu_only_machine_never_says_gpu(no_gpu, monkeypatch, capsys, demo_model):
    monkeypatch.setattr(hardware, "_measure", lambda hw, s: AVX2_BOX)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["bench", "--model", str(demo_model), "--requests", "3", "--gen-len", "3", "--batch", "2",
                 "--micro-batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "CPU-only chain" in out and "CPU compute ms/layer" in out
    assert "gpu" not in out.lower().replace("ms/layer", "") and "h2d" not in out and "MB" not in out


def test_a_probe_on_a_busy_machine_reads_what_a_quiet_one_does():
    """Other processes on every core take most of the wall clock; the probe times its matmuls by the lesser
    of the wall clock and this process's CPU seconds, so its rate stays near the quiet one (before: a
    loaded 2-core box read 75 GFLOP/s where a quiet one read 380). One thread, a few hogs per core."""
    import os
    import subprocess
    import sys

    import torch

    if not hardware._CPU_CLOCK:
        pytest.skip("this platform's process clock is too coarse to time a probe's runs")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    hogs = []
    try:
        quiet = hardware._matmul_rate("float32")(0.3)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 1))]
        busy = hardware._matmul_rate("float32")(0.3)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        torch.set_num_threads(before)
    assert busy > 0.6 * quiet, f"{busy / 1e9:.1f} GFLOP/s busy vs {quiet / 1e9:.1f} quiet"
