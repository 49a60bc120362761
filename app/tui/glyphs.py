"""Symbols for consoles that cannot show them (Windows' legacy console, cp437/cp1252, a latin-1 locale): the
app's own signs (✓ ✗ ⚠ ⏎ …) become words or ASCII at start-up; everything else goes through the "mlight-ascii"
error handler, one look-alike per cell, so nothing raises (Textual writes with errors="strict" on Windows, where a
✓ in cp437 hangs the app) and nothing shifts."""

from __future__ import annotations

import codecs
import contextlib
import os
import sys
from types import SimpleNamespace

from rich.cells import cell_len

from core import platform

# name -> (the sign, its ASCII stand-in)
SIGNS = {
    "ok": ("✓", "OK"), "bad": ("✗", "X"), "warn": ("⚠", "!"), "enter": ("⏎", "Enter"),
    "backspace": ("⌫", "Backspace"), "crumb": ("›", ">"), "swatch": ("■", "#"),
    "newline": ("⏎", "|"),  # a line break inside a one-line excerpt
    "control": ("�", "?"),  # a control character in a model's output (the terminal would act on it)
}


glyph = SimpleNamespace()  # `glyph.ok` and so on: the sign, or its ASCII stand-in after `use_ascii(True)`


def use_ascii(on: bool) -> None:
    glyph.__dict__.update((name, signs[on]) for name, signs in SIGNS.items())


use_ascii(False)

# one character for one cell: what a stream's encoding lacks becomes the nearest ASCII shape
_LOOKALIKE = {
    **dict.fromkeys("─━═╌╍┄┅┈┉╴╶╸╺▔▁", "-"), **dict.fromkeys("│┃║╎╏┆┇┊┋╵╷╹╻▕▏▎", "|"),
    **dict.fromkeys("┌┐└┘╭╮╯╰┏┓┗┛╔╗╚╝├┤┬┴┼┣┫┳┻╋╠╣╦╩╬╞╡╤╧╪╒╕╘╛", "+"),
    **dict.fromkeys("█▉▊▋▌▍▐▓▇▆▅▄▃▂■▀", "#"), **dict.fromkeys("░▒", "."),
    "—": "-", "–": "-", "…": ".", "·": ".", "•": "*", "“": '"', "”": '"', "‘": "'", "’": "'", "×": "x",
    "→": ">", "←": "<", "↔": "-", "↑": "^", "↓": "v", "≈": "~", "≤": "<", "≥": ">", "μ": "u", "µ": "u",
    "▼": "v", "▲": "^", "▶": ">", "◀": "<", "►": ">", "◄": "<", "›": ">", "‹": "<", "✓": "+", "✗": "x",
    "⚠": "!", "⏎": "<", "⌫": "<", "\u00a0": " ", "\ufffd": "?",
}


def _ascii_lookalike(error: UnicodeError):
    if not isinstance(error, UnicodeEncodeError):
        raise error
    return "".join(_LOOKALIKE.get(ch) or "?" * cell_len(ch) for ch in error.object[error.start:error.end]), error.end


codecs.register_error("mlight-ascii", _ascii_lookalike)


def can_show(encoding: str | None) -> bool:
    try:
        "".join(fancy for fancy, _ in SIGNS.values()).encode(encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def setup(streams=None, legacy_console: bool | None = None, env=None) -> bool:
    """Before the app starts: ASCII signs where the stream's encoding or the console's fonts lack them (or
    MLIGHT_ASCII=1 asks), and the look-alike handler on every stream that needs it. Returns whether signs are ASCII."""
    env = os.environ if env is None else env
    streams = [s for s in (streams if streams is not None else (sys.__stdout__, sys.__stderr__)) if s is not None]
    short = [s for s in streams if not can_show(getattr(s, "encoding", None))]
    for s in short:
        with contextlib.suppress(AttributeError, ValueError, OSError):  # else the signs below are ASCII anyway
            s.reconfigure(errors="mlight-ascii")
    if legacy_console is None:
        legacy_console = platform.terminal(env) == "legacy-console"
    plain = bool(short) or legacy_console or env.get("MLIGHT_ASCII", "") not in ("", "0")
    use_ascii(plain)
    return plain
