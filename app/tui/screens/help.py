"""The help screen (`?` or F1): the six steps, the keys that work everywhere, and the keys of the screen it was
opened from (read from its own bindings, so it never drifts)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Static

from app.tui.widgets.footer import KeyFooter
from app.tui.widgets.steps import STEPS

STEP_LINES = {
    "Machine": "what mlight found: GPU, RAM, cores, PCIe link and measured bandwidth (r measures again)",
    "Model": "the demo model, a checkpoint folder (type it or drop it), or a Hugging Face repo id",
    "Prompts": "a .txt, .jsonl, .csv or .tsv file: type the path, drop the file, browse (Ctrl+O) or the demo prompts (Ctrl+T)",
    "Plan": "memory budgets in, the planner's policy and predicted tokens/s out; edit it, Advanced for dtype",
    "Run": "live throughput against the prediction, the pipeline timeline, memory and progress",
    "Results": "every result, Enter for one in full, c / j to export CSV / JSONL",
}
GLOBAL_KEYS = [
    ("Ctrl+N", "next step (accepts the plan on Plan)"),
    ("Esc", "previous step (closes a dialog or the file tree first)"),
    ("Tab", "next field or button"),
    ("Ctrl+P", "command palette: every action by name"),
    ("? or F1", "this help"),
    ("q or Ctrl+Q", "quit (asks first while a run is going; finished results are always kept)"),
]
_KEY_NAMES = {"ctrl": "Ctrl", "shift": "Shift", "space": "Space", "escape": "Esc", "enter": "Enter",
              "backspace": "Backspace"}


def key_text(key: str) -> str:
    """'ctrl+r' -> 'Ctrl+R', 'space' -> 'Space' (the way the help writes keys)."""
    first = key.split(",")[0]
    return "+".join(_KEY_NAMES.get(p, p.upper() if len(p) == 1 and "ctrl" in first else p) for p in first.split("+"))


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "Close")]

    def __init__(self, under: Screen):
        super().__init__()
        self.under = under

    def compose(self) -> ComposeResult:
        step = getattr(self.under, "STEP", "")  # a dialog or the default screen has no step
        with Vertical(id="help", classes="modal"):
            # keys first: what a user opens help for; the steps below scroll into view (↓, PgDn, the wheel)
            with VerticalScroll(id="help-text"):
                own = self._screen_keys()
                if own:
                    yield Static(Text(f"Keys on this screen ({step})" if step else "Keys on this screen",
                                      style="bold"), classes="help-head")
                    yield Static(_table(own))
                yield Static(Text("Keys everywhere", style="bold"), classes="help-head")
                yield Static(_table(GLOBAL_KEYS))
                yield Static(Text("Steps", style="bold"), classes="help-head")
                yield Static(_table([(Text(f"{i + 1} {name}", style="bold reverse" if name == step else "bold"),
                                      STEP_LINES[name]) for i, name in enumerate(STEPS)], 11, style=""))
        yield KeyFooter(compact=True)  # compact: at 80 columns every key shown fits, ? Help too

    def on_mount(self) -> None:
        self.query_one("#help").border_title = "mlight — help"
        self.query_one("#help").border_subtitle = "↑↓ PgUp PgDn scroll · Esc closes"
        self.query_one("#help-text").focus()  # so that the arrows, PgDn and End scroll it

    def _screen_keys(self) -> list[tuple[str, str]]:
        seen, out = {"ctrl+n", "escape"}, []
        for b in getattr(self.under, "BINDINGS", []):
            if b.key in seen or not b.description:
                continue
            seen.add(b.key)
            out.append((key_text(b.key), b.description))
        return out


def _table(rows: list[tuple], min_width: int = 12, style: str = "bold") -> Table:
    table = Table.grid(padding=(0, 1), expand=True)
    table.add_column(style=style, no_wrap=True, min_width=min_width)
    table.add_column(ratio=1)
    for row in rows:
        table.add_row(*row)
    return table
