"""A measured CPU-only run, folded back into this machine's calibration history (core.plan.cpu_history).

`RunSums` is an event sink: per step it adds up a few of the engine's own figures (the busy seconds the
executor already measured, by resource; prompt and output tokens as requests finish) — no clock of its
own, nothing kept per step. At the end of the run, `fold_back` sets them beside what the planner predicts
for the same workload and batch with this machine's current factors, at the speed its CPU runs at as the run ends
(core.plan.cpu_speed): compute (pre-attention, post-attention,
experts) and attention per decode step and layer, prefill per prompt token. Their ratios times the current
factors are the run's factors, one history entry; the stored factors become the median over the history.

Only runs the calibration describes are folded: CPU-only, unquantized, one process (not tensor parallel),
a model this machine was calibrated on, enough decode steps to mean something.
"""

from __future__ import annotations

import dataclasses

from core.telemetry import EventSink, RequestDone, StepDone, ignore

MIN_DECODE_STEPS = 8  # fewer: a run too short to say anything about the machine's speed


class RunSums:
    """An EventSink that keeps the sums fold_back needs, and forwards every event to `forward`."""

    def __init__(self, forward: EventSink = ignore):
        self.forward = forward
        self.decode_steps = 0
        self.compute = self.attention = 0.0  # decode busy seconds: CPU compute, CPU attention
        self.prefill = 0.0  # prefill busy seconds
        self.prefill_tokens = 0
        self.active = 0  # most requests in flight in a step: the batch the run ran at
        self.requests = self.prompt_tokens = self.output_tokens = self.longest_prompt = 0

    def __call__(self, e) -> None:
        if isinstance(e, StepDone):
            busy = e.busy
            if e.kind == "decode":
                self.decode_steps += 1
                self.compute += busy.get("gpu", 0.0)
                self.attention += busy.get("cpu_attn", 0.0)
                if e.active > self.active:
                    self.active = e.active
            else:
                self.prefill += busy.get("gpu", 0.0)
                self.prefill_tokens += e.tokens
        elif isinstance(e, RequestDone):
            self.requests += 1
            self.prompt_tokens += e.prompt_tokens
            self.output_tokens += e.output_tokens
            if e.prompt_tokens > self.longest_prompt:
                self.longest_prompt = e.prompt_tokens
        self.forward(e)


def cpu_policy(batch: int, micro_batch: int, expert_group: int = 1, pages: int = 1):
    """The CPU-only planner Policy of a run at `batch` / `micro_batch` (as `mlight bench` predicts it)."""
    from core.plan.policy import Policy

    mu = max(1, min(micro_batch, batch))
    n = max(mu, batch // mu * mu)
    return Policy(batch_size=n, micro_batch_size=mu, expert_batch_size=mu * max(1, expert_group),
                  attention_on="cpu", ffn_on="cpu", gpu_weight_fraction=0.0, pages_per_layer=pages)


def foldable(engine) -> bool:
    """A run the CPU calibration describes: CPU-only, unquantized, one process."""
    from core.plan import hrm

    c = getattr(engine, "config", None)
    if c is None or getattr(engine, "tp", None) is not None:
        return False
    d = hrm.dims(engine.spec)
    return (getattr(c, "device", "") == "cpu" and getattr(c, "ffn_on", "") == "cpu"
            and getattr(c, "attention_on", "cpu") == "cpu" and d.qkind == "none" and d.dense_qkind == "none")


def fold_back(engine, meter: RunSums, micro_batch: int, hw=None) -> dict | None:
    """Fold the run `meter` watched into this machine's history; the summary (cpu_history.summary, with the
    run's `ratios` to the prediction) or None when the run is not one to fold (see the module's doc) or the
    folding failed: it runs after a finished run's results are saved, and bookkeeping for the next
    prediction must never turn that run into a failed one."""
    try:
        return _fold_back(engine, meter, micro_batch, hw)
    except Exception:  # noqa: BLE001 - a cache that cannot be written or read, a model the planner refuses, ...
        return None


def _fold_back(engine, meter: RunSums, micro_batch: int, hw) -> dict | None:
    from core.plan import cpu_history, hrm
    from core.plan.hardware import cached_probe, with_speed
    from core.plan.planner import Workload, predict

    if meter.decode_steps < MIN_DECODE_STEPS or not meter.requests or not foldable(engine):
        return None
    hw = hw if hw is not None else cached_probe()
    if hw is not None and not hw.cpu_speed:  # the run's factors against its pieces at the speed the CPU runs at now
        hw = with_speed(hw)
    d = hrm.dims(engine.spec)
    known = cpu_history.stored(hw, d, engine.cpu.math) if hw is not None else None
    if known is None:  # never calibrated on this model: nothing to be relative to
        return None
    costs, _ = known
    prompt = max(1, round(meter.prompt_tokens / meter.requests))
    work = Workload(prompt_len=prompt, gen_len=max(1, round(meter.output_tokens / meter.requests)),
                    max_prompt_len=max(prompt, meter.longest_prompt), num_requests=meter.requests)
    policy = cpu_policy(meter.active or micro_batch, micro_batch, getattr(engine.config, "expert_group", 1))
    hw = dataclasses.replace(hw, cpu_costs={**hw.cpu_costs, costs.math: {costs.model: costs.to_dict()}})
    p = predict(policy, engine.spec, hw, work)
    # the run's sums against the prediction's for the same run, every wave's steps (a smaller last wave's cost
    # less a step: against a full wave's, a run at 204 of 256 requests read its compute 0.90 and its attention
    # 0.72 of predicted where its full waves' tasks ran 1.0-1.2 of it), a step and a prompt token each
    ratios = {}
    steps = max(1, p.decode_steps)
    for key, got in (("compute", meter.compute), ("attention", meter.attention)):
        want = p.decode_busy.get("gpu" if key == "compute" else "cpu_attn", 0.0) / steps
        if want > 0 and got > 0:
            ratios[key] = got / meter.decode_steps / want
    pre = p.prefill_busy.get("gpu", 0.0) / max(1.0, p.prompt_tokens)
    if pre > 0 and meter.prefill > 0 and meter.prefill_tokens:
        ratios["prefill"] = meter.prefill / meter.prefill_tokens / pre
    kind = {"pre_eff": "compute", "post_eff": "compute", "ffn_eff": "compute", "attn_eff": "attention",
            "prefill_eff": "prefill"}
    names = costs.nearest(policy.micro_batch_size)  # the factors of the calibration's micro-batch nearest the run's
    kind = {names[n]: k for n, k in kind.items()}
    factors = {n: getattr(costs, n) * ratios[k] for n, k in kind.items() if k in ratios}
    if not factors:
        return None
    new = cpu_history.entry(d, costs, factors, "run", batch=(policy.batch_size, policy.micro_batch_size))
    _, summary = cpu_history.record(hw, d, costs, [new])
    return {**summary, "ratios": ratios}
