"""Step 4 — Plan: memory budgets in, the planner's policy and prediction out, editable with live checks.

Budgets (GPU and CPU GB) re-plan after a short pause in typing; edits to N, μ, placement and the
resident fractions are validated by core's planner as they are typed, and what does not fit is
listed with its shortfall. Planning and validation run in thread workers; a generation counter
drops answers to questions that have since been replaced.
"""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Input, Label, Select, Static

from app.tui import fmt
from app.tui.backend import GB
from app.tui.messages import Checked, PlanReady
from app.tui.screens.base import StepScreen
from app.tui.widgets.bars import LabelBar
from app.tui.widgets.facts import Facts
from app.tui.widgets.path_input import PathInput

RESOURCE_LABELS = {"gpu": "GPU compute", "cpu_attn": "CPU attention", "h2d": "PCIe H→D", "d2h": "PCIe D→H"}
PLACES = [("CPU", "cpu"), ("GPU", "gpu")]


def _row(label: str, widget) -> Horizontal:
    return Horizontal(Label(label, classes="form-label"), widget, classes="form-row")


class PlanScreen(StepScreen):
    STEP = "Plan"
    BINDINGS = [Binding("ctrl+r", "replan", "Re-plan", priority=True)]

    def __init__(self):
        super().__init__()
        self._gen = 0  # bumps with every plan/check request; older answers are ignored
        self._replan_timer = None
        self._asked: tuple[str, str] | None = None  # budget fields' text when the last plan was asked for
        self._confirmed: Path | None = None  # an existing results file the user agreed to replace

    def compose_body(self) -> ComposeResult:
        with Horizontal(id="body"):
            with VerticalScroll(id="plan-form", classes="panel"):
                yield Static("Memory budget", classes="form-head")
                yield _row("GPU memory GB", Input(compact=True, id="gpu-mem", type="number"))
                yield _row("CPU memory GB", Input(compact=True, id="cpu-mem", type="number"))
                yield Static("Policy (edit to try your own)", classes="form-head")
                yield _row("Batch N", Input(compact=True, id="batch", type="integer"))
                yield _row("Micro-batch μ", Input(compact=True, id="micro", type="integer"))
                yield _row("Expert batch", Input(compact=True, id="expert", type="integer"))
                yield _row("Attention on", Select(PLACES, compact=True, id="attention", allow_blank=False, value="cpu"))
                yield _row("FFN on", Select(PLACES, compact=True, id="ffn", allow_blank=False, value="gpu"))
                yield _row("GPU experts %", Input(compact=True, id="gpu-weights", type="number"))
                yield _row("GPU KV %", Input(compact=True, id="gpu-kv", type="number"))
                yield _row("Pages / layer", Input(compact=True, id="pages", type="integer"))
                yield Static("Results file (.jsonl or .csv)", classes="form-head")
                yield PathInput(compact=True, id="out")
                yield Static("", id="out-note", classes="muted")
            with VerticalScroll(id="plan-right"):
                yield Facts(id="prediction", classes="panel", label_width=11)
                with Vertical(id="memory", classes="panel"):
                    yield LabelBar("GPU", id="mem-gpu", label_width=5, value_width=22)
                    yield LabelBar("CPU", id="mem-cpu", label_width=5, value_width=22)
                with Vertical(id="layer", classes="panel"):
                    for key, label in RESOURCE_LABELS.items():
                        yield LabelBar(label, id=f"res-{key}", value_width=10)
                yield Static("", id="validation", classes="panel")
                with Horizontal(classes="actions"):
                    yield Button("Accept and run  ^N", compact=True, id="accept", variant="primary", disabled=True)
                    yield Button("Re-plan  ^R", compact=True, id="replan")

    def on_mount(self) -> None:
        self.query_one("#plan-form").border_title = "Plan"
        self.query_one("#prediction").border_title = "Prediction"
        self.query_one("#memory").border_title = "Memory (planned / budget)"
        self.query_one("#layer").border_title = "Decode layer: busy time"
        self.query_one("#validation").border_title = "Check"
        out = self.session.out_path or self.session.default_out()
        self.query_one("#out", PathInput).value = str(out)
        if self.session.plan is not None:
            self.fill(self.session.plan)
        else:
            self.query_one("#prediction", Facts).set_rows([("", "Planning…")])
            self.plan_now(self._budgets_from_options())

    # ---- planning -------------------------------------------------------------------------------
    def _budgets_from_options(self) -> tuple[int | None, int | None]:
        o = self.session.options
        g = int(o.gpu_mem * GB) if o.gpu_mem is not None else None
        c = int(o.cpu_mem * GB) if o.cpu_mem is not None else None
        return g, c

    def plan_now(self, budgets: tuple[int | None, int | None]) -> None:
        self._asked = self._budget_texts()
        self._gen += 1
        self.query_one("#accept", Button).disabled = True
        self.status("Planning…")
        self.make_plan(self._gen, *budgets)

    @work(thread=True, exclusive=True, exit_on_error=False, group="plan", description="plan")
    def make_plan(self, gen: int, gpu_budget: int | None, cpu_budget: int | None) -> None:
        s, b = self.session, self.backend
        # reached straight from the command line: do the earlier steps' work here (plain attribute
        # writes; the backend makes concurrent asks for the same machine or model share one answer)
        if s.machine is None:
            s.machine = b.machine()
        if s.model is None:
            s.model = b.open_model(s.options.model, s.machine)
        if s.prompts is None:
            s.prompts = b.read_prompts(Path(s.options.prompts).expanduser())
        plan = b.plan(s.model, s.machine, s.prompts, gpu_budget, cpu_budget)
        self.post_message(PlanReady(plan, gen))

    def on_plan_ready(self, msg: PlanReady) -> None:
        if msg.gen != self._gen:
            return
        self.session.plan = msg.plan
        if self.query_one("#out", PathInput).value in ("", str(Path("results.jsonl"))):
            self.query_one("#out", PathInput).value = str(self.session.default_out())
        self.fill(msg.plan)

    def worker_failed(self, worker, error) -> None:
        if worker.group == "plan":  # no plan at all (nothing fits, a bad model or prompts file)
            self.query_one("#prediction", Facts).set_rows([("No plan", Text(self.mapp.describe_error(error),
                                                                            style=self.mapp.tone("error")))])
            self.query_one("#accept", Button).disabled = True
        super().worker_failed(worker, error)

    def action_replan(self) -> None:
        if self._replan_timer is not None:
            self._replan_timer.stop()  # a re-plan asked for now makes the pending one moot
            self._replan_timer = None
        self.plan_now(self._budgets())

    # ---- the form -------------------------------------------------------------------------------
    def fill(self, plan) -> None:
        p = plan.policy
        values = {
            "gpu-mem": _gb_text(plan.gpu_budget), "cpu-mem": _gb_text(plan.cpu_budget),
            "batch": str(p.batch_size), "micro": str(p.micro_batch_size), "expert": str(p.expert_batch_size),
            "gpu-weights": _pct(p.gpu_weight_fraction), "gpu-kv": _pct(p.gpu_kv_fraction),
            "pages": str(p.pages_per_layer),
        }
        for wid, v in values.items():
            self.query_one(f"#{wid}", Input).value = v
        self.query_one("#attention", Select).value = p.attention_on
        self.query_one("#ffn", Select).value = p.ffn_on
        self.show(plan)

    def _budgets(self) -> tuple[int | None, int | None]:
        def gb(wid: str) -> int | None:
            try:
                return int(float(self.query_one(f"#{wid}", Input).value) * GB)
            except ValueError:
                return None

        return gb("gpu-mem"), gb("cpu-mem")

    def _budget_texts(self) -> tuple[str, str]:
        return self.query_one("#gpu-mem", Input).value, self.query_one("#cpu-mem", Input).value

    def _policy_fields(self) -> dict:
        def num(wid: str, kind=int):
            text = self.query_one(f"#{wid}", Input).value.strip()
            return kind(float(text)) if text else None

        return {
            "batch_size": num("batch"), "micro_batch_size": num("micro"), "expert_batch_size": num("expert"),
            "attention_on": self.query_one("#attention", Select).value, "ffn_on": self.query_one("#ffn", Select).value,
            "gpu_weight_fraction": (num("gpu-weights", float) or 0.0) / 100,
            "gpu_kv_fraction": (num("gpu-kv", float) or 0.0) / 100, "pages_per_layer": num("pages"),
        }

    @on(Input.Changed, "#gpu-mem, #cpu-mem")
    def budget_changed(self) -> None:
        plan = self.session.plan
        texts = self._budget_texts()
        if plan is None or texts in ((_gb_text(plan.gpu_budget), _gb_text(plan.cpu_budget)), self._asked):
            return  # filled from the plan, or already being planned for
        if self._replan_timer is not None:
            self._replan_timer.stop()
        self._replan_timer = self.set_timer(0.4, self.action_replan)  # re-plan once typing pauses

    @on(Input.Changed, "#batch, #micro, #expert, #gpu-weights, #gpu-kv, #pages")
    @on(Select.Changed)
    def policy_changed(self) -> None:
        plan = self.session.plan
        if plan is None:
            return
        try:
            fields = self._policy_fields()
        except ValueError:
            self.show_problems(["a field holds something that is not a number"])
            return
        if any(v is None for v in fields.values()):
            self.show_problems(["fill in every field"])
            return
        if _same(fields, {k: getattr(plan.policy, k) for k in fields}):
            return  # the form was filled from the plan, not edited
        self._gen += 1
        self.query_one("#accept", Button).disabled = True
        self.check(self._gen, fields)

    @work(thread=True, exclusive=True, exit_on_error=False, group="check", description="validate policy")
    def check(self, gen: int, fields: dict) -> None:
        plan = self.backend.check(self.session.model, self.session.machine, self.session.plan, fields)
        self.post_message(Checked(plan, plan.problems, gen))

    def on_checked(self, msg: Checked) -> None:
        if msg.gen != self._gen:
            return
        if msg.plan.prediction is not None and not msg.problems:
            self.session.plan = msg.plan
        self.show(msg.plan)

    @on(PathInput.Changed, "#out")
    def out_changed(self) -> None:
        self.query_one("#out-note", Static).update(self.backend.resume_info(self.query_one("#out", PathInput).path))

    # ---- drawing --------------------------------------------------------------------------------
    def show(self, plan) -> None:
        pred = plan.prediction
        machine = self.session.machine
        cpu_mode = machine is not None and machine.cpu_mode
        self.query_one("#res-gpu", LabelBar).label = "Compute (CPU)" if cpu_mode else "GPU compute"
        if pred is not None:
            rows = [
                ("Throughput", Text(f"{pred.tokens_per_s:,.1f} tokens/s end to end", style="bold")),
                ("Decode", f"{pred.decode_tokens_per_s:,.1f} tokens/s"),
                ("Prefill", f"{pred.prefill_tokens_per_s:,.1f} prompt tokens/s"),
                ("Bottleneck", pred.bottleneck_text),
                ("Policy", f"N={plan.policy.batch_size}, μ={plan.policy.micro_batch_size} "
                           f"({_plural(plan.policy.num_micro_batches, 'micro-batch', 'micro-batches')}), attention on "
                           f"{plan.policy.attention_on.upper()}, FFN on {plan.policy.ffn_on.upper()}"),
                ("Workload", f"{self.session.prompts.count} prompts, " + plan.workload_text),
            ]
            if cpu_mode:
                rows.append(("CPU mode", "no GPU: every stage runs on the CPU; N and μ are used as planned"))
            self.query_one("#prediction", Facts).set_rows(rows)
            self.query_one("#mem-gpu", LabelBar).update(
                pred.gpu_bytes / plan.gpu_budget if plan.gpu_budget else 0.0,
                "no GPU (CPU mode)" if cpu_mode else f"{fmt.human_bytes(pred.gpu_bytes)} / {fmt.human_bytes(plan.gpu_budget)}")
            self.query_one("#mem-cpu", LabelBar).update(
                pred.cpu_bytes / plan.cpu_budget if plan.cpu_budget else 0.0,
                f"{fmt.human_bytes(pred.cpu_bytes)} / {fmt.human_bytes(plan.cpu_budget)}")
            top = max(pred.layer_seconds.values(), default=0.0) or 1.0
            for key in RESOURCE_LABELS:
                sec = pred.layer_seconds.get(key, 0.0)
                self.query_one(f"#res-{key}", LabelBar).update(sec / top, _ms(sec))
        self.show_problems(plan.problems)

    def show_problems(self, problems: list[str]) -> None:
        box = self.query_one("#validation", Static)
        accept = self.query_one("#accept", Button)
        if problems:
            text = Text()
            for p in problems:
                text.append("✗ ", style=self.mapp.tone("error"))
                text.append(p + "\n")
            box.update(text)
            accept.disabled = True
            self.status("This policy does not fit — fix the fields listed under Check, or Ctrl+R to re-plan.", "error")
        else:
            box.update(Text("✓ fits the budget", style=self.mapp.tone("ok")))
            accept.disabled = False
            self.status("Ctrl+N accepts the plan and starts the run.", "ok")

    # ---- leaving --------------------------------------------------------------------------------
    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "accept":
            self.action_next()
        elif event.button.id == "replan":
            self.action_replan()

    def action_next(self) -> None:
        plan = self.session.plan
        if plan is None or plan.problems or self.query_one("#accept", Button).disabled:
            self.status("No plan that fits yet — see Check.", "warn")
            return
        out = self.query_one("#out", PathInput).path
        try:
            self.backend.check_output(out)
        except Exception as e:  # a user error (folder missing, not writable, unknown suffix)
            self.status(self.mapp.describe_error(e), "error")
            return
        run_file = out.with_name(out.name + ".run.jsonl")
        replace = out.exists() and not run_file.exists()
        if replace and self._confirmed != out:
            self._confirmed = out  # a second Ctrl+N on the same path confirms
            self.status(f"{out.name} already exists: Ctrl+N again replaces it, or change the results file.", "warn")
            return
        self.session.out_path = out
        self.mapp.next_step(self.STEP, replace=replace)

    def palette_commands(self):
        yield SystemCommand("Re-plan", "Ask the planner again for the current budgets", self.action_replan)


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _gb_text(n: int) -> str:
    return f"{n / GB:.1f}" if n >= GB else f"{n / GB:.3g}"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.2f}".rstrip("0").rstrip(".")


def _same(a: dict, b: dict) -> bool:
    """Equal field by field, floats to 1e-6 (percentages typed back in are not bit-exact)."""
    return all(abs(a[k] - b[k]) < 1e-6 if isinstance(b[k], float) else a[k] == b[k] for k in b)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds < 1 else f"{seconds:,.2f} s"
