"""Step 3 — Prompts: a file typed, dragged onto the terminal, or picked from a tree; then a preview with the
count, length statistics and every bad line (which the run skips, and says so)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, DataTable, DirectoryTree, Static

from app.tui import fmt
from app.tui.backend import PROMPT_SUFFIXES
from app.tui.glyphs import glyph
from app.tui.messages import PromptsReady
from app.tui.screens.base import StepScreen, button
from app.tui.widgets.facts import Facts
from app.tui.widgets.path_input import PathInput


def _turns_text(entries) -> str:
    """For a multi-turn file (MT-Bench's): how its entries run — later turns after the earlier answers."""
    later = sum(1 for e in entries if (getattr(e, "turn", None) or 1) > 1)
    if not later:
        return ""
    return f" ({len(entries) - later} first turns, then {later} later turns with the model's own earlier answers)"


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


class PromptTree(DirectoryTree):
    """Folders and prompt files only; hidden entries left out. Backspace climbs to the parent folder."""

    BINDINGS = [Binding("backspace", "up", "Parent folder")]

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        return [p for p in paths if not p.name.startswith(".")
                and (p.is_dir() or p.suffix.lower() in PROMPT_SUFFIXES)]

    def on_mount(self) -> None:
        self._title()

    def action_up(self) -> None:
        here = Path(self.path).resolve()
        if here.parent != here:
            self.path = here.parent
            self._title()

    def _title(self) -> None:
        self.border_title = fmt.excerpt(str(Path(self.path).resolve()), 30)
        self.border_subtitle = f"{glyph.backspace} parent folder"


class PromptsScreen(StepScreen):
    STEP = "Prompts"
    BINDINGS = [Binding("ctrl+o", "browse", "Browse", priority=True),  # short: at 80 columns the footer keeps ? Help
                Binding("ctrl+t", "demo_prompts", "Demo", priority=True)]

    def compose_body(self) -> ComposeResult:
        with Vertical(id="body"):
            yield Static("Prompts file — .txt (one a line), .jsonl, .csv, .tsv: type, drop, or Ctrl+O",
                         classes="title")  # one line at 80 columns: the bad lines below need the rows
            with Horizontal(classes="field"):
                yield PathInput(placeholder="prompts file (Enter opens)", compact=True, id="prompts-input")
                yield button(f"Open {glyph.enter}", "open")
                yield button("Browse ^O", "browse")
                yield button("Demo ^T", "demo-prompts", "demo_prompts")
            with Horizontal(id="prompts-main"):
                with Vertical(id="prompts-right"):
                    yield Facts(id="prompts-facts", classes="panel", label_width=14)
                    yield DataTable(id="preview", cursor_type="row", zebra_stripes=True)
                    yield Static("", id="rejects", classes="panel")
            with Horizontal(classes="actions"):
                yield button("Continue to Plan", "next", variant="primary", disabled=True)

    def on_mount(self) -> None:
        self.query_one("#prompts-facts").border_title = "Summary"
        self.query_one("#rejects").border_title = "Bad lines"
        self.query_one("#preview", DataTable).add_columns("id", "prompt", "max new")
        self.query_one("#preview").border_title = "First prompts"
        inp = self.query_one("#prompts-input", PathInput)
        if self.session.prompts is not None:
            inp.show(str(self.session.prompts.path))
            self.show(self.session.prompts)
        elif self.session.options.prompts:
            inp.value = self.session.options.prompts
            self.open(inp.path)
        else:
            self.query_one("#prompts-facts", Facts).set_rows([("File", "none yet — type or drop a path above, "
                                                                      "Ctrl+O to browse, or Ctrl+T for the demo prompts")])
            inp.focus()

    @on(PathInput.Submitted, "#prompts-input")
    @on(PathInput.Dropped, "#prompts-input")
    def submitted(self, event) -> None:
        inp = self.query_one("#prompts-input", PathInput)
        path = inp.path
        if inp.value != str(path):
            inp.show(str(path))  # show what was understood: quotes, escapes and file:// removed
        self.open(path)

    def on_paste(self, event) -> None:
        """A file dropped while focus is elsewhere on the screen lands here."""
        inp = self.query_one("#prompts-input", PathInput)
        inp.value = ""
        inp.focus()
        inp.post_message(event.__class__(event.text))

    def action_open(self) -> None:
        self.open(self.query_one("#prompts-input", PathInput).path)

    def action_demo_prompts(self) -> None:
        path = self.backend.demo_prompts
        self.query_one("#prompts-input", PathInput).show(str(path))
        self.open(path)

    def action_browse(self) -> None:
        # mounted only while open: the tree keeps a loader worker alive for as long as it exists
        trees = self.query(PromptTree)
        if trees:
            trees.remove()
            self.query_one("#prompts-input").focus()
            return
        start = self.query_one("#prompts-input", PathInput).path
        root = start.parent if start.suffix and start.parent.is_dir() else (start if start.is_dir() else Path.cwd())
        tree = PromptTree(root, id="tree")
        self.query_one("#prompts-main").mount(tree, before=0)
        tree.focus()

    @on(DirectoryTree.FileSelected, "#tree")
    def picked(self, event: DirectoryTree.FileSelected) -> None:
        self.query_one("#prompts-input", PathInput).show(str(event.path))
        self.open(Path(event.path))

    def open(self, path: Path) -> None:
        if not str(path).strip() or str(path) == ".":
            self.status("Type or drop the path of a prompts file first.", "warn")
            return
        self.query_one("#next", Button).disabled = True
        self.status(f"Reading {path}…")
        self.read(path)

    @work(thread=True, exclusive=True, exit_on_error=False, group="prompts", description="read prompts")
    def read(self, path: Path) -> None:
        self.post_message(PromptsReady(self.backend.read_prompts(path)))

    def on_screen_resume(self) -> None:
        """Back from Plan: it may have set aside prompts longer than the model's context with the bad lines."""
        if self.session.prompts is not None:
            self.show(self.session.prompts)

    def on_prompts_ready(self, msg: PromptsReady) -> None:
        self.session.prompts = msg.prompts
        self.session.plan = None
        self.session.skip_agreed = False  # another file: its bad lines are asked about anew
        self.show(msg.prompts)

    def worker_failed(self, worker, error) -> None:
        # a whole-file problem (missing, binary, not UTF-8, no prompt column): the old preview is stale
        self.session.prompts = None
        self.query_one("#preview", DataTable).clear()
        self.query_one("#rejects").display = False
        self.query_one("#prompts-facts", Facts).set_rows([("Problem", Text(self.mapp.describe_error(error),
                                                                              style=self.mapp.tone("error")))])
        super().worker_failed(worker, error)

    def show(self, view) -> None:
        ps = view.prompts
        lo, mean, hi = view.lengths
        rows = [
            ("File", f"{view.path.name} ({ps.format})"),
            ("Prompts", f"{view.count} to run" + _turns_text(ps.entries)
             + (f", {ps.blank_lines} blank lines skipped" if ps.blank_lines else "")),
            ("Length", f"{lo}–{hi} characters, mean {mean:.0f}"),
            ("Generate", f"up to {view.budget_tokens:,} new tokens in all"),
            ("Bad lines", Text(f"{len(ps.rejects)} — listed below; Ctrl+N asks before skipping them",
                               style=self.mapp.tone("warn")) if ps.rejects else "none"),
        ]
        self.query_one("#prompts-facts", Facts).set_rows(rows)
        table = self.query_one("#preview", DataTable)
        table.clear()
        # the prompt column gets what the id and "max new" columns, borders and padding leave
        width = max(20, (table.size.width or (self.size.width or 80) - 4) - 30)
        for rid, text, mnt in view.preview:
            table.add_row(fmt.excerpt(rid, 10), fmt.excerpt(text, width), str(mnt))
        rejects = self.query_one("#rejects", Static)
        rejects.display = bool(ps.rejects)
        if ps.rejects:
            lines = Text()
            for r in ps.rejects[:50]:
                lines.append(f"line {r.line}: ", style="bold")
                lines.append(f"{r.reason}\n")
            if len(ps.rejects) > 50:
                lines.append(f"… and {len(ps.rejects) - 50} more")
            rejects.update(lines)
        ok = view.count > 0
        self.query_one("#next", Button).disabled = not ok
        if not ok:
            self.status(f"{view.path.name}: no usable prompts — every line is bad (see the list).", "error")
        elif ps.rejects:
            self.status(f"{view.count} prompts ready, {_lines(len(ps.rejects))} bad (listed): fix the file, or "
                        "Ctrl+N to skip them.", "warn")
        else:
            self.status(f"{view.count} prompts ready. Ctrl+N to plan.", "ok")

    def action_back(self) -> None:
        if self.query(PromptTree):  # Esc closes the open file tree first
            self.action_browse()
            return
        super().action_back()

    def action_next(self) -> None:
        prompts = self.session.prompts
        if prompts is None or prompts.count == 0:
            self.status("Open a prompts file with at least one good prompt first.", "warn")
            return
        bad = len(prompts.prompts.rejects)
        if bad and not self.session.skip_agreed:
            self.session.skip_agreed = True  # asked: a second Ctrl+N is the yes
            self.status(f"Skip the {_lines(bad)} listed? They go to RESULTS.rejected.jsonl beside the results; "
                        f"Ctrl+N again skips them and plans the {prompts.count} good prompts.", "warn")
            return
        self.mapp.next_step(self.STEP)

    def palette_commands(self):
        yield SystemCommand("Browse for a prompts file", "Show the file tree", self.action_browse)
        yield SystemCommand("Use the demo prompts", "16 MT-Bench questions bundled with mlight",
                            self.action_demo_prompts)
