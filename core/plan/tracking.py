"""Predicted next to measured, as a run goes: the core side of "a prediction shown to a user is a promise".

`Tracker(prediction)` is fed the engine's StepDone events (any sink can forward them) and answers
`comparison()` at any time: measured tokens/s end to end and in decode beside the planner's, each
resource's busy time per decode layer beside the HRM's, the relative error, and `parted` once enough
steps were seen and measured and predicted decode rates part by more than `warn_at` (25 % by default,
what the app warns at). `mlight bench` prints the same comparison at the end of a run.

Boundary: plain arithmetic over events; no clock of its own (the events carry their seconds), no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.telemetry import RESOURCES, RequestDone, StepDone

WARN_AT = 0.25  # relative error past which measured and predicted are said to part
MIN_DECODE_STEPS = 5  # decode steps before a rate is worth comparing


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
    def message(self) -> str:
        """One line for a status bar: "measured 512 tok/s vs 498 predicted (+3 %)"."""
        if self.error is None:
            return f"predicted {self.predicted_decode_tokens_per_s:,.0f} tok/s in decode; measuring…"
        text = (f"decode: measured {self.measured_decode_tokens_per_s:,.0f} tok/s vs "
                f"{self.predicted_decode_tokens_per_s:,.0f} predicted ({self.error:+.0%})")
        return text + (" — the prediction is off: run `mlight bench --calibrate`" if self.parted else "")


class Tracker:
    def __init__(self, prediction, num_layers: int, warn_at: float = WARN_AT):
        self.prediction, self.layers, self.warn_at = prediction, num_layers, warn_at
        self.seconds = 0.0
        self.finished = 0  # requests done: each also had a first token from its prefill
        self.decode_tokens, self.decode_seconds, self.decode_steps = 0, 0.0, 0
        self.busy = {r: 0.0 for r in RESOURCES}

    def __call__(self, event) -> None:
        """An EventSink: pass it (or forward events to it) from `Engine.generate(on_event=...)`."""
        if isinstance(event, RequestDone):
            self.finished += 1
        if not isinstance(event, StepDone):
            return
        self.seconds += event.seconds
        if event.kind == "prefill":
            return
        self.decode_tokens += event.tokens
        self.decode_seconds += event.seconds
        self.decode_steps += 1
        for r in RESOURCES:
            self.busy[r] += event.busy.get(r, 0.0)

    def comparison(self) -> Comparison:
        p = self.prediction
        dec = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
        e2e = (self.decode_tokens + self.finished) / self.seconds if self.seconds else 0.0
        error = dec / p.decode_tokens_per_s - 1 if self.decode_steps >= MIN_DECODE_STEPS and p.decode_tokens_per_s else None
        steps = max(1, self.decode_steps) * self.layers
        layer = {r: (p.layer_seconds.get(r, 0.0), self.busy[r] / steps) for r in RESOURCES}
        return Comparison(p.tokens_per_s, e2e, p.decode_tokens_per_s, dec, self.decode_steps, error,
                          error is not None and abs(error) > self.warn_at, layer)
