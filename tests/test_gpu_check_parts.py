"""bench/gpu_check.py's parts that only a GPU run reaches whole, checked here on their own: the plan of a real run
fits one nine-minute run, the memory cap is reset however a stage ends, variants a batch cannot hold are listed
with the reason, an op's host cost is taken only from a launch-bound run, and the PCIe bound is the streamed
bytes over the link."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import gpu_check as gc_  # noqa: E402

from core.plan.hardware import preset  # noqa: E402
from core.plan.planner import Workload, predict  # noqa: E402
from core.plan.policy import Policy  # noqa: E402
from core.plan.presets import preset_spec  # noqa: E402

MIXTRAL = preset_spec("mixtral-8x7b")


def test_the_real_run_fits_nine_minutes_in_the_order_that_feeds_later_stages():
    stages = gc_.parse_args([]).stages
    assert stages == ["smoke", "pcie", "host", "offload", "many-experts", "baseline", "parity"]
    assert sum(sec for _, sec in gc_.real_run_plan(stages)) <= gc_.DEADLINE < gc_.RUN_LIMIT <= 540
    assert gc_.parse_args(["--stages", "parity,smoke"]).stages == ["smoke", "parity"]  # reordered
    assert "multi" not in stages and gc_.STALL_S == 90


def test_a_smoke_run_cut_short_compares_the_tokens_it_made():
    want = {0: [5, 6, 7], 1: [8, 9, 10]}
    assert gc_.agree({0: [5, 6], 1: [8]}, want, cut_short=True)
    assert not gc_.agree({0: [5, 6], 1: [8]}, want, cut_short=False)  # a whole run must give them all
    assert not gc_.agree({0: [5, 7], 1: [8]}, want, cut_short=True)  # a wrong token is wrong however short
    assert not gc_.agree({2: [5]}, want, cut_short=True)
    assert gc_.agree(dict(want), want, cut_short=False)


def test_the_memory_fraction_is_reset_when_a_stage_fails(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f: calls.append(f))
    c = types.SimpleNamespace(dry=False)
    with pytest.raises(RuntimeError):
        with gc_.capped(c, int(16e9)):
            raise RuntimeError("out of memory in a variant")
    assert calls == [pytest.approx(0.2), 1.0]


def test_variants_a_batch_cannot_hold_are_listed_with_the_reason():
    hw, w = preset("t4"), Workload(77, 16, 418, 128)
    policy = Policy(108, 36, 36, "cpu", "gpu", 0.05, 0.0, 2)  # the H200 run's next plan: N = 108, μ = 36
    runs, not_run = gc_.variants(MIXTRAL, int(16e9), w, policy, predict(policy, MIXTRAL, hw, w), hw)
    assert [(x["variant"], x["why"]) for x in not_run] == [("mu=144", "μ = 144 is over N = 108"),
                                                           ("mu=576", "μ = 576 is over N = 108")]
    assert [(n, s) for n, s, _, _ in runs] == [("planner", "cgopipe"), ("at the policy above", "s4"),
                                               ("at the policy above", "s3")]
    policy = Policy(120, 12, 12, "cpu", "gpu", 0.0, 0.0, 2)
    _, not_run = gc_.variants(MIXTRAL, int(16e9), w, policy, predict(policy, MIXTRAL, hw, w), hw)
    assert not_run == [{"variant": "mu=48", "why": "μ = 48 does not divide N = 120"},
                       {"variant": "mu=192", "why": "μ = 192 is over N = 120"}]


def test_an_ops_host_cost_comes_only_from_a_launch_bound_run():
    pred = types.SimpleNamespace(layer_seconds={"gpu": 0.008})
    run = {"launches_per_layer_step": 2600, "waits_per_layer_step": 56, "layer_seconds": {"gpu": 0.0762}}
    assert gc_.op_seconds_from_run(run, pred) == pytest.approx(0.0762 / 2656)  # the H200 run: ≈ 29 µs
    assert gc_.op_seconds_from_run({**run, "layer_seconds": {"gpu": 0.012}}, pred) is None  # the GPU's own work
    assert gc_.op_seconds_from_run({"error": "OOM"}, pred) is None


def test_the_pcie_bound_streams_every_layers_non_resident_experts():
    policy = Policy(128, 4, 4, "cpu", "gpu", 0.25, 0.0, 32)
    streamed = 0.75 * 32 * 8 * 3 * 4096 * 14336 * 2  # bytes a step: 3/4 of every layer's bf16 experts
    assert gc_.pcie_bound(MIXTRAL, policy, 55e9) == pytest.approx(128 / (streamed / 55e9), rel=1e-6)
    assert gc_.pcie_bound(MIXTRAL, Policy(128, 4, 4, "cpu", "gpu", 1.0, 0.0, 1), 55e9) == float("inf")
