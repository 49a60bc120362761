"""The CPU's cost model (docs/CONTRACTS.md, Planner): a CPU-only task's seconds are its units of work (from
core.plan.hrm.Dims) times twelve fitted coefficients (`NAMES`). Boundary: pure functions plus the cache file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from core.model import limits
from core.plan.policy import JsonRecord

VERSION = 16  # 16: twelve fitted coefficients and a band (15 and before: pieces and run factors)
NAMES = ("flop_s", "weight_s", "expert_flop_s", "expert_weight_s", "expert_call_s", "kv_s", "elem_s", "sdpa_flop_s",
         "prefill_tok_s", "task_s", "step_s", "wave_s")
MIN_BAND = 0.05  # never narrower than this machine's run-to-run spread of one run
DEFAULT_BAND = 0.5  # a machine never calibrated: the probe's rates with typical overheads


@dataclass(frozen=True)
class CpuCosts(JsonRecord):
    math: str  # the CPU math dtype (kernel) these were measured with
    flop_s: float = 0.0  # dense GEMMs (QKV, O, router, shared expert, LM head): seconds per FLOP
    weight_s: float = 0.0  # ... per weight element a call reads (the small-M intercept of the roofline)
    expert_flop_s: float = 0.0  # the routed experts' kernel: per FLOP
    expert_weight_s: float = 0.0  # ... per weight element of each expert touched
    expert_call_s: float = 0.0  # ... per expert touched (its calls' dispatch, its rows gathered)
    kv_s: float = 0.0  # decode attention: per cached K or V element read (its per-request work: elem_s)
    elem_s: float = 0.0  # elementwise work (norms, RoPE, SwiGLU, gathers, sampling): per activation element
    sdpa_flop_s: float = 0.0  # prefill attention: per FLOP
    prefill_tok_s: float = 0.0  # a prefill task: per token (routing's sort and scatter over the whole call)
    task_s: float = 0.0  # every task of the step graph (Python, dispatch, small ops)
    step_s: float = 0.0  # every engine step (embedding, sampling set-up, bookkeeping)
    wave_s: float = 0.0  # every prefill step beyond step_s: admitting a wave (its runner and cache made)
    band: float = DEFAULT_BAND  # a prediction's relative half-width: the fit's residuals, widened by runs outside it
    threads: int = 0  # torch threads when measured
    model: str = ""  # model_key() of the model the costs were measured on
    model_bytes: int = 0  # its weights, for picking the nearest calibration for another model
    measured: bool = True  # False: `defaults`, the model of a machine never calibrated
    coefficients = property(lambda self: [getattr(self, n) for n in NAMES])

    @classmethod
    def from_dict(cls, d: dict) -> "CpuCosts":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def vec(units: dict) -> list[float]:
    return [float(units.get(n, 0.0)) for n in NAMES]


def seconds(c: CpuCosts, units: list[float]) -> float:
    return sum(a * b for a, b in zip(c.coefficients, units))


# ---- the units of each task (Counter: units add up) --------------------------------------------------
def _gemm(rows: float, n: float, k: float) -> Counter:
    return Counter(flop_s=2 * rows * n * k, weight_s=n * k)


def pre_units(d, t: float) -> Counter:
    qkv = d.q + 2 * d.kv
    return _gemm(t, qkv, d.D) + Counter(elem_s=t * (3 * d.D + 3 * qkv))


def post_units(d, t: float) -> Counter:
    width = d.moe_frac * d.Is + (1 - d.moe_frac) * d.Id
    return (_gemm(t, d.D, d.q) + _gemm(t, d.E, d.D) + _gemm(t, 3 * width, d.D)
            + Counter(elem_s=t * (5 * d.D + 3 * d.E + (3 * width + 2 * d.D if width else 0))))


def ffn_units(d, t: float) -> Counter:
    from core.plan.hrm import expected_experts

    per, e = 3 * d.I * d.D, expected_experts(t, d.E, d.k)  # weight elements of one expert; experts touched
    return Counter(expert_flop_s=d.moe_frac * 2 * t * d.k * per, expert_weight_s=d.moe_frac * e * per,
                   expert_call_s=d.moe_frac * e, elem_s=d.moe_frac * t * d.k * (3 * d.D + 3 * d.I))


def head_units(d, tokens: float) -> Counter:
    return _gemm(tokens, d.V, d.D) + Counter(elem_s=tokens * (4 * d.D + 2 * d.V))


def prefill_units(d, prompts: float, prompt_len: float, prompt_sq: float | None = None) -> Counter:
    """One layer of a prefill call, a chunk at a time (each reads the experts again); `prompt_sq`: mean square."""
    t, sq = prompts * prompt_len, prompt_sq if prompt_sq is not None else prompt_len * prompt_len
    chunk = limits.prefill_chunk(d.D, d.q, d.kv, d.I, d.Is, d.Id, d.E, d.k)  # tokens a CPU prefill runs at a time
    whole, rest = int(t // chunk), t % chunk
    ffn = Counter({k: v * whole for k, v in ffn_units(d, chunk).items()}) + (ffn_units(d, rest) if rest else Counter())
    return pre_units(d, t) + post_units(d, t) + ffn + Counter(
        sdpa_flop_s=4 * prompts * (sq + prompt_len) / 2 * d.heads * d.head_dim, prefill_tok_s=t, task_s=1.0)


def decode_units(d, micro_batch: float, expert_batch: float, tokens: float) -> dict[str, Counter]:
    """`tokens`: cached tokens its attention reads."""
    one = Counter(task_s=1.0)
    return {"pre_attn": pre_units(d, micro_batch) + one,
            "cpu_attn": Counter(kv_s=tokens * 2 * d.kv, elem_s=micro_batch * 2 * d.kv) + one,
            "post_attn": post_units(d, micro_batch) + one, "ffn": ffn_units(d, expert_batch) + one}


def decode_tasks(d, c: CpuCosts, *, micro_batch: float, expert_batch: float, context: float,
                 lengths: list[int] | None = None) -> dict[str, float]:
    """Seconds of one task of each kind; `lengths`: the requests' own (attention reads each one's cache in place)."""
    tokens = sum(lengths) if lengths else micro_batch * context
    return {k: seconds(c, vec(u)) for k, u in decode_units(d, micro_batch, expert_batch, tokens).items()}


def prefill_seconds(d, c: CpuCosts, prompts: float, prompt_len: float, prompt_sq: float | None = None) -> float:
    return seconds(c, vec(prefill_units(d, prompts, prompt_len, prompt_sq)))


def head_seconds(d, c: CpuCosts, tokens: float) -> float:
    return seconds(c, vec(head_units(d, tokens) + Counter(step_s=1.0)))


def nnls(a: list[list[float]], b: list[float], iters: int = 200) -> list[float]:
    """x ≥ 0 minimising |a·x − b| (Lawson and Hanson's active set), in float64 through torch."""
    import torch

    A, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)  # [rows, n], [rows]
    n = A.shape[1]
    x = torch.zeros(n, dtype=torch.float64)
    free = torch.zeros(n, dtype=torch.bool)  # the passive set: coefficients allowed to move
    tol = 1e-12 * float(A.abs().max() * y.abs().max() + 1)
    for _ in range(iters):
        w = A.T @ (y - A @ x)  # the gradient: a bound coefficient worth freeing points up
        w[free] = -math.inf
        j = int(w.argmax())
        if w[j] <= tol:
            break
        free[j] = True
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            z[free] = torch.linalg.lstsq(A[:, free], y[:, None]).solution[:, 0]
            if (z[free] > 0).all():
                x = z
                break
            neg = free & (z <= 0)  # step back to the boundary and drop what reached it
            x = x + float((x[neg] / (x[neg] - z[neg])).min()) * (z - x)
            free &= x > 1e-12  # the columns are scaled to one: the solution is of order one
            x[~free] = 0.0
    return x.tolist()


