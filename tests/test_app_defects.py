"""The 22 defects issue 12 found in mlight-app on a newcomer's first try, one Pilot test each (the CLI ones
are in test_app_commands.py; 16's app side is in test_app_flow.py's stop-and-resume test).

Each test drives the app by keys, the way the defect was met, and fails on the code before its fix.
The scripted backend (test_app_support) keeps them fast and independent of this machine's speed; the
real engine and planner run in test_app_flow.py.
"""

from __future__ import annotations

import threading

from textual.widgets import Collapsible, Select

from app.tui.app import create_app
from app.tui.backend import Backend
from app.tui.session import Options
from test_app_snapshots import _cpu_only, _t4, workdir  # noqa: F401 - the fixture
from test_app_support import (FrozenClock, ScriptedBackend, pause_until, run_over, settle, settle_until, status_text,
                              sync, wait_event)

WIDE, SMALL = (120, 40), (80, 24)


def _app(hardware=None, backend=None, **options):
    backend = backend or ScriptedBackend(hardware=hardware or _t4(), clock=FrozenClock())
    return create_app(Options(**options), backend)


def _direct(**kw):
    kw.setdefault("out", "results.jsonl")
    return _app(model="demo", prompts="demo_prompts.jsonl", **kw)


async def _plan(pilot):
    await settle_until(pilot, lambda app: app.session.plan is not None and type(app.screen).__name__ == "PlanScreen")


async def _set(pilot, wid: str, value: str):
    pilot.app.screen.query_one(f"#{wid}").value = value
    await settle(pilot)


def _check(app) -> str:
    return str(app.screen.query_one("#validation").render())


def _facts(app, wid: str) -> str:
    return app.screen.query_one(f"#{wid}").text


def _screen_text(app) -> str:
    return "\n".join("".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips())


async def _to_model(pilot):
    await settle(pilot)
    await pilot.press("enter")  # Machine: "Continue to Model"
    await settle(pilot)
    assert type(pilot.app.screen).__name__ == "ModelScreen"


async def _to_prompts(pilot):
    await _to_model(pilot)
    await pilot.press("enter")  # the demo model
    await settle(pilot)
    await pilot.press("ctrl+n")
    await settle(pilot)
    assert type(pilot.app.screen).__name__ == "PromptsScreen"


# ---- 1: bf16 on a CPU without the kernels --------------------------------------------------------
@sync
async def test_01_a_cpu_that_cannot_run_bf16_is_told_so_and_offered_float32(workdir):
    backend = ScriptedBackend(hardware=_cpu_only(), clock=FrozenClock(),
                              fail_unless=lambda choices: choices is not None and choices.dtype == "float32")
    app = _direct(backend=backend)
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        assert app.session.run_state == "failed"
        assert "unexpected error" not in status_text(app)
        assert "float32" in status_text(app) and "Advanced" in status_text(app), status_text(app)
        await pilot.press("r")  # retrying the same settings would only fail again: it says what to do instead
        await settle(pilot)
        assert len(backend.loaded) == 1 and "float32" in status_text(app)
        await pilot.press("escape")
        await settle(pilot)
        screen = app.screen
        assert type(screen).__name__ == "PlanScreen"
        assert not screen.query_one("#advanced", Collapsible).collapsed
        assert app.focused is screen.query_one("#dtype", Select)
        assert "as stored in the checkpoint" in str(screen.query_one("#dtype-hint").render())  # each explained
        screen.query_one("#dtype", Select).value = "float32"
        await settle(pilot)
        assert "runs on every CPU" in str(screen.query_one("#dtype-hint").render())
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        assert app.session.run_state == "done", status_text(app)
    assert backend.loaded[-1].dtype == "float32"


