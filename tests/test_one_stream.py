"""A decode step of a few requests as bound kernel calls (core.runtime.one_stream, issue 47's small batches).

The bound calls must be the general path's kernels with its arguments: the logits of every step equal the
general path's bit for bit — GGUF Q8_0, a Q4_K_M mix (a projection in two formats, experts' down rows in
Q6_K), a bf16 checkpoint on the panels, Qwen3-MoE's per-head q/k norms; one request and five of different
lengths (several Q8_0 rows on gguf_blocks' tiles, attention split over threads) — across a thread-count change,
with the executor's timeline filled as a run fills it; a family the calls do not cover says why and keeps the
general path.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_checkpoint
from core.model.cpu import ffn, gguf_token, native, row_ops
from core.runtime import one_stream
from core.runtime.engine import Engine, Request
from core.telemetry import StepDone, task_spans
from gguf_files import q4_k_m, uniform, write_gguf

PROMPT = "The quick brown fox jumps over the lazy dog"
STEPS = 6
built = pytest.mark.skipif(None in (row_ops.library(), native.library(), gguf_token.library()),
                           reason="the row, attention and GGUF token kernels are not built here")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-stream")
    ckpt = make_checkpoint("mixtral", root / "ckpt", dtype=torch.bfloat16, hidden_size=256, intermediate_size=256)
    return {"Q8_0": write_gguf("mixtral", ckpt, root / "q8 ü.gguf", uniform("Q8_0")),
            "Q4_K_M": write_gguf("mixtral", ckpt, root / "q4km.gguf", lambda n: q4_k_m(n, 2)),
            "bf16": ckpt,
            "qwen3": write_gguf("qwen3_moe", make_checkpoint("qwen3_moe", root / "qwen", dtype=torch.bfloat16,
                                                             hidden_size=256, moe_intermediate_size=256, head_dim=32),
                                root / "qwen3.gguf", uniform("Q4_K"))}


def _steps(engine, fast: bool, M: int, threads=(1, 2)):
    """Logits and timelines of STEPS decode steps of M requests of different lengths in slots 1..M (greedy), the
    thread count moving halfway."""
    ids = [engine.prompt_token_ids(Request(id=str(m), prompt=PROMPT + " and so on" * m)) for m in range(M)]
    runner = engine.runner(slots=M + 1, micro_batch_size=M + 1, max_tokens=96)
    if not fast:
        runner._one = {m: False for m in range(1, one_stream.MAX_ROWS + 1)}
    logits, _ = runner.prefill(ids, list(range(1, M + 1)), [list(range(M))])
    toks, pos, out, spans, before = logits.argmax(-1).tolist(), [len(x) for x in ids], [], [], torch.get_num_threads()
    try:
        for step in range(STEPS):
            torch.set_num_threads(threads[step * len(threads) // STEPS])
            logits, busy = runner.decode([toks], [list(range(1, M + 1))], [pos])
            out.append(logits.clone())
            spans.append(task_spans(StepDone("decode", M, 0.0, busy, tasks=runner.last_tasks, times=runner.ex.times)))
            toks, pos = logits.argmax(-1).tolist(), [p + 1 for p in pos]
    finally:
        torch.set_num_threads(before)
    return out, spans, runner


@built
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M", "bf16", "qwen3"])
@pytest.mark.parametrize("M", [1, 5])
def test_bound_calls_give_the_general_paths_logits_bit_for_bit(models, kind, M):
    engine = Engine.load(models[kind])
    runner = engine.runner(slots=M, micro_batch_size=M, max_tokens=64)
    why = one_stream.why_not(runner, M)
    if kind == "bf16" and ffn.library() is None:
        pytest.skip(f"no bf16 panels here ({ffn.status()}): {why}")
    if runner.widen_attn is not None or runner.widen_ffn is not None:
        pytest.skip(f"this CPU computes in a wider dtype: {why}")
    assert why == ""
    fast, fast_spans, r = _steps(engine, True, M)
    general, general_spans, _ = _steps(engine, False, M)
    assert r._one[M] and r._one[M].threads == 2  # made at the first step, made again when the threads moved
    for step, (a, b) in enumerate(zip(fast, general)):
        assert a.shape[0] == M and torch.equal(a, b), f"step {step}: {(a - b).abs().max().item()}"
    L = engine.spec.num_layers
    for spans, ref in zip(fast_spans, general_spans):  # the same timeline: every task once, in order, timed
        assert [(s.resource, s.kind, s.layer) for s in spans] == [(s.resource, s.kind, s.layer) for s in ref]
        assert len(spans) == 4 * L and all(s.end >= s.start >= 0 for s in spans)
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))


@built
def test_the_engine_gives_the_same_tokens_with_and_without_the_bound_calls(models, monkeypatch):
    engine = Engine.load(models["Q4_K_M"])
    req = [Request(id="a", prompt=PROMPT, max_new_tokens=8)]
    with_calls = [r.output_token_ids for r in engine.generate(req, batch_size=1)]
    monkeypatch.setattr(one_stream, "why_not", lambda r, M: "off for this test")
    without = [r.output_token_ids for r in engine.generate(req, batch_size=1)]
    assert with_calls == without and len(with_calls[0]) == 8


@built
def test_a_kernel_refusing_its_call_stops_the_step_and_names_its_task(models):
    """The step's calls run from one C loop (row_ops.c's mlight_run_calls): a kernel that refuses (here layer 1's
    experts, handed a path they do not have) stops it there, and the error names the task, as each call did."""
    engine = Engine.load(models["Q8_0"])
    runner = engine.runner(slots=1, micro_batch_size=1, max_tokens=32)
    if one_stream.why_not(runner):
        pytest.skip(one_stream.why_not(runner))
    ids = engine.prompt_token_ids(Request(id="a", prompt=PROMPT))
    logits, _ = runner.prefill([ids], [0], [[0]])
    tok = int(logits[0].argmax())
    runner.decode([[tok]], [[0]], [[len(ids)]])
    one = runner._one[1]
    row = [i for i in range(one.table.shape[0]) if one.table[i, 4] == 4 + 3][0]  # layer 1's ffn: its experts first
    one.table[row, 5 + 23] = 0  # mlight_gguf_tokens_moe's path: 1 or 2
    with pytest.raises(RuntimeError, match="ffn of layer 1: a kernel refused its bound call"):
        runner.decode([[tok]], [[0]], [[len(ids) + 1]])


def test_a_family_the_calls_do_not_cover_keeps_the_general_path(tmp_path):
    ckpt = make_checkpoint("deepseek_v2", tmp_path / "dsv2", dtype=torch.bfloat16)  # MLA, a dense first layer
    engine = Engine.load(ckpt)
    runner = engine.runner(slots=1, micro_batch_size=1, max_tokens=32)
    assert one_stream.why_not(runner)  # a reason, not ""
    ids = engine.prompt_token_ids(Request(id="a", prompt=PROMPT))
    logits, _ = runner.prefill([ids], [0], [[0]])
    logits, _ = runner.decode([[int(logits[0].argmax())]], [[0]], [[len(ids)]])
    assert runner._one[1] is False and torch.isfinite(logits).all()


@built
@pytest.mark.parametrize("kind", ["Q8_0", "qwen3"])
@pytest.mark.parametrize("M", [1, 5])
def test_a_bound_step_allocates_nothing(models, kind, M):
    """After its first step the bound step fills buffers it holds: no op allocates (the brief's hot path), at
    one request and at several (their tokens, slots and positions, and the attention's split over threads)."""
    engine = Engine.load(models[kind])
    ids = [engine.prompt_token_ids(Request(id=str(m), prompt=PROMPT + " and so on" * m)) for m in range(M)]
    runner = engine.runner(slots=M + 1, micro_batch_size=M + 1, max_tokens=96)
    if runner.widen_attn is not None or runner.widen_ffn is not None:
        pytest.skip(f"this CPU computes in a wider dtype: {one_stream.why_not(runner, M)}")
    slots = list(range(1, M + 1))
    logits, _ = runner.prefill(ids, slots, [list(range(M))])
    toks, pos = logits.argmax(-1).tolist(), [len(x) for x in ids]
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the attention split over threads at M > 1
    try:
        runner.decode([toks], [slots], [pos])
        assert runner._one[M], "the step did not take the bound calls"
        step = runner._one[M].step
        with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as prof:
            step(runner, toks, slots, [p + 1 for p in pos])
    finally:
        torch.set_num_threads(before)
    made = [(ev.name, ev.cpu_memory_usage) for ev in prof.function_events if ev.cpu_memory_usage > 0]
    assert made == []
