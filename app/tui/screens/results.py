"""Step 6 — Results: a table of every finished request, a detail view, and export to CSV / JSONL (through core's
atomic writers)."""

from __future__ import annotations

from pathlib import Path

from rich.cells import cell_len
from rich.text import Text
from textual import on
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Static

from app.tui import fmt
from app.tui.glyphs import glyph
from app.tui.screens.base import StepScreen
from app.tui.widgets.facts import Facts
from app.tui.widgets.footer import KeyFooter
from app.tui.widgets.path_input import PathInput


class ResultsScreen(StepScreen):
    STEP = "Results"
    BINDINGS = [
        Binding("enter", "detail", "Details", show=True),
        Binding("c", "export('csv')", "Export CSV"),
        Binding("j", "export('jsonl')", "Export JSONL"),
        Binding("ctrl+n", "next", "Next", show=False, priority=True),
    ]

    def __init__(self, records: list[dict]):
        super().__init__()
        self.records = records

    def compose_body(self) -> ComposeResult:
        with Vertical(id="body"):
            yield Static("", id="results-summary", classes="title")
            yield DataTable(id="results", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one("#results", DataTable)
        self.id_width = max(4, min(18, max((cell_len(str(r["id"])) for r in self.records), default=4)))
        self._width = 0
        self._fill()
        table.focus()
        total_out = sum(int(r.get("output_tokens", 0)) for r in self.records)
        self.query_one("#results-summary", Static).update(
            f"{len(self.records)} results, {total_out:,} tokens generated — Enter: details, c: CSV, j: JSONL")
        self.status(f"Results are saved in {self.session.out_path}. Export copies them to a file you choose.", "ok")

    def on_resize(self) -> None:
        self._fill()

    def _fill(self) -> None:
        """Columns sized to the terminal, rebuilt on resize: DataTable keeps a column's widest content otherwise, and
        the last columns fall off."""
        width = self.size.width or 120
        if width == self._width:
            return
        self._width = width
        table = self.query_one("#results", DataTable)
        row = table.cursor_row
        # other columns, cell padding, the body's padding and the scrollbar's gutter: the columns reach the
        # scrollbar, which stays at the table's right edge
        left = width - (self.id_width + 9 + 7 + 6 + 6 * 2 + 2 + 2)
        text_w = max(12, left // 2)
        out_w = max(12, left - text_w)
        table.clear(columns=True)
        for key, label, w in (("id", "id", self.id_width), ("prompt", "prompt", text_w), ("output", "output", out_w),
                              ("tokens", "tokens", 9), ("seconds", "seconds", 7), ("finish", "finish", 6)):
            table.add_column(label, key=key, width=w)
        for r in self.records:
            table.add_row(fmt.excerpt(str(r["id"]), self.id_width), fmt.excerpt(r.get("prompt", ""), text_w),
                          fmt.excerpt(r.get("output", ""), out_w),
                          f"{r.get('prompt_tokens', 0)}→{r.get('output_tokens', 0)}",
                          f"{float(r.get('seconds', 0.0)):.2f}", r.get("finish_reason", ""), key=str(r["id"]))
        if self.records:
            table.move_cursor(row=min(row, len(self.records) - 1))

    @on(DataTable.RowSelected, "#results")
    def action_detail(self) -> None:
        table = self.query_one("#results", DataTable)
        if not self.records:
            return
        self.app.push_screen(DetailScreen(self.records[table.cursor_row]))

    def action_export(self, fmt_name: str) -> None:
        out = self.session.out_path or Path("results.jsonl")
        default = out.with_name(f"{out.stem.removesuffix('.results')}.export.{fmt_name}")
        self.app.push_screen(ExportScreen(default, self.records), lambda done: done and self.status(done, "ok"))

    def palette_commands(self):
        yield SystemCommand("Export results as CSV", "Write every result to a .csv file", lambda: self.action_export("csv"))
        yield SystemCommand("Export results as JSONL", "Write every result to a .jsonl file",
                            lambda: self.action_export("jsonl"))


class DetailScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,enter", "dismiss", "Close")]

    def __init__(self, record: dict):
        super().__init__()
        self.record = record

    def compose(self) -> ComposeResult:
        r = self.record
        with Vertical(id="detail", classes="modal"):
            yield Facts([
                ("Id", str(r["id"])),
                ("Tokens", f"{r.get('prompt_tokens', 0)} prompt → {r.get('output_tokens', 0)} generated"),
                ("Time", f"{float(r.get('seconds', 0.0)):.2f} s"),
                ("Finish", {"stop": "stop (end of text or a stop string)", "length": "length (max_new_tokens)"}
                 .get(r.get("finish_reason", ""), r.get("finish_reason", ""))),
            ], label_width=8)
            with VerticalScroll(id="detail-text"):
                yield Static(Text("Prompt", style="bold"))
                yield Static(Text(fmt.printable(r.get("prompt", ""))), classes="detail-block")
                yield Static(Text("Output", style="bold"))
                yield Static(Text(fmt.printable(r.get("output", ""))), classes="detail-block")
        yield KeyFooter()

    def on_mount(self) -> None:
        self.query_one("#detail").border_title = f"Result {self.record['id']}"


class ExportScreen(ModalScreen[str | None]):
    """Ask where to write, then write with core's writer; the format comes from the suffix."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, default: Path, records: list[dict]):
        super().__init__()
        self.default, self.records = default, records

    def compose(self) -> ComposeResult:
        with Vertical(id="export", classes="modal"):
            yield Static("Export to (.csv or .jsonl); Enter writes, Esc cancels", classes="title")
            yield PathInput(str(self.default), compact=True, id="export-path")
            yield Static("", id="export-note", classes="muted")
            with Horizontal(classes="actions"):
                yield Button(f"Write  {glyph.enter}", compact=True, id="write", variant="primary")
                yield Button("Cancel", compact=True, id="cancel", action="screen.dismiss(None)")
        yield KeyFooter()

    def on_mount(self) -> None:
        self.query_one("#export").border_title = f"Export {len(self.records)} results"
        self._note()

    @on(PathInput.Changed, "#export-path")
    def _note(self) -> None:
        path = self.query_one("#export-path", PathInput).path
        note = self.query_one("#export-note", Static)
        note.update(f"{path.name} exists and will be replaced" if path.exists() else "")

    @on(PathInput.Submitted, "#export-path")
    @on(Button.Pressed, "#write")
    def write(self) -> None:
        path = self.query_one("#export-path", PathInput).path
        try:
            kind = self.app.backend.export(self.records, path)
        except Exception as e:  # user errors (suffix, folder, permission, disk full) stay in the dialog
            self.query_one("#export-note", Static).update(Text(self.app.describe_error(e), style=self.app.tone("error")))
            return
        self.dismiss(f"Wrote {len(self.records)} results as {kind.upper()} to {path}")
