"""Decode throughput over the run, measured against the planner's prediction (textual-plotext). The x axis is
the engine's own time (pauses left out); the predicted line is flat (one rate for the policy)."""

from __future__ import annotations

import math

from textual_plotext import PlotextPlot

from app.tui.widgets.timeline import nice_step

MEASURED_COLOR = (52, 152, 219)  # blue and orange: apart for the colour-blind, readable on dark and light
PREDICTED_COLOR = (230, 126, 34)


def legend_color(rgb: tuple[int, int, int]) -> str:
    """The chart's line colour as a Rich style, for the legend drawn beside the chart (not over its lines)."""
    return "rgb({},{},{})".format(*rgb)


class ThroughputChart(PlotextPlot):
    def __init__(self, **kw):
        super().__init__(**kw)
        self._data: tuple = ()
        self._predicted: float | None = None

    def show(self, history: tuple[tuple[float, float], ...], predicted: float | None) -> None:
        """Redraw when the data changed: `history` is (seconds into the run, decode tokens/s) per step."""
        if history == self._data and predicted == self._predicted:
            return
        self._data, self._predicted = history, predicted
        self.refresh()

    def render(self):
        plt = self.plt  # drawn here, because the ticks depend on the size
        plt.clear_data()
        plt.clear_figure()
        plt.xlabel("engine time (s)")
        plt.ylabel("tokens/s")
        xs = [t for t, _ in self._data]
        ys = [v for _, v in self._data]
        if len(xs) == 1:  # one point draws no line: widen it to a short flat segment
            xs, ys = [xs[0], xs[0] + 1e-3], [ys[0], ys[0]]
        if xs:
            plt.plot(xs, ys, color=MEASURED_COLOR, marker="braille")  # no plotext legend: it is drawn over the lines
        if self._predicted:
            span = (xs[0], xs[-1]) if xs else (0.0, 1.0)
            plt.plot(list(span), [self._predicted] * 2, color=PREDICTED_COLOR, marker="braille")
        # at most one tick every other row and every 12 columns: of two ticks on one row, either label may show
        rows, cols = max(1, (self.size.height or 8) - 3), max(1, (self.size.width or 60) - 8)
        top = max(ys + [self._predicted or 0.0, 1.0]) * 1.15
        step = nice_step(top, max(1, rows // 2))
        top = max(top, step)  # a short chart: up to its first tick, or 0 would be the only label on the axis
        ticks = [i * step for i in range(int(top // step) + 1)]
        plt.ylim(0, top)
        plt.yticks(ticks, [f"{t:,.0f}" if step >= 1 else f"{t:g}" for t in ticks])
        if xs:
            x_step = nice_step(xs[-1] - xs[0], max(1, cols // 12)) if xs[-1] > xs[0] else 1.0
            first = math.ceil(xs[0] / x_step) * x_step
            x_ticks = [first + i * x_step for i in range(int((xs[-1] - first) // x_step) + 1)]
            plt.xticks(x_ticks, [f"{t:g}" for t in x_ticks])
        else:
            plt.xlim(0, 1)
        return super().render()
