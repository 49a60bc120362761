"""mlight on Ray Data: one engine per actor, loaded once, planned for its machine unless given a policy (README)."""

from __future__ import annotations

import math
from typing import Any

REQUEST_COLUMNS = ("prompt", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
_INTS = ("max_new_tokens", "top_k", "seed")  # pandas makes an int column with gaps float


def _plain(v: Any) -> Any:
    """A pandas/numpy cell as plain Python (None for missing)."""
    if v is None or isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "tolist"):  # numpy scalars and arrays
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def plan_here(model: str, workload: dict, cpu_share: int = 1, gpu_mem_gb: float | None = None,
              cpu_mem_gb: float | None = None) -> dict:
    """The policy (a dict) for one of `cpu_share` engines sharing this machine: run it where the actors run."""
    import dataclasses

    from core.model.families import load_spec
    from core.plan import planner
    from core.plan.hardware import resolve

    hw = resolve("local")
    budget = planner.Budget.for_hardware(hw, gpu_mem_gb * max(1, hw.gpu_count) if gpu_mem_gb else None, cpu_mem_gb)
    budget = dataclasses.replace(budget, cpu_bytes=budget.cpu_bytes // max(1, cpu_share))
    policy, _ = planner.plan(load_spec(model), hw, planner.Workload(**workload), budget, ranks=1)
    return policy.to_dict()


class MlightPredictor:
    def __init__(self, model: str, *, policy: dict | None = None, workload: dict | None = None,
                 defaults: dict | None = None, threads: int | None = None, **engine_kwargs):
        import torch

        from core.plan.policy import Policy
        from core.runtime.engine import Engine

        if threads:
            torch.set_num_threads(threads)
        if policy is None and workload is not None:
            policy = plan_here(model, workload)
        self.policy = Policy.from_dict(policy) if policy else None
        self.defaults = dict(defaults or {})
        self.engine = Engine.load(model, policy=self.policy, **engine_kwargs)

    def requests(self, batch) -> list:
        from core.runtime.engine import Request

        out = []
        for i, row in enumerate(batch.to_dict("records")):
            row = {k: _plain(v) for k, v in row.items()}
            kw = {**self.defaults, **{k: row[k] for k in REQUEST_COLUMNS if row.get(k) is not None}}
            kw.update(id=str(row["id"] if row.get("id") is not None else i), stop=tuple(kw.get("stop") or ()))
            kw.update({k: int(kw[k]) for k in _INTS if kw.get(k) is not None})
            if kw.get("messages") is not None:
                kw.pop("prompt", None)
            out.append(Request(**kw))
        return out

    def __call__(self, batch):
        import pandas as pd

        reqs = self.requests(batch)
        done = {r.id: r.to_dict() for r in self.engine.generate(reqs)}
        return pd.DataFrame([done[r.id] for r in reqs])
