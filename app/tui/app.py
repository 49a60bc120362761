"""MlightApp and `create_app`, the factory shared by the command line and the tests."""

from __future__ import annotations

from typing import Iterable

from textual.app import App
from textual.app import SystemCommand
from textual.screen import Screen

from app.tui.backend import Backend
from app.tui.session import Options, Session
from app.tui.widgets.steps import STEPS
from core.errors import MlightError


class MlightApp(App):
    CSS_PATH = "mlight.tcss"
    TITLE = "mlight"
    SUB_TITLE = "MoE batch inference"
    # the stylesheet tightens a few layouts on small terminals (80×24) through these classes
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]

    def __init__(self, options: Options, backend: Backend):
        super().__init__()
        self.session = Session(options)
        self.backend = backend

    def on_mount(self) -> None:
        opts = self.session.options
        self.push_screen(_step_screen("Machine"))
        if opts.model and opts.prompts:
            # straight to Plan; the steps below stay on the stack so Esc walks back through them
            for step in ("Model", "Prompts", "Plan"):
                self.push_screen(_step_screen(step))

    def next_step(self, current: str, **kwargs) -> None:
        """Open the step after `current` (a name in STEPS); screens know the flow only through this."""
        self.push_screen(_step_screen(STEPS[STEPS.index(current) + 1], **kwargs))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        palette = getattr(screen, "palette_commands", None)
        if palette is not None:
            yield from palette()

    def tone(self, level: str) -> str:
        """A Rich style for ok / warn / error text in the current theme (readable on dark and light)."""
        key = {"ok": "text-success", "warn": "text-warning", "error": "text-error"}.get(level)
        if key is None:
            return ""
        color = self.theme_variables.get(key, "")
        return f"bold {color}" if level == "error" else color

    @staticmethod
    def describe_error(error: BaseException | None) -> str:
        """One line for the status bar: core's own message for user errors, the type for bugs."""
        if isinstance(error, MlightError):
            return str(error)
        if isinstance(error, OSError):
            return f"{error.strerror or error}: {error.filename}" if error.filename else str(error)
        return f"unexpected error: {type(error).__name__}: {error}"


def _step_screen(step: str, **kwargs) -> Screen:
    """The screen of one step. The app alone knows every screen; screens never import each other."""
    from app.tui.screens.machine import MachineScreen
    from app.tui.screens.model import ModelScreen
    from app.tui.screens.plan import PlanScreen
    from app.tui.screens.prompts import PromptsScreen
    from app.tui.screens.results import ResultsScreen
    from app.tui.screens.run import RunScreen

    screens = {"Machine": MachineScreen, "Model": ModelScreen, "Prompts": PromptsScreen, "Plan": PlanScreen,
               "Run": RunScreen, "Results": ResultsScreen}
    return screens[step](**kwargs)


def create_app(options: Options | None = None, backend: Backend | None = None) -> MlightApp:
    return MlightApp(options or Options(), backend or Backend())
