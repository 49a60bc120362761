"""`--quantize none | int8 | int4 | auto`: the experts' format, planned, with the reason. `auto` takes the least
lossy format that fits and never trades accuracy for speed; every choice also plans the unquantized model, for
the speed-up. Quantized checkpoints (GGUF, MXFP4) run as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.errors import BudgetError, UsageError
from core.model.quant.dense_spec import with_dense
from core.model.quant.formats import QUANTIZE_CHOICES, parse_choice, quantized_spec
from core.model.spec import ModelSpec
from core.plan import planner
from core.plan.hardware import HardwareSpec
from core.plan.policy import Policy, Prediction

# (experts, dense weights; those only CPU-only) by mean KL against bf16: 0, 0.020, 0.091, 0.305, 0.333, 0.851
LADDER = (("none", None), ("int8", None), ("int8", "int8"), ("int4", None), ("int4", "int8"), ("int4", "int4"))


@dataclass(frozen=True)
class FormatChoice:
    quantize: str  # none | int8 | int4 (what Engine.load takes)
    spec: ModelSpec  # the model with its experts in that format
    policy: Policy
    prediction: Prediction
    why: str
    baseline: Prediction | None = None  # the unquantized model's plan on the same budget, if it fits
    tried: dict[str, str] = field(default_factory=dict)  # format -> what its plan said
    dense: str | None = None  # --quantize-dense: int8 | int4, or None (the dense weights in the checkpoint's dtype)

    @property
    def speedup(self) -> float | None:
        if self.baseline is None or self.quantize == "none":
            return None
        return self.prediction.tokens_per_s / self.baseline.tokens_per_s

    def to_dict(self) -> dict:
        return {"quantize": self.quantize, "format": self.spec.expert_format, "bits_per_weight": self.spec.expert_bits
                or 8 * self.spec.dtype_bytes, "why": self.why, "tried": self.tried,
                "baseline_tokens_per_s": self.baseline.tokens_per_s if self.baseline else None,
                "speedup": self.speedup, "dense_format": self.spec.dense_format if self.dense else None}


def _name(spec: ModelSpec, q: str, group_size: int | None = None, dense: str | None = None) -> str:
    if q == "none":
        return spec.dtype
    name = quantized_spec(spec, parse_choice(q, group_size)).expert_format
    return f"{name} with {parse_choice(dense, group_size).label} dense weights" if dense else name


def spec_in_format(model: ModelSpec, q: str, dense: str | None, group_size: int | None) -> ModelSpec:
    spec = quantized_spec(model, parse_choice(q, group_size))
    return with_dense(spec, parse_choice(dense, group_size)) if dense and q != "none" else spec


def choose(model: ModelSpec, hw: HardwareSpec, workload: planner.Workload, budget: planner.Budget,
           quantize: str = "auto", group_size: int | None = None, ranks: int | None = None,
           dense: str | bool | None = None) -> FormatChoice:
    """Plan `model` in the asked format (auto: the least lossy that fits); `dense`: the dense weights too, CPU-only
    (None: auto may pick them without a GPU). BudgetError where nothing asked fits."""
    if quantize not in QUANTIZE_CHOICES:
        raise UsageError(f"unknown --quantize {quantize!r}", f"use one of {', '.join(QUANTIZE_CHOICES)}")
    if dense and quantize == "none":
        raise UsageError("--quantize-dense needs a format", "pass --quantize int8 or --quantize int4 with it")
    if model.expert_format != "none":
        if quantize in ("int8", "int4"):
            raise UsageError(f"this model's experts are already quantized ({model.expert_format})",
                             "leave out --quantize (or use auto) to run it as it is")
        policy, pred = planner.plan(model, hw, workload, budget, ranks=ranks)
        return FormatChoice("none", model, policy, pred, f"the checkpoint's own {model.expert_format} experts")
    if quantize == "auto":
        rungs = [(q, d) for q, d in LADDER if d is None] if hw.has_gpu and not dense else list(LADDER)
        if dense:  # asked: every quantized rung with those dense weights
            rungs = [("none", None)] + [(q, q if dense is True else dense) for q in ("int8", "int4")]
    else:
        rungs = list(dict.fromkeys([("none", None), (quantize, (quantize if dense is True else dense) or None)]))
    tried: dict[str, str] = {}
    plans: dict[tuple, tuple] = {}
    errors: dict[tuple, BudgetError] = {}
    for rung in rungs:
        spec = spec_in_format(model, *rung, group_size)
        label = rung[0] if not rung[1] else f"{rung[0]}+dense-{rung[1]}"
        try:
            plans[rung] = (spec, *planner.plan(spec, hw, workload, budget, ranks=ranks))
            tried[label] = f"fits: {plans[rung][2].tokens_per_s:,.1f} tokens/s predicted"
        except BudgetError as e:
            errors[rung] = e
            tried[label] = f"does not fit: {e.problem}"
        if quantize == "auto" and rung in plans:
            break
    want = next(iter(plans), None) if quantize == "auto" else rungs[-1]
    if want is None or want not in plans:
        raise errors[rungs[-1]]
    spec, policy, pred = plans[want]
    base = plans[("none", None)][2] if ("none", None) in plans else None
    name = _name(model, *want[:1], group_size, want[1])
    if quantize != "auto":
        why = f"asked for {name}"
        if base is not None and want[0] != "none" and pred.tokens_per_s < base.tokens_per_s:
            # e.g. int4 at batch 64 on a CPU: the weight-only kernels lose to the bf16 matmul there
            why += (f"; {model.dtype} fits too and is predicted faster at this batch "
                    f"({pred.tokens_per_s / base.tokens_per_s:.2f}x): the format saves memory here, not time")
    elif want[0] == "none":
        why = f"{model.dtype} fits the budget: no quantization needed"
    else:
        passed = [_name(model, q, group_size, d) for q, d in rungs[:rungs.index(want)]]
        why = (f"{' and '.join(passed)} {'do' if len(passed) > 1 else 'does'} not fit the budget; {name} is the "
               "least lossy format that does")
    if want[1] and policy.ffn_on == "gpu":
        why += (f"; the plan runs the FFN on the GPU, where the dense weights stay in {model.dtype} "
                "(--quantize-dense applies to the CPU-only mode)")
    return FormatChoice(want[0], spec, policy, pred, why, base, tried, dense=want[1])
