"""This machine's CPU-only runs, measured beside predicted, in its calibration file; a run outside its band
widens the stored band to its error (docs/CONTRACTS.md, Planner).
"""

from __future__ import annotations

import dataclasses
import time

from core.plan import cpu_cost

RUNS_MAX = 40  # runs kept per machine


def runs(hw, model: str | None = None) -> list[dict]:
    """Oldest first; `model`: a model_key."""
    return [r for r in cpu_cost.read(hw).get("runs") or [] if isinstance(r, dict) and model in (None, r.get("model"))]


def record(hw, costs, *, predicted: float, measured: float, batch=()) -> dict:
    """Keep one run of `costs`' model and widen its band when the run fell outside it; the summary after."""
    error = measured / predicted - 1 if predicted > 0 else 0.0
    entry = {"time": time.time(), "model": costs.model, "math": costs.math, "batch": list(batch),
             "predicted": predicted, "measured": measured, "error": error}
    kept = (runs(hw) + [entry])[-RUNS_MAX:]
    if abs(error) > costs.band:
        costs = dataclasses.replace(costs, band=abs(error))
    cpu_cost.save(hw, costs, runs=kept)
    return {**summary([r for r in kept if r["model"] == costs.model]), "band": costs.band, "error": error,
            "ratios": {"decode": measured / predicted if predicted > 0 else 0.0}}


def summary(entries: list[dict]) -> dict:
    errors = [r["error"] for r in entries]
    return {"entries": len(entries), "runs": len(entries), "errors": errors[-5:],
            "spread": [min(errors), max(errors)] if errors else []}


def behind(hw, spec) -> dict:
    from core.plan import hrm

    return summary(runs(hw, cpu_cost.model_key(hrm.dims(spec))))


def spread_words(h: dict) -> str:
    if not h.get("spread"):
        return ""
    (lo, hi), n = h["spread"], h["runs"]
    return f"{n} run{'s' if n != 1 else ''} here read {lo:+.0%} to {hi:+.0%} of predicted"
