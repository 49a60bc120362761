"""A decode step drawn as the paper's CGOPipe figure: one lane per resource, one bar per task, coloured by kind.
A cell shows the task covering most of its time; a lane's consecutive tasks alternate full and shaded blocks, so
two bars stay two. `zoom` shows only the first layers, for models with too many tasks."""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from app.tui.glyphs import glyph

LANES = ("compute", "cpu_attn", "h2d", "d2h")
LANE_LABELS = {"compute": "GPU compute", "cpu_attn": "CPU attention", "h2d": "H→D copies", "d2h": "D→H copies"}
CPU_LANE_LABELS = {"compute": "CPU compute", "cpu_attn": "CPU attention", "h2d": "copies in", "d2h": "copies out"}
KIND_NAMES = {  # in a layer's task order, the legend's
    "pre_attn": "pre-attention", "d1": "QKV out", "cpu_attn": "CPU attention", "gpu_attn": "GPU attention",
    "d2": "attention in", "post_attn": "post-attention", "ffn": "experts", "weight_page": "weight pages",
    "kv_load": "KV in", "kv_store": "KV out", "prefill": "prefill",
}
# distinct hues that read on dark and light backgrounds alike
KIND_COLORS = {
    "pre_attn": "#3498db", "post_attn": "#9b59b6", "ffn": "#e67e22", "gpu_attn": "#e74c3c", "prefill": "#e67e22",
    "cpu_attn": "#27ae60", "d1": "#16a085", "kv_store": "#8e44ad", "d2": "#e84393", "weight_page": "#d4ac0d",
    "kv_load": "#a04000",
}
ZOOMS = (None, 2, 1)  # layers shown: every layer, the first two, the first one
LABEL_W = 14
SHARE_W = 5


class Span(NamedTuple):
    resource: str
    kind: str
    layer: int
    start: float  # seconds from the step's start
    end: float


def spans_of_simulation(timeline) -> list[Span]:
    return [Span(s.task.resource, s.task.kind, s.task.layer, s.start, s.end) for s in timeline.spans]


def time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def nice_step(span: float, ticks: int) -> float:
    """A 1-2-5 step that cuts `span` into about `ticks` parts."""
    if span <= 0 or ticks < 1:
        return 1.0
    raw = span / ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def legend(kinds: Iterable[str], width: int = 0) -> Text:
    """`■ name` for each kind, in its colour, each once; lines of at most `width` cells (0: one line) broken
    between items only (Rich would wrap at a no-break space, parting a colour from its name)."""
    text = Text()
    used = 0
    for k in dict.fromkeys(kinds):
        name = KIND_NAMES.get(k, k)
        cells = 2 + len(name)
        if width and used and used + 2 + cells > width:  # two spaces between items
            text.append("\n")
            used = 0
        elif used:
            text.append("  ")
            used += 2
        text.append(f"{glyph.swatch} ", style=KIND_COLORS.get(k, ""))
        text.append(name)
        used += cells
    return text


class Legend(Static):
    def show(self, kinds: Iterable[str]) -> None:
        self._kinds = list(dict.fromkeys(kinds))
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(legend(getattr(self, "_kinds", ()), width).plain.split("\n"))

    def render(self) -> Text:
        return legend(getattr(self, "_kinds", ()), self.size.width)


class Timeline(Widget):
    COMPONENT_CLASSES = {"timeline--idle", "timeline--axis"}

    zoom: reactive[int] = reactive(0)

    def __init__(self, *, cpu_mode: bool = False, **kw):
        super().__init__(**kw)
        self.spans: list[Span] = []
        self.seconds = 0.0
        self.header: Text | str = ""
        self.lanes: tuple[str, ...] = LANES
        self.labels = CPU_LANE_LABELS if cpu_mode else LANE_LABELS

    def show(self, spans: list[Span], seconds: float, header: Text | str, lanes: tuple[str, ...]) -> None:
        self.spans, self.seconds, self.header, self.lanes = list(spans), seconds, header, lanes
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:
        return 2 + len(self.lanes)

    def window(self) -> float:
        """Seconds shown: the whole step, or up to the end of the first ZOOMS[zoom] layers."""
        layers = ZOOMS[self.zoom % len(ZOOMS)]
        ends = [s.end for s in self.spans if layers is None or 0 <= s.layer < layers]
        return max(ends, default=0.0) or max(self.seconds, 1e-12)

    def render(self) -> Text:
        out = Text(no_wrap=True, overflow="crop")
        out.append_text(self.header if isinstance(self.header, Text) else Text(self.header, style="bold"))
        bar_w = max(20, self.size.width or 80) - LABEL_W - SHARE_W
        idle = self.get_component_rich_style("timeline--idle")
        if not self.spans:
            for r in self.lanes:
                out.append("\n" + f"{self.labels[r]:<{LABEL_W}}"[:LABEL_W], style="bold")
                out.append("·" * bar_w, style=idle)
            out.append("\n")
            return out
        window = self.window()
        for r in self.lanes:
            out.append("\n")
            out.append_text(self._lane(r, window, bar_w, idle))
        out.append("\n")
        out.append_text(self._axis(window, bar_w))
        return out

    def _lane(self, resource: str, window: float, bar_w: int, idle) -> Text:
        scale = bar_w / window
        cover = [0.0] * bar_w
        cell: list[tuple[str, int] | None] = [None] * bar_w
        busy = 0.0
        mine = sorted((s for s in self.spans if s.resource == resource), key=lambda s: s.start)
        for n, s in enumerate(mine):
            if s.start >= window:
                break
            end = min(s.end, window)
            busy += end - s.start
            a, b = s.start * scale, end * scale
            for c in range(int(a), min(bar_w, max(int(a) + 1, math.ceil(b)))):
                overlap = max(min(b, c + 1) - max(a, c), 1e-9)  # a task shorter than a cell still counts
                if overlap > cover[c]:
                    cover[c], cell[c] = overlap, (s.kind, n)
        text = Text(f"{self.labels.get(resource, resource):<{LABEL_W}}"[:LABEL_W], style="bold")
        for c in cell:
            if c is None:
                text.append("·", style=idle)
            else:
                text.append("█" if c[1] % 2 == 0 else "▓", style=KIND_COLORS.get(c[0], ""))
        text.append(f"{min(1.0, busy / window):>{SHARE_W}.0%}")
        return text

    def _axis(self, window: float, bar_w: int) -> Text:
        mult, unit = time_unit(window)
        step = nice_step(window * mult, max(1, bar_w // 10))
        line = [" "] * bar_w
        k = 0
        while k * step <= window * mult + 1e-9:
            t = k * step
            label = f"{t:.3g}"
            pos = min(int(round(t / (window * mult) * (bar_w - 1))), bar_w - len(label))  # the last one ends flush
            if all(ch == " " for ch in line[max(0, pos - 1):pos + len(label) + 1]):
                line[pos:pos + len(label)] = label
            k += 1
        axis = Text(f"{'time (' + unit + ')':<{LABEL_W}}", style=self.get_component_rich_style("timeline--axis"))
        axis.append("".join(line), style=self.get_component_rich_style("timeline--axis"))
        return axis
