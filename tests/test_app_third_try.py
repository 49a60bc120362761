"""What the app's third newcomer try found (issue 46's try before closing), one test each."""

from __future__ import annotations

import unicodedata

from test_app_defects import _app
from test_app_snapshots import workdir  # noqa: F401 - the fixture
from test_app_support import settle, sync

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
