"""Which backend `experts` runs for each kind of input: moe.BACKENDS' rows, their conditions and their order."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from core.model import moe
from core.model.cpu.kernels import Widen
from test_moe import reference

T, E, k, D, I = 3, 4, 2, 16, 16  # 16 fp32 columns: grouped_mm's alignment holds


class Fused:
    """The fused C kernel's layout as `experts` sees it: a callable marked `fused_swiglu` (returning the reference)."""

    fused_swiglu = True

    def __init__(self, w13, w2):
        self.w13, self.w2 = w13, w2

    def __len__(self):
        return len(self.w13)

    def __call__(self, h, weights, idx, out=None):
        return reference(h, self.w13, self.w2, weights, idx).to(h.dtype)


class Quant:
    """QuantExperts' interface over plain weights; `kernel`: whether its C kernel runs (else None), here for up
    to two tokens."""

    def __init__(self, w13, w2, kernel: bool):
        self.w13, self.w2, self.kernel = w13, w2, kernel

    def __len__(self):
        return len(self.w13)

    def up(self, e, x):
        return F.linear(x, self.w13[e])

    def down(self, e, y):
        return F.linear(y, self.w2[e])

    def in_one_call(self, h, weights, idx):
        return reference(h, self.w13, self.w2, weights, idx).to(h.dtype) if self.kernel and len(h) <= 2 else None


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return h, w13, w2, torch.softmax(torch.randn(T, k, generator=g), -1), idx


def _cases():
    """name -> (h, weights, idx, experts' keyword arguments, the backend that must answer the call)."""
    h, w13, w2, weights, idx = _inputs()
    plain, bf16 = {"w13": w13, "w2": w2}, {"w13": w13.bfloat16(), "w2": w2.bfloat16()}
    fused, quant, declines = Fused(w13, w2), Quant(w13, w2, True), Quant(w13, w2, False)
    cases = {
        "fused": (T, {"packed": fused}, "fused"),
        "fused layout beside a quant": (1, {"packed": fused, "quant": quant}, "fused"),
        "quant, one token": (1, {"quant": quant}, "quant_in_one_call"),
        "quant, two tokens": (2, {"quant": quant}, "quant_in_one_call"),
        "quant, one token, kernel declines": (1, {"quant": declines}, "one_token"),
        "quant, one token, clamped activation": (1, {"quant": quant, "act": moe.clamped_swiglu(1.7, 7.0)}, "one_token"),
        "quant, batch": (T, {"quant": quant}, "loop"),
        "loop, one token": (1, {**plain, "grouped": False}, "one_token"),
        "loop, batch": (T, {**plain, "grouped": False}, "loop"),
        "widened beats grouped": (T, {**bf16, "grouped": True, "widen": Widen(torch.float32, direct_rows=0)}, "loop"),
        "widened, one token": (1, {**bf16, "grouped": True, "widen": Widen(torch.float32)}, "one_token"),
    }
    if moe.HAS_GROUPED_MM:
        cases["grouped, batch"] = (T, {**plain, "grouped": True}, "grouped")
        cases["grouped, one token"] = (1, {**plain, "grouped": True}, "grouped")  # grouped_mm has no batch-1 form
    if moe.can_pack(torch.bfloat16):
        packed = moe.pack_experts(w13.bfloat16(), w2.bfloat16())
        cases["packed, one token"] = (1, {"packed": packed, "h": h.bfloat16()}, "one_token")
        cases["packed, batch"] = (T, {"packed": packed, "h": h.bfloat16()}, "loop")
    return {name: (kw.pop("h", h)[:n], weights[:n], idx[:n], {"w13": None, "w2": None, **kw}, want)
            for name, (n, kw, want) in cases.items()}


def _ran(backends, h, weights, idx, kw) -> str:
    """The name of the row that answered this call under `backends`, or the error it ended in."""
    ran = []

    def recorded(name, run):
        def each(c):
            out = run(c)
            if out is not None:
                ran.append(name)
            return out
        return each

    rows = [(name, when, recorded(name, run)) for name, when, run in backends]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "BACKENDS", rows)
        try:
            moe.experts(h, weights=weights, idx=idx, **kw)
        except Exception as e:  # a swapped table may hand a call to a backend that cannot read its weights
            return type(e).__name__
    return ran[-1]


CASES = _cases()


@pytest.mark.parametrize("name", CASES)
def test_each_kind_of_input_runs_its_backend(name):
    h, weights, idx, kw, want = CASES[name]
    assert _ran(moe.BACKENDS, h, weights, idx, kw) == want
    if "act" not in kw:  # and computes the MoE: against the float64 reference over the fp32 master weights
        _, w13, w2, _, _ = _inputs()
        got = moe.experts(h, weights=weights, idx=idx, **kw).double()
        narrow = h.dtype != torch.float32 or kw["w13"] is not None and kw["w13"].dtype != torch.float32
        tol = 2e-2 if narrow else 1e-5  # bf16 weights or activations
        torch.testing.assert_close(got, reference(h, w13, w2, weights, idx), rtol=tol, atol=tol)


def test_the_rows_order_decides():
    """Swapping any two rows of the table changes the backend some input above runs: the order is tested."""
    rows = moe.BACKENDS
    assert [r[0] for r in rows] == ["fused", "quant_in_one_call", "one_token", "loop", "grouped"]
    for i, j in itertools.combinations(range(len(rows)), 2):
        swapped = list(rows)
        swapped[i], swapped[j] = rows[j], rows[i]
        changed = [n for n, (h, w, idx, kw, want) in CASES.items() if _ran(swapped, h, w, idx, kw) != want]
        assert changed, f"rows {rows[i][0]} and {rows[j][0]} swapped: no input notices"


def test_the_fused_layout_refuses_what_it_cannot_run():
    h, weights, idx, kw, _ = CASES["fused"]
    with pytest.raises(ValueError, match="plain SwiGLU without biases"):
        moe.experts(h, weights=weights, idx=idx, **kw, act=moe.clamped_swiglu(1.7, 7.0))
    with pytest.raises(ValueError, match="plain SwiGLU without biases"):
        moe.experts(h, weights=weights, idx=idx, **kw, b2=torch.zeros(E, D))
