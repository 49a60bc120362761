"""Decode attention's cost in the fused C kernel (core.model.cpu.native), as the planner prices it.

The kernel reads each request's own cached tokens in place and splits a call's requests over its threads
by Σ length (native.cuts), so a call lasts as long as its largest share. Before, the model priced every
micro-batch at its longest context, copied out of the row (a slicing engine) or the whole row, with a
per-element copy rate fitted only from 48-token contexts, where it could not be told apart from the per-row
cost: the 784M's runs read 1.2-1.4x that model's attention on MT-Bench-like prompts and 0.73-0.78x on 4x
longer ones (2.1-2.7x and 0.68-0.80x under the AVX2 limits; bench/RESULTS.md, issue 11, sixth session).
"""

from __future__ import annotations

import dataclasses

import pytest

from core.model.cpu.native import cuts
from core.plan import cpu_cost, hrm
from core.plan.cpu_cost import CpuCosts
from core.plan.planner import Workload
from core.runtime import calibrate as cal
from core.runtime import calibrate_pieces as pieces
from core.runtime.batching import SlotTable

THREADS = 2
OWN = CpuCosts(math="bfloat16", flop_s=1e-12, weight_s=1e-10, call_s=1e-6, kv_s=2e-11, kv_copy_s=9e-11,
               attn_row_s=4e-7, attn_call_s=2e-5, task_s=5e-5, threads=THREADS, own_rows=True)


def _dims():
    from core.plan.presets import resolve_spec

    return hrm.dims(resolve_spec("mixtral-8x7b"))


def _kernel(d, lengths, call=150e-6, row=1.5e-6, token=2e-9) -> float:
    """What the kernel takes for one call (the machine's truth in these tests): waking its threads (a call of
    one request runs on its caller: none), then its threads each run a share of the requests as native.cuts
    splits them (per KV-head row, per cached token and KV head), the call as long as its longest share."""
    hkv = d.kv // d.head_dim
    parts = min(THREADS, len(lengths))
    b = cuts(lengths, parts)
    return (call if parts > 1 else 0.0) + max(sum(hkv * (row + token * n) for n in lengths[b[j]:b[j + 1]]) for j in range(parts))


def test_the_kernel_is_priced_by_the_tokens_it_reads_and_how_its_threads_share_them():
    d = _dims()
    at = lambda c, **kw: cpu_cost.attention_seconds(d, c, 4, 275, **kw)  # noqa: E731
    no_kv = dataclasses.replace(OWN, kv_s=0.0)
    kv = lambda lengths: at(OWN, lengths=lengths) - at(no_kv, lengths=lengths)  # noqa: E731
    per_token = OWN.kv_s * 2 * d.kv * THREADS
    # the request that crosses half the tokens goes whole to the first thread: 800 there, 300 beside it ...
    assert kv([800, 100, 100, 100]) == pytest.approx(per_token * 800)
    # ... and last in line, the first thread takes all four (native.cuts), so the call is one thread's work
    assert kv([100, 100, 100, 800]) == pytest.approx(per_token * 1100)
    assert kv([275] * 4) == pytest.approx(per_token * 550)
    # one request: one thread reads it while the other waits, and no threads are woken for it
    assert cpu_cost.attention_seconds(d, OWN, 1, 300, lengths=[300]) - cpu_cost.attention_seconds(
        d, no_kv, 1, 300, lengths=[300]) == pytest.approx(per_token * 300)
    no_call = dataclasses.replace(OWN, attn_call_s=0.0)
    assert at(OWN, lengths=[275] * 4) - at(no_call, lengths=[275] * 4) == pytest.approx(OWN.attn_call_s)
    assert cpu_cost.attention_seconds(d, OWN, 1, 300) == cpu_cost.attention_seconds(d, no_call, 1, 300)
    # the row it sits in, the micro-batch's longest and widening do not change what it reads
    rows = {at(OWN, row_tokens=r, longest=lo, lengths=[275] * 4) for r in (300, 4000) for lo in (275, 290)}
    assert len(rows) == 1 and at(dataclasses.replace(OWN, widens=True), lengths=[275] * 4) in rows
    assert cpu_cost.read_tokens(OWN, 275, 4000, 800) == 275  # the KV a step streams beside the weights


