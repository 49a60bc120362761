"""This machine's measured runs, kept: the calibrated efficiency factors as the median over many of them.

One calibration measures its own minute. On a 2-core Zen 5 VM the same workload ran 101.5-138.8 tokens/s
in fresh processes (the 784M Mixtral; slow stretches of 10-70 s slow every task kind at once), so a
calibration in a slow minute predicted every later run that much slow. Here every calibration window and
every measured CPU-only run (`mlight run`, `mlight bench`) adds an entry to a bounded history kept in the
calibration file beside the costs (core.plan.cpu_cost: per machine, dropped with the code's fingerprint),
and the factors the planner uses (CpuCosts.*_eff, step_s, wave_s) are the median over it: one slow minute
moves them little, and each run makes the next prediction better.

An entry holds absolute seconds, not factors: for each task kind, what a fixed reference task of that kind
(`reference`) took at the machine's speed in that window or run — its factor times the reference's cost
under the coefficients it was measured against. Factors from calibrations whose GEMM pieces were timed in
different minutes then compare: a later calibration's coefficients turn the median seconds back into its
own factors (`apply`).

Boundary: pure functions over (Dims, CpuCosts, entries), and the cache file through cpu_cost.read/write.
"""

from __future__ import annotations

import dataclasses
import time
from statistics import median

from core.plan import cpu_cost
from core.plan.cpu_cost import CpuCosts

HISTORY_MAX = 40  # entries kept per (math dtype, model): about eight calibrations' windows, or their runs
DECODE_EFF = {"pre_attn": "pre_eff", "cpu_attn": "attn_eff", "post_attn": "post_eff", "ffn": "ffn_eff"}
# the reference tasks: a decode micro-batch of 4 (its expert batch too) at 128 cached tokens in rows of 256,
# a prefill micro-batch of 4 prompts of 77 tokens (only a scale: any fixed shapes would do)
REF_DECODE = dict(micro_batch=4, expert_batch=4, context=128, row_tokens=256, longest=160)
REF_PREFILL = (4, 77)


def reference(d, c: CpuCosts) -> dict[str, float]:
    """Seconds the coefficients of `c` (its factors taken as 1) give the reference task of each kind, by factor name
    (a mid or large micro-batch's factor, *_eff_mid, *_eff_large, on the same scale as its kind's)."""
    c = c.unscaled()
    t = cpu_cost.decode_tasks(d, c.for_step(REF_DECODE["micro_batch"] * REF_DECODE["longest"] * d.kv_tok), **REF_DECODE)
    out = {eff: t[kind] for kind, eff in DECODE_EFF.items()}
    n, length = REF_PREFILL
    out["prefill_eff"] = cpu_cost.prefill_seconds(d, c.for_step(n * length * d.kv_tok), n, length)
    # the same scale for the mid and large micro-batches' factors
    return {**out, **{cpu_cost.LARGE[k]: v for k, v in out.items()}, **{cpu_cost.MID[k]: v for k, v in out.items()}}


def entry(d, base: CpuCosts, factors: dict[str, float], source: str, *, step_s: float | None = None,
          wave_s: float | None = None, batch=(), when: float | None = None) -> dict:
    """A history entry: `factors` (by factor name; those absent were not measured) measured against the
    coefficients of `base`, as the reference tasks' seconds; `source`: "calibration" or "run"."""
    ref = reference(d, base)
    e = {"time": time.time() if when is None else when, "source": source, "batch": list(batch),
         "seconds": {n: f * ref[n] for n, f in factors.items() if n in ref and f > 0 and ref[n] > 0}}
    if step_s is not None:
        e["step_s"] = step_s
    if wave_s is not None:
        e["wave_s"] = wave_s
    return e


def apply(d, base: CpuCosts, entries: list[dict]) -> CpuCosts:
    """`base`'s coefficients with each factor, step_s and wave_s the median over `entries` (what they do not
    measure stays `base`'s); run_windows says how many entries that is."""
    if not entries:
        return base
    ref = reference(d, base)
    got = {}
    for n in cpu_cost.FACTORS:
        xs = [e["seconds"][n] for e in entries if n in e.get("seconds", {})]
        if xs and ref[n] > 0:
            got[n] = median(xs) / ref[n]
    for n in ("step_s", "wave_s"):
        xs = [e[n] for e in entries if e.get(n) is not None]
        if xs:
            got[n] = median(xs)
    return dataclasses.replace(base, **got, run_windows=len(entries))


