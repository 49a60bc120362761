"""Snapshot tests (pytest-textual-snapshot) of every screen, with deterministic data.

Preset hardware (a T4 machine from core's datasheet presets, or a fixed CPU-only machine), the demo
model's real spec at a fixed display path, the bundled demo prompts, a fixed plan (so that tuning the
planner's cost model does not change these pictures), a frozen clock, and a scripted engine for the
Run and Results screens (their numbers must not depend on this machine's speed). The real planner
and the real engine are exercised in test_app_flow.py.

Most of an app run's cost is starting the app and reaching the Plan screen, so the pictures that lie on one
path through the app (Plan, Help, Run, Results, Export, Detail ...) are taken in one run, a journey
(`JOURNEYS`): each test compares its own picture, taken where a run of its own would take it, with the keys
and waits of that run, and the stored SVGs are the same as with one run per picture.
Update after an intended change: `pytest tests/test_app_snapshots.py --snapshot-update`, then look at the
SVGs (a browser opens them; cairosvg turns one into a PNG).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from textual.app import App

from app.tui.app import create_app
from app.tui.session import Options
from test_app_support import DEMO_PROMPTS, FrozenClock, ScriptedBackend, run_over, settle, settle_until

WIDE, SMALL = (120, 40), (80, 24)
SIZES = pytest.mark.parametrize("size", [WIDE, SMALL], ids=["120x40", "80x24"])


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


async def _back(pilot, times: int):
    for _ in range(times):
        await pilot.press("escape")
        await settle(pilot)
    await still(pilot)


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
    await pilot.press("ctrl+n")
    await settle_until(pilot, lambda app: type(app.screen).__name__ == "ResultsScreen")
    await still(pilot)


async def _help(pilot):
    """F1 over the Plan screen, then closed again."""
    await _plan_ready(pilot)
    await pilot.press("f1")
    await settle(pilot)
    await still(pilot)


async def _close(pilot):
    await pilot.press("escape")
    await settle(pilot)


# ---- journeys: (how the app starts, terminal size, the path through it) --------------------------------------
# Each `steps(pilot, shot)` awaits `shot(name)` where a test's picture is taken; the tests below name theirs.
# A picture's steps are those its test had on its own (its run_before), after the pictures before it on the path.


async def _plan_help_run_results(pilot, shot):
    await _settled(pilot)
    await shot("plan")
    await _help_then_run(pilot, shot)
    await _results_export_detail(pilot, shot)


async def _results_export_detail(pilot, shot):
    await _to_results(pilot)
    await shot("results")
    await pilot.press("c")
    await settle(pilot)
    await still(pilot)
    await shot("export")
    await _close(pilot)
    await pilot.press("down", "enter")
    await settle(pilot)
    await shot("detail")


async def _plan_help_run_timeline_results(pilot, shot):
    """At 80x24: as _plan_help_run_results, and the Run screen's timeline (t) before Results."""
    await _settled(pilot)
    await shot("plan")
    await _help_then_run(pilot, shot)
    await _timeline(pilot)
    await shot("timeline")
    await _results_export_detail(pilot, shot)


async def _timeline(pilot):
    await pilot.press("t")
    await settle(pilot)
    await still(pilot)


async def _back_to_prompts_and_model(pilot, shot):
    await _plan_ready(pilot)
    await _back(pilot, 1)
    await shot("prompts")
    await _back(pilot, 1)
    await shot("model")


async def _advanced_then_int4(pilot, shot):
    await _plan_ready(pilot)
    screen = pilot.app.screen
    screen.query_one("#advanced").collapsed = False
    await settle(pilot)
    await still(pilot)
    await shot("advanced")
    screen.query_one("#quantize").value = "int4"
    await settle_until(pilot, lambda app: app.session.plan.quantize == "int4")
    screen.query_one("#group_size").value = 32
    await settle_until(pilot, lambda app: app.session.plan.group_size == 32)
    screen.query_one("#plan-form").scroll_end(animate=False)
    await settle(pilot)
    await still(pilot)
    await shot("int4")


async def _invalid_micro_batch(pilot, shot):
    await _plan_ready(pilot)
    screen = pilot.app.screen
    screen.query_one("#micro").value = "5"  # does not divide N = 16
    await settle_until(pilot, lambda app: "✗" in str(screen.query_one("#validation").render()))
    await still(pilot)
    await shot("invalid")


async def _confirm_quit(pilot, shot):
    """q while a run is going asks first (the run's state set by hand: no engine thread held)."""
    await _plan_ready(pilot)
    pilot.app.session.run_state = "running"
    pilot.app.session.out_path = Path("results.jsonl")
    await pilot.press("q")
    await pilot.pause()
    await still(pilot)
    await shot("quit")


async def _help_then_run(pilot, shot):
    await _help(pilot)
    await shot("help")
    await _close(pilot)
    await _run(pilot)
    await still(pilot)
    await shot("run")


async def _help_run_results(pilot, shot):
    await _help_then_run(pilot, shot)
    await _to_results(pilot)
    await shot("results")