@pytest.mark.parametrize("elem_s", [0.0, 1.6e-9])
def test_calibrated_attention_follows_the_workload_it_is_asked_about(elem_s):
    """The calibration's decode steps (runner_observations' plan: equal lengths, whole and sliced rows) timed
    by the kernel's truth; the terms fitted from them predict the attention of the bench's two workloads —
    MT-Bench-like prompts and 4x longer ones, admitted longest first into balanced micro-batches of 4 — from
    the planner's abstraction (mean context, spread), against the truth over the engine's own micro-batches.
    Defect (elem_s 1.6e-9, what the 784M's dense work fits on two Zen 5 threads): the model priced the kernel's
    scores at torch's elementwise rate, a per-token cost the fit could not take back (kv_s is not negative), and
    the 4x prompts' attention was predicted far slower than the kernel runs it."""
    d = _dims()
    L = 2
    base = CpuCosts(math="bfloat16", flop_s=1e-12, weight_s=1e-10, call_s=1e-6, task_s=5e-5, threads=THREADS,
                    own_rows=True, elem_s=elem_s)
    plan = [(b, c, c + 4) for b in pieces.DECODE_BATCHES for c in pieces.DECODE_CONTEXTS]
    plan += [(b, pieces.SLICED[0], pieces.SLICED[1]) for b in pieces.DECODE_BATCHES]
    obs = []
    for b, c, row in plan:
        o = pieces.Obs("decode", b, c, {}, 0.0, row)
        dense = pieces._layer_decode(d, base, o)[0]
        write = elem_s * b * 2 * d.kv  # the new token's K and V, stored by torch
        obs.append(dataclasses.replace(o, busy={"gpu": L * dense, "cpu_attn": L * (base.task_s + _kernel(d, [c] * b) + write)}))

    class Engine:
        spec = dataclasses.replace(__import__("core.plan.presets", fromlist=["x"]).resolve_spec("mixtral-8x7b"),
                                   num_layers=L)

    fitted = pieces.fit_engine_terms(Engine(), base, obs)
    per_step = {}
    for mean in (77, 308):
        from core.io.workloads import target_lengths

        top, gen, batch, mu = round(418 * mean / 77), 32, 16, 4
        prompts = sorted(target_lengths(32, mean=mean, max_len=top), reverse=True)
        truth = steps = 0
        for w in range(0, len(prompts), batch):  # each wave: Algorithm 2's placement, then its decode steps
            table, groups = SlotTable(batch, mu), {}
            for i, n in enumerate(prompts[w:w + batch]):
                groups.setdefault(table.place(i, n) // mu, []).append(n)
            for step in range(1, gen):
                truth += sum(_kernel(d, [n + step for n in g]) + elem_s * len(g) * 2 * d.kv for g in groups.values())
                steps += 1
        work = Workload(prompt_len=round(sum(prompts) / len(prompts)), gen_len=gen, max_prompt_len=top)
        model = cpu_cost.attention_seconds(d, fitted, mu, work.decode_context, work.longest_prompt + gen,
                                           work.micro_batch_context(mu))
        per_step[mean] = (model * batch / mu, truth / steps)
        assert model * batch / mu == pytest.approx(truth / steps, rel=0.08), mean
    # the 4x prompts' attention against the default's: what separates the workloads, whatever the level
    (m1, t1), (m4, t4) = per_step[77], per_step[308]
    assert m4 / m1 == pytest.approx(t4 / t1, rel=0.05)


def test_the_runs_attention_beyond_its_pieces_is_a_cost_per_call_not_a_scale():
    """In a run the attention task cost about the same per call whatever it read (the 784M: 0.24 ms a call at
    94 and 324 tokens; 4 or 16 requests a call alike), far above what the kernel's pieces say. Fitted as a
    factor on attention, that fixed cost grew with every token and request: the 4x prompts' attention was
    predicted 1.5x too slow against the default's. It is fitted per call now, and a run of other micro-batches
    and contexts is predicted as the machine runs it."""
    from types import SimpleNamespace

    from test_calibration_run import _mixtral, _steps

    spec = _mixtral()
    pieces = dataclasses.replace(OWN, attn_call_s=2e-5, step_s=1e-5)
    truth = dataclasses.replace(pieces, attn_call_s=2.4e-4, step_s=4e-4)  # the run's calls: 0.24 ms each
    engine = SimpleNamespace(spec=spec, config=SimpleNamespace(expert_group=1))
    got = cal.fit_run_windows(engine, pieces, [_steps(spec, truth, truth.step_s) for _ in range(3)])
    assert got.attn_call_s == pytest.approx(2.4e-4, rel=1e-6) and got.attn_eff == pytest.approx(1.0, rel=1e-6)
    d = hrm.dims(spec)
    for mu, context, longest in ((4, 94, 145), (16, 324, 650), (64, 1200, 2600)):
        kw = dict(micro_batch=mu, expert_batch=mu, context=context, row_tokens=4000, longest=longest)
        assert cpu_cost.decode_tasks(d, got, **kw)["cpu_attn"] == pytest.approx(
            cpu_cost.decode_tasks(d, truth, **kw)["cpu_attn"], rel=1e-6), (mu, context)
