"""An Input that understands files dragged onto the terminal: a paste into an empty input is cleaned with
`parse_dropped_path` and posted as `Dropped`, so the screen can open the file at once."""

from __future__ import annotations

from pathlib import Path

from rich.cells import cell_len
from textual import events
from textual.geometry import Region
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
        self.show(path)
        self.post_message(self.Dropped(self, path))

    def show(self, text: str) -> None:
        """Set the value with its end in view: a long path shows its file's name, not the folders it starts with."""
        self.value = text
        self.cursor_position = len(text)
        self._end_in_view()

    def _on_resize(self, event: events.Resize) -> None:
        self._end_in_view()  # set before the field had a width (on mount), or the terminal narrowed since

    def _end_in_view(self) -> None:
        if self.cursor_at_end and self.size.width:
            self.scroll_to_region(Region(cell_len(self.value), 0, 1, 1), force=True, animate=False)

    @property
    def path(self) -> Path:
        """The value as a path (cleaned of quotes/escapes as a dropped path would be, ~ expanded)."""
        return Path(parse_dropped_path(self.value)).expanduser()
