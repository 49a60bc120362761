"""The app's screens know only the backend and their widgets: the app owns navigation (no import cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

TUI = Path(__file__).resolve().parent.parent / "app" / "tui"


def _module(path: Path) -> str:
    rel = path.relative_to(TUI.parent.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """app.tui modules a file imports, at any depth (function-level imports count too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("app.tui")}


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in TUI.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def test_screens_import_no_other_screen_and_not_the_app():
    for m, deps in _graph().items():
        if m.startswith("app.tui.screens.") and m != "app.tui.screens.base":
            bad = {d for d in deps if d.startswith("app.tui.screens.") and d != "app.tui.screens.base"}
            assert not bad, f"{m} imports {bad}: navigation goes through the app (MlightApp.next_step)"
            assert "app.tui.app" not in deps, m
    assert "app.tui.app" not in _graph()["app.tui.screens.base"]


def test_no_import_cycle_in_the_app():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in graph.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [m, d]))
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_every_step_has_a_screen():
    from app.tui.app import _step_screen
    from app.tui.widgets.steps import STEPS

    for step in STEPS[:-1]:
        assert _step_screen(step).STEP == step
    assert _step_screen("Results", records=[]).STEP == "Results"
