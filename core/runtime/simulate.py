"""A task graph replayed with HRM task costs; every dependency and same-resource predecessor comes earlier in the
list, so one pass in list order is exact."""

from __future__ import annotations

from dataclasses import dataclass

from core.plan import hrm
from core.runtime import schedule
from core.plan.hardware import HardwareSpec
from core.plan.policy import Policy
from core.runtime.schedule import Task
from core.model.spec import ModelSpec
from core.telemetry import RESOURCES, Busy


@dataclass(frozen=True)
class Span:
    task: Task
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    spans: tuple[Span, ...]
    makespan: float  # seconds from the first start to the last end
    busy: dict[str, float]  # resource -> seconds busy

    @property
    def utilization(self) -> dict[str, float]:
        return {k: (v / self.makespan if self.makespan else 0.0) for k, v in self.busy.items()}

    @property
    def idle(self) -> dict[str, float]:
        return {k: self.makespan - v for k, v in self.busy.items()}


def replay(tasks: list[Task], seconds: dict[str, float], host: dict[str, float] | None = None) -> Timeline:
    """`host[kind]`: launches, in list order."""
    free = {r: 0.0 for r in RESOURCES}
    busy = Busy.fromkeys(RESOURCES, 0.0)
    end: list[float] = []
    spans, launched = [], 0.0
    for t in tasks:
        launched += host.get(t.kind, 0.0) if host else 0.0
        start = max([free[t.resource], launched, *(end[d] for d in t.deps)])
        dur = seconds.get(t.kind, 0.0)
        end.append(start + dur)
        free[t.resource] = start + dur
        busy[t.resource] += dur
        spans.append(Span(t, start, start + dur))
    return Timeline(tuple(spans), max(end, default=0.0), busy)


def simulate_decode(model: ModelSpec, hardware: HardwareSpec, policy: Policy, context: float,
                    schedule_name: str = "cgopipe") -> Timeline:
    """One decode step at an average `context` (cached tokens)."""
    tasks = schedule.for_policy(policy, model.num_layers, schedule_name)
    r = hrm.effective_rates(hardware)  # the FFN's host ops on its expert path, as the planner prices them
    host = hrm.host_task_seconds(r, hrm.ffn_ops(model, r, policy.expert_batch_size)) if policy.ffn_on == "gpu" else None
    costs = hrm.decode_tasks(model, hrm.effective_rates(hardware, model.dtype, model), batch=policy.batch_size,
                             micro_batch=policy.micro_batch_size, expert_batch=policy.expert_batch_size,
                             attention_on=policy.attention_on, ffn_on=policy.ffn_on, context=context,
                             gpu_weight_fraction=policy.gpu_weight_fraction, gpu_kv_fraction=policy.gpu_kv_fraction,
                             pages=policy.pages_per_layer)
    return replay(tasks, {k: c.seconds for k, c in costs.items()}, host)
