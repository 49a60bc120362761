"""The breadcrumb at the top of every screen: where the user is in the six-step flow."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from app.tui.glyphs import glyph

STEPS = ("Machine", "Model", "Prompts", "Plan", "Run", "Results")


class Steps(Static):
    """`1 Machine › 2 Model › …` with the current step highlighted; narrow terminals get initials."""

    def __init__(self, current: str, **kw):
        super().__init__(**kw)
        self.current = current

    def render(self) -> Text:
        full = 10 + sum(len(n) + 4 for n in STEPS) + 3 * (len(STEPS) - 1)  # the line with every name
        wide = self.size.width == 0 or self.size.width >= full
        text = Text(" mlight ", style="bold reverse")
        text.append("  ")
        for i, name in enumerate(STEPS):
            label = f"{i + 1} {name}" if wide or name == self.current else f"{i + 1}"
            if i:
                text.append(f" {glyph.crumb} ", style="dim")
            style = "bold reverse" if name == self.current else ("" if wide else "dim")
            text.append(f" {label} ", style=style)
        return text
