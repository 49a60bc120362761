"""StepScreen: the breadcrumb, footer, back/next keys, status line and worker-error handling that
every step shares (workers fail into one handler, never a traceback)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Button, Static
from textual.worker import Worker, WorkerState

from app.tui.messages import WorkProgress
from app.tui.widgets.footer import KeyFooter
from app.tui.widgets.steps import Steps


def button(label: str, id: str, action: str = "", **kw) -> Button:
    """A compact button that runs this screen's `action` (default: its id) when pressed."""
    # born with the classes Button's own watchers would add one by one, each add restyling it
    variant = kw.get("variant", "default")
    made = " -style-default" + ("" if variant == "default" else f" -{variant}")
    kw["classes"] = kw.get("classes", "") + made
    return Button(label, compact=True, id=id, action=f"screen.{action or id}", **kw)


class StepScreen(Screen):
    STEP = ""
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("ctrl+n", "next", "Next", priority=True),
    ]

    @property
    def mapp(self):
        """MlightApp, which screens never import: session, backend, next_step, machine_known, run_ended, tone and
        describe_error are all they use of it."""
        return self.app

    @property
    def session(self):
        return self.mapp.session

    @property
    def backend(self):
        return self.mapp.backend

    @property
    def cpu_mode(self) -> bool:
        """The machine has no GPU (False while it is not known yet)."""
        m = self.session.machine
        return m is not None and m.cpu_mode

    def compose(self) -> ComposeResult:
        yield Steps(self.STEP, id="steps")
        yield from self.compose_body()
        yield Static(id="status")  # what is happening, or what went wrong and what to do
        yield KeyFooter(compact=True)  # compact: at 80 columns every key shown fits, ? Help too

    def compose_body(self) -> ComposeResult:
        yield from ()

    def status(self, text: str, level: str = "info") -> None:
        status = self.query_one("#status", Static)
        status.set_classes(f"-{level}")
        status.update(text)

    def post_progress(self, ev) -> None:
        """A core Progress event from a worker thread, to this screen's `on_work_progress`."""
        self.post_message(WorkProgress(ev.what, ev.done, ev.total, getattr(ev, "unit", ""), getattr(ev, "rate", None)))

    def _first(self) -> bool:
        return len(self.app.screen_stack) <= 2  # [default, Machine, ...]: Machine is the first step

    def check_action(self, action: str, parameters) -> bool | None:
        """The first step has nothing to go back to: its footer does not offer Esc."""
        return not (action == "back" and self._first())

    def action_back(self) -> None:
        if not self._first():
            self.app.pop_screen()

    def action_next(self) -> None:
        """Go on to the next step when this one is complete (each screen says what is missing)."""

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR:
            self.worker_failed(event.worker, event.worker.error)

    def worker_failed(self, worker: Worker, error: BaseException | None) -> None:
        self.status(self.mapp.describe_error(error), "error")
