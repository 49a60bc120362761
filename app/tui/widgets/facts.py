"""A two-column list of facts (label, value) that wraps long values instead of cutting them."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static


class Facts(Static):
    def __init__(self, rows: list[tuple[str, str]] | None = None, label_width: int = 18, **kw):
        super().__init__(**kw)
        self.label_width = label_width
        self.set_rows(rows or [])

    def set_rows(self, rows: list[tuple[str, str | Text]]) -> None:
        self.rows = [(label, str(value)) for label, value in rows]
        table = Table.grid(padding=(0, 1), expand=True)
        table.add_column(style="bold", width=self.label_width, no_wrap=True)
        table.add_column(ratio=1, overflow="fold")
        for label, value in rows:
            table.add_row(label, value)
        self.update(table)

    @property
    def text(self) -> str:
        return "\n".join(f"{label}: {value}" if label else value for label, value in self.rows)
