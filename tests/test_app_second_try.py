"""What the app's second newcomer try found (after issue 12's 22 defects were fixed), one Pilot test each."""

from __future__ import annotations

from test_app_defects import _app, _check, _direct, _plan
from test_app_snapshots import workdir  # noqa: F401 - the fixture
from test_app_support import settle, sync

WIDE = (120, 40)


@sync
async def test_replanning_the_filled_in_budget_does_not_warn_it_is_above_the_gpu(workdir):
    """The form shows 17.2 for a T4's 17.18 GB: re-planning (Ctrl+R, or an Advanced choice) must plan for the
    budget filled in, not for its rounding, which is more than the GPU has."""
    app = _direct()
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        planned = app.session.plan.gpu_budget
        assert "more than" not in _check(app)
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert app.session.plan.gpu_budget == planned
        assert "more than" not in _check(app), _check(app)


@sync
async def test_prompts_demo_on_the_command_line_opens_on_plan_without_an_error(workdir):
    """`mlight-app --model demo --prompts demo` (`--help` offers 'demo'): straight to Plan, no 'not found'."""
    app = _app(model="demo", prompts="demo")
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        assert not app._notifications, [n.message for n in app._notifications]
        assert app.session.prompts.path.name == "demo_prompts.jsonl" and app.session.prompts.count == 16
        assert app.screen.query_one("#out").value.endswith("demo_prompts.results.jsonl")


def _line(app, wid: str) -> str:
    widget = app.screen.query_one(f"#{wid}")
    return "".join(seg.text for seg in widget.render_line(0))


@sync
async def test_long_paths_show_their_file_name_and_placeholders_fit_at_80x24(workdir):
    """A path set by the app (the default results file, the demo prompts) shows its end: the file's name, not
    the folders it starts with; the empty fields' hints are whole at 80 columns."""
    from test_app_defects import _to_model

    app = _app(model="demo", prompts="demo_prompts.jsonl")  # the results file in the (long) results folder
    async with app.run_test(size=WIDE) as pilot:
        await _plan(pilot)
        out = app.screen.query_one("#out")
        assert len(out.value) > out.size.width  # the path is longer than the field
        assert "demo_prompts.results.jsonl" in _line(app, "out"), _line(app, "out")
    app = _app()
    async with app.run_test(size=(80, 24)) as pilot:
        await _to_model(pilot)
        assert "folder, .gguf file or owner/name repo id" in _line(app, "model-input"), _line(app, "model-input")
        await pilot.press("enter")  # the demo model
        await settle(pilot)
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert "prompts file (Enter opens)" in _line(app, "prompts-input"), _line(app, "prompts-input")
        app.screen.action_demo_prompts()
        await settle(pilot)
        assert "demo_prompts.jsonl" in _line(app, "prompts-input"), _line(app, "prompts-input")


def test_the_parting_names_the_measured_rate_its_ratio_is_of():
    """The panel shows 'now' (the last steps) and 'average' (end to end); the tracker's ratio is of neither, so
    its warning says the decode rate it was taken from (before: '6.7× below' beside 713.2, 237.5 and 5,677.1)."""
    from app.tui.meter import RunSnapshot
    from app.tui.screens.run import RunScreen
    from core.plan.policy import Prediction
    from core.plan.tracking import Tracker
    from core.telemetry import StepDone

    tracker = Tracker(Prediction(1000.0, 1500.0, 9000.0, "gpu", 0, 0, {}), num_layers=2)
    for _ in range(10):
        tracker(StepDone("decode", 100, 0.1))  # 1,000 tokens/s against 1,500 predicted
    said = RunScreen._parted(RunSnapshot(comparison=tracker.comparison(), full_batch=True))
    assert said.startswith("decode measured at 1,000.0 tokens/s: 1.5× below the prediction — "), said


def test_the_first_batchs_prefill_is_named_while_nothing_can_be_counted():
    """int4 experts on a slow CPU: 16 s of prefill showed 'running', 0 tokens, 0 % and no sign of what it did."""
    from app.tui.meter import RunMeter
    from app.tui.screens.run import RunScreen
    from core.telemetry import StepDone

    meter = RunMeter(16, 384, batch_size=16)
    meter.set_state("running")
    assert "prefilling the first batch" in RunScreen._state_text(meter.snapshot())
    meter.on_event(StepDone("prefill", 0, 0.5, active=16))
    assert RunScreen._state_text(meter.snapshot()) == "running"


@sync
async def test_a_short_chart_far_below_its_prediction_still_labels_its_axis():
    """A 7-row chart, 131 tokens/s measured against 4,003 predicted: the y axis said only '0'."""
    from textual.app import App

    from app.tui.widgets.chart import ThroughputChart

    class One(App):
        CSS = "ThroughputChart { height: 7; }"

        def compose(self):
            yield ThroughputChart(id="c")

    app = One()
    async with app.run_test(size=(66, 9)) as pilot:
        chart = app.query_one(ThroughputChart)
        chart.show(((16.0, 120.0), (17.0, 131.0), (18.0, 131.4)), 4003.2)
        await pilot.pause()
        text = "\n".join("".join(seg.text for seg in line) for line in app.screen._compositor.render_strips())
        assert "5,000┤" in text and "0┤" in text, text


