"""Snapshot tests (pytest-textual-snapshot) of every screen, with deterministic data.

Preset hardware (a T4 machine from core's datasheet presets, or a fixed CPU-only machine), the demo
model's real spec at a fixed display path, the bundled demo prompts, a fixed plan (so that tuning the
planner's cost model does not change these pictures), a frozen clock, and a scripted engine for the
Run and Results screens (their numbers must not depend on this machine's speed). The real planner
and the real engine are exercised in test_app_flow.py.
Update after an intended change: `pytest tests/test_app_snapshots.py --snapshot-update`, then look at the
SVGs (a browser opens them; cairosvg turns one into a PNG).
"""

from __future__ import annotations

import shutil

import pytest

from app.tui.app import create_app
from app.tui.session import Options
from test_app_support import DEMO_PROMPTS, FrozenClock, ScriptedBackend, run_over, settle, settle_until

WIDE, SMALL = (120, 40), (80, 24)
SIZES = pytest.mark.parametrize("size", [WIDE, SMALL], ids=["120x40", "80x24"])
THEMES = pytest.mark.parametrize("theme", ["textual-dark", "textual-light"], ids=["dark", "light"])


@pytest.fixture
def workdir(tmp_path, monkeypatch, demo_model):
    """A temp working dir holding the demo prompts, so the paths on screen are the same everywhere."""
    shutil.copy(DEMO_PROMPTS, tmp_path / "demo_prompts.jsonl")
    bad = DEMO_PROMPTS.read_text(encoding="utf-8").splitlines()[:3]
    bad.insert(1, '{"prompt": "unterminated')
    bad.insert(3, '{"messages": []}')
    (tmp_path / "some_bad.jsonl").write_text("\n".join(bad) + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _t4():
    from core.plan.hardware import preset

    return preset("t4")


def _cpu_only():
    from core.plan.hardware import HardwareSpec

    return HardwareSpec(name="local", gpu_name=None, gpu_count=0, gpu_mem_bytes=0, gpu_flops=0.0, gpu_bw=0.0,
                        h2d_bw=0.0, d2h_bw=0.0, cpu_flops=2.0e11, cpu_bw=2.0e10, cpu_mem_bytes=32 * 10**9,
                        cpu_cores=8, cpu_mem_available_bytes=24 * 10**9, source="probe",
                        measured=("cpu_bw", "cpu_flops"))


def _app(hardware=None, theme: str | None = None, **options):
    app = create_app(Options(**options), ScriptedBackend(hardware=hardware or _t4(), clock=FrozenClock()))
    if theme:
        app.theme = theme
    return app


def _direct(**kw):
    """Started as `mlight-app --model demo --prompts demo_prompts.jsonl --out results.jsonl`: opens on Plan."""
    return _app(model="demo", prompts="demo_prompts.jsonl", out="results.jsonl", **kw)


async def still(pilot):
    """Stop the text cursors blinking: a blink caught mid-way would make the picture differ run to run."""
    from textual.widgets import Input

    for screen in pilot.app.screen_stack:
        for inp in screen.query(Input):
            inp.cursor_blink = False
    await pilot.pause()


def _back(times: int):
    async def run(pilot):
        await _plan_ready(pilot)
        for _ in range(times):
            await pilot.press("escape")
            await settle(pilot)
        await still(pilot)

    return run


async def _settled(pilot):
    await settle(pilot, rounds=3)
    if pilot.app.session.options.prompts:
        await _plan_ready(pilot)
    await still(pilot)


async def _plan_ready(pilot):
    await settle_until(pilot, lambda app: app.session.plan is not None and type(app.screen).__name__ == "PlanScreen")


async def _run(pilot):
    await _plan_ready(pilot)
    await pilot.press("ctrl+n")  # accept the plan: the scripted run goes to its end
    await settle_until(pilot, run_over)


async def _to_results(pilot):
    await _run(pilot)
    await pilot.press("ctrl+n")
    await settle_until(pilot, lambda app: type(app.screen).__name__ == "ResultsScreen")
    await still(pilot)


def test_machine_t4(snap_compare, workdir):
    assert snap_compare(_app(), terminal_size=WIDE, run_before=_settled)


def test_machine_cpu_only(snap_compare, workdir):
    assert snap_compare(_app(hardware=_cpu_only()), terminal_size=WIDE, run_before=_settled)


def test_machine_small_terminal(snap_compare, workdir):
    assert snap_compare(_app(hardware=_cpu_only()), terminal_size=SMALL, run_before=_settled)


@SIZES
def test_model_demo(snap_compare, workdir, size):
    assert snap_compare(_direct(), terminal_size=size, run_before=_back(2))


@SIZES
def test_prompts_demo(snap_compare, workdir, size):
    assert snap_compare(_direct(), terminal_size=size, run_before=_back(1))


@SIZES
def test_prompts_with_bad_lines(snap_compare, workdir, size):
    app = _app(model="demo", prompts="some_bad.jsonl", out="results.jsonl")
    assert snap_compare(app, terminal_size=size, run_before=_back(1))


def test_plan_t4(snap_compare, workdir):
    assert snap_compare(_direct(), terminal_size=WIDE, run_before=_settled)


def test_plan_small_terminal(snap_compare, workdir):
    assert snap_compare(_direct(), terminal_size=SMALL, run_before=_settled)


def test_plan_invalid_micro_batch(snap_compare, workdir):
    async def edit(pilot):
        await _plan_ready(pilot)
        screen = pilot.app.screen
        screen.query_one("#micro").value = "5"  # does not divide N = 16
        await settle_until(pilot, lambda app: "✗" in str(screen.query_one("#validation").render()))
        await still(pilot)

    assert snap_compare(_direct(), terminal_size=WIDE, run_before=edit)


def test_plan_cpu_only(snap_compare, workdir):
    assert snap_compare(_direct(hardware=_cpu_only()), terminal_size=WIDE, run_before=_settled)



@SIZES
@THEMES
def test_run_throughput_chart(snap_compare, workdir, size, theme):
    """The Run screen at the end of a run: progress, the throughput chart (measured against predicted,
    with axes and units) and, at 120×40, the pipeline timelines below it."""

    async def run(pilot):
        await _run(pilot)
        await still(pilot)

    assert snap_compare(_direct(theme=theme), terminal_size=size, run_before=run)


@THEMES
def test_run_pipeline_timeline_small_terminal(snap_compare, workdir, theme):
    """At 80×24, t jumps to the last decode step, lane by lane and task by task, above the planner's
    simulation (at 120×40 both are on screen with the chart: test_run_throughput_chart)."""
    size = SMALL

    async def run(pilot):
        await _run(pilot)
        await pilot.press("t")
        await settle(pilot)
        await still(pilot)

    assert snap_compare(_direct(theme=theme), terminal_size=size, run_before=run)


def test_run_pipeline_zoomed_cpu_only(snap_compare, workdir):
    """CPU-only: the lanes say CPU, there are no PCIe lanes; z z shows the first layer alone."""

    async def run(pilot):
        await _run(pilot)
        await pilot.press("z", "z")
        await settle(pilot)
        await still(pilot)

    assert snap_compare(_direct(hardware=_cpu_only()), terminal_size=WIDE, run_before=run)


@SIZES
@THEMES
def test_help_screen(snap_compare, workdir, size, theme):
    async def run(pilot):
        await _plan_ready(pilot)
        await pilot.press("f1")
        await settle(pilot)
        await still(pilot)

    assert snap_compare(_direct(theme=theme), terminal_size=size, run_before=run)


def test_plan_advanced_choices(snap_compare, workdir):
    async def run(pilot):
        await _plan_ready(pilot)
        pilot.app.screen.query_one("#advanced").collapsed = False
        await settle(pilot)
        await still(pilot)

    assert snap_compare(_direct(), terminal_size=WIDE, run_before=run)


def test_plan_quantized_int4(snap_compare, workdir):
    """Advanced: int4 experts in groups of 32: the group's row appears, the plan says why and what it buys."""

    async def run(pilot):
        await _plan_ready(pilot)
        screen = pilot.app.screen
        screen.query_one("#advanced").collapsed = False
        screen.query_one("#quantize").value = "int4"
        await settle_until(pilot, lambda app: app.session.plan.quantize == "int4")
        screen.query_one("#group_size").value = 32
        await settle_until(pilot, lambda app: app.session.plan.group_size == 32)
        screen.query_one("#plan-form").scroll_end(animate=False)
        await settle(pilot)
        await still(pilot)

    assert snap_compare(_direct(), terminal_size=WIDE, run_before=run)


@SIZES
def test_plan_quantized_dense(snap_compare, workdir, size):
    """Advanced on a machine without a GPU: int4 experts, then "Dense weights" (shown only beside quantized
    experts) set to int8; the plan names both, as `mlight plan --quantize int4 --quantize-dense int8`."""

    async def run(pilot):
        await _plan_ready(pilot)
        screen = pilot.app.screen
        screen.query_one("#advanced").collapsed = False
        await settle(pilot)
        assert not screen.query_one("#quantize_dense").parent.display  # hidden beside unquantized experts
        screen.query_one("#quantize").value = "int4"
        await settle_until(pilot, lambda app: app.session.plan.quantize == "int4")
        assert screen.query_one("#quantize_dense").parent.display
        screen.query_one("#quantize_dense").value = "int8"
        await settle_until(pilot, lambda app: app.session.plan.quant_dense == "int8")
        screen.query_one("#plan-form").scroll_end(animate=False)
        await settle(pilot)
        await still(pilot)

    assert snap_compare(_direct(hardware=_cpu_only()), terminal_size=size, run_before=run)


@SIZES
def test_results(snap_compare, workdir, size):
    assert snap_compare(_direct(), terminal_size=size, run_before=_to_results)


def test_results_light(snap_compare, workdir):
    assert snap_compare(_direct(theme="textual-light"), terminal_size=WIDE, run_before=_to_results)


@SIZES
def test_result_detail(snap_compare, workdir, size):
    async def detail(pilot):
        await _to_results(pilot)
        await pilot.press("down", "enter")
        await settle(pilot)

    assert snap_compare(_direct(), terminal_size=size, run_before=detail)


@SIZES
def test_export_dialog(snap_compare, workdir, size):
    async def export(pilot):
        await _to_results(pilot)
        await pilot.press("c")
        await settle(pilot)
        await still(pilot)

    assert snap_compare(_direct(), terminal_size=size, run_before=export)


@SIZES
def test_plan_step_by_step(snap_compare, workdir, size):
    """Plan reached by keys (Machine, Model, Prompts, Plan) on a CPU-only machine: the same screen as opened from
    the command line (test_plan_cpu_only), bar the results file's default name."""

    async def steps(pilot):
        await settle(pilot)
        await pilot.press("enter")  # Machine → Model
        await settle(pilot)
        await pilot.press("enter")  # the demo model
        await settle(pilot)
        await pilot.press("ctrl+n")
        await settle(pilot)
        pilot.app.screen.query_one("#prompts-input").value = "demo_prompts.jsonl"
        pilot.app.screen.query_one("#prompts-input").focus()
        await pilot.press("enter")
        await settle(pilot)
        await pilot.press("ctrl+n")
        await _plan_ready(pilot)
        pilot.app.screen.query_one("#out").value = "results.jsonl"
        await settle(pilot)
        await still(pilot)

    assert snap_compare(_app(hardware=_cpu_only()), terminal_size=size, run_before=steps)


def test_plan_cpu_only_small_terminal(snap_compare, workdir):
    """The CPU-only Plan opened from the command line at 80×24 (beside test_plan_step_by_step)."""
    assert snap_compare(_direct(hardware=_cpu_only()), terminal_size=SMALL, run_before=_settled)


@SIZES
def test_confirm_quit(snap_compare, workdir, size):
    """q while a run is going asks first (the run's state set by hand: no engine thread held)."""
    from pathlib import Path

    async def ask(pilot):
        await _plan_ready(pilot)
        pilot.app.session.run_state = "running"
        pilot.app.session.out_path = Path("results.jsonl")
        await pilot.press("q")
        await pilot.pause()
        await still(pilot)

    assert snap_compare(_direct(), terminal_size=size, run_before=ask)