# ---- 2, 3, 5, 10, 11: the Plan form ----------------------------------------------------------------
@sync
async def test_02_emptying_the_results_field_asks_for_a_name(workdir):
    app = _direct()
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        await _set(pilot, "out", "")
        assert app.return_code is None and type(app.screen).__name__ == "PlanScreen"
        assert "Type the results file" in str(app.screen.query_one("#out-note").render())
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert type(app.screen).__name__ == "PlanScreen" and "Type the results file" in status_text(app)


@sync
async def test_03_retyping_the_planners_own_value_makes_the_plan_stand_again(workdir):
    app = _direct()
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        await _set(pilot, "expert", "")
        assert "fill in Expert batch" in _check(app) and app.screen.query_one("#accept").disabled
        await _set(pilot, "expert", "8")  # the planner's own value again
        assert "fits the budget" in _check(app), _check(app)
        assert not app.screen.query_one("#accept").disabled
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert type(app.screen).__name__ == "RunScreen"


@sync
async def test_05_the_results_file_follows_a_newly_chosen_prompts_file(workdir):
    app = _app(model="demo", prompts="demo_prompts.jsonl")
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        assert app.screen.query_one("#out").value.endswith("demo_prompts.results.jsonl")
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        await pilot.press("escape")  # back to Plan
        await settle(pilot)
        await pilot.press("escape")  # back to Prompts
        await settle(pilot)
        inp = app.screen.query_one("#prompts-input")
        inp.value = "some_bad.jsonl"
        inp.focus()
        await pilot.press("enter")
        await settle(pilot)
        assert app.session.prompts.path.name == "some_bad.jsonl"
        await pilot.press("ctrl+n", "ctrl+n")  # the second agrees to skip its bad lines (issue 46's defect 6)
        await _plan(pilot)
        assert app.screen.query_one("#out").value.endswith("some_bad.results.jsonl")


@sync
async def test_10_check_messages_use_the_labels_on_screen(workdir):
    app = _direct(gpu_mem=0.005)
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        await _set(pilot, "micro", "5")
        await settle_until(pilot, lambda app: "✗" in _check(app))
        text = _check(app)
        assert "Micro-batch μ" in text and "Batch N" in text
        assert "micro_batch_size" not in text and "Policy." not in text
        await _set(pilot, "micro", "4")
        await _set(pilot, "gpu-weights", "150")
        await settle_until(pilot, lambda app: "✗" in _check(app))
        assert "GPU experts % must be between 0 and 100, got 150" in _check(app), _check(app)
        await _set(pilot, "gpu-weights", "99")  # 12 MB of experts on a 5 MB GPU budget
        await settle_until(pilot, lambda app: "GPU memory" in _check(app))
        text = _check(app)
        assert "resident experts" in text and "dense weights" in text and "non_expert" not in text, text
        assert "usable (86% of the 0.01 GB budget)" in text, text


@sync
async def test_11_an_invalid_policy_clears_the_prediction_and_usable_memory_is_explained(workdir):
    app = _direct()
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        assert "1,234.5 tokens/s" in _facts(app, "prediction")
        usable = str(app.screen.query_one("#usable").render())
        assert "86% of the GPU budget" in usable and "80% of the CPU budget" in usable
        assert "/ 14.8 GB" in str(app.screen.query_one("#mem-gpu").render())  # usable, not the 17.2 GB budget
        await _set(pilot, "micro", "5")
        await settle_until(pilot, lambda app: "✗" in _check(app))
        assert "1,234.5" not in _facts(app, "prediction")
        assert "not valid" in _facts(app, "prediction")


# ---- 4, 13, 14: the Model step --------------------------------------------------------------------
@sync
async def test_04_after_open_the_field_keeps_the_keys(workdir, tmp_path):
    app = _app()
    async with app.run_test(size=WIDE) as pilot:
        await _to_model(pilot)
        inp = app.screen.query_one("#model-input")
        inp.value = str(tmp_path / "models")
        await pilot.click("#open")
        await settle(pilot)
        assert app.focused is inp
        await pilot.press("/", "d", "e", "m", "o")  # a path with a `d` in it: letters, not the demo key
        await settle(pilot)
        assert inp.value.endswith("/demo") and app.session.model is None
        assert type(app.screen).__name__ == "ModelScreen"


