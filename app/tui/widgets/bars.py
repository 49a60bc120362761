"""Labelled horizontal bars (memory used / budget, busy share) drawn as text, so they stay crisp in any theme
and in plain-text captures."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

BLOCKS = " ▏▎▍▌▋▊▉█"


def bar_text(fraction: float, width: int, fill_style: str = "", empty_style: str = "dim") -> Text:
    fraction = max(0.0, min(1.0, fraction))
    full, part = divmod(int(round(fraction * width * 8)), 8)
    text = Text("█" * full, style=fill_style)
    if part and full < width:
        text.append(BLOCKS[part], style=fill_style)
        full += 1
    text.append("░" * max(0, width - full), style=empty_style)
    return text


class LabelBar(Widget):
    """`label ███████░░░ value` on one line; `fraction` > 1 is drawn full and flagged as over."""

    COMPONENT_CLASSES = {"bar--fill", "bar--over", "bar--empty"}

    fraction: reactive[float] = reactive(0.0)
    value: reactive[str] = reactive("")

    def __init__(self, label: str, label_width: int = 14, value_width: int = 20, **kw):
        super().__init__(**kw)
        self.label, self.label_width, self.value_width = label, label_width, value_width

    def update(self, fraction: float, value: str) -> None:
        self.fraction, self.value = fraction, value

    def render(self) -> Text:
        width = self.size.width or 60
        bar_w = max(4, width - self.label_width - self.value_width - 2)
        over = self.fraction > 1.0 + 1e-9
        fill = self.get_component_rich_style("bar--over" if over else "bar--fill")
        empty = self.get_component_rich_style("bar--empty")
        text = Text(f"{self.label:<{self.label_width}}"[: self.label_width])
        text.append_text(bar_text(self.fraction, bar_w, fill, empty))
        text.append(f" {self.value:>{self.value_width}}"[: self.value_width + 1])
        return text