def fit(rows: list[tuple[list[float], float]]) -> list[float]:
    """NNLS on relative errors, columns scaled near one."""
    rows = [(u, s) for u, s in rows if s > 0]
    cols = [max(1e-30, max(abs(u[i]) / s for u, s in rows)) for i in range(len(NAMES))]
    x = nnls([[u[i] / s / cols[i] for i in range(len(NAMES))] for u, s in rows], [1.0] * len(rows))
    return [v / c for v, c in zip(x, cols)]


def band_of(errors: list[float]) -> float:
    return max([MIN_BAND] + [abs(e) for e in errors])


# Before any calibration: shares of the probe's rates and the engine's per-call costs (CPU-bound: they do not
# shrink with cores), as calibrations on two Zen 5 threads found them; narrower experts are widened tile by tile.
DEFAULT_READ, DEFAULT_KV_READ, DEFAULT_SDPA, DEFAULT_PACKED_READ, DEFAULT_WIDEN_READ = 0.45, 0.5, 0.5, 0.7, 0.2
# per GEMM call (a prepacked weight dispatches through Python); float32 weights run as torch ops an expert at a
# time, each also paying its rows' gather, SwiGLU and scatter; narrower ones widened by the C kernel in one call
DEFAULT_CALL = {"torch": 55e-6, "widened": 2.2e-6, "packed": 18e-6}
DEFAULT_ELEM, DEFAULT_TASK, DEFAULT_STEP = 1.0e-9, 100e-6, 1.2e-3


