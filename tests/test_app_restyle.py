"""Opening and leaving screens restyles only what changed: the footer rebuilds its keys only when the keys it
shows change, and still shows exactly the keys Textual's own Footer would (the reference).

Bounds: a journey Machine → Model → Prompts → back → back took 21 footer recomposes and 169 style updates with
Textual's Footer; the keys that really change there need 10 recomposes, and with step buttons, footer keys and
screens born with their classes 40 style updates are left. The bounds leave room for a Textual release that adds a few.
"""

from __future__ import annotations

from textual.app import App
from textual.widgets import Footer
from textual.widgets._footer import FooterKey

from app.tui.app import create_app
from app.tui.backend import Backend
from app.tui.session import Options
from test_app_support import settle, sync


def _shown_keys(screen) -> list[str]:
    """The keys Footer.compose shows for `screen`: the first shown binding of each action, in order."""
    first: dict[str, str] = {}
    for _, binding, _, _ in screen.active_bindings.values():
        if binding.show:
            first.setdefault(binding.action, binding.key)
    return list(first.values())


def _footer_keys(screen) -> list[str]:
    return [k.key for k in screen.query_one(Footer).query(FooterKey) if not k.has_class("-command-palette")]


@sync
async def test_a_screen_journey_restyles_only_what_changed(monkeypatch):
    counts = {"recompose": 0, "styles": 0}
    recompose, update_styles = Footer.recompose, App.update_styles

    async def counted_recompose(self):
        counts["recompose"] += 1
        return await recompose(self)

    def counted_update_styles(self, node, animate=True):
        counts["styles"] += 1
        return update_styles(self, node, animate)

    monkeypatch.setattr(Footer, "recompose", counted_recompose)
    monkeypatch.setattr(App, "update_styles", counted_update_styles)

    app = create_app(Options(), Backend(max_new_tokens=4))
    async with app.run_test(size=(120, 40)) as pilot:
        seen = []
        for key in (None, "enter", "enter", "ctrl+n", "escape", "escape"):
            if key:
                await pilot.press(key)
            await settle(pilot)
            seen.append(type(app.screen).__name__)
            assert _footer_keys(app.screen) == _shown_keys(app.screen), seen
        assert seen == ["MachineScreen", "ModelScreen", "ModelScreen", "PromptsScreen", "ModelScreen",
                        "MachineScreen"]
        assert app.session.model is not None
    assert counts["recompose"] <= 12, counts
    assert counts["styles"] <= 70, counts
