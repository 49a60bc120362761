"""Quitting while a run is going: ask first, and say that nothing finished is lost."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ConfirmQuit(ModalScreen[bool]):
    BINDINGS = [
        Binding("y,q", "dismiss(True)", "Quit"),
        Binding("n,escape", "dismiss(False)", "Keep running"),
    ]

    def __init__(self, run_file: str):
        super().__init__()
        self.run_file = run_file

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-quit", classes="modal"):
            yield Static("A run is going. Quit now?", classes="title", id="confirm-head")
            yield Static(f"The run stops after its current step. Every finished result is already in "
                         f"{self.run_file}; start the app (or `mlight run`) on the same files again to "
                         "finish the rest.", id="confirm-text")
            with Horizontal(classes="actions"):
                yield Button("Quit  y", compact=True, id="yes", variant="error", action="screen.dismiss(True)")
                yield Button("Keep running  n", compact=True, id="no", variant="primary", action="screen.dismiss(False)")

    def on_mount(self) -> None:
        self.query_one("#confirm-quit").border_title = "Quit?"
        self.query_one("#no", Button).focus()

    def run_ended(self, head: str, text: str) -> None:
        """The run ended behind the dialog: say what is true now (its run file may be gone)."""
        self.query_one("#confirm-head", Static).update(head)
        self.query_one("#confirm-text", Static).update(text)
