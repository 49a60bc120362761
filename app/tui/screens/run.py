"""Step 5 — Run: the engine in a thread worker, live panels fed by coalesced telemetry.

Panels: throughput (now, average, sparkline), memory used / budget, pipeline stage busy share
(GPU compute, CPU attention, H2D, D2H), progress (requests, tokens, elapsed, ETA) and a log of
warnings. RunUpdate messages replace each other in the queue (`can_replace`); the screen keeps
only the newest and redraws on a 4 Hz timer, so the display costs the same however fast the
engine steps. Space pauses between steps, s stops cleanly (results so far are on disk), r resumes.
"""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import ProgressBar, RichLog, Sparkline, Static

from app.tui import fmt
from app.tui.messages import RunEnded, RunLog, RunUpdate
from app.tui.meter import RunSnapshot
from app.tui.runjob import RunJob
from app.tui.screens.base import StepScreen
from app.tui.widgets.bars import LabelBar
from app.tui.widgets.facts import Facts

REDRAW_S = 0.25  # at most 4 redraws a second
STAGES = {"gpu": "GPU compute", "cpu_attn": "CPU attention", "h2d": "H2D copies", "d2h": "D2H copies"}
STATE_WORDS = {
    "loading": "loading the model", "running": "running", "paused": "paused (space to continue)",
    "stopping": "stopping after this step…", "done": "done", "stopped": "stopped — r resumes",
    "failed": "failed — see the message below",
}