async def _help_run_timeline(pilot, shot):
    await _help_then_run(pilot, shot)
    await _timeline(pilot)
    await shot("timeline")


async def _plan_run_zoomed(pilot, shot):
    await _settled(pilot)
    await shot("plan")
    await _run(pilot)
    await pilot.press("z", "z")
    await settle(pilot)
    await still(pilot)
    await shot("zoomed")


async def _plan_then_dense(pilot, shot):
    await _settled(pilot)
    await shot("plan")
    await _dense(pilot, shot)


async def _dense(pilot, shot):
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
    await shot("dense")


async def _machine_then_steps(pilot, shot):
    await _settled(pilot)
    await shot("machine")
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
    await shot("steps")


async def _settled_shot(pilot, shot):
    await _settled(pilot)
    await shot("settled")


async def _bad_lines(pilot, shot):
    await _plan_ready(pilot)
    await _back(pilot, 1)
    await shot("prompts")


JOURNEYS = {
    "t4-wide": (_direct, {}, WIDE, _plan_help_run_results),
    "t4-small": (_direct, {}, SMALL, _plan_help_run_timeline_results),
    "t4-wide-back": (_direct, {}, WIDE, _back_to_prompts_and_model),
    "t4-small-back": (_direct, {}, SMALL, _back_to_prompts_and_model),
    "t4-wide-advanced": (_direct, {}, WIDE, _advanced_then_int4),
    "t4-wide-invalid": (_direct, {}, WIDE, _invalid_micro_batch),
    "t4-wide-quit": (_direct, {}, WIDE, _confirm_quit),
    "t4-small-quit": (_direct, {}, SMALL, _confirm_quit),
    "light-wide": (_direct, {"theme": "textual-light"}, WIDE, _help_run_results),
    "light-small": (_direct, {"theme": "textual-light"}, SMALL, _help_run_timeline),
    "cpu-wide": (_direct, {"hardware": _cpu_only}, WIDE, _plan_run_zoomed),
    "cpu-wide-dense": (_direct, {"hardware": _cpu_only}, WIDE, _dense),
    "cpu-small": (_direct, {"hardware": _cpu_only}, SMALL, _plan_then_dense),
    "cpu-machine-wide": (_app, {"hardware": _cpu_only}, WIDE, _machine_then_steps),
    "cpu-machine-small": (_app, {"hardware": _cpu_only}, SMALL, _machine_then_steps),
    "t4-machine": (_app, {}, WIDE, _settled_shot),
    "bad-wide": (_app, {"model": "demo", "prompts": "some_bad.jsonl", "out": "results.jsonl"}, WIDE, _bad_lines),
    "bad-small": (_app, {"model": "demo", "prompts": "some_bad.jsonl", "out": "results.jsonl"}, SMALL, _bad_lines),
}


class _Taken(App):
    """A picture a journey took, for snap_compare: the plugin runs the app it is given and compares what the run
    returns with the stored SVG (and reports a difference), so this app's run returns the picture."""

    def __init__(self, svg: str):
        super().__init__()
        self.svg = svg

    def run(self, *args, **kwargs) -> str:
        return self.svg


@pytest.fixture(scope="module")
def _taken() -> dict:
    return {}


@pytest.fixture
def picture(workdir, _taken):
    """picture(journey, name): that journey's picture `name`, the journey run (in this test's working dir) by the
    first test that asks for one of its pictures."""

    def get(journey: str, name: str) -> App:
        if journey not in _taken:
            _taken[journey] = _take(*JOURNEYS[journey])
        return _Taken(_taken[journey][name])

    return get


def _take(make, options: dict, size: tuple[int, int], steps) -> dict[str, str]:
    app = make(**{k: v() if callable(v) else v for k, v in options.items()})
    title, pictures = app.title, {}

    async def auto_pilot(pilot) -> None:
        async def shot(name: str) -> None:
            # what snap_compare's screenshot (textual._doc.take_svg_screenshot) does once its run_before is done
            await pilot.pause()
            await pilot.wait_for_scheduled_animations()
            await pilot.pause()
            await pilot.pause()
            await pilot.wait_for_scheduled_animations()
            pictures[name] = pilot.app.export_screenshot(title=title, simplify=True)

        await steps(pilot, shot)
        pilot.app.exit()

    app.run(headless=True, auto_pilot=auto_pilot, size=size)
    return pictures


def test_machine_t4(snap_compare, picture):
    assert snap_compare(picture("t4-machine", "settled"), terminal_size=WIDE)


def test_machine_cpu_only(snap_compare, picture):
    assert snap_compare(picture("cpu-machine-wide", "machine"), terminal_size=WIDE)


def test_machine_small_terminal(snap_compare, picture):
    assert snap_compare(picture("cpu-machine-small", "machine"), terminal_size=SMALL)


