"""Which format the experts run in: `--quantize none | int8 | int4 | auto`, planned, with the reason.

`auto` takes the least lossy format whose plan fits the memory budget (bf16/the checkpoint's dtype,
then int8, then int4) and says why the more faithful ones were passed over: it never trades accuracy
for speed, so where bf16 fits it runs bf16 even at batch 1 (where int4 is faster on a CPU), and it
picks int4 only when nothing less lossy fits (even at large batches, where int4 is slower on a CPU
than bf16 would be: bf16 is then not an option). An explicit int8/int4 whose plan is slower than the
unquantized one that also fits says so. Every choice also plans
the unquantized model on the same budget, so the speed-up a format buys is a prediction the user sees
(or the statement that the unquantized model does not fit at all). A checkpoint that arrives
quantized (GGUF, MXFP4) runs as it is: `auto` keeps it, int8/int4 are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.errors import BudgetError, UsageError
from core.model.quant.formats import QUANTIZE_CHOICES, parse_choice, quantized_spec
from core.model.spec import ModelSpec
from core.plan import planner
from core.plan.hardware import HardwareSpec
from core.plan.policy import Policy, Prediction

ORDER = ("none", "int8", "int4")  # least lossy first


@dataclass(frozen=True)
class FormatChoice:
    quantize: str  # none | int8 | int4 (what Engine.load takes)
    spec: ModelSpec  # the model with its experts in that format
    policy: Policy
    prediction: Prediction
    why: str
    baseline: Prediction | None = None  # the unquantized model's plan on the same budget, if it fits
    tried: dict[str, str] = field(default_factory=dict)  # format -> what its plan said

    @property
    def speedup(self) -> float | None:
        if self.baseline is None or self.quantize == "none":
            return None
        return self.prediction.tokens_per_s / self.baseline.tokens_per_s

    def to_dict(self) -> dict:
        return {"quantize": self.quantize, "format": self.spec.expert_format, "bits_per_weight": self.spec.expert_bits
                or 8 * self.spec.dtype_bytes, "why": self.why, "tried": self.tried,
                "baseline_tokens_per_s": self.baseline.tokens_per_s if self.baseline else None,
                "speedup": self.speedup}


def _name(spec: ModelSpec, q: str, group_size: int | None = None) -> str:
    return spec.dtype if q == "none" else quantized_spec(spec, parse_choice(q, group_size)).expert_format


def choose(model: ModelSpec, hw: HardwareSpec, workload: planner.Workload, budget: planner.Budget,
           quantize: str = "auto", group_size: int | None = None, ranks: int | None = None) -> FormatChoice:
    """Plan `model` in the asked format (or, for auto, the least lossy that fits). Raises BudgetError when
    the asked format (or, for auto, even int4) does not fit."""
    if quantize not in QUANTIZE_CHOICES:
        raise UsageError(f"unknown --quantize {quantize!r}", f"use one of {', '.join(QUANTIZE_CHOICES)}")
    if model.expert_format != "none":
        if quantize in ("int8", "int4"):
            raise UsageError(f"this model's experts are already quantized ({model.expert_format})",
                             "leave out --quantize (or use auto) to run it as it is")
        policy, pred = planner.plan(model, hw, workload, budget, ranks=ranks)
        return FormatChoice("none", model, policy, pred, f"the checkpoint's own {model.expert_format} experts")
    tried: dict[str, str] = {}
    plans: dict[str, tuple] = {}
    errors: dict[str, BudgetError] = {}
    for q in (ORDER if quantize == "auto" else tuple(dict.fromkeys(("none", quantize)))):
        spec = quantized_spec(model, parse_choice(q, group_size))
        try:
            plans[q] = (spec, *planner.plan(spec, hw, workload, budget, ranks=ranks))
            tried[q] = f"fits: {plans[q][2].tokens_per_s:,.1f} tokens/s predicted"
        except BudgetError as e:
            errors[q] = e
            tried[q] = f"does not fit: {e.problem}"
        if quantize == "auto" and q in plans:
            break
    want = next(iter(plans), None) if quantize == "auto" else quantize
    if want is None or want not in plans:
        raise errors[quantize if quantize != "auto" else "int4"]
    spec, policy, pred = plans[want]
    base = plans["none"][2] if "none" in plans else None
    if quantize != "auto":
        why = f"asked for {_name(model, want, group_size)}"
        if base is not None and want != "none" and pred.tokens_per_s < base.tokens_per_s:
            # e.g. int4 at batch 64 on a CPU: the weight-only kernels lose to the bf16 matmul there
            why += (f"; {model.dtype} fits too and is predicted faster at this batch "
                    f"({pred.tokens_per_s / base.tokens_per_s:.2f}x): the format saves memory here, not time")
    elif want == "none":
        why = f"{model.dtype} fits the budget: no quantization needed"
    else:
        passed = [q for q in ORDER[:ORDER.index(want)]]
        why = (f"{' and '.join(_name(model, q, group_size) for q in passed)} {'do' if len(passed) > 1 else 'does'} "
               f"not fit the budget; {_name(model, want, group_size)} is the least lossy format that does")
    return FormatChoice(want, spec, policy, pred, why, base, tried)
