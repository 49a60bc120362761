"""A measured CPU-only run recorded beside its prediction (core.plan.cpu_history); nothing is refitted, so the same
plan is made tomorrow."""

from __future__ import annotations

from core.plan import cpu_cost, cpu_history, hrm
from core.plan.hardware import cached_probe
from core.plan.planner import Workload, predict
from core.plan.policy import Policy
from core.plan.tracking import MIN_DECODE_STEPS, RunSums  # noqa: F401  (RunSums: the sink callers pass a run)


def cpu_policy(batch: int, micro_batch: int, expert_group: int = 1, pages: int = 1):
    """The CPU-only planner Policy of a run (as `mlight bench` predicts it)."""
    mu = max(1, min(micro_batch, batch))
    n = max(mu, batch // mu * mu)
    return Policy(batch_size=n, micro_batch_size=mu, expert_batch_size=mu * max(1, expert_group),
                  attention_on="cpu", ffn_on="cpu", gpu_weight_fraction=0.0, pages_per_layer=pages)


def foldable(engine) -> bool:
    """A run the CPU calibration describes: CPU-only, unquantized, one process."""
    c, d = getattr(engine, "config", None), hrm.dims(engine.spec)
    return (c is not None and getattr(engine, "tp", None) is None and getattr(c, "device", "") == "cpu"
            and getattr(c, "ffn_on", "") == "cpu" and getattr(c, "attention_on", "cpu") == "cpu"
            and d.qkind == "none" and d.dense_qkind == "none")


def fold_back(engine, meter: RunSums, micro_batch: int, hw=None) -> dict | None:
    """cpu_history.record's summary, or None (bookkeeping after a run's results are saved must never fail it)."""
    try:
        if meter.decode_steps < MIN_DECODE_STEPS or not meter.requests or not meter.decode_seconds \
                or not foldable(engine):
            return None
        hw = hw if hw is not None else cached_probe()
        costs = hrm.effective_rates(hw, engine.spec.dtype, engine.spec).cpu_costs if hw is not None else None
        if costs is None or not costs.measured or costs.model != cpu_cost.model_key(hrm.dims(engine.spec)):
            return None  # never calibrated on this model: nothing to hold the prediction to
        prompt = max(1, round(meter.prompt_tokens / meter.requests))
        work = Workload(prompt_len=prompt, gen_len=max(1, round(meter.output_tokens / meter.requests)),
                        max_prompt_len=max(prompt, meter.longest_prompt), num_requests=meter.requests)
        policy = cpu_policy(meter.active or micro_batch, micro_batch, getattr(engine.config, "expert_group", 1))
        return cpu_history.record(hw, costs, predicted=predict(policy, engine.spec, hw, work).decode_tokens_per_s,
                                  measured=meter.decode_tokens / meter.decode_seconds,
                                  batch=(policy.batch_size, policy.micro_batch_size))
    except Exception:  # noqa: BLE001 - a cache that cannot be written or read, a model the planner refuses, ...
        return None
