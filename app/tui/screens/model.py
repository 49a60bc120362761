"""Step 2 — Model: the built-in demo model, a local checkpoint folder, or a Hugging Face repo id (downloaded in a
worker, cancellable and resumable later). The weights are loaded on the Run step, not here."""

from __future__ import annotations

import contextlib
import threading

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, ProgressBar, Static

from app.tui import fmt
from app.tui.glyphs import glyph
from app.tui.messages import ModelReady, WorkProgress
from app.tui.paths import parse_dropped_path
from app.tui.screens.base import StepScreen, button
from app.tui.widgets.facts import Facts
from app.tui.widgets.path_input import PathInput


class ModelScreen(StepScreen):
    STEP = "Model"
    BINDINGS = [
        Binding("d", "demo", "Demo model"),
        Binding("x", "cancel", "Cancel download", show=False),
    ]

    def __init__(self):
        super().__init__()
        self._stop = threading.Event()

    def compose_body(self) -> ComposeResult:
        with Vertical(id="body"):
            yield Static("Which model? A folder or .gguf file, a Hugging Face repo id, or the demo model", classes="title")
            with Horizontal(classes="field"):
                yield PathInput(placeholder="folder, .gguf file or owner/name repo id",
                                compact=True, id="model-input")
                yield button(f"Open {glyph.enter}", "open")
                yield button("Demo model (d)", "demo", variant="primary")
            with Horizontal(classes="busy-row", id="download"):
                yield ProgressBar(total=None, show_eta=False, id="dl-bar")
                yield Static("", id="dl-text")
                yield button("Cancel (x)", "cancel", variant="error")
            yield Facts(id="model-facts", classes="panel", label_width=13)
            with Horizontal(classes="actions"):
                yield button("Continue to Prompts", "next", variant="primary", disabled=True)

    def on_mount(self) -> None:
        self.query_one("#model-facts").border_title = "Model"
        self.query_one("#model-facts", Facts).set_rows([("Model", "none chosen yet — d (or Enter) takes the demo "
                                                                  "model; Tab reaches the path field")])
        opts = self.session.options
        if self.session.model is not None:
            self.show(self.session.model)
        elif opts.model:
            text = "" if self.backend.classify_model_text(opts.model) == "demo" else opts.model
            self.query_one("#model-input", Input).value = text
            self.open_text(text)
        else:
            self.query_one("#demo", Button).focus()  # Enter picks the demo; Tab reaches the path input

    def on_paste(self, event) -> None:
        """A folder dropped while the input is not focused: put it there and open it."""
        event.stop()
        self.query_one("#model-input", Input).value = parse_dropped_path(event.text)
        self.open_text(event.text)

    def action_demo(self) -> None:
        self.query_one("#model-input", Input).value = ""
        self.open_text("")

    @on(Input.Submitted, "#model-input")
    @on(PathInput.Dropped, "#model-input")  # the field shows the dropped path, cleaned
    def submitted(self) -> None:
        self.open_text(self.query_one("#model-input", Input).value)

    def action_open(self) -> None:
        inp = self.query_one("#model-input", Input)
        inp.focus()  # typing goes on in the field: a `d` there is a letter, not the demo key
        self.open_text(inp.value)

    def open_text(self, raw: str) -> None:
        text = parse_dropped_path(raw)
        if raw.strip() != text:
            self.query_one("#model-input", Input).value = text  # show the cleaned path
        kind = self.backend.classify_model_text(text)
        if kind == "missing":
            self.failed(f"{text}: no such folder, and not an owner/name repo id — check the path")
            return
        self._stop.clear()
        self.query_one("#next", Button).disabled = True
        verb = {"demo": "Preparing the demo model", "folder": "Checking the folder", "repo": "Downloading"}[kind]
        self.status(f"{verb}…")
        if kind == "repo":
            self.query_one("#dl-bar", ProgressBar).update(total=None, progress=0)
            self.query_one("#dl-text", Static).update(f"{text}: starting…")
            self.query_one("#download").display = True
            self.query_one("#cancel", Button).focus()  # so that x (or Enter) cancels, not types
        self.load(text)

    @work(thread=True, exclusive=True, exit_on_error=False, group="model", description="model")
    def load(self, text: str) -> None:
        model = self.backend.open_model(text, self.session.machine, self.post_progress, self._stop.is_set)
        self.post_message(ModelReady(model))
        with contextlib.suppress(Exception):  # none here: Plan estimates from characters, and says so
            self.backend.tokenizer(model)  # Plan's first need, read while the prompts are chosen

    def action_cancel(self) -> None:
        if self.query_one("#download").display:
            self._stop.set()
            self.status("Cancelling the download… Open the same repo id again to resume it.", "warn")

    def on_work_progress(self, msg: WorkProgress) -> None:
        if msg.unit == "B" and msg.total:
            bar = self.query_one("#dl-bar", ProgressBar)
            bar.update(total=msg.total, progress=msg.done)
            rate = f" at {fmt.human_bytes(msg.rate)}/s" if msg.rate else ""
            self.query_one("#dl-text", Static).update(
                f"{fmt.human_bytes(msg.done)} of {fmt.human_bytes(msg.total)}{rate}")
        else:
            self.status(f"{msg.what}…")

    def on_model_ready(self, msg: ModelReady) -> None:
        self.query_one("#download").display = False
        self.session.model = msg.model
        self.session.plan = None  # a new model needs a new plan
        self.show(msg.model)
        level = "ok" if msg.model.fits is not False else "warn"
        self.status(f"{msg.model.title}: {msg.model.fits_text}. Ctrl+N to choose prompts.", level)
        self.query_one("#next", Button).focus()

    def worker_failed(self, worker, error) -> None:
        self.query_one("#download").display = False
        self.failed(self.mapp.describe_error(error))

    def failed(self, problem: str) -> None:
        """The model could not be opened: say so in the Model panel too, and give the field back."""
        self.session.model = None
        self.query_one("#model-facts", Facts).set_rows([
            ("Model", "none — the last one could not be opened"),
            ("Problem", Text(problem, style=self.mapp.tone("error"))),
            ("", "Fix the path or repo id and press Enter, or pick the Demo model button."),
        ])
        self.query_one("#next", Button).disabled = True
        self.status(problem, "error")
        self.query_one("#model-input", Input).focus()

    def show(self, m) -> None:
        s, size = m.spec, fmt.human_bytes
        fits = Text(m.fits_text, style=self.mapp.tone("ok" if m.fits else ("error" if m.fits is False else "")))
        rows = [
            ("Model", m.title),
            ("Path", str(m.path)),
            ("Architecture", f"{s.architecture} ({s.family})"),
            ("Layers", f"{s.num_layers} × hidden {s.hidden_size}, {s.num_heads} heads / {s.num_kv_heads} KV heads"),
            ("Experts", f"{s.num_experts} per layer, top-{s.top_k}"
                        + (f", shared expert {s.shared_intermediate}" if s.shared_intermediate else "")),
            ("Parameters", f"{fmt.count(s.num_params)} total, {fmt.count(s.active_params)} active per token"),
            ("Weights", f"{size(s.total_bytes)} in {s.dtype} ({size(s.total_expert_bytes)} experts)"
                        if s.expert_format == "none" else
                        f"{size(s.total_bytes)}: {size(s.total_expert_bytes)} experts in {s.expert_format}, "
                        f"the rest in {s.dtype}"),
            ("Size on disk", fmt.human_bytes(m.disk_bytes)),
            ("Fits?", fits),
        ]
        self.query_one("#model-facts", Facts).set_rows(rows)
        self.query_one("#next", Button).disabled = False

    def action_next(self) -> None:
        if self.session.model is None:
            self.status("Choose a model first (d for the demo model).", "warn")
            return
        self.mapp.next_step(self.STEP)

    def palette_commands(self):
        yield SystemCommand("Use the demo model", "Small random-weight Mixtral, built locally", self.action_demo)
