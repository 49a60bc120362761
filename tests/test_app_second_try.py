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
