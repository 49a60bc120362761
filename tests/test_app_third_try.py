"""What the app's third newcomer try found (issue 46's try before closing), one test each."""

from __future__ import annotations

import json
import unicodedata

from test_app_defects import _app
from test_app_snapshots import _t4, workdir  # noqa: F401 - the fixture
from test_app_support import FrozenClock, ScriptedBackend, settle, sync

WIDE = (120, 40)


def _screen_text(app) -> str:
    return "\n".join("".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips())


def _controls(text: str) -> list[str]:
    return sorted({repr(ch) for line in text.splitlines() for ch in line if unicodedata.category(ch) == "Cc"})


@sync
async def test_control_characters_in_an_output_are_shown_not_sent_to_the_terminal(workdir):
    """The demo model answers random bytes: a shift-out (\\x0e) or an ESC reached the terminal from the Results
    table, and in tmux the rows after it were drawn over others (MT-Bench's 94:1 to 96:2 went missing). Table
    and detail show such characters as a sign; line breaks stay line breaks in the detail."""
    from app.tui.screens.results import ResultsScreen

    records = [{"id": f"q{i}", "prompt": "say\x0eit", "output": f"a\x1b[2Jb\x0e{i}\x17c\x7fd\ne", "prompt_tokens": 3,
                "output_tokens": 4, "seconds": 0.1, "finish_reason": "stop"} for i in range(3)]
    app = _app()
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot)
        app.push_screen(ResultsScreen(records))
        await settle(pilot)
        table = _screen_text(app)
        assert _controls(table) == [], _controls(table)
        assert [line.split()[0] for line in table.splitlines() if line.strip().startswith("q")] == ["q0", "q1", "q2"]
        assert "a�[2Jb�0�c�d" in table  # each shown as one sign, the text around it kept
        await pilot.press("enter")
        await settle(pilot)
        detail = _screen_text(app)
        assert _controls(detail) == [], _controls(detail)
        assert any(line.strip(" │") == "e" for line in detail.splitlines())  # the line break kept


@sync
async def test_a_prompt_longer_than_the_context_is_a_bad_line_on_plan_as_mlight_run_says(workdir):
    """400 prompts, one of 2481 tokens for the demo model's 2048: Plan said "fits" and planned for it, the run
    skipped it unasked and ended on "399 / 400", where `mlight run` refuses the file without --skip-bad. Plan
    sets it aside with the bad lines, plans without it and asks before skipping it."""
    from test_app_defects import _check, _plan
    from test_app_support import run_over, settle_until, status_text

    lines = [json.dumps({"id": f"q{i}", "prompt": f"question {i}", "max_new_tokens": 2}) for i in range(3)]
    lines.insert(1, json.dumps({"id": "long", "prompt": "word " * 3000, "max_new_tokens": 2}))
    (workdir / "long.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    app = _app(model="demo", prompts="long.jsonl", out="results.jsonl")
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        assert "1 bad line in long.jsonl will be skipped" in _check(app), _check(app)
        assert app.session.plan.workload.num_requests == 3 and app.session.plan.workload.longest_prompt < 2048
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert "Skip the bad line" in status_text(app), status_text(app)
        await pilot.press("escape")  # "Esc: Prompts lists them"
        await settle(pilot)
        listed = str(app.screen.query_one("#rejects").render())
        assert "the model's context is 2048 tokens" in listed and "3 to run" in app.screen.query_one(
            "#prompts-facts").text, listed
        await pilot.press("ctrl+n")  # agreed on Plan already: neither step asks again
        await _plan(pilot)
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        assert "3 / 3" in app.screen.query_one("#progress-facts").text
        assert "; 1 skipped line in results.jsonl.rejected.jsonl" in status_text(app), status_text(app)
    assert [json.loads(x)["id"] for x in (workdir / "results.jsonl").read_text().splitlines()] == ["q0", "q1", "q2"]
    (reject,) = [json.loads(x) for x in (workdir / "results.jsonl.rejected.jsonl").read_text().splitlines()]
    assert reject["id"] == "long" and "the model's context is 2048 tokens" in reject["reason"]


def test_this_runs_new_tokens_are_the_results_tokens(workdir):
    """400 prompts on the demo model, one run: "Tokens 42,331 new (this run)" beside "Saved 42,211 new" and
    Results' "42,211 tokens generated" — the 120 requests that ended on the end-of-text token had it counted
    by the decode step that sampled it, though it is no output. The real engine, a run from nothing: this
    run's new tokens are the saved ones."""
    from pathlib import Path

    from app.tui.backend import Backend
    from app.tui.messages import RunEnded
    from app.tui.runjob import RunJob

    questions = Path(__file__).parents[1] / "core" / "assets" / "mt_bench_questions.jsonl"
    prompts = [json.loads(line)["turns"][0] for line in questions.read_text(encoding="utf-8").splitlines()[:12]]
    Path("p.txt").write_text("\n".join(p.replace("\n", " ") for p in prompts) + "\n", encoding="utf-8")
    b = Backend()
    b.max_new_tokens = 48
    machine = b.machine()
    model, view = b.open_model("demo", machine), b.read_prompts(Path("p.txt"))
    ended = []
    job = RunJob(b, model, view, b.plan(model, machine, view, None, None), workdir / "o.jsonl",
                 post=lambda m: ended.append(m.snapshot) if isinstance(m, RunEnded) else None)
    assert job.run() == "done"
    records = [json.loads(x) for x in (workdir / "o.jsonl").read_text().splitlines()]
    assert any(r["finish_reason"] == "stop" for r in records)  # the case: some end on the end-of-text token
    (snap,) = ended
    assert snap.tokens_out == snap.saved_out == sum(r["output_tokens"] for r in records)


@sync
async def test_the_tokenizer_is_read_while_the_prompts_are_chosen(workdir):
    """Ctrl+N on Prompts with 400 prompts showed the plan after ≈ 10 s, most of it importing transformers and
    reading the tokenizer (counting the 400 prompts takes 0.3 s): the Model step reads it in its worker once the
    model is open, so it is ready before Plan asks."""
    from test_app_support import settle_until

    read = []

    class Backend(ScriptedBackend):
        def _once(self, key, make, fresh=False):
            if key[0] == "tokenizer":
                read.append(type(app.screen).__name__)
            return super()._once(key, make, fresh)

    app = _app(backend=Backend(hardware=_t4(), clock=FrozenClock()))
    async with app.run_test(size=WIDE) as pilot:
        await settle_until(pilot, lambda app: app.session.machine is not None)
        await pilot.press("ctrl+n")
        await settle(pilot)
        await pilot.press("d")
        await settle_until(pilot, lambda app: read)
        assert read[0] == "ModelScreen", read