@sync
async def test_13_a_model_that_cannot_be_opened_says_so_in_the_model_panel(workdir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    app = _app()
    async with app.run_test(size=WIDE) as pilot:
        await _to_model(pilot)
        inp = app.screen.query_one("#model-input")
        inp.value = str(empty)
        inp.focus()
        await pilot.press("enter")
        await settle(pilot)
        facts = _facts(app, "model-facts")
        assert "none chosen yet" not in facts and "has no config.json" in facts, facts
        inp.value = str(tmp_path / "nowhere")
        await pilot.press("enter")
        await settle(pilot)
        assert "no such folder" in _facts(app, "model-facts")


@sync
async def test_14_a_bad_command_line_opens_on_the_step_to_fix(workdir):
    app = _app(model="no-such-folder", prompts="missing.txt")
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot, rounds=3)
        assert type(app.screen).__name__ == "ModelScreen"
        assert "no such folder" in _facts(app, "model-facts")
        said = "\n".join(n.message for n in app._notifications)
        assert "no-such-folder" in said and "missing.txt: not found" in said


# ---- 6, 15, 17, 21: the Run step ----------------------------------------------------------------
@sync
async def test_06_measured_is_shown_beside_predicted_and_their_parting_is_said(workdir):
    from app.tui.meter import RunSnapshot
    from app.tui.screens.run import RunScreen

    app = _direct()
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        tps = str(app.screen.query_one("#tps").render())
        assert "1,502.2 predicted" in tps  # the plan's decode prediction, beside the measured 134.3
        assert "134.3 tokens/s now" in tps and "11.2× below the prediction" in tps, tps
        log = "\n".join(str(line.text) for line in app.screen.query_one("#log").lines)
        assert "11.2× below the prediction" in log
    from core.plan.policy import Prediction
    from core.plan.tracking import Tracker
    from core.telemetry import StepDone

    def snapshot(tokens_per_step: int) -> RunSnapshot:  # ten decode steps of 0.1 s against 1,500 tokens/s
        tracker = Tracker(Prediction(1000.0, 1500.0, 9000.0, "gpu", 0, 0, {}), num_layers=2)
        for _ in range(10):
            tracker(StepDone("decode", tokens_per_step, 0.1))
        return RunSnapshot(comparison=tracker.comparison(), full_batch=True)

    assert RunScreen._parted(snapshot(130)) == ""  # 1,300 against 1,500: within the 25 % it tolerates
    assert "1.4× above" in RunScreen._parted(snapshot(210))
    assert "1.5× below" in RunScreen._parted(snapshot(100))


@sync
async def test_15_cpu_only_output_never_says_gpu_compute_or_pcie(workdir):
    app = _direct(hardware=_cpu_only())
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        facts = _facts(app, "prediction")
        assert "GPU compute" not in facts and "CPU compute" in facts, facts
        assert not app.screen.query_one("#res-h2d").display and not app.screen.query_one("#res-d2h").display
        assert app.screen.query_one("#res-compute").label == "CPU compute"
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        text = _screen_text(app)
        assert "CPU compute" in text and "GPU compute" not in text and "H→D" not in text and "PCIe" not in text