class RunScreen(StepScreen):
    STEP = "Run"
    BINDINGS = [
        Binding("space", "pause", "Pause/continue"),
        Binding("s", "stop", "Stop"),
        Binding("r", "resume_run", "Resume"),
        Binding("ctrl+n", "next", "Results", priority=True),
    ]

    def __init__(self, replace: bool = False):
        super().__init__()
        self.replace = replace  # the user agreed to replace an existing results file (first start only)
        self.job: RunJob | None = None
        self._latest: RunSnapshot | None = None
        self._dirty = False
        self._shown_state = ""
        self._t0: float | None = None  # set on mount

    def compose_body(self) -> ComposeResult:
        with Vertical(id="body"):
            with Horizontal(classes="run-row"):
                with Vertical(id="throughput", classes="panel"):
                    yield Static("", id="tps")
                    yield Sparkline([], id="spark")
                with Vertical(id="run-memory", classes="panel"):
                    yield LabelBar("GPU", id="run-gpu", label_width=5, value_width=21)
                    yield LabelBar("CPU", id="run-cpu", label_width=5, value_width=21)
            with Horizontal(classes="run-row"):
                with Vertical(id="stages", classes="panel"):
                    for key, label in STAGES.items():
                        yield LabelBar(label, id=f"busy-{key}", label_width=15, value_width=5)
                with Vertical(id="progress", classes="panel"):
                    yield ProgressBar(total=1, show_eta=False, id="req-bar")
                    yield Facts(id="progress-facts", label_width=9)
            yield RichLog(id="log", classes="panel", wrap=True, markup=False, max_lines=500, min_width=20)

    def on_mount(self) -> None:
        self._t0 = self.backend.clock()  # log times count from the screen's start, across resumes
        if self.session.machine is not None and self.session.machine.cpu_mode:
            self.query_one("#busy-gpu", LabelBar).label = "Compute (CPU)"  # telemetry's "gpu" is the CPU here
        for wid, title in (("throughput", "Throughput"), ("run-memory", "Memory (used / budget)"),
                           ("stages", "Pipeline stages (busy share)"), ("progress", "Progress"), ("log", "Log")):
            self.query_one(f"#{wid}").border_title = title
        self.set_interval(REDRAW_S, self._redraw_if_dirty)
        self.start()

    # ---- the job --------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.session
        self.job = RunJob(self.backend, s.model, s.prompts, s.plan, s.out_path, self.post_message, started=self._t0,
                          replace=self.replace)
        self.replace = False  # a resume continues this run's file
        s.run_state = "running"
        self.log_line(f"Run: {s.model.title} on {s.prompts.count} prompts → {s.out_path}")
        self._latest = self.job.meter.snapshot()
        self._redraw()
        self.status("Loading the model… (space pauses, s stops; both keep every finished result)")
        self.run_job()

    @work(thread=True, exclusive=True, exit_on_error=False, group="run", description="engine run")
    def run_job(self) -> None:
        self.job.run()

    def on_run_update(self, msg: RunUpdate) -> None:
        self._latest, self._dirty = msg.snapshot, True
        state = msg.snapshot.state
        if state != self._shown_state:
            self._shown_state = state
            if state == "running":
                self.status("Running. Space pauses between two steps; s stops cleanly (finished results stay).")

    def on_run_log(self, msg: RunLog) -> None:
        self.log_line(msg.text, msg.level)

    def on_run_ended(self, msg: RunEnded) -> None:
        self._latest = msg.snapshot
        self._redraw()
        self.session.run_state = msg.state
        n, total = len(self.job.records), self.session.prompts.count
        if msg.state == "done":
            self.log_line(f"Done: {n} results written to {self.session.out_path}", "ok")
            self.status(f"Done: {n} results in {self.session.out_path}. Ctrl+N shows them.", "ok")
        else:
            run_file = self.session.out_path.name + ".run.jsonl"
            self.log_line(f"Stopped cleanly: {n} of {total} results kept in {run_file}", "warn")
            self.status(f"Stopped: {n} of {total} results are safe in {run_file}. r resumes the rest; "
                        "Ctrl+N shows what is done.", "warn")

    def worker_failed(self, worker, error) -> None:
        self.session.run_state = "failed"
        self.log_line(self.mapp.describe_error(error), "error")
        super().worker_failed(worker, error)
        if self.job is not None:
            self._latest = self.job.meter.snapshot()
            self._redraw()

    # ---- keys -----------------------------------------------------------------------------------
    def action_pause(self) -> None:
        if self.job is None:
            return
        if self.job.state == "running":
            self.job.pause()
            self.status("Paused between two steps. Space continues, s stops.", "warn")
        elif self.job.state == "paused":
            self.job.resume()
            self.status("Running.")

    def action_stop(self) -> None:
        if self.job is not None and self.job.state in ("running", "paused", "loading"):
            self.job.stop()
            self.status("Stopping after the current step…", "warn")

    def action_resume_run(self) -> None:
        if self.session.run_state in ("stopped", "failed"):
            self.log_line("Resuming the stopped run…")
            self.start()

    def action_back(self) -> None:
        if self.session.run_state in ("running", "paused"):
            self.status("A run is going: s stops it first (nothing finished is lost).", "warn")
            return
        super().action_back()

    def action_next(self) -> None:
        if self.job is None or not self.job.records:
            self.status("No results yet.", "warn")
            return
        self.mapp.next_step(self.STEP, records=self.job.ordered_records())

    def on_unmount(self) -> None:
        if self.job is not None:
            self.job.stop()  # leaving the app mid-run: stop cleanly, the run file stays resumable

    def palette_commands(self):
        yield SystemCommand("Pause or continue the run", "Hold the engine between two steps", self.action_pause)
        yield SystemCommand("Stop the run", "Stop cleanly; finished results stay on disk", self.action_stop)
        yield SystemCommand("Resume the run", "Run the prompts a stopped run left", self.action_resume_run)

    # ---- drawing --------------------------------------------------------------------------------
    def log_line(self, text: str, level: str = "info") -> None:
        style = self.mapp.tone(level)
        elapsed = self.backend.clock() - self._t0 if self._t0 is not None else 0.0
        line = Text(f"[{fmt.duration(elapsed)}] ", style="dim")
        line.append(text, style=style)
        self.query_one("#log", RichLog).write(line)

    def _redraw_if_dirty(self) -> None:
        if not self._dirty and self.job is not None and self.job.state in ("loading", "running", "paused"):
            # no news from the engine (a long prefill, a pause): still advance the clock and the ETA
            self._latest, self._dirty = self.job.meter.snapshot(), True
        if self._dirty:
            self._redraw()

    def _redraw(self) -> None:
        snap = self._latest
        if snap is None:
            return
        self._dirty = False
        with self.app.batch_update():
            tps = Text(f"{snap.current_tps:,.1f}", style="bold")
            tps.append(" tokens/s now   ")
            tps.append(f"{snap.average_tps:,.1f}", style="bold")
            tps.append(" average")
            self.query_one("#tps", Static).update(tps)
            self.query_one("#spark", Sparkline).data = list(snap.history)
            for key, used, budget in (("gpu", snap.gpu_used, snap.gpu_budget), ("cpu", snap.cpu_used, snap.cpu_budget)):
                frac = used / budget if budget else 0.0
                label = f"{fmt.human_bytes(used)} / {fmt.human_bytes(budget)}" if used or budget else "—"
                if key == "gpu" and self.session.machine is not None and self.session.machine.cpu_mode:
                    label, frac = "no GPU (CPU mode)", 0.0
                self.query_one(f"#run-{key}", LabelBar).update(frac, label)
            for key in STAGES:
                share = snap.busy.get(key, 0.0)
                self.query_one(f"#busy-{key}", LabelBar).update(share, f"{share * 100:3.0f}%")
            bar = self.query_one("#req-bar", ProgressBar)
            bar.update(total=max(1, snap.requests_total), progress=snap.requests_done)
            eta = "—" if snap.eta is None else ("0:00" if snap.state == "done" else f"≤ {fmt.duration(snap.eta)}")
            loading = f" ({snap.loading})" if snap.state == "loading" and snap.loading else ""
            self.query_one("#progress-facts", Facts).set_rows([
                ("State", STATE_WORDS.get(snap.state, snap.state) + loading),
                ("Requests", f"{snap.requests_done} / {snap.requests_total}"),
                ("Tokens", f"{snap.tokens_out:,} new, {snap.tokens_in:,} prompt"),
                ("Time", f"{fmt.duration(snap.elapsed)} elapsed, ETA {eta}"),
            ])
