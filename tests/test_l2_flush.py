"""The tasks after a long attention stream (cpu_cost.flush_s): priced by how much of each core's L2 a micro-batch's
KV stream evicts, and fitted by the calibration from what the dense work and experts took more at a long context
than at a short one. No timing: observations are made from known costs."""

from __future__ import annotations

import dataclasses

import pytest

from core.plan import cpu_cost, hrm
from core.plan.cpu_cost import CpuCosts
from core.runtime import calibrate_pieces as pieces

L2 = 2 << 20
BASE = CpuCosts(math="float32", flop_s=5e-12, weight_s=3e-10, call_s=2.6e-6, expert_flop_s=5e-12,
                expert_weight_s=2.4e-10, expert_call_s=4e-6, elem_s=1.5e-9, task_s=7e-5, kv_s=2e-10,
                attn_row_s=4e-7, own_rows=True, attn_call_s=2e-5, threads=2, l2_bytes=L2)


def _demo_dims():
    from core.model.demo import demo_model_dir
    from core.model.families import load_spec

    return hrm.dims(load_spec(demo_model_dir()))


def test_the_tasks_after_a_stream_that_fills_the_l2_pay_for_it(demo_model):
    """Defect: the demo's post-attention tasks took +70 µs each after an attention task streaming 6-12 MB of KV
    through two cores' 2 MB L2s (64 and 128 requests of ~380 tokens), which no term priced; the planner, its run
    factors measured where the stream fits (32 requests of ~90 tokens) or already exceeds it (256), priced 64 and
    100 requests a micro-batch 10 % fast at 308-token prompts and planned them over one micro-batch of 256."""
    d = _demo_dims()
    c = dataclasses.replace(BASE, flush_s=7e-5)
    post = lambda costs, b, ctx: cpu_cost.decode_tasks(d, costs, micro_batch=b, expert_batch=b,  # noqa: E731
                                                       context=ctx)["post_attn"]
    per_token = d.kv_tok_layer
    for b, ctx in ((96, 382), (128, 382), (256, 190)):
        assert b * ctx * per_token / 2 > 1.5 * L2  # each core's share past one and a half L2s: all of it
        assert post(c, b, ctx) - post(BASE, b, ctx) == pytest.approx(7e-5, rel=1e-9)
    for b, ctx in ((32, 93), (64, 60)):  # a core's share under half its L2: none
        assert b * ctx * per_token / 2 < 0.5 * L2
        assert post(c, b, ctx) == post(BASE, b, ctx)
    mid = 128 * 93 * per_token / 2 / L2 - 0.5  # between: a ramp
    assert 0 < mid < 1 and post(c, 128, 93) - post(BASE, 128, 93) == pytest.approx(7e-5 * mid, rel=1e-9)
    # an L2 not known prices nothing; the other tasks never pay it
    assert post(dataclasses.replace(c, l2_bytes=0), 128, 382) == post(BASE, 128, 382)
    for kind in ("pre_attn", "cpu_attn", "ffn"):
        assert cpu_cost.decode_tasks(d, c, micro_batch=128, expert_batch=128, context=382)[kind] == \
            cpu_cost.decode_tasks(d, BASE, micro_batch=128, expert_batch=128, context=382)[kind]


def test_the_calibration_fits_the_flush_from_the_dense_work_at_two_contexts(demo_model):
    """The calibration's decode steps (one micro-batch of 1-128 requests at 48 and 384 tokens) timed as a machine
    whose tasks after a long stream pay 70 µs: the fit gives it back, and the dense terms beside it."""
    from core.model.demo import demo_model_dir
    from core.model.families import load_spec
    from types import SimpleNamespace

    spec = load_spec(demo_model_dir())
    d, L = hrm.dims(spec), spec.num_layers
    truth = dataclasses.replace(BASE, flush_s=7e-5)
    obs = []
    for b in pieces.DECODE_BATCHES:
        for ctx in pieces.DECODE_CONTEXTS:
            o = pieces.Obs("decode", b, ctx, {}, 0.0, ctx + 4)
            dense, attn = pieces._layer_decode(d, truth, o)
            obs.append(dataclasses.replace(o, busy={"gpu": L * dense, "cpu_attn": L * attn}))
    start = dataclasses.replace(BASE, elem_s=0.0, task_s=0.0)
    got = pieces.fit_engine_terms(SimpleNamespace(spec=spec), start, obs)
    assert got.flush_s == pytest.approx(7e-5, rel=0.02)
    assert got.task_s == pytest.approx(BASE.task_s, rel=0.02) and got.elem_s == pytest.approx(BASE.elem_s, rel=0.05)
    # without the L2 known, nothing to fit it from: the dense terms as before
    blind = pieces.fit_engine_terms(SimpleNamespace(spec=spec), dataclasses.replace(start, l2_bytes=0), obs)
    assert blind.flush_s == 0.0