@sync
async def test_17_elapsed_time_and_eta_stand_still_while_paused(workdir):
    gate, clock = threading.Event(), FrozenClock()
    backend = ScriptedBackend(hardware=_t4(), clock=clock, gate=gate)
    app = _direct(backend=backend)
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        await pilot.press("ctrl+n")
        await wait_event(pilot, backend.held)  # the engine is between two decode steps, held there
        screen = app.screen
        # every step before the gate has reached the screen (its snapshots were taken before the clock
        # moves), and is drawn, so the next redraw takes a fresh snapshot
        await pause_until(pilot, lambda app: app.screen._latest.decode_steps == backend.last_engine.hold_after)
        screen._redraw_if_dirty()
        clock.t += 30
        screen._redraw_if_dirty()
        before = _facts(app, "progress-facts")
        assert "0:30" in before.split("Time: ")[1], before
        await pilot.press("space")
        await pilot.pause()
        screen._redraw_if_dirty()
        assert "State: paused" in _facts(app, "progress-facts")
        clock.t += 600  # ten minutes paused
        screen._redraw_if_dirty()
        assert _facts(app, "progress-facts").split("Time: ")[1] == before.split("Time: ")[1]
        await pilot.press("space")
        await pilot.pause()
        gate.set()
        await settle_until(pilot, run_over)
        assert app.session.run_state == "done"


@sync
async def test_21_budgets_above_the_machine_warn_and_quitting_a_run_asks_first(workdir):
    gate = threading.Event()
    backend = ScriptedBackend(hardware=_cpu_only(), clock=FrozenClock(), gate=gate)
    app = _direct(backend=backend, gpu_mem=15, cpu_mem=150)
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        check = _check(app)
        assert "this machine has no GPU" in check and "more than this machine's 32.0 GB of RAM" in check, check
        assert "warning" in status_text(app)
        await pilot.press("ctrl+n")
        await wait_event(pilot, backend.held)
        for key in ("ctrl+q", "q"):
            await pilot.press(key)
            await pilot.pause()
            assert type(app.screen).__name__ == "ConfirmQuit" and app.return_code is None
            await pilot.press("n")
            await pilot.pause()
            assert type(app.screen).__name__ == "RunScreen" and app.return_code is None
        gate.set()
        await settle_until(pilot, run_over)
        assert app.session.run_state == "done"


# ---- 7, 20: what fits the terminal ----------------------------------------------------------------
def _records(prompts_outputs):
    return [{"id": f"r{i}", "prompt": p, "output": o, "prompt_tokens": 10, "output_tokens": 5, "seconds": 1.25,
             "finish_reason": "stop"} for i, (p, o) in enumerate(prompts_outputs)]


def _table_lines(app, rows: int) -> list[str]:
    table = app.screen.query_one("#results")
    return ["".join(seg.text for seg in table.render_line(y)) for y in range(rows)]


@sync
async def test_07_results_columns_shrink_with_the_terminal(workdir):
    from app.tui.screens.results import ResultsScreen

    recs = _records([("A prompt long enough to be cut somewhere " * 3, "An output long enough to be cut too " * 3)])
    app = _app()
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot)
        app.push_screen(ResultsScreen(recs))
        await settle(pilot)
        assert "finish" in _table_lines(app, 1)[0]
        await pilot.resize_terminal(80, 24)
        await settle(pilot)
        header, row = _table_lines(app, 2)
        assert "finish" in header and "stop" in row and "1.25" in row, header


@sync
async def test_20_at_80x24_the_plan_shows_check_and_accept(workdir):
    app = _direct()
    async with app.run_test(size=SMALL) as pilot:
        await _plan(pilot)
        screen_region = app.screen.region
        for wid in ("#accept", "#validation"):
            region = app.screen.query_one(wid).region
            assert region.area and screen_region.contains_region(region), wid
            assert region in app.screen.find_widget(app.screen.query_one(wid)).region
        assert "Accept and run" in _screen_text(app) and "fits the budget" in _screen_text(app)


@sync
async def test_20_wide_characters_keep_the_results_columns_in_line(workdir):
    from app.tui.screens.results import ResultsScreen

    app = _app()
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot)
        recs = _records([("Plain English prompt about the sea and the sky", "An answer in plain English"),
                         ("日本語のプロンプトです。海と空について教えてください。", "答えは日本語で書かれています。とても長い答えです。"),
                         ("bad bytes \ufffd\ufffd\ufffd here", "emoji 😀😀😀 in the output and more text after it")])
        app.push_screen(ResultsScreen(recs))
        await settle(pilot)
        from rich.cells import cell_len

        lines = _table_lines(app, 4)
        cols = {cell_len(line[:line.find("10→5")]) if "10→5" in line else None for line in lines[1:]}  # tokens column
        assert len(cols) == 1 and None not in cols, lines  # on screen, and in line
        assert len({cell_len(line) for line in lines}) == 1


