"""Multi-turn prompts (MT-Bench's question file, FastChat's format): read as one entry per turn, run in
waves with the model's own earlier answers in context, resumed from answers an earlier session saved."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from app.cli import main
from core.assets import MT_BENCH
from core.io.prompts import read_prompts
from core.io.runstore import RunStore, finish_run, prepare_requests, run_pending

MANIFEST = {"model": {"source": "m"}, "prompts": {"sha256": "p"}, "settings": {"t": 0}, "policy": {}}


def _questions(*qs: tuple) -> bytes:
    return "".join(json.dumps({"question_id": q, "category": "writing", "turns": list(t)}) + "\n"
                   for q, t in qs).encode()


def test_the_bundled_mt_bench_file_is_read_one_entry_per_turn():
    """The paper's workload: 80 questions of 2 turns each, ids from question_id, nothing refused."""
    lines = [json.loads(x) for x in MT_BENCH.read_text(encoding="utf-8").splitlines()]
    ps = read_prompts(str(MT_BENCH))
    assert ps.rejects == [] and len(ps.entries) == 160
    want = [(f"{q['question_id']}:{k + 1}", n, k + 1) for n, q in enumerate(lines, 1) for k in range(2)]
    assert [(e.id, e.line, e.turn) for e in ps.entries] == want
    e = ps.entries[1]
    assert [m["content"] for m in e.messages] == lines[0]["turns"] and e.earlier == (ps.entries[0].id,)


def test_bad_turns_are_rejected_with_their_line():
    data = (_questions((1, ["a", "b"])) + b'{"question_id": 2, "turns": []}\n{"question_id": 3, "turns": ["x", 4]}\n'
            + b'{"question_id": 1, "turns": ["again"]}\n')
    ps = read_prompts("q.jsonl", data=data)
    assert [e.id for e in ps.entries] == ["1:1", "1:2"]
    assert [(r.line, r.reason.split(" (")[0]) for r in ps.rejects] == [
        (2, "`turns` must be a non-empty list of non-empty strings"),
        (3, "`turns` must be a non-empty list of non-empty strings"),
        (4, "duplicate id '1:1'")]


