"""An Input that understands files dragged onto the terminal.

Terminals "drop" a file by pasting its path (quoted, escaped or as a file:// URL). When a paste
lands in an empty input, PathInput cleans it with `parse_dropped_path` and posts `Dropped`, so the
screen can open the file at once instead of waiting for Enter.
"""

from __future__ import annotations

from pathlib import Path

from textual import events
from textual.message import Message
from textual.widgets import Input

from app.tui.paths import parse_dropped_path


class PathInput(Input):
    class Dropped(Message):
        def __init__(self, input: "PathInput", path: str):
            super().__init__()
            self.input, self.path = input, path

        @property
        def control(self) -> "PathInput":
            return self.input

    def _on_paste(self, event: events.Paste) -> None:
        whole = not self.value or abs(self.selection.end - self.selection.start) == len(self.value)
        if not whole or not event.text.strip():
            return  # an edit inside a path: Input's own paste handler (called after this one) inserts it
        event.prevent_default()  # Textual would otherwise also run Input._on_paste
        event.stop()
        path = parse_dropped_path(event.text)
        self.value = path
        self.cursor_position = len(path)
        self.post_message(self.Dropped(self, path))

    @property
    def path(self) -> Path:
        """The value as a path (cleaned of quotes/escapes as a dropped path would be, ~ expanded)."""
        return Path(parse_dropped_path(self.value)).expanduser()
