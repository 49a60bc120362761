"""Human-readable numbers for the screens: bytes, durations, counts."""

from __future__ import annotations

import unicodedata

from rich.cells import cell_len, set_cell_size

from app.tui.glyphs import glyph


def human_bytes(n: float) -> str:
    """Decimal units, as the planner, `--gpu-mem` and disk vendors count."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def count(n: int | float) -> str:
    n = float(n)
    for suffix, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{n:.0f}"


def duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "—"
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def printable(text: str, keep: str = "\n\t") -> str:
    """`text` with its control characters but `keep` shown as a sign: an ESC or a shift-out from a model would
    start a terminal sequence or switch character sets."""
    return "".join(glyph.control if unicodedata.category(ch) == "Cc" and ch not in keep else ch for ch in text)


def excerpt(text: str | None, width: int) -> str:
    """One line of at most `width` terminal cells (newlines shown as ⏎); a CJK character or an emoji takes two."""
    if not text:
        return ""
    flat = " ".join(printable(text.replace("\r", "").replace("\n", f" {glyph.newline} "), keep=" \t").split())
    if cell_len(flat) <= width:
        return flat
    return set_cell_size(flat, max(0, width - 1)).rstrip() + "…"
