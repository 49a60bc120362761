"""The planner prices the host work the runtime does (issue 42, item 5): per task and per torch op, with the FFN's
ops on the expert path that runs it (constant in E on every path the runtime has), at a machine's own
measured costs where bench/gpu_check.py recorded them, and page-locking in a first run's prediction only."""

from __future__ import annotations

import dataclasses
import json

import pytest

from app.cli import main
from core.plan import hardware, hrm
from core.plan.hardware import preset
from core.plan.presets import preset_spec

MIXTRAL = preset_spec("mixtral-8x7b")
PLAN = ["plan", "--model", "mixtral-8x7b", "--prompt-len", "77", "--gen-len", "128", "--json"]


def _rates(gpu="h100", **kw):
    return dataclasses.replace(hrm.effective_rates(preset(gpu)), **kw)


def _with_experts(E: int) -> hrm.Dims:
    return dataclasses.replace(hrm.dims(MIXTRAL), E=E)


@pytest.mark.parametrize("tokens", [64, 2000])  # the fused path, then grouped_mm (an H100's bf16 experts)
def test_the_fused_and_grouped_ffn_issue_the_same_ops_whatever_the_experts(tokens):
    r = _rates()
    counts = {E: hrm.ffn_ops(_with_experts(E), r, tokens) for E in (8, 64, 128, 256)}
    assert len(set(counts.values())) == 1, counts


def test_the_path_is_the_runtimes_choice():
    """As core.model.fused_moe.expert_path: grouped_mm for bf16 experts on long calls from SM80, the fused path
    for decode-sized calls, quantized experts and a T4 (SM75: no grouped_mm)."""
    from core.model import fused_moe

    assert hrm.expert_path(MIXTRAL, _rates("h100"), 64) == "fused"
    assert hrm.expert_path(MIXTRAL, _rates("h100"), 2000) == "grouped"
    assert hrm.expert_path(MIXTRAL, _rates("t4"), 2000) == "fused"
    int4 = dataclasses.replace(hrm.dims(MIXTRAL), qkind="int4")
    assert hrm.expert_path(int4, _rates("h100"), 2000) == "fused"
    for quantized, T, grouped_mm in ((False, 64, True), (False, 2000, True), (False, 2000, False), (True, 2000, True)):
        d = dataclasses.replace(hrm.dims(MIXTRAL), qkind="int4" if quantized else "none")
        r = _rates("h100" if grouped_mm else "t4")
        assert hrm.expert_path(d, r, T) == fused_moe.expert_path(quantized, T, grouped_mm)


def test_the_host_bound_is_tasks_times_their_ops_at_the_machines_costs():
    """Hand sum over one layer's tasks: per task the executor's cost plus its ops (the FFN's on its path) at the
    per-op cost — the H200's where nothing was measured, the machine's own where gpu_check recorded one."""
    kw = dict(batch=256, micro_batch=32, expert_batch=64, attention_on="cpu", ffn_on="gpu", gpu_weight_fraction=0.2,
              gpu_kv_fraction=0.0, context=200, pages=8)
    for hw in (preset("t4"), dataclasses.replace(preset("t4"), host_task_seconds=30e-6, host_op_seconds=9e-6)):
        r = hrm.effective_rates(hw)
        task, op = (hw.host_task_seconds or 80e-6), (hw.host_op_seconds or 25e-6)
        assert (r.task_seconds, r.op_seconds) == (task, op) and r.host_measured == bool(hw.host_op_seconds)
        tasks = hrm.decode_tasks(MIXTRAL, r, **kw)
        ffn = hrm.ffn_ops(MIXTRAL, r, 64)
        want = sum(c.per_layer * (task + (ffn if kind == "ffn" else hrm.HOST_OPS[kind]) * op)
                   for kind, c in tasks.items())
        assert hrm.decode_layer_seconds(MIXTRAL, r, **kw)["host"] == pytest.approx(want, rel=1e-12)
    more = dataclasses.replace(MIXTRAL, num_experts=128)  # the fused path: the host's share does not grow with E
    r = _rates("t4")
    assert hrm.decode_layer_seconds(more, r, **kw)["host"] == hrm.decode_layer_seconds(MIXTRAL, r, **kw)["host"]


def test_gpu_checks_measured_costs_are_kept_for_the_machine(tmp_path, monkeypatch):
    """What gpu_check records (host seconds per task and op, page-locking rate) comes back with the probe's
    rates, and a probe measured again keeps it."""
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path))
    base = preset("t4")
    calls = []

    def measure(hw, seconds):
        calls.append(1)
        return {"cpu_flops": 1e12}

    assert hardware.probe(base, measure=measure).host_op_seconds is None
    hardware.record_gpu_costs(base, host_task_seconds=40e-6, host_op_seconds=12e-6)
    hardware.record_gpu_costs(base, pin_bw=3.5e9)  # a later stage adds; the earlier figures stay
    for hw in (hardware.probe(base, measure=measure), hardware.cached_probe(base),
               hardware.probe(base, refresh=True, measure=measure)):
        assert (hw.host_task_seconds, hw.host_op_seconds, hw.pin_bw) == (40e-6, 12e-6, 3.5e9)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="unknown GPU costs"):
        hardware.record_gpu_costs(base, op_seconds=1.0)


def test_the_plan_shows_the_host_share_and_a_first_runs_page_locking(capsys):
    """New keys beside the contract's (unchanged): the host's seconds and share of the layer, beside PCIe and
    compute; and a first run's tokens/s with the streamed weights page-locked first at 2 GB/s (the H200's)."""
    assert main(PLAN + ["--hardware", "t4"]) == 0
    data = json.loads(capsys.readouterr().out)
    pred, host, first = data["prediction"], data["host"], data["first_run"]
    ls = pred["layer_seconds"]
    assert host["layer_seconds"] == ls["host"] and host["pcie_seconds"] == ls["h2d"]
    assert host["compute_seconds"] == ls["gpu"] and host["share"] == pytest.approx(ls["host"] / max(ls.values()))
    assert host["expert_path"] == "fused" and not host["measured"] and host["op_seconds"] == 25e-6
    n = data["policy"]["batch_size"] * 128
    pin = pred["pinned_bytes"] / 2e9
    assert first["pin_seconds"] == pytest.approx(pin) and pred["pinned_bytes"] > 10e9
    assert first["tokens_per_s"] == pytest.approx(n / (n / pred["tokens_per_s"] + pin), rel=1e-9)
    assert main(PLAN[:-1] + ["--hardware", "t4"]) == 0
    out = capsys.readouterr().out
    assert "host share" in out and "beside PCIe" in out and "first run" in out and "page-locking" in out