def speeds(entries: list[dict]) -> list[float]:
    """Each entry's decode speed, as the inverse of its reference step (the four decode kinds' seconds):
    what moves when the machine does. Entries that miss a kind are left out."""
    out = []
    for e in entries:
        s = e.get("seconds", {})
        if all(n in s for n in DECODE_EFF.values()):
            out.append(1.0 / sum(s[n] for n in DECODE_EFF.values()))
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = q * (len(xs) - 1)
    lo = int(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def summary(entries: list[dict]) -> dict:
    """How many calibration windows and runs back the factors, and how this machine's speed spread over them:
    `low` / `high` the 10th / 90th percentile of their decode speeds against the median (−0.08: 8 % slower),
    `spread` the larger of the two in size (0 with fewer than three entries: no spread to speak of)."""
    v = speeds(entries)
    out = {"entries": len(entries), "calibration_windows": sum(e.get("source") == "calibration" for e in entries),
           "runs": sum(e.get("source") == "run" for e in entries), "low": 0.0, "high": 0.0, "spread": 0.0}
    if len(v) >= 3:
        mid = median(v)
        out.update(low=_quantile(v, 0.1) / mid - 1, high=_quantile(v, 0.9) / mid - 1)
        out["spread"] = max(-out["low"], out["high"])
    if entries:
        out["since"] = min(e.get("time", 0.0) for e in entries)
    return out


def spread_words(s: dict) -> str:
    """"this machine's runs spread ±8 % (12 calibration windows, 5 runs)", or "" without a history."""
    if not s or not s.get("entries"):
        return ""
    back = f"{s['calibration_windows']} calibration window{'s' if s['calibration_windows'] != 1 else ''}, " \
           f"{s['runs']} run{'s' if s['runs'] != 1 else ''}"
    if s["entries"] < 3:
        return f"from {back}: too few to say how this machine's speed spreads"
    return f"this machine's runs spread ±{s['spread']:.0%} ({back})"


# ---- kept per machine, in the calibration file ----------------------------------------------------------
def load(hw, math: str, model: str) -> list[dict]:
    """The history of `model` (a cpu_cost.model_key) in `math` on this machine, oldest first."""
    try:
        got = cpu_cost.read(hw).get("history", {}).get(math, {}).get(model, [])
        return [e for e in got if isinstance(e, dict) and isinstance(e.get("seconds"), dict)]
    except AttributeError:
        return []


def record(hw, d, base: CpuCosts, new: list[dict], *, keep: int = HISTORY_MAX,
           calibration: CpuCosts | None = None) -> tuple[CpuCosts, dict]:
    """Add `new` entries to the history of `base`'s model and math, keep the newest `keep`, and store `base`'s
    coefficients with the factors over the whole history (`apply`); `calibration`, a calibration's own
    costs (its windows alone), is kept beside them (`last_calibration`). Returns the stored costs and the
    `summary`. Two processes recording at once: the last to write wins (one's entries are lost, nothing is
    damaged)."""
    data = cpu_cost.read(hw)
    history = data.get("history") if isinstance(data.get("history"), dict) else {}
    kept = (load(hw, base.math, base.model) + list(new))[-keep:]
    history.setdefault(base.math, {})[base.model] = kept
    costs = apply(d, base, kept)
    known = cpu_cost.load(hw)
    known.setdefault(costs.math, {})[costs.model] = costs.to_dict()
    alone = data.get("last_calibration") if isinstance(data.get("last_calibration"), dict) else {}
    if calibration is not None:
        alone.setdefault(calibration.math, {})[calibration.model] = calibration.to_dict()
    cpu_cost.write(hw, {**data, "cpu": known, "history": history, "last_calibration": alone})
    return costs, summary(kept)


def last_calibration(hw, math: str, model: str) -> CpuCosts | None:
    """The last calibration's own costs (its windows' median, before the history), when kept."""
    try:
        return CpuCosts.from_dict(cpu_cost.read(hw)["last_calibration"][math][model])
    except (KeyError, TypeError, AttributeError):
        return None


def stored(hw, d, math: str) -> tuple[CpuCosts, list[dict]] | None:
    """This model's calibrated costs in `math` and their history, when this machine was calibrated on it."""
    per = cpu_cost.load(hw).get(math, {})
    key = cpu_cost.model_key(d)
    if key not in per:
        return None
    return CpuCosts.from_dict(per[key]), load(hw, math, key)


def behind(hw, model) -> dict:
    """The `summary` of the history behind a CPU-only prediction for `model` (a ModelSpec) on `hw`: that of the
    calibration the planner picks (this model's, else the nearest one's); {} when there is none."""
    from core.plan import hrm

    c = hrm.effective_rates(hw, model.dtype, model).cpu_costs
    if c is None or not c.measured:
        return {}
    entries = load(hw, c.math, c.model)
    return summary(entries) if entries else {}