# ---- 8, 9, 12, 19: keys, words, the file tree, where results go -----------------------------------
@sync
async def test_08_quit_and_help_are_visible_and_work_on_the_first_screen(workdir):
    app = _app()
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        footer = _screen_text(app).splitlines()[-1]
        assert "^q Quit" in footer and "? Help" in footer, footer
        for key in ("question_mark", "f1"):
            await pilot.press(key)
            await settle(pilot)
            assert type(app.screen).__name__ == "HelpScreen"
            assert "Keys everywhere" in _screen_text(app) and "Steps" in _screen_text(app)
            assert ("r", "Re-probe") in app.screen._screen_keys()  # the keys of the screen it was opened on
            await pilot.press("escape")
            await settle(pilot)
            assert type(app.screen).__name__ == "MachineScreen" and app.return_code is None
        await pilot.press("q")  # no run going: q quits at once
        await settle(pilot)
        assert app.return_code == 0


@sync
async def test_08_ctrl_c_quits_outside_text_fields(workdir):
    app = _app()
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+c")
        await settle(pilot)
        assert app.return_code == 0


@sync
async def test_09_errors_name_what_to_do_in_the_app_not_a_command_line_flag(workdir):
    app = _app()
    async with app.run_test(size=WIDE) as pilot:
        await _to_prompts(pilot)
        inp = app.screen.query_one("#prompts-input")
        inp.value = "missing.txt"
        inp.focus()
        await pilot.press("enter")
        await settle(pilot)
        assert "not found" in status_text(app) and "--" not in status_text(app), status_text(app)
    from app.tui.wording import for_screen
    from core.errors import BudgetError, UsageError

    for error in (UsageError("output folder x does not exist", "create it first or choose another --out"),
                  UsageError("--out x is a folder", "give a file name ending in .jsonl or .csv"),
                  BudgetError("nothing fits", "raise --gpu-mem / --cpu-mem, pick a machine with more memory, "
                                              "or shorten --prompt-len / --gen-len")):
        assert "--" not in for_screen(str(error)), for_screen(str(error))


@sync
async def test_12_esc_closes_the_file_tree_and_backspace_climbs_out_of_its_folder(workdir):
    app = _app()
    async with app.run_test(size=WIDE) as pilot:
        await _to_prompts(pilot)
        # (no settle while the tree is open: its loader worker lives as long as the tree)
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert app.screen.query("#tree")
        await pilot.press("escape")
        await pilot.pause()
        assert type(app.screen).__name__ == "PromptsScreen" and not app.screen.query("#tree")
        await pilot.press("ctrl+o")
        await pilot.pause()
        tree = app.screen.query_one("#tree")
        start = tree.path
        assert app.focused is tree
        await pilot.press("backspace")
        await pilot.pause()
        assert str(tree.path) == str(workdir.resolve().parent) and str(start) != str(tree.path)
        await pilot.press("escape")
        await pilot.pause()


@sync
async def test_19_results_go_to_the_results_folder_not_the_working_folder(workdir, tmp_path_factory, monkeypatch):
    results = tmp_path_factory.mktemp("documents") / "my results"
    monkeypatch.setenv("MLIGHT_RESULTS_DIR", str(results))  # made on first use
    before = sorted(p.name for p in workdir.iterdir())
    app = _app(model="demo", prompts="demo_prompts.jsonl")
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        assert app.screen.query_one("#out").value == str(results / "demo_prompts.results.jsonl")
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        assert app.session.run_state == "done", status_text(app)
    assert (results / "demo_prompts.results.jsonl").is_file()
    after = sorted(p.name for p in workdir.iterdir())
    assert after == before, after  # the working folder (a checkout) stays clean


