"""Step 1 — Machine: the GPU(s), CPU RAM, cores, PCIe link and measured host↔device bandwidth. The probe runs
in a thread worker (core caches it per machine); `r` probes again, ignoring the cache."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, LoadingIndicator, Static

from app.tui.glyphs import glyph
from app.tui.messages import MachineReady, WorkProgress
from app.tui.screens.base import StepScreen, button
from app.tui.widgets.facts import Facts


class MachineScreen(StepScreen):
    STEP = "Machine"
    BINDINGS = [Binding("r", "probe(True)", "Re-probe")]

    def compose_body(self) -> ComposeResult:
        with Vertical(id="body"):
            yield Static("What mlight found on this machine", classes="title")
            with Horizontal(classes="panels"):
                yield Facts(id="gpu", classes="panel", label_width=14)
                yield Facts(id="cpu", classes="panel", label_width=12)
            with Horizontal(classes="busy-row", id="probing"):
                yield LoadingIndicator()
                yield Static("Detecting hardware and measuring bandwidth…", id="probe-what")
            yield Static("", id="source", classes="muted")
            with Horizontal(classes="actions"):
                yield button(f"Continue to Model  {glyph.enter}", "next", variant="primary", disabled=True)
                yield button("Re-probe (r)", "reprobe", "probe(True)")

    def on_mount(self) -> None:
        self.query_one("#gpu").border_title = "GPU"
        self.query_one("#cpu").border_title = "CPU"
        if self.session.machine is None:
            self.query_one("#gpu", Facts).set_rows([("GPU", "looking…")])
            self.query_one("#cpu", Facts).set_rows([("RAM", "looking…")])
            self.action_probe(False)
        else:
            self.show(self.session.machine)

    def action_probe(self, refresh: bool) -> None:
        self.query_one("#probing").display = True
        self.query_one("#next", Button).disabled = True
        self.status("Probing… (the first time takes a few seconds; the result is cached)")
        self.probe(refresh)

    @work(thread=True, exclusive=True, exit_on_error=False, group="probe", description="hardware probe")
    def probe(self, refresh: bool) -> None:
        self.post_message(MachineReady(self.backend.machine(refresh=refresh, progress=self.post_progress)))

    def on_work_progress(self, msg: WorkProgress) -> None:
        self.query_one("#probe-what", Static).update(f"{msg.what}…")

    def on_machine_ready(self, msg: MachineReady) -> None:
        self.session.machine = msg.machine
        self.show(msg.machine)
        self.status("Ready. Press Enter or Ctrl+N to choose a model.", "ok")
        self.query_one("#next", Button).focus()
        self.mapp.machine_known()

    def show(self, m) -> None:
        self.query_one("#probing").display = False
        self.query_one("#gpu", Facts).set_rows(m.gpu_rows)
        self.query_one("#cpu", Facts).set_rows(m.cpu_rows)
        self.query_one("#source", Static).update(m.source)
        self.query_one("#next", Button).disabled = False

    def worker_failed(self, worker, error) -> None:
        self.query_one("#probing").display = False
        super().worker_failed(worker, error)

    def action_next(self) -> None:
        if self.session.machine is None:
            self.status("Still probing the machine — a moment.", "warn")
            return
        self.mapp.next_step(self.STEP)

    def action_back(self) -> None:
        self.status("This is the first step: Enter goes on, ? shows the keys and steps, q quits.")

    def palette_commands(self):
        yield SystemCommand("Re-probe the machine", "Measure the hardware again, ignoring the cache",
                            lambda: self.action_probe(True))