@sync
async def test_the_first_step_does_not_offer_esc_back(workdir):
    """On Machine, the footer said 'esc Back' and Esc did nothing; the next step offers it and it works."""
    from test_app_defects import _screen_text, _to_model

    app = _app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert "esc Back" not in _screen_text(app).splitlines()[-1]
        await _to_model(pilot)
        assert "esc Back" in _screen_text(app).splitlines()[-1]
        await pilot.press("escape")
        await settle(pilot)
        assert type(app.screen).__name__ == "MachineScreen"


def test_mlight_app_help_says_every_options_default():
    """As `mlight`'s commands do (issue 12's defect 18): what happens without the flag."""
    from app.tui.main import build_parser

    for action in build_parser()._actions:
        if action.dest not in ("help", "version"):
            assert "(default: " in action.help, action.dest


def test_the_timelines_legend_never_parts_a_colour_from_its_name():
    """At 80×24 the legend wrapped between '■' and 'post-attention' (Rich breaks at a no-break space too)."""
    from rich.cells import cell_len

    from app.tui.widgets.timeline import KIND_NAMES, legend

    kinds = list(KIND_NAMES)
    for width in (30, 60, 74, 118):
        lines = legend(kinds, width).plain.split("\n")
        assert all(cell_len(line) <= width for line in lines), lines
        items = [item for line in lines for item in line.split("  ")]
        assert items == [f"■ {KIND_NAMES[k]}" for k in kinds], lines  # each whole, on one line, in order


@sync
async def test_while_paused_the_footer_offers_space_to_continue(workdir):
    """Paused, the footer still said 'space Pause'."""
    import threading

    from test_app_defects import _screen_text
    from test_app_snapshots import _t4
    from test_app_support import FrozenClock, ScriptedBackend, run_over, settle_until, wait_event

    gate = threading.Event()
    backend = ScriptedBackend(hardware=_t4(), clock=FrozenClock(), gate=gate)
    app = _direct(backend=backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await _plan(pilot)
        await pilot.press("ctrl+n")
        await wait_event(pilot, backend.held)
        footer = _screen_text(app).splitlines()[-1]
        assert "space Pause" in footer and "Continue" not in footer, footer
        await pilot.press("space")
        await pilot.pause()
        footer = _screen_text(app).splitlines()[-1]
        assert app.session.run_state == "paused" and "space Continue" in footer and "Pause" not in footer, footer
        await pilot.press("space")
        await pilot.pause()
        assert app.session.run_state == "running" and "space Pause" in _screen_text(app).splitlines()[-1]
        gate.set()
        await settle_until(pilot, run_over)
        assert app.session.run_state == "done"


def test_the_pipeline_sets_the_median_step_beside_the_simulation_not_one_step():
    """A walkthrough's panel read one step, 7.3 ms, as 2.6× the 2.8 ms simulation while the run's throughput was
    within 3 % of its prediction: the ratio is of the median of the last seconds' steps, and says of how many."""
    from app.tui.meter import RunMeter
    from app.tui.screens.run import RunScreen
    from types import SimpleNamespace

    from core.telemetry import StepDone
    from test_app_support import FrozenClock

    task = [SimpleNamespace(resource="gpu", kind="ffn", layer=0)]
    clock = FrozenClock(10.0)
    meter = RunMeter(16, 1000, batch_size=16, clock=clock)
    for seconds in (0.0028, 0.0030, 0.0029, 0.0031, 0.0073):  # the last one slow: the one drawn
        clock.t += 0.3
        meter.on_event(StepDone("decode", 16, seconds, {"gpu": seconds}, active=16,
                                tasks=task, times=[0.0, seconds]))
    snap = meter.snapshot()
    assert snap.timeline.seconds == 0.0073 and snap.typical_steps == 5 and snap.typical_step_s == 0.0030
    head = RunScreen._measured_head(snap, 0.0028).plain
    assert head.startswith("Measured · 1.1× simulated: median of 5 steps 3.0 ms · drawn"), head
    assert head.endswith("drawn: 7.3 ms, 16 requests") and "fewer" not in head, head
    # steps with fewer requests in flight than the plan's batch are not what the simulation describes: said so
    meter = RunMeter(16, 1000, batch_size=16, clock=clock)
    meter.on_event(StepDone("decode", 8, 0.002, {"gpu": 0.002}, active=8, tasks=task, times=[0.0, 0.002]))
    assert "fewer requests than planned" in RunScreen._measured_head(meter.snapshot(), 0.0028).plain
