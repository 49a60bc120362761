"""The whole app, driven by keys with Textual's Pilot, on the real engine and the built-in demo model.

pick demo → load a prompts file → accept the plan → run to completion → export CSV and JSONL →
check both files; then stop-and-resume, and what the screens say about bad files and folders.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import pytest
from textual import events

from app.tui.app import create_app
from app.tui.backend import Backend
from app.tui.session import Options
from app.tui.widgets.path_input import PathInput
from test_app_support import run_over, settle, settle_until, status_text, sync, write_prompts

SIZE = (120, 40)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


async def _to_prompts(pilot) -> None:
    """Machine → Model (demo) → Prompts, by keys only."""
    app = pilot.app
    await settle(pilot)
    assert type(app.screen).__name__ == "MachineScreen"
    await pilot.press("enter")  # "Continue to Model" has the focus
    await settle(pilot)
    assert type(app.screen).__name__ == "ModelScreen"
    await pilot.press("enter")  # "Demo model" has the focus
    await settle(pilot)
    assert app.session.model is not None and app.session.model.source == "demo", status_text(app)
    await pilot.press("ctrl+n")
    await settle(pilot)
    assert type(app.screen).__name__ == "PromptsScreen"


async def _open_prompts(pilot, path: Path) -> None:
    inp = pilot.app.screen.query_one("#prompts-input", PathInput)
    inp.focus()
    inp.value = str(path)
    await pilot.press("enter")
    await settle(pilot)


@pytest.mark.timeout(240)
@sync
async def test_whole_flow_on_the_demo_model(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=4, max_new_tokens=4)
    out = tmp_path / "run.jsonl"
    app = create_app(Options(), Backend(max_new_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        await _to_prompts(pilot)
        await _open_prompts(pilot, prompts)
        assert app.session.prompts.count == 4, status_text(app)
        await pilot.press("ctrl+n")
        await settle_until(pilot, lambda app: app.session.plan is not None)
        assert type(app.screen).__name__ == "PlanScreen"
        assert app.session.plan is not None and not app.session.plan.problems, status_text(app)
        app.screen.query_one("#out", PathInput).value = str(out)
        await pilot.press("ctrl+n")  # accept the plan: the run starts
        await settle_until(pilot, run_over)
        assert type(app.screen).__name__ == "RunScreen"
        assert app.session.run_state == "done", status_text(app)
        assert "Done: 4 results" in status_text(app)
        run_records = _jsonl(out)
        assert [r["id"] for r in run_records] == ["mtbench-81", "mtbench-82", "mtbench-83", "mtbench-84"]
        assert all(1 <= r["output_tokens"] <= 4 for r in run_records)

        await pilot.press("ctrl+n")
        await settle(pilot)
        assert type(app.screen).__name__ == "ResultsScreen"
        for key, name in (("c", "export.csv"), ("j", "export.jsonl")):
            await pilot.press(key)
            await settle(pilot)
            assert type(app.screen).__name__ == "ExportScreen"
            app.screen.query_one("#export-path", PathInput).value = str(tmp_path / name)
            await pilot.press("enter")
            await settle(pilot)
            assert type(app.screen).__name__ == "ResultsScreen"
            assert f"Wrote 4 results as {name.split('.')[1].upper()}" in status_text(app)

    exported = _jsonl(tmp_path / "export.jsonl")
    assert exported == run_records
    with open(tmp_path / "export.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["id"] for r in rows] == [r["id"] for r in run_records]
    for row, rec in zip(rows, run_records):
        assert row["prompt"] == rec["prompt"]
        assert row["output"] == rec["output"]
        assert int(row["output_tokens"]) == rec["output_tokens"]
        assert row["finish_reason"] == rec["finish_reason"]


class _StopAfterFirst(Backend):
    """The real engine, wrapped so that the test presses `s` right after the first result arrives."""

    def __init__(self, app_ref: list, **kw):
        super().__init__(**kw)
        self.app_ref = app_ref
        self.asked: list[list[str]] = []  # request ids given to each generate call
        self.stop_once = True

    def engine(self, path, policy=None, progress=lambda e: None, **kw):
        real = super().engine(path, policy, progress, **kw)
        backend = self

        class Wrapped:
            context_length = real.context_length
            prompt_token_ids = staticmethod(real.prompt_token_ids)

            def generate(self, requests, **kw):
                requests = list(requests)
                backend.asked.append([r.id for r in requests])
                for result in real.generate(requests, **kw):
                    yield result
                    if backend.stop_once:
                        backend.stop_once = False
                        app = backend.app_ref[0]
                        app.call_from_thread(app.screen.action_stop)  # as if `s` were pressed

        return Wrapped()


@pytest.mark.timeout(240)
@sync
async def test_stop_is_clean_and_resume_finishes_the_rest(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=5, max_new_tokens=3)
    out = tmp_path / "out.jsonl"
    ref: list = []
    backend = _StopAfterFirst(ref, max_new_tokens=3)
    app = create_app(Options(model="demo", prompts=str(prompts), out=str(out)), backend)
    ref.append(app)
    async with app.run_test(size=SIZE) as pilot:
        await settle_until(pilot, lambda app: app.session.plan is not None)
        assert type(app.screen).__name__ == "PlanScreen", status_text(app)  # --model + --prompts: straight to Plan
        # one request at a time, so that the stop lands between requests
        for wid, value in (("batch", "1"), ("micro", "1"), ("expert", "1")):
            app.screen.query_one(f"#{wid}").value = value
            await settle(pilot)
        assert app.session.plan.policy.batch_size == 1, status_text(app)
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        assert app.session.run_state == "stopped", status_text(app)
        assert "r resumes" in status_text(app)
        run_file = out.with_name(out.name + ".run.jsonl")
        kept = _jsonl(run_file)[1:]  # line 1 is the manifest
        assert 1 <= len(kept) < 5
        assert not out.exists()  # the final output is written only when every request is done

        await pilot.press("r")
        await settle_until(pilot, lambda app: app.session.run_state == "done" or app.session.run_state == "failed")
        assert app.session.run_state == "done", status_text(app)
        log = "\n".join(str(line.text) for line in app.screen.query_one("#log").lines)
        assert f"Resuming: {len(kept)} results" in log
        tokens_row = app.screen.query_one("#progress-facts").text.split("Saved: ")[1].splitlines()[0]

    final = _jsonl(out)
    # defect 16: after a resume the saved counters are the file's (earlier sessions' results included); issue 46's
    # defect 9: in a row of their own, named, beside this run's
    assert tokens_row == (f"{sum(r['output_tokens'] for r in final):,} new, "
                          f"{sum(r['prompt_tokens'] for r in final):,} prompt (finished results, all runs)")
    ids = [r["id"] for r in final]
    assert ids == [f"mtbench-{81 + i}" for i in range(5)]  # every request exactly once, in file order
    assert {r["id"]: r for r in final}[kept[0]["id"]] == kept[0]  # the stopped run's result is kept as is
    assert len(backend.asked) == 2
    assert set(backend.asked[1]).isdisjoint(r["id"] for r in kept)  # finished requests are not run again
    assert not run_file.exists()


@sync
async def test_bad_prompt_files_say_what_is_wrong(tmp_path):
    from core.plan.hardware import preset

    bad_lines = tmp_path / "some_bad.jsonl"
    bad_lines.write_text('{"prompt": "fine"}\n{"prompt": \n{"text": "no prompt"}\n{"prompt": "also fine"}\n',
                         encoding="utf-8")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"hello\x00world")
    no_column = tmp_path / "no_column.csv"
    no_column.write_text("question,id\nwhat?,1\n", encoding="utf-8")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))

    app = create_app(Options(), Backend(hardware=preset("t4")))
    async with app.run_test(size=SIZE) as pilot:
        await _to_prompts(pilot)
        await _open_prompts(pilot, tmp_path / "missing.jsonl")
        assert "not found" in status_text(app)
        await _open_prompts(pilot, binary)
        assert "binary file" in status_text(app)
        await _open_prompts(pilot, no_column)
        assert "no `prompt` column" in status_text(app)
        await _open_prompts(pilot, latin1)
        assert "not UTF-8" in status_text(app) and "byte offset 3" in status_text(app)
        assert app.screen.query_one("#next").disabled

        await _open_prompts(pilot, bad_lines)
        assert app.session.prompts.count == 2
        rejects = str(app.screen.query_one("#rejects").render())
        assert "line 2: bad JSON" in rejects
        assert "line 3:" in rejects and "neither `prompt` nor `messages`" in rejects
        assert "2 lines bad (listed)" in status_text(app) and "Ctrl+N to skip them" in status_text(app)
        assert not app.screen.query_one("#next").disabled


@sync
async def test_dropping_a_file_onto_the_prompts_screen_opens_it(tmp_path):
    from core.plan.hardware import preset

    folder = tmp_path / "my prompts été"
    folder.mkdir()
    prompts = write_prompts(folder / "drop me.jsonl", n=3, max_new_tokens=2)
    app = create_app(Options(), Backend(hardware=preset("t4")))
    async with app.run_test(size=SIZE) as pilot:
        await _to_prompts(pilot)
        inp = app.screen.query_one("#prompts-input", PathInput)
        inp.focus()
        await pilot.pause()
        escaped = str(prompts).replace(" ", "\\ ")  # how iTerm2 / macOS Terminal paste a dropped file
        inp.post_message(events.Paste(escaped))
        await settle(pilot)
        assert inp.value == str(prompts)
        assert app.session.prompts is not None and app.session.prompts.count == 3, status_text(app)


@sync
async def test_bad_model_folders_say_what_is_wrong_and_a_good_one_opens(tmp_path, demo_model):
    from core.plan.hardware import preset

    empty = tmp_path / "empty"
    empty.mkdir()
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"],
                                                    "auto_map": {"AutoModel": "x.Y"}}), encoding="utf-8")
    app = create_app(Options(), Backend(hardware=preset("t4")))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("enter")
        await settle(pilot)
        inp = app.screen.query_one("#model-input")
        for path, expected in ((empty, "has no config.json"), (remote, "remote code"),
                               (tmp_path / "nowhere" / "x" / "y", "no such folder")):
            inp.value = str(path)
            inp.focus()
            await pilot.press("enter")
            await settle(pilot)
            assert expected in status_text(app), status_text(app)
            assert app.session.model is None
        inp.value = f"'{demo_model}'"  # as a terminal pastes a dropped folder
        inp.focus()
        await pilot.press("enter")
        await settle(pilot)
        assert app.session.model is not None and app.session.model.source == "folder", status_text(app)
        assert inp.value == str(demo_model)
        assert "Mixtral" in app.screen.query_one("#model-facts").text


@sync
async def test_download_shows_bytes_and_rate_cancels_and_resumes(tmp_path, monkeypatch, demo_model):
    """The hub is replaced by a stand-in that reports progress and then waits for the test."""
    import threading

    import core.io.download as dl
    from core.plan.hardware import preset

    gate = threading.Event()
    calls = []

    def fake_download(repo_id, revision=None, *, progress, **kw):
        calls.append(repo_id)
        total = 4_000_000
        progress(dl.DownloadProgress(f"downloading {repo_id}", 1_000_000, total, "B", file="model.safetensors",
                                     rate=2_000_000.0))
        gate.wait(60)
        progress(dl.DownloadProgress(f"downloading {repo_id}", total, total, "B", rate=2_000_000.0))
        return demo_model

    monkeypatch.setattr(dl, "download_model", fake_download)
    app = create_app(Options(), Backend(hardware=preset("t4")))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("enter")
        await settle(pilot)
        inp = app.screen.query_one("#model-input")
        inp.value = "some-org/some-moe"
        inp.focus()
        await pilot.press("enter")
        text = app.screen.query_one("#dl-text")
        for _ in range(1000):  # wait for the progress message, not for time
            await pilot.pause()
            if "MB" in str(text.render()):
                break
        assert str(text.render()) == "1.0 MB of 4.0 MB at 2.0 MB/s"
        await pilot.press("x")  # cancel: the next progress callback stops the download
        gate.set()
        await settle(pilot)
        assert "download cancelled" in status_text(app) and "resume" in status_text(app)
        assert app.session.model is None and not app.screen.query_one("#download").display

        inp.value = "some-org/some-moe"  # again: the stand-in finishes this time
        inp.focus()
        await pilot.press("enter")
        await settle(pilot)
        assert app.session.model is not None and app.session.model.source == "hub", status_text(app)
        assert app.session.model.name == "some-org/some-moe"
        assert calls == ["some-org/some-moe", "some-org/some-moe"]


@sync
async def test_a_run_stopped_in_the_app_is_finished_by_mlight_run(tmp_path, monkeypatch):
    """The app writes the same run file and manifest as `mlight run`, so either resumes the other."""
    from app.cli import main as mlight

    prompts = write_prompts(tmp_path / "prompts.jsonl", n=4, max_new_tokens=3)
    out = tmp_path / "out.jsonl"
    ref: list = []
    app = create_app(Options(model="demo", prompts=str(prompts), out=str(out)), _StopAfterFirst(ref, max_new_tokens=3))
    ref.append(app)
    async with app.run_test(size=SIZE) as pilot:
        await settle_until(pilot, lambda app: app.session.plan is not None)
        for wid in ("batch", "micro", "expert"):
            app.screen.query_one(f"#{wid}").value = "1"
            await settle(pilot)
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        assert app.session.run_state == "stopped", status_text(app)
    kept = _jsonl(out.with_name(out.name + ".run.jsonl"))[1:]

    class Terminal(io.StringIO):  # a terminal's stderr, where `mlight run` keeps its progress line
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    code = mlight(["run", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "3"])
    err = sys.stderr.getvalue()
    assert code == 0, err
    assert f"resuming: {len(kept)} of 4 requests already done" in err
    # defect 16: the progress line counts the resumed session's results too: it ends at 4 of 4
    assert err.split("\r")[-1].startswith("4/4 requests done"), err.split("\r")[-1]
    final = _jsonl(out)
    assert [r["id"] for r in final] == [f"mtbench-{81 + i}" for i in range(4)]
    assert {r["id"]: r for r in final}[kept[0]["id"]] == kept[0]


@sync
async def test_a_budget_nothing_fits_in_says_so_on_the_plan(tmp_path):
    from core.plan.hardware import preset

    prompts = write_prompts(tmp_path / "p.jsonl", n=2, max_new_tokens=2)
    app = create_app(Options(model="demo", prompts=str(prompts), out=str(tmp_path / "o.jsonl"), gpu_mem=0.0,
                             cpu_mem=0.001), Backend(hardware=preset("t4")))
    async with app.run_test(size=SIZE) as pilot:
        await settle_until(pilot, lambda app: "nothing fits" in status_text(app))
        assert "nothing fits in the memory budget" in app.screen.query_one("#prediction").text
        assert app.screen.query_one("#accept").disabled
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert type(app.screen).__name__ == "PlanScreen"  # no run without a plan that fits


@sync
async def test_an_existing_results_file_is_replaced_only_when_confirmed(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", n=2, max_new_tokens=2)
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "old"}\n', encoding="utf-8")
    app = create_app(Options(model="demo", prompts=str(prompts), out=str(out)), Backend(max_new_tokens=2))
    async with app.run_test(size=SIZE) as pilot:
        await settle_until(pilot, lambda app: app.session.plan is not None)
        assert "o.jsonl exists" in str(app.screen.query_one("#out-note").render())
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert type(app.screen).__name__ == "PlanScreen" and "Ctrl+N again replaces it" in status_text(app)
        assert out.read_text(encoding="utf-8") == '{"id": "old"}\n'
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        assert app.session.run_state == "done", status_text(app)
    assert [r["id"] for r in _jsonl(out)] == ["mtbench-81", "mtbench-82"]


@sync
async def test_an_edited_policy_is_checked_live_and_overruns_are_named(tmp_path):
    from core.plan.hardware import preset

    prompts = write_prompts(tmp_path / "p.jsonl", n=4, max_new_tokens=4)
    app = create_app(Options(model="demo", prompts=str(prompts), out=str(tmp_path / "o.jsonl")),
                     Backend(hardware=preset("t4")))
    async with app.run_test(size=SIZE) as pilot:
        await settle_until(pilot, lambda app: app.session.plan is not None)
        screen = app.screen
        check = screen.query_one("#validation")
        screen.query_one("#gpu-mem").value = "0.005"
        await pilot.press("ctrl+r")  # re-plan now rather than after the typing pause
        await settle_until(pilot, lambda app: app.session.plan.gpu_budget == 5_000_000)
        assert "fits the budget" in str(check.render())
        screen.query_one("#attention").value = "cpu"
        screen.query_one("#ffn").value = "gpu"
        screen.query_one("#gpu-weights").value = "99"  # 12.6 MB of experts on a 5 MB GPU
        await settle_until(pilot, lambda app: "✗" in str(check.render()))
        assert "GPU memory: needs" in str(check.render()) and "over" in str(check.render())
        assert screen.query_one("#accept").disabled
        screen.query_one("#micro").value = "3"  # does not divide N
        await settle_until(pilot, lambda app: "not a multiple" in str(check.render()))
        await pilot.press("ctrl+r")  # back to the planner's choice
        await settle_until(pilot, lambda app: "fits the budget" in str(check.render()))
        assert not screen.query_one("#accept").disabled


@sync
async def test_the_demo_prompts_are_one_button_away(tmp_path):
    from core.plan.hardware import preset

    app = create_app(Options(), Backend(hardware=preset("t4")))
    async with app.run_test(size=SIZE) as pilot:
        await _to_prompts(pilot)
        await pilot.click("#demo-prompts")
        await settle(pilot)
        assert app.session.prompts is not None and app.session.prompts.count == 16, status_text(app)
        assert app.session.prompts.path.name == "demo_prompts.jsonl"


@sync
async def test_the_demo_prompts_have_a_key_named_in_the_footer_at_80_columns(tmp_path):
    """At 80×24 the button row can be off to the side of the eye: the footer names Ctrl+T, and Ctrl+T works
    while the path field has the focus (it is a priority binding, not a letter typed into the field)."""
    from textual.widgets import Footer

    from core.plan.hardware import preset

    app = create_app(Options(), Backend(hardware=preset("t4")))
    async with app.run_test(size=(80, 24)) as pilot:
        await _to_prompts(pilot)
        footer_keys = {b.binding.action for b in app.screen.active_bindings.values() if b.binding.show}
        assert "demo_prompts" in footer_keys and app.screen.query(Footer)
        assert app.focused is app.screen.query_one("#prompts-input")
        await pilot.press("ctrl+t")
        await settle(pilot)
        assert app.session.prompts is not None and app.session.prompts.count == 16, status_text(app)
