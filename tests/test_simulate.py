"""Replaying task graphs with HRM costs: exact replay rules, CGOPipe vs S4/S3, agreement with the HRM."""

import dataclasses

import pytest

from core.plan import hrm

from core.runtime import schedule
from core.plan.hardware import preset
from core.plan.planner import Workload, plan, predict
from core.plan.policy import Policy
from core.plan.presets import preset_spec
from core.runtime.schedule import Task
from core.runtime.simulate import replay, simulate_decode
from core.telemetry import RESOURCES

MIXTRAL = preset_spec("mixtral-8x7b")
MTBENCH = Workload(77, 128)


def test_replay_follows_resource_order_and_dependencies():
    tasks = [
        Task(0, "pre_attn", "compute", 0, 0),
        Task(1, "d1", "d2h", 0, 0, deps=(0,)),
        Task(2, "cpu_attn", "cpu_attn", 0, 0, deps=(1,)),
        Task(3, "pre_attn", "compute", 0, 1),  # independent: runs right after task 0 on the GPU
        Task(4, "d2", "h2d", 0, 0, deps=(2,)),
        Task(5, "post_attn", "compute", 0, 0, deps=(4,)),
    ]
    cost = {"pre_attn": 1.0, "d1": 0.5, "cpu_attn": 2.0, "d2": 0.5, "post_attn": 1.0}
    tl = replay(tasks, cost)
    spans = {s.task.id: (s.start, s.end) for s in tl.spans}
    assert spans == {0: (0, 1), 1: (1, 1.5), 2: (1.5, 3.5), 3: (1, 2), 4: (3.5, 4), 5: (4, 5)}
    assert tl.makespan == 5 and tl.busy == {"compute": 3.0, "cpu_attn": 2.0, "h2d": 0.5, "d2h": 0.5}
    assert tl.utilization["compute"] == pytest.approx(0.6) and tl.idle["h2d"] == 4.5


@pytest.fixture(scope="module")
def t4_plan():
    return plan(MIXTRAL, preset("t4"), MTBENCH)


def test_cgopipe_leaves_the_link_less_idle_than_s4_and_s3(t4_plan):
    policy, _ = t4_plan
    tl = {s: simulate_decode(MIXTRAL, preset("t4"), policy, MTBENCH.decode_context, s) for s in schedule.SCHEDULES}
    # the same work on every schedule: same busy time per resource
    for r in RESOURCES:
        assert tl["cgopipe"].busy[r] == pytest.approx(tl["s3"].busy[r]) == pytest.approx(tl["s4"].busy[r])
    assert tl["cgopipe"].idle["h2d"] < tl["s4"].idle["h2d"] < tl["s3"].idle["h2d"] * 1.0001
    assert tl["cgopipe"].idle["h2d"] < 0.5 * tl["s3"].idle["h2d"]
    assert tl["cgopipe"].makespan < tl["s4"].makespan <= tl["s3"].makespan
    assert set(tl["cgopipe"].utilization) == set(RESOURCES)
    assert all(0 <= u <= 1 for u in tl["cgopipe"].utilization.values())


def test_s3_makespan_is_the_sum_of_all_work(t4_plan):
    policy, _ = t4_plan
    tl = simulate_decode(MIXTRAL, preset("t4"), policy, MTBENCH.decode_context, "s3")
    # (plus the rare moment the host's launch of a tiny task is later than the task before it ends)
    assert tl.makespan == pytest.approx(sum(tl.busy.values()), rel=1e-4)


def test_simulated_busy_time_is_the_hrms(t4_plan):
    policy, _ = t4_plan
    tl = simulate_decode(MIXTRAL, preset("t4"), policy, MTBENCH.decode_context)
    layer = hrm.decode_layer_seconds(
        MIXTRAL, hrm.effective_rates(preset("t4")), batch=policy.batch_size, micro_batch=policy.micro_batch_size,
        expert_batch=policy.expert_batch_size, attention_on="cpu", ffn_on="gpu",
        gpu_weight_fraction=policy.gpu_weight_fraction, gpu_kv_fraction=0.0, context=MTBENCH.decode_context,
        pages=policy.pages_per_layer)
    for r in RESOURCES:
        assert tl.busy[r] == pytest.approx(MIXTRAL.num_layers * layer[r], rel=1e-9)


@pytest.mark.parametrize("gpu", ["t4", "l4"])
def test_planned_step_time_matches_the_simulated_cgopipe_step(gpu):
    policy, pred = plan(MIXTRAL, preset(gpu), MTBENCH)
    tl = simulate_decode(MIXTRAL, preset(gpu), policy, MTBENCH.decode_context)
    head = pred.step_seconds - MIXTRAL.num_layers * max(pred.layer_seconds.values())
    assert tl.makespan + head == pytest.approx(pred.step_seconds, rel=0.03)


@pytest.mark.parametrize("mu,n,g", [(36, 64, 1), (36, 64, 4), (36, 64, 16), (36, 64, 64), (132, 16, 1),
                                    (292, 8, 2), (292, 8, 8), (4, 200, 200)])
def test_hrm_pipeline_bound_tracks_the_simulation(t4_plan, mu, n, g):
    base, _ = t4_plan
    policy = dataclasses.replace(base, batch_size=mu * n, micro_batch_size=mu, expert_batch_size=mu * g,
                                 pages_per_layer=n)
    pred = predict(policy, MIXTRAL, preset("t4"), MTBENCH)
    tl = simulate_decode(MIXTRAL, preset("t4"), policy, MTBENCH.decode_context)
    head = pred.step_seconds - MIXTRAL.num_layers * max(pred.layer_seconds.values())
    assert pred.step_seconds == pytest.approx(tl.makespan + head, rel=0.08)


def test_cpu_only_policy_simulates_as_a_chain():
    hw = dataclasses.replace(preset("t4"), gpu_name=None, gpu_count=0)
    p = Policy(batch_size=8, micro_batch_size=4, expert_batch_size=8, attention_on="cpu", ffn_on="cpu")
    tl = simulate_decode(preset_spec("olmoe-1b-7b"), hw, p, 100.0)
    assert tl.makespan == pytest.approx(sum(tl.busy.values())) and tl.busy["h2d"] == 0
