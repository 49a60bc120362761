"""Footer that rebuilds its keys only when the keys it shows change. Textual's Footer recomposes, remounting
and restyling every key, on each focus move and screen switch: most of the style work of opening a screen."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer

try:  # private to Textual (textual>=8 is not pinned): without it the keys are restyled once more, nothing else
    from textual.widgets._footer import FooterKey
except ImportError:  # pragma: no cover
    FooterKey = None


class KeyFooter(Footer):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._shown: tuple | None = None  # what the footer shows once the recompose asked for has run

    def _keys(self) -> tuple:
        """Everything Footer.compose reads, so that an equal value means an identical footer."""
        app = self.app
        active = self.screen.active_bindings
        keys = tuple((b, enabled, tooltip, app.get_key_display(b))
                     for (_, b, enabled, tooltip) in active.values() if b.show)
        palette = None
        if self.show_command_palette and app.ENABLE_COMMAND_PALETTE:
            found = active.get(app.COMMAND_PALETTE_BINDING)
            if found is not None:
                _, b, enabled, tooltip = found
                palette = (b, enabled, tooltip, app.get_key_display(b))
        return keys, palette

    def compose(self) -> ComposeResult:
        try:
            self._shown = self._keys() if getattr(self, "_bindings_ready", False) else None
        except (AttributeError, TypeError, ValueError):
            self._shown = None
        for widget in super().compose():
            if FooterKey is not None and isinstance(widget, FooterKey):
                # born compact or not as the footer is, with the class its compact watcher would otherwise set
                # once mounted, restyling the key a second time (twice for a key of a full-size footer)
                widget.set_reactive(FooterKey.compact, self.compact)
                widget.set_class(self.compact, "-compact", update=False)
            yield widget

    def bindings_changed(self, screen: Screen) -> None:
        ready = getattr(self, "_bindings_ready", False)
        if not (ready and self.is_attached and screen is self.screen and self.app.app_focus):
            super().bindings_changed(screen)
            return
        try:
            keys = self._keys()
        except (AttributeError, TypeError, ValueError):  # a Textual whose bindings read differently: rebuild always
            super().bindings_changed(screen)
            return
        if keys == self._shown:  # shown now, or by the recompose already asked for
            return
        self._shown = keys
        super().bindings_changed(screen)