def defaults(math: str, flops: float, bw: float, width: int, threads: int = 0, block_bytes: float = 0.0) -> CpuCosts:
    """A machine never calibrated: from the probe's `flops` (matmuls in `math`) and read bandwidth `bw`; `width`:
    bytes a weight and a cached K/V element. `block_bytes`: GGUF experts' bytes a weight, read where they lie."""
    packed = math == "bfloat16"  # bf16 math is chosen only where it is native, and then oneDNN prepacks
    widened = math == "float32" and width < 4
    read = width / ((DEFAULT_WIDEN_READ if widened else DEFAULT_READ) * bw)
    expert_read = width / ((DEFAULT_PACKED_READ if packed else DEFAULT_WIDEN_READ if widened else DEFAULT_READ) * bw)
    call = DEFAULT_CALL["packed" if packed else "widened" if widened else "torch"]
    if block_bytes:  # in a C call, at packed bf16's share (Zen 5, calibrated: Q8_0, Q4_K_M 1.04-1.15x as fast)
        expert_read, call = block_bytes / (DEFAULT_PACKED_READ * bw), DEFAULT_CALL["widened"]
    return CpuCosts(math=math, flop_s=1 / flops, weight_s=read, expert_flop_s=1 / flops, expert_weight_s=expert_read,
                    expert_call_s=2 * call,
                    kv_s=width / (DEFAULT_KV_READ * bw), elem_s=DEFAULT_ELEM, sdpa_flop_s=1 / (DEFAULT_SDPA * flops),
                    task_s=DEFAULT_TASK, step_s=DEFAULT_STEP, threads=threads, measured=False)


# ---- the cache: one file per machine, torch build and kernels' code -----------------------------------
def model_key(d) -> str:
    return f"L{d.layers}-D{d.D}-q{d.q}-kv{d.kv}-E{d.E}x{d.I}-k{d.k}-s{d.Is}-V{d.V}-b{d.dt}"


def pick(entries: dict, d=None) -> CpuCosts | None:
    """From {model_key: costs dict}, the costs measured on this model, else on the model nearest in size."""
    if not entries:
        return None
    if d is not None and model_key(d) in entries:
        return CpuCosts.from_dict(entries[model_key(d)])
    size = d.total_bytes if d is not None else 0
    best = min(entries.values(), key=lambda c: abs(math.log(max(c.get("model_bytes") or 1, 1) / max(size, 1))))
    return CpuCosts.from_dict(best)


# A calibration also depends on the CPU kernels' code and torch: either changed, the file is another one.
FINGERPRINT_MODULES = ("core.model.moe", "core.model.attention", "core.model.expert_choice")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of the kernels' sources (found without importing them: no torch here), torch's and mlight's versions."""
    from importlib import metadata
    from importlib.util import find_spec

    from core.assets import HERE

    h = hashlib.sha256(str(VERSION).encode())
    for dist in ("torch", "mlight"):
        try:
            h.update(f"{dist}={metadata.version(dist)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=?;".encode())
    files = sorted((HERE / "kernels").glob("*.c"))
    files += sorted(Path(next(iter(find_spec("core.model.cpu").submodule_search_locations))).glob("*.py"))
    for f in files + [Path(find_spec(m).origin) for m in FINGERPRINT_MODULES]:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def cache_path(hw) -> Path:
    from core.plan.hardware import machine_key
    from core.platform import cache_dir

    return cache_dir() / "calibration" / f"v{VERSION}-{machine_key(hw)}-{code_fingerprint()}.json"


def read(hw) -> dict:
    try:
        raw = json.loads(cache_path(hw).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def load(hw) -> dict[str, dict[str, dict]]:
    """This machine's calibrations: {math dtype: {model_key: costs dict}} ({} when never calibrated)."""
    try:
        return {m: {k: CpuCosts.from_dict(v).to_dict() for k, v in per.items()} for m, per in read(hw)["cpu"].items()}
    except (KeyError, TypeError, AttributeError):
        return {}


def save(hw, costs: CpuCosts, runs: list | None = None) -> Path:
    """Add (or replace) `costs` keeping every other entry; `runs` (core.plan.cpu_history): unchanged when None."""
    from core.plan.hardware import _write_json

    data, known = read(hw), load(hw)
    known.setdefault(costs.math, {})[costs.model] = costs.to_dict()
    _write_json(cache_path(hw), {**data, "cpu": known, **({"runs": runs} if runs is not None else {})})
    return cache_path(hw)