# ---- beyond the defects: Advanced choices reach the planner and the engine ----------------------------
class _LoadRecorder(Backend):
    """The real backend and engine, noting the choices each engine was loaded with."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.loaded: list = []

    def engine(self, path, policy=None, progress=lambda e: None, choices=None):
        self.loaded.append(choices)
        return super().engine(path, policy, progress, choices=choices)


@sync
async def test_advanced_quantization_replans_for_that_format_and_the_run_loads_it(workdir):
    from test_app_support import write_prompts

    write_prompts(workdir / "two.jsonl", n=2, max_new_tokens=3)
    backend = _LoadRecorder(hardware=_cpu_only(), max_new_tokens=3)
    app = create_app(Options(model="demo", prompts="two.jsonl", out="r.jsonl"), backend)
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        screen = app.screen
        assert "Experts" not in _facts(app, "prediction")
        screen.query_one("#advanced", Collapsible).collapsed = False
        assert not screen.query_one("#group_size").parent.display  # int4's group only once int4 may be chosen
        screen.query_one("#quantize", Select).value = "int4"
        await settle_until(pilot, lambda app: app.session.plan.quantize == "int4")
        assert screen.query_one("#group_size").parent.display
        assert "4-bit experts" in str(screen.query_one("#quantize-hint").render())
        screen.query_one("#group_size", Select).value = 32
        await settle_until(pilot, lambda app: app.session.plan.group_size == 32)
        facts = _facts(app, "prediction")
        assert "Experts: int4, group 32: asked for int4-g32" in facts, facts
        plan = app.session.plan
        assert plan.quant_speedup == plan.prediction.tokens_per_s / plan.quant_baseline_tps  # core's choose, shown
        assert f"{plan.quant_speedup:.2f}× the unquantized model's" in facts, facts
        assert ("Speed-up: none: " in facts) == (plan.quant_speedup < 1), facts  # slower said as such
        assert app.session.choices.quantize == "int4" and app.session.choices.group_size == 32
        manifest = backend.manifest(app.session.model, app.session.prompts, plan, app.session.choices)
        assert manifest["settings"]["quantize"] == "int4" and manifest["settings"]["group_size"] == 32  # as mlight run
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        assert app.session.run_state == "done", status_text(app)
        assert backend.loaded[-1].load_kwargs() == {"quantize": "int4", "group_size": 32}
        assert backend._engine[1].spec.expert_format == "int4-g32"  # the engine holds its experts in that format
    import json

    records = [json.loads(line) for line in (workdir / "r.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == ["mtbench-81", "mtbench-82"]
    assert set(records[0]) == {"id", "prompt", "output", "output_token_ids", "prompt_tokens", "output_tokens",
                               "finish_reason", "seconds"}  # the results look as they do unquantized


@sync
async def test_a_fitted_band_is_shown_beside_every_prediction(workdir):
    """Issue 43, item 1: where the CPU cost model's fit gives a band, the Plan and Run screens show it as
    `mlight plan` does ("± 12 %"); without one (no fit), the bare figure."""
    import dataclasses

    app = _direct()
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        plan = app.session.plan
        assert "±" not in _facts(app, "prediction")  # the scripted machine has no fitted CPU model
        app.session.plan = plan = dataclasses.replace(plan, prediction=dataclasses.replace(plan.prediction, band=0.12))
        app.screen.show(plan)
        await settle(pilot)
        facts = _facts(app, "prediction")
        assert "tokens/s end to end ± 12%" in facts and f"{plan.prediction.decode_tokens_per_s:,.1f} tokens/s ± 12%" in facts
        await pilot.press("ctrl+n")
        await settle_until(pilot, run_over)
        assert f"{plan.prediction.decode_tokens_per_s:,.1f} ± 12% predicted" in str(app.screen.query_one("#tps").render())
