"""The breadcrumb at the top of every screen: where the user is in the six-step flow."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from app.tui.glyphs import glyph

STEPS = ("Machine", "Model", "Prompts", "Plan", "Run", "Results")


class Steps(Static):
    """`1 Machine › 2 Model › …` with the current step highlighted; every name fits in 80 columns."""

    def __init__(self, current: str, **kw):
        super().__init__(**kw)
        self.current = current

    def render(self) -> Text:
        # every step by name: with padding around each where the line holds it, else around the current one only
        wide = self.size.width == 0 or self.size.width >= 10 + sum(len(n) + 4 for n in STEPS) + 3 * (len(STEPS) - 1)
        text = Text(" mlight ", style="bold reverse")
        text.append("  " if wide else " ")
        for i, name in enumerate(STEPS):
            label = f"{i + 1} {name}"
            if i:
                text.append(f" {glyph.crumb} ", style="dim")
            if name == self.current:
                text.append(f" {label} ", style="bold reverse")
            else:
                text.append(f" {label} " if wide else label)
        return text
