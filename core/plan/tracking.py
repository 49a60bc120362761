"""Predicted next to measured, as a run goes: `RunSums` sums a run's step events; `Tracker` also compares them
with the planner's figures. Plain arithmetic over events: no clock of its own, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.telemetry import RESOURCES, Busy, EventSink, RequestDone, StepDone, ignore

WARN_AT = 0.25  # relative error past which measured and predicted are said to part
MIN_DECODE_STEPS = 8  # decode steps before a run's rate is worth comparing or recording


class RunSums:
    def __init__(self, forward: EventSink = ignore):
        self.forward, self.seconds = forward, 0.0  # every step's seconds
        self.decode_steps, self.decode_tokens, self.decode_seconds = 0, 0, 0.0
        self.busy = {r: 0.0 for r in RESOURCES}  # decode busy seconds by resource
        self.prefill, self.prefill_tokens = 0.0, 0  # prefill busy seconds (the CPU's compute) and tokens
        self.active = 0  # most requests in flight in a step: the batch the run ran at
        self.requests = self.prompt_tokens = self.output_tokens = self.longest_prompt = 0

    def __call__(self, e) -> None:
        if isinstance(e, StepDone):
            self.seconds += e.seconds
            if e.kind == "decode":
                self.decode_steps += 1
                self.decode_tokens += e.tokens
                self.decode_seconds += e.seconds
                for r in RESOURCES:
                    self.busy[r] += e.busy.get(r, 0.0)
                self.active = max(self.active, e.active)
            else:
                self.prefill += e.busy.get("compute", 0.0)
                self.prefill_tokens += e.tokens
        elif isinstance(e, RequestDone):
            self.requests += 1
            self.prompt_tokens += e.prompt_tokens
            self.output_tokens += e.output_tokens
            self.longest_prompt = max(self.longest_prompt, e.prompt_tokens)
        self.forward(e)


@dataclass(frozen=True)
class Comparison:
    predicted_tokens_per_s: float  # end to end, the planner's
    measured_tokens_per_s: float  # end to end so far: (decode tokens + finished requests' first tokens) / step seconds
    predicted_decode_tokens_per_s: float
    measured_decode_tokens_per_s: float
    decode_steps: int
    error: float | None  # measured decode rate / predicted − 1; None until MIN_DECODE_STEPS
    parted: bool  # |error| > warn_at
    layer_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)  # resource -> (predicted, measured)

    @property
    def message(self) -> str:  # one line for a status bar: "measured 512 tok/s vs 498 predicted (+3 %)"
        if self.error is None:
            return f"predicted {self.predicted_decode_tokens_per_s:,.0f} tok/s in decode; measuring…"
        text = (f"decode: measured {self.measured_decode_tokens_per_s:,.0f} tok/s vs "
                f"{self.predicted_decode_tokens_per_s:,.0f} predicted ({self.error:+.0%})")
        return text + (" — the prediction is off: run `mlight bench --calibrate`" if self.parted else "")


class Tracker(RunSums):
    def __init__(self, prediction, num_layers: int, forward: EventSink = ignore):
        super().__init__(forward)
        self.prediction, self.layers = prediction, num_layers
        self.warn_at = prediction.band or WARN_AT

    def comparison(self) -> Comparison:
        p = self.prediction
        dec = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
        e2e = (self.decode_tokens + self.requests) / self.seconds if self.seconds else 0.0
        enough = self.decode_steps >= MIN_DECODE_STEPS and p.decode_tokens_per_s
        error = dec / p.decode_tokens_per_s - 1 if enough else None
        layer = Busy({r: (p.layer_seconds.get(r, 0.0), self.busy[r] / (max(1, self.decode_steps) * self.layers))
                      for r in RESOURCES})
        return Comparison(p.tokens_per_s, e2e, p.decode_tokens_per_s, dec, self.decode_steps, error,
                          error is not None and abs(error) > self.warn_at, layer)