def test_request_kwargs_put_the_answers_between_the_user_turns():
    e = read_prompts("q.jsonl", data=_questions((7, ["u1", "u2", "u3"]))).entries[2]
    msgs = e.request_kwargs({}, answers=["a1", "a2"])["messages"]
    assert msgs == [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                    {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"},
                    {"role": "user", "content": "u3"}]
    with pytest.raises(ValueError):  # a later turn is never asked without its earlier answers
        e.request_kwargs({})


class _ChatEngine:
    """Answers each request with a text naming it; tokens = characters of the conversation."""

    def __init__(self, context_length: int = 1000):
        self.context_length = context_length
        self.waves: list[list[tuple[str, list]]] = []
        self.sinks: list = []  # each wave's on_event

    def prompt_token_ids(self, req):
        return [0] * sum(len(m["content"]) + 1 for m in req.messages)

    def generate(self, requests, *, batch_size=None, micro_batch_size=None, on_event=None, should_stop=None):
        from core.runtime.engine import Result

        requests = list(requests)
        self.waves.append([(r.id, r.messages) for r in requests])
        self.sinks.append(on_event)
        for r in requests:
            if should_stop and should_stop():
                return
            yield Result(r.id, "p", f"answer {r.id}", [5], 1, 1, "length", 0.0)


def test_later_turns_run_in_a_second_wave_with_the_models_answers(tmp_path):
    prompts = read_prompts("q.jsonl", data=_questions((81, ["u1", "u2"]), (82, ["v1", "v2"])))
    engine, events = _ChatEngine(), []
    with RunStore(tmp_path / "o.jsonl") as st:
        st.start(MANIFEST)
        assert run_pending(engine, prompts, st, prepare_requests(engine, prompts, {"max_new_tokens": 4}),
                           on_event=events.append)
        records = finish_run(st, prompts, "m")
    assert [[i for i, _ in w] for w in engine.waves] == [["81:1", "82:1"], ["81:2", "82:2"]]
    assert engine.sinks == [events.append] * 2  # each wave's engine events reach the caller's sink
    assert dict(engine.waves[1])["82:2"] == [{"role": "user", "content": "v1"},
                                             {"role": "assistant", "content": "answer 82:1"},
                                             {"role": "user", "content": "v2"}]
    assert [(r["id"], r["turn"]) for r in records] == [("81:1", 1), ("81:2", 2), ("82:1", 1), ("82:2", 2)]


def test_a_resumed_run_builds_the_next_turn_from_the_saved_answer(tmp_path):
    """Stopped after one first turn: the rerun runs the other first turn, then both second turns, the one
    whose answer the first session saved with that answer in context."""
    prompts = read_prompts("q.jsonl", data=_questions((1, ["u1", "u2"]), (2, ["v1", "v2"])))
    out = tmp_path / "o.jsonl"
    first = _ChatEngine()
    with RunStore(out) as st:
        st.start(MANIFEST)
        seen = []
        assert not run_pending(first, prompts, st, prepare_requests(first, prompts, {}),
                               should_stop=lambda: len(seen) >= 1, on_result=seen.append)
    assert len(first.waves) == 1  # a stop in wave 1 starts no second wave
    again = _ChatEngine()
    with RunStore(out) as st:
        st.start(MANIFEST)
        assert st.resumed and set(st.done) == {"1:1"}
        assert run_pending(again, prompts, st, prepare_requests(again, prompts, {}))
        records = finish_run(st, prompts, "m")
    assert [[i for i, _ in w] for w in again.waves] == [["2:1"], ["1:2", "2:2"]]
    assert dict(again.waves[1])["1:2"][1] == {"role": "assistant", "content": "answer 1:1"}
    assert [r["id"] for r in records] == ["1:1", "1:2", "2:1", "2:2"]


def test_a_turn_that_outgrows_the_context_is_set_aside_with_the_turns_after_it(tmp_path):
    """Checked twice: before the run with empty answers (the shortest it can be), and in its wave with
    the real ones; either way the question's later turns go with it, to the rejects file."""
    long = "x" * 90
    prompts = read_prompts("q.jsonl", data=_questions((1, ["u1", long, "u3"]), (2, ["v" * 95, "v2"]),
                                                      (3, ["w1", "w2"])))
    engine, warnings = _ChatEngine(context_length=100), []
    with RunStore(tmp_path / "o.jsonl") as st:
        st.start(MANIFEST)
        reqs = prepare_requests(engine, prompts, {})
        assert [r.id for r in prompts.rejects] == ["2:2"]  # 96 + 1 + 3 ≥ 100 with an empty answer
        assert run_pending(engine, prompts, st, reqs, on_event=lambda ev: warnings.append(str(ev.message)))
        records = finish_run(st, prompts, "m")
    assert [r["id"] for r in records] == ["1:1", "2:1", "3:1", "3:2"]
    assert [r.id for r in prompts.rejects] == ["1:2", "1:3", "2:2"]
    assert "turn 2 with the earlier answers is 105 tokens" in prompts.rejects[0].reason  # 3 + 11 + 91
    assert "turn 3 cannot run: turn 1:2 of the same question was set aside" in prompts.rejects[1].reason
    assert len(warnings) == 2 and all(w.startswith("q.jsonl:1: ") for w in warnings)
    rejected = [json.loads(x)["id"] for x in (tmp_path / "o.jsonl.rejected.jsonl").read_text().splitlines()]
    assert rejected == ["1:2", "1:3", "2:2"]


def _mt_subset(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "mt.jsonl"
    path.write_text("".join(MT_BENCH.read_text(encoding="utf-8").splitlines(keepends=True)[:n]), encoding="utf-8")
    return path


def test_mlight_run_answers_both_turns_with_the_first_answer_in_the_chat_template(tmp_path, capsys, demo_model):
    """On the demo model: turn 2's prompt is the chat template over turn 1, the model's own turn-1 output
    and turn 2 — rendered here by the tokenizer itself, as the reference."""
    from transformers import AutoTokenizer

    src, out = _mt_subset(tmp_path, 3), tmp_path / "o.jsonl"
    code = main(["run", "--prompts", str(src), "--out", str(out), "--max-new-tokens", "6"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    questions = [json.loads(x) for x in src.read_text(encoding="utf-8").splitlines()]
    assert [(r["id"], r["turn"]) for r in rows] == [(f"{q['question_id']}:{k}", k) for q in questions for k in (1, 2)]
    tok = AutoTokenizer.from_pretrained(demo_model)
    for q, (one, two) in zip(questions, zip(rows[::2], rows[1::2])):
        conv = [{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": one["output"]},
                {"role": "user", "content": q["turns"][1]}]
        assert two["prompt"] == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert one["prompt"] == tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=False)


@pytest.mark.slow
def test_mlight_run_on_the_whole_mt_bench_file(tmp_path, capsys, demo_model):
    """The issue's check: both turns of all 80 questions on the demo model (35 to 70 s on 2 shared cores)."""
    out = tmp_path / "o.jsonl"
    t0 = time.perf_counter()
    assert main(["run", "--prompts", str(MT_BENCH), "--out", str(out)]) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 160 and [r["turn"] for r in rows] == [1, 2] * 80
    assert all(r["output_tokens"] >= 1 for r in rows), time.perf_counter() - t0


def test_splitting_the_work_refuses_multi_turn_questions_in_one_line(tmp_path, capsys):
    """Replicas and ranks split the entries; a later turn needs the answer another may hold: refused
    before any rank starts."""
    code = main(["run", "--prompts", str(_mt_subset(tmp_path, 2)), "--out", str(tmp_path / "o.jsonl"),
                 "--tensor-parallel", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "has multi-turn questions (`turns`), which --tensor-parallel cannot run yet" in err


def test_interrupted_in_the_second_wave_the_rerun_gives_the_uninterrupted_answers(tmp_path, capsys, monkeypatch,
                                                                                   demo_model):
    """Stopped after every first turn and one second turn: the rerun builds the other second turns from
    the first answers saved in the run file, and the output equals an uninterrupted run's (greedy)."""
    import app.commands.run as run_cmd

    src = _mt_subset(tmp_path, 3)
    args = ["run", "--prompts", str(src), "--max-new-tokens", "5", "--batch", "1"]  # one result a step
    assert main([*args, "--out", str(tmp_path / "whole.jsonl")]) == 0
    real = run_cmd.run_pending

    def stop_after_four(*a, on_result, should_stop, **kw):
        seen = []
        return real(*a, **kw, on_result=lambda r: (seen.append(r), on_result(r)), should_stop=lambda: len(seen) >= 4)

    monkeypatch.setattr(run_cmd, "run_pending", stop_after_four)
    assert main([*args, "--out", str(tmp_path / "o.jsonl")]) == 130
    saved = [json.loads(x) for x in (tmp_path / "o.jsonl.run.jsonl").read_text().splitlines()[1:]]
    assert sorted(r["turn"] for r in saved) == [1, 1, 1, 2]
    monkeypatch.setattr(run_cmd, "run_pending", real)
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "o.jsonl")]) == 0
    assert "resuming: 4 of 6 requests already done by an earlier run; running the other 2" in capsys.readouterr().err

    def answers(name):
        return [(r["id"], r["prompt"], r["output_token_ids"]) for r in
                map(json.loads, (tmp_path / name).read_text(encoding="utf-8").splitlines())]

    assert answers("o.jsonl") == answers("whole.jsonl")
