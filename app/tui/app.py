"""MlightApp and `create_app`, the factory shared by the command line and the tests."""

from __future__ import annotations

from typing import Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from app.tui import wording
from app.tui.backend import Backend
from app.tui.screens.confirm import ConfirmQuit
from app.tui.screens.help import HelpScreen
from app.tui.session import Options, Session
from app.tui.widgets.steps import STEPS
from core.errors import MlightError

class MlightApp(App):
    CSS_PATH = "mlight.tcss"
    TITLE = "mlight"
    SUB_TITLE = "MoE batch inference"
    # the stylesheet tightens a few layouts on small terminals (80×24) through these classes
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("ctrl+c", "quit", "Quit", show=False),  # a text field keeps Ctrl+C for copy
        Binding("q", "quit", "Quit", show=False),  # typed into a text field, q is a letter
        Binding("question_mark", "help", "Help"),
        Binding("f1", "help", "Help"),  # the footer shows one key per action: F1 where a text field takes ?
    ]

    def __init__(self, options: Options, backend: Backend):
        super().__init__()
        self.session = Session(options)
        self.backend = backend
        if options.max_new_tokens is not None:
            backend.max_new_tokens = options.max_new_tokens

    def on_mount(self) -> None:
        # the machine first on every path: the command line's later steps open once it is known (`machine_known`)
        self._opening: tuple[str, dict[str, str]] | None = None
        opts = self.session.options
        if opts.model and opts.prompts:
            # to Plan, or the first step the command line got wrong; the steps before stay for Esc
            problems = self.backend.check_options(opts.model, opts.prompts)
            stop = next((step for step in ("Model", "Prompts") if step in problems), "Plan")
            self._opening = (stop, problems)
        self.push_screen(_step_screen("Machine"))

    def push_screen(self, screen, *args, **kwargs):
        # born with the breakpoint class of the current width, its first resize does not restyle the whole screen
        if isinstance(screen, Screen) and not screen.is_attached:
            width = self.size.width
            edges = screen.HORIZONTAL_BREAKPOINTS if screen.HORIZONTAL_BREAKPOINTS is not None \
                else self.HORIZONTAL_BREAKPOINTS
            fits = [name for edge, name in sorted(edges or [], reverse=True) if width >= edge]
            if fits and not (screen.VERTICAL_BREAKPOINTS or self.VERTICAL_BREAKPOINTS):
                screen.add_class(fits[0], update=False)
        return super().push_screen(screen, *args, **kwargs)

    def machine_known(self) -> None:
        """The session holds the machine now: open the steps the command line asked for, once."""
        if self._opening is None:
            return
        stop, problems = self._opening
        self._opening = None
        for step in STEPS[1:STEPS.index(stop) + 1]:
            self.push_screen(_step_screen(step))
        if problems:
            self.notify("\n".join(problems.values()), title="Fix the command line's choices here",
                        severity="error", timeout=20)

    def next_step(self, current: str, **kwargs) -> None:
        """Open the step after `current` (a name in STEPS); screens know the flow only through this."""
        self.push_screen(_step_screen(STEPS[STEPS.index(current) + 1], **kwargs))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help", "The steps and their keys (? or F1)", self.action_help)
        yield from getattr(screen, "palette_commands", tuple)()  # a step's own entries; a dialog has none

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.screen))

    async def action_quit(self) -> None:
        if isinstance(self.screen, ConfirmQuit) or self.session.run_state not in ("running", "paused"):
            self.exit()  # on the dialog, asked twice: that is a yes
            return
        out = self.session.out_path
        run_file = out.name + ".run.jsonl" if out is not None else "the run file"
        self.push_screen(ConfirmQuit(run_file), lambda yes: self.exit() if yes else None)

    def run_ended(self, head: str, text: str) -> None:
        """A run ended: a quit dialog still asking about it says so instead."""
        for screen in self.screen_stack:
            if isinstance(screen, ConfirmQuit):
                screen.run_ended(head, text)

    def tone(self, level: str) -> str:
        """A Rich style for ok / warn / error text in the current theme (readable on dark and light)."""
        key = {"ok": "text-success", "warn": "text-warning", "error": "text-error"}.get(level)
        if key is None:
            return ""
        color = self.theme_variables.get(key, "")
        return f"bold {color}" if level == "error" else color

    @staticmethod
    def describe_error(error: BaseException | None) -> str:
        """One line for the status bar: core's message for user errors (in the app's words), what to do for a CPU that
        lacks a feature, the type for bugs."""
        cause = error.__cause__ if isinstance(error, MlightError) else None  # a task's own error
        if wording.missing_feature(error) or wording.missing_feature(cause):
            root = error if cause is None else cause
            first = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
            return (f"this machine cannot compute the model in its stored dtype ({first[:90]}). "
                    "Esc goes back to Plan: choose Compute dtype float32 under Advanced (or another executor), "
                    "then Ctrl+N")
        if isinstance(error, MlightError):
            return wording.for_screen(str(error))
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

