"""`mlight-app`'s command line: the flags are a contract (they pre-fill the screens)."""

from __future__ import annotations

import pytest

from app.tui.app import create_app
from app.tui.backend import Backend
from app.tui.main import main, parse_options
from test_app_support import settle_until, sync, write_prompts


def test_flags_parse_into_options():
    o = parse_options(["--model", "demo", "--prompts", "p.jsonl", "--out", "r.csv", "--gpu-mem", "8",
                       "--cpu-mem", "31.5"])
    assert (o.model, o.prompts, o.out, o.gpu_mem, o.cpu_mem) == ("demo", "p.jsonl", "r.csv", 8.0, 31.5)
    assert parse_options([]).model is None


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--prompts", "--out", "--gpu-mem", "--cpu-mem"):
        assert flag in out


@sync
async def test_model_prompts_and_budgets_go_straight_to_a_plan_for_those_budgets(tmp_path):
    from core.plan.hardware import preset

    prompts = write_prompts(tmp_path / "p.jsonl", n=3, max_new_tokens=2)
    options = parse_options(["--model", "demo", "--prompts", str(prompts), "--out", str(tmp_path / "r.csv"),
                             "--gpu-mem", "8", "--cpu-mem", "16"])
    app = create_app(options, Backend(hardware=preset("l4")))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle_until(pilot, lambda app: app.session.plan is not None)
        assert type(app.screen).__name__ == "PlanScreen"
        assert [type(s).__name__ for s in app.screen_stack[1:]] == ["MachineScreen", "ModelScreen", "PromptsScreen",
                                                                    "PlanScreen"]
        plan = app.session.plan
        assert (plan.gpu_budget, plan.cpu_budget) == (8 * 10**9, 16 * 10**9)
        assert app.screen.query_one("#gpu-mem").value == "8.0"
        assert app.screen.query_one("#out").value == str(tmp_path / "r.csv")