@SIZES
def test_plan_step_by_step(snap_compare, picture, size):
    """Plan reached by keys (Machine, Model, Prompts, Plan) on a CPU-only machine: the same screen as opened from
    the command line (test_plan_cpu_only), bar the results file's default name."""
    assert snap_compare(picture(f"cpu-machine-{_wide(size)}", "steps"), terminal_size=size)


@SIZES
def test_model_demo(snap_compare, picture, size):
    assert snap_compare(picture(f"t4-{_wide(size)}-back", "model"), terminal_size=size)


@SIZES
def test_prompts_demo(snap_compare, picture, size):
    assert snap_compare(picture(f"t4-{_wide(size)}-back", "prompts"), terminal_size=size)


@SIZES
def test_prompts_with_bad_lines(snap_compare, picture, size):
    assert snap_compare(picture(f"bad-{_wide(size)}", "prompts"), terminal_size=size)


def test_plan_t4(snap_compare, picture):
    assert snap_compare(picture("t4-wide", "plan"), terminal_size=WIDE)


def test_plan_small_terminal(snap_compare, picture):
    assert snap_compare(picture("t4-small", "plan"), terminal_size=SMALL)


def test_plan_invalid_micro_batch(snap_compare, picture):
    assert snap_compare(picture("t4-wide-invalid", "invalid"), terminal_size=WIDE)


@SIZES
@pytest.mark.parametrize("theme", ["dark", "light"])
def test_help_screen(snap_compare, picture, size, theme):
    journey = f"t4-{_wide(size)}" if theme == "dark" else f"light-{_wide(size)}"  # dark: Textual's default
    assert snap_compare(picture(journey, "help"), terminal_size=size)


@SIZES
@pytest.mark.parametrize("theme", ["dark", "light"])
def test_run_throughput_chart(snap_compare, picture, size, theme):
    """The Run screen at the end of a run: progress, the throughput chart (measured against predicted,
    with axes and units) and, at 120×40, the pipeline timelines below it."""
    journey = f"t4-{_wide(size)}" if theme == "dark" else f"light-{_wide(size)}"
    assert snap_compare(picture(journey, "run"), terminal_size=size)


@pytest.mark.parametrize("theme", ["dark", "light"])
def test_run_pipeline_timeline_small_terminal(snap_compare, picture, theme):
    """At 80×24, t jumps to the last decode step, lane by lane and task by task, above the planner's
    simulation (at 120×40 both are on screen with the chart: test_run_throughput_chart)."""
    journey = "t4-small" if theme == "dark" else "light-small"
    assert snap_compare(picture(journey, "timeline"), terminal_size=SMALL)


def test_run_pipeline_zoomed_cpu_only(snap_compare, picture):
    """CPU-only: the lanes say CPU, there are no PCIe lanes; z z shows the first layer alone."""
    assert snap_compare(picture("cpu-wide", "zoomed"), terminal_size=WIDE)


def test_plan_advanced_choices(snap_compare, picture):
    assert snap_compare(picture("t4-wide-advanced", "advanced"), terminal_size=WIDE)


def test_plan_quantized_int4(snap_compare, picture):
    """Advanced: int4 experts in groups of 32: the group's row appears, the plan says why and what it buys."""
    assert snap_compare(picture("t4-wide-advanced", "int4"), terminal_size=WIDE)


@SIZES
def test_plan_quantized_dense(snap_compare, picture, size):
    """Advanced on a machine without a GPU: int4 experts, then "Dense weights" (shown only beside quantized
    experts) set to int8; the plan names both, as `mlight plan --quantize int4 --quantize-dense int8`."""
    journey = "cpu-wide-dense" if size == WIDE else "cpu-small"
    assert snap_compare(picture(journey, "dense"), terminal_size=size)


@SIZES
def test_results(snap_compare, picture, size):
    assert snap_compare(picture(f"t4-{_wide(size)}", "results"), terminal_size=size)


def test_results_light(snap_compare, picture):
    assert snap_compare(picture("light-wide", "results"), terminal_size=WIDE)


@SIZES
def test_result_detail(snap_compare, picture, size):
    assert snap_compare(picture(f"t4-{_wide(size)}", "detail"), terminal_size=size)


@SIZES
def test_export_dialog(snap_compare, picture, size):
    assert snap_compare(picture(f"t4-{_wide(size)}", "export"), terminal_size=size)


def test_plan_cpu_only(snap_compare, picture):
    assert snap_compare(picture("cpu-wide", "plan"), terminal_size=WIDE)


def test_plan_cpu_only_small_terminal(snap_compare, picture):
    """The CPU-only Plan opened from the command line at 80×24 (beside test_plan_step_by_step)."""
    assert snap_compare(picture("cpu-small", "plan"), terminal_size=SMALL)


@SIZES
def test_confirm_quit(snap_compare, picture, size):
    """q while a run is going asks first (the run's state set by hand: no engine thread held)."""
    assert snap_compare(picture(f"t4-{_wide(size)}-quit", "quit"), terminal_size=size)


def _wide(size) -> str:
    return "wide" if size == WIDE else "small"
