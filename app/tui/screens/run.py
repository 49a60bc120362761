"""Step 5 — Run: progress, throughput against the prediction, the last decode step beside the planner's
simulation, and a log; redrawn at 4 Hz, so the display costs the same however fast the engine steps."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import ProgressBar, RichLog, Static

from app.tui import fmt, wording
from app.tui.glyphs import glyph
from app.tui.messages import RunEnded, RunLog, RunUpdate, SimulatedStep
from app.tui.meter import RunSnapshot
from app.tui.runjob import RunJob
from app.tui.screens.base import StepScreen
from app.tui.widgets.bars import LabelBar
from app.tui.widgets.chart import MEASURED_COLOR, PREDICTED_COLOR, ThroughputChart, legend_color
from app.tui.widgets.facts import Facts
from app.tui.widgets.timeline import (KIND_NAMES, LANES, ZOOMS, Legend, Span, Timeline, spans_of_simulation,
                                      time_unit)

REDRAW_S = 0.25  # at most 4 redraws a second
STATE_WORDS = {
    "loading": "loading the model", "running": "running", "paused": "paused (space to continue)",
    "stopping": "stopping after this step…", "done": "done", "stopped": "stopped — r resumes",
    "failed": "failed — see the message below",
}
ZOOM_WORDS = {None: "whole step", 2: "first 2 layers", 1: "first layer"}


class RunScreen(StepScreen):
    STEP = "Run"
    BINDINGS = [
        Binding("space", "pause", "Pause"),
        Binding("space", "unpause", "Continue"),  # the same key: the footer says what it does now
        Binding("s", "stop", "Stop"),
        Binding("r", "resume_run", "Resume"),
        Binding("t", "timeline", "Timeline"),
        Binding("z", "zoom", "Zoom timeline", show=False),
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
        self._simulated: list[Span] = []
        self._simulated_s = 0.0
        self._parted_logged = False
        self._zoom = 0

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="body"):
            with Horizontal(classes="run-row", id="run-top"):
                with Vertical(id="progress", classes="panel"):
                    yield ProgressBar(total=1, show_eta=False, id="req-bar")
                    yield Facts(id="progress-facts", label_width=9)
                    yield LabelBar("GPU", id="run-gpu", label_width=9, value_width=21)
                    yield LabelBar("CPU", id="run-cpu", label_width=9, value_width=21)
                with Vertical(id="throughput", classes="panel"):
                    yield Static("", id="tps")
                    yield ThroughputChart(id="chart")
            with Vertical(id="pipeline", classes="panel"):
                with Horizontal(id="timelines"):
                    yield Timeline(id="tl-measured", cpu_mode=self.cpu_mode)
                    yield Timeline(id="tl-simulated", cpu_mode=self.cpu_mode)
                yield Legend(id="legend")
            yield RichLog(id="log", classes="panel", wrap=True, markup=False, max_lines=500, min_width=20)

    def on_mount(self) -> None:
        self._t0 = self.backend.clock()  # log times count from the screen's start, across resumes
        for wid, title in (("throughput", "Decode throughput: measured and predicted"), ("progress", "Progress"),
                           ("pipeline", "Pipeline: the last decode step"), ("log", "Log")):
            self.query_one(f"#{wid}").border_title = title
        self.query_one("#pipeline").border_subtitle = "z zoom · t jump here and back"
        self.set_interval(REDRAW_S, self._redraw_if_dirty)
        self.start()

    def start(self) -> None:
        s = self.session
        previous = self._latest if self.job is not None else None  # a resume goes on from the stopped run
        self.job = RunJob(self.backend, s.model, s.prompts, s.plan, s.out_path, self.post_message, previous=previous,
                          replace=self.replace, choices=s.choices, machine=s.machine)
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
            self.refresh_bindings()
            if state == "running":
                self.status("Running. Space pauses between two steps; s stops cleanly (finished results stay).")

    def on_simulated_step(self, msg: SimulatedStep) -> None:
        if msg.timeline is not None:
            self._simulated = spans_of_simulation(msg.timeline)
            self._simulated_s = msg.timeline.makespan
            self._dirty = True

    def on_run_log(self, msg: RunLog) -> None:
        self.log_line(msg.text, msg.level)

    def on_run_ended(self, msg: RunEnded) -> None:
        self._latest = msg.snapshot
        self._redraw()
        self.session.run_state = msg.state
        self.refresh_bindings()
        n, total = len(self.job.records), self.session.prompts.count
        out = self.session.out_path
        if msg.state == "done":
            rejects = self.session.prompts.prompts.rejects
            lines = "1 skipped line" if len(rejects) == 1 else f"{len(rejects)} skipped lines"
            skipped = f"; {lines} in {out.name}.rejected.jsonl" if rejects else ""
            self.log_line(f"Done: {n} results written to {out}{skipped}", "ok")
            self.status(f"Done: {n} results in {out}{skipped}. Ctrl+N shows them.", "ok")
            self.mapp.run_ended("The run is done. Quit now?",
                                f"Every result is in {out.name}; nothing is lost by quitting.")
        else:
            run_file = out.name + ".run.jsonl"
            self.log_line(f"Stopped cleanly: {n} of {total} results kept in {run_file}", "warn")
            self.status(f"Stopped: {n} of {total} results are safe in {run_file}. r resumes the rest; "
                        "Ctrl+N shows what is done.", "warn")
            self.mapp.run_ended("The run has stopped. Quit now?",
                                f"{n} of {total} results are in {run_file}; start the app (or `mlight run`) on the "
                                "same files again to finish the rest.")

    def worker_failed(self, worker, error) -> None:
        self.session.run_state = "failed"
        cause = getattr(error, "__cause__", None)
        if wording.missing_feature(error) or wording.missing_feature(cause):
            self.session.failure = "dtype"  # the Plan screen opens its Advanced choices on the way back
        self.log_line(self.mapp.describe_error(error), "error")
        super().worker_failed(worker, error)
        self.refresh_bindings()
        if self.job is not None:
            self._latest = self.job.meter.snapshot()
            self._redraw()

    def check_action(self, action: str, parameters) -> bool | None:
        """The footer lists only the keys that do something now (and so has room for ^q and ?)."""
        state = self.job.state if self.job is not None else ""
        going = state in ("loading", "running", "paused", "stopping")
        now = {"pause": going and state != "paused", "unpause": state == "paused", "stop": going,
               "resume_run": state in ("stopped", "failed"), "back": not going}
        return now[action] if action in now else super().check_action(action, parameters)

    def action_pause(self) -> None:
        if self.job is None:
            return
        if self.job.state == "running":
            self.job.pause()
            self.session.run_state = "paused"
            self.status("Paused between two steps. Space continues, s stops.", "warn")
        elif self.job.state == "paused":
            self.job.resume()
            self.session.run_state = "running"
            self.status("Running.")
        self._latest, self._dirty = self.job.meter.snapshot(), True
        self.refresh_bindings()

    def action_unpause(self) -> None:
        self.action_pause()  # space toggles; two bindings only so that the footer names what it does

    def action_stop(self) -> None:
        if self.job is not None and self.job.state in ("running", "paused", "loading"):
            self.job.stop()
            self.status("Stopping after the current step…", "warn")

    def action_resume_run(self) -> None:
        if self.session.run_state == "failed" and self.session.failure == "dtype":
            self.status("Retrying would fail the same way: Esc goes back to Plan; choose Compute dtype float32 "
                        "under Advanced, then Ctrl+N.", "warn")
            return
        if self.session.run_state in ("stopped", "failed"):
            self.log_line("Resuming the stopped run…")
            self.start()

    def action_timeline(self) -> None:
        body = self.query_one("#body", VerticalScroll)
        pipeline = self.query_one("#pipeline")
        if body.max_scroll_y == 0:
            return  # everything is on screen already
        if body.scroll_y >= min(pipeline.virtual_region.y, body.max_scroll_y) - 1:
            body.scroll_home(animate=False)
        else:
            body.scroll_to_widget(pipeline, animate=False, top=True)

    def action_zoom(self) -> None:
        self._zoom = (self._zoom + 1) % len(ZOOMS)
        for tl in self.query(Timeline):
            tl.zoom = self._zoom
        shown = "" if ZOOMS[self._zoom] is None else f"{ZOOM_WORDS[ZOOMS[self._zoom]]} shown · "
        self.query_one("#pipeline").border_subtitle = f"{shown}z zoom · t jump here and back"
        self._draw_pipeline(self._latest)
        self.status(f"Timelines: {ZOOM_WORDS[ZOOMS[self._zoom]]} (z for more).")

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
        yield SystemCommand("Zoom the timelines", "Whole step, first two layers, first layer", self.action_zoom)

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
            self._draw_progress(snap)
            self._draw_throughput(snap)
            self._draw_pipeline(snap)

    def _draw_progress(self, snap: RunSnapshot) -> None:
        for key, used, budget in (("gpu", snap.gpu_used, snap.gpu_budget), ("cpu", snap.cpu_used, snap.cpu_budget)):
            frac = used / budget if budget else 0.0
            label = f"{fmt.human_bytes(used)} / {fmt.human_bytes(budget)}" if used or budget else "—"
            if key == "gpu" and self.cpu_mode:
                label, frac = "no GPU (CPU mode)", 0.0
            self.query_one(f"#run-{key}", LabelBar).update(frac, label)
        self.query_one("#req-bar", ProgressBar).update(total=max(1, snap.requests_total), progress=snap.requests_done)
        self.query_one("#progress-facts", Facts).set_rows([
            ("State", self._state_text(snap)),
            ("Requests", f"{snap.requests_done} / {snap.requests_total}"),
            ("Tokens", f"{snap.tokens_out:,} new, {snap.tokens_in:,} prompt (this run)"),
            ("Saved", f"{snap.saved_out:,} new, {snap.saved_in:,} prompt (finished results, all runs)"),
            ("Time", _time_text(snap)),
        ])

    @staticmethod
    def _state_text(snap: RunSnapshot) -> str:
        """The state in words, with what takes a while: loading (and quantizing), or the first batch's prefill."""
        text = STATE_WORDS.get(snap.state, snap.state)
        if snap.state == "loading" and snap.loading:
            return f"{text} ({snap.loading})"
        if snap.state == "running" and not snap.stepped:
            return f"{text}: prefilling the first batch (its first tokens come at the end of it)"
        return text

    def _draw_throughput(self, snap: RunSnapshot) -> None:
        pred = self.session.plan.prediction if self.session.plan is not None else None
        predicted = pred.decode_tokens_per_s if pred is not None else None
        band = getattr(pred, "band", 0.0)
        text = Text.assemble(("━ ", legend_color(MEASURED_COLOR)), (f"{snap.decode_tps:,.1f}", "bold"),
                             " tokens/s now · ", (f"{snap.average_tps:,.1f}", "bold"), " average · ",
                             ("━ ", legend_color(PREDICTED_COLOR)),
                             (f"{predicted:,.1f}" if predicted else "—", "bold"),
                             f" ± {band:.0%} predicted" if predicted and band else " predicted")
        parted = self._parted(snap)
        if parted:
            text.append(f"\n{glyph.warn} " + parted, style=self.mapp.tone("warn"))
            if not self._parted_logged:  # the log says the same as the chart, in the same words
                self._parted_logged = True
                self.log_line(parted, "warn")
        self.query_one("#tps", Static).update(text)
        self.query_one("#chart", ThroughputChart).show(snap.history, predicted)

    @staticmethod
    def _parted(snap: RunSnapshot) -> str:
        """Why measured and predicted decode part, once core's tracker says they do (as `mlight bench`), else ''."""
        c = snap.comparison
        if c is None or not c.parted or c.error is None or c.error <= -1:
            return ""
        ratio = 1 + c.error
        how = f"{1 / ratio:.1f}× below" if ratio < 1 else f"{ratio:.1f}× above"
        why = ("measured with fewer requests in flight than the plan's batch, which the prediction is for"
               if not snap.full_batch else
               "the planner's model of this machine is off (`mlight bench --calibrate` fits it)")
        return f"decode measured at {c.measured_decode_tokens_per_s:,.1f} tokens/s: {how} the prediction — {why}"

    @staticmethod
    def _measured_head(snap: RunSnapshot | None, simulated_s: float) -> Text:
        """The step drawn and, beside the simulation, the window's median step (one step is a noisy sample)."""
        head = Text("Measured", style="bold")
        step = snap.timeline if snap is not None else None
        if step is None:
            head.append(" · waiting for the first decode step", style="dim")
            return head
        if snap.typical_steps and simulated_s > 0:  # first: the title is cropped at the panel's width
            fewer = ", fewer requests than planned" if not snap.full_batch else ""
            head.append(f" · {snap.typical_step_s / simulated_s:.1f}× simulated: median of {snap.typical_steps} "
                        f"steps {_time(snap.typical_step_s)}{fewer}")
        head.append(f" · drawn: {_time(step.seconds)}, {step.active} requests", style="dim")
        return head

    def _draw_pipeline(self, snap: RunSnapshot | None) -> None:
        measured = self.query_one("#tl-measured", Timeline)
        simulated = self.query_one("#tl-simulated", Timeline)
        step = snap.timeline if snap is not None else None
        m_spans = [Span(*s) for s in step.spans] if step is not None else []
        present = {s.resource for s in m_spans} | {s.resource for s in self._simulated}
        lanes = tuple(r for r in LANES if r in present) or (("compute", "cpu_attn") if self.cpu_mode else LANES)
        head = self._measured_head(snap, self._simulated_s)
        sim_head = Text("Planner's simulation", style="bold")
        if self._simulated:
            n = self.session.plan.policy.batch_size if self.session.plan is not None else 0
            sim_head.append(f" · {_time(self._simulated_s)} · {n} requests")
        else:
            sim_head.append(" · not available", style="dim")
        measured.show(m_spans, step.seconds if step is not None else 0.0, head, lanes)
        simulated.show(self._simulated, self._simulated_s, sim_head, lanes)
        kinds = {s.kind for s in m_spans} | {s.kind for s in self._simulated}
        order = {k: i for i, k in enumerate(KIND_NAMES)}
        self.query_one("#legend", Legend).show(sorted(kinds, key=lambda k: order.get(k, 99)))


def _time_text(snap: RunSnapshot) -> str:
    """Running time and what is left: an estimate while the run goes, what it took once it is over."""
    took = fmt.duration(snap.elapsed)
    if snap.state == "done":
        return f"took {took}"
    if snap.state in ("stopped", "failed"):
        return f"{took} before it {'stopped' if snap.state == 'stopped' else 'failed'}"
    left = "—" if snap.eta is None else f"about {fmt.duration(snap.eta)}"
    return f"{took} running, {left} left"


def _time(seconds: float) -> str:
    mult, unit = time_unit(seconds)
    return f"{seconds * mult:,.1f} {unit}"
