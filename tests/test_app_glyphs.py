"""Consoles that cannot show ✓ ✗ ⏎ (Windows' legacy console, a cp437 or cp1252 code page, a latin-1 locale): the
app's signs turn to ASCII words, and whatever else is drawn reaches the stream as one ASCII look-alike per cell
instead of raising (Textual writes strictly on Windows) or spilling backslash escapes (Python's stderr default)."""

from __future__ import annotations

import io

import pytest
from rich.cells import cell_len

from app.tui import glyphs
from test_app_defects import _check, _direct, _plan, _screen_text
from test_app_snapshots import workdir  # noqa: F401 - the fixture
from test_app_support import settle, status_text, sync

DRAWN = "╭─ Check ──╮│✓ fits the budget ⚠ 1,234.5 tokens/s ≈ 12 μs…│█▉▏░ ▼ › ■ ⏎ 日本 — “x”╰──────────╯"


def _stream(encoding: str, errors: str = "strict") -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors=errors, write_through=True)


@pytest.fixture
def plain_signs():
    yield
    glyphs.use_ascii(False)


@pytest.mark.parametrize("encoding", ["cp437", "cp1252", "latin-1", "ascii"])
def test_a_stream_that_lacks_the_signs_gets_one_ascii_lookalike_per_cell(encoding, plain_signs):
    out, err = _stream(encoding), _stream(encoding, "backslashreplace")  # as Python opens stdout and stderr
    with pytest.raises(UnicodeEncodeError):
        out.write("✓")  # what ended Textual's output thread (and so hung the app) before
    assert glyphs.setup([out, err], legacy_console=False, env={}) is True
    for stream in (out, err):
        stream.write(DRAWN)
        shown = stream.buffer.getvalue().decode(encoding)
        assert "\\u" not in shown and "\\x" not in shown  # no escapes: they take six cells for one
        assert cell_len(shown) == cell_len(DRAWN), shown  # nothing shifts
        assert "fits the budget" in shown and "1,234.5 tokens/s" in shown
    assert glyphs.glyph.ok == "OK" and glyphs.glyph.enter == "Enter"


def test_a_utf8_terminal_keeps_the_signs_unless_the_console_or_the_user_says_otherwise(plain_signs):
    out = _stream("utf-8")
    assert glyphs.setup([out], legacy_console=False, env={}) is False
    assert out.errors == "strict" and glyphs.glyph.ok == "✓"
    assert glyphs.setup([out], legacy_console=True, env={}) is True  # conhost's fonts lack ⏎ and ⚠
    assert glyphs.setup([out], legacy_console=False, env={"MLIGHT_ASCII": "1"}) is True
    assert out.errors == "strict"  # the stream can carry them: only the signs change


@sync
async def test_the_app_in_a_cp437_console_says_ok_and_enter_and_every_line_encodes(workdir, plain_signs):
    out = _stream("cp437")
    glyphs.setup([out], legacy_console=False, env={})
    app = _direct(gpu_mem=100)  # more than the T4 has: a warning under Check
    async with app.run_test(size=(80, 24)) as pilot:
        await _plan(pilot)
        check = _check(app)
        assert "OK fits the budget" in check and "! GPU memory" in check, check
        assert "✓" not in check and "⚠" not in check
        await pilot.press("escape", "escape", "escape")  # back to the Machine step
        await settle(pilot)
        text = _screen_text(app)
        assert "Continue to Model  Enter" in text and " > " in text, text  # the button, the step crumbs
        assert "⏎" not in text and "›" not in text, status_text(app)
        for line in text.splitlines():
            out.write(line)
            assert len(line.encode("cp437", "mlight-ascii")) == cell_len(line) == 80
