"""Step 4 — Plan: memory budgets in, the planner's policy and prediction out, editable with live checks.
Planning and checks run in thread workers; a generation counter drops answers to questions since replaced."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Collapsible, Input, Label, Select, Static

from app.tui import fmt, wording
from app.tui.backend import GB, EngineChoices
from app.tui.glyphs import glyph
from app.tui.messages import Checked, PlanReady, WorkProgress
from app.tui.screens.base import StepScreen, button
from app.tui.widgets.bars import LabelBar
from app.tui.widgets.facts import Facts
from app.tui.widgets.path_input import PathInput

RESOURCE_LABELS = {"compute": "GPU compute", "cpu_attn": "CPU attention", "h2d": "PCIe H→D", "d2h": "PCIe D→H"}
CPU_MODE_LABELS = {"compute": "CPU compute", "cpu_attn": "CPU attention"}
CPU_MODE_BOTTLENECK = {"compute": "CPU compute (dense layers and experts run on the CPU)",
                       "cpu_attn": "CPU attention (memory bandwidth reading the KV cache)"}
PLACES = [("CPU", "cpu"), ("GPU", "gpu")]
AUTO = "auto"

# Advanced choices: (value, label, what it does in one line); AUTO leaves it to the engine
DTYPES = [
    (AUTO, "auto", "as stored in the checkpoint, unless this CPU computes it slowly"),
    ("float32", "float32", "runs on every CPU; twice the memory of bfloat16"),
    ("bfloat16", "bfloat16", "half the memory; fast on GPUs and on CPUs with AVX-512 BF16 or AMX"),
    ("float16", "float16", "half the memory; for GPUs (slow on most CPUs)"),
]
EXECUTORS = [
    (AUTO, "auto", "CUDA streams when a GPU is present, else one CPU thread in order"),
    ("sequential", "sequential", "every task in order on one thread: simplest, nothing overlaps"),
    ("threaded", "threaded", "a thread per resource: copies and CPU attention overlap compute"),
    ("cuda", "cuda", "CUDA streams and events (needs an NVIDIA GPU)"),
]
SCHEDULES = [
    (AUTO, "auto", "CGOPipe, or FlexGen-style when the plan puts attention on the GPU"),
    ("cgopipe", "CGOPipe", "CPU attention and weight pages overlap GPU work (the paper's pipeline)"),
    ("s4", "FlexGen (S4)", "attention on the GPU; the next layer's weights go first"),
    ("s3", "no overlap (S3)", "one chain, layer by layer: a baseline to compare with"),
]
QUANTIZE = [  # here "auto" is a choice of its own (the planner picks the format), and "none" the default
    ("none", "none", "experts as stored in the checkpoint"),
    ("int8", "int8", "8-bit experts: half of bfloat16 in RAM and over PCIe, near-lossless"),
    ("int4", "int4", "4-bit experts: a quarter of bfloat16; some loss"),
    ("auto", "auto", "the least lossy format that fits the budget (the plan says which)"),
]
DENSE = [  # --quantize-dense: the row shows only beside quantized experts
    ("none", "none", "attention and LM head as stored in the checkpoint"),
    ("int8", "int8", "attention and LM head in 8 bits (CPU-only): faster at small batches, some loss"),
    ("int4", "int4", "attention and LM head in 4 bits (CPU-only): fastest at batch 1, much more loss"),
]
GROUPS = [  # int4's weights per scale (core's INT4_GROUPS); the row shows only when int4 may be chosen
    (32, "32", "a scale per 32 weights: the least loss, the most bytes"),
    (64, "64", "a scale per 64 weights: the usual balance"),
    (128, "128", "a scale per 128 weights: the fewest bytes, a little more loss"),
]
# the Advanced rows: EngineChoices field -> (label, the value that leaves it to the engine, the options)
ADVANCED = {"dtype": ("Compute dtype", AUTO, DTYPES), "executor": ("Executor", AUTO, EXECUTORS),
            "schedule": ("Schedule", AUTO, SCHEDULES), "quantize": ("Quantize", "none", QUANTIZE),
            "quantize_dense": ("Dense weights", "none", DENSE), "group_size": ("int4 group", 64, GROUPS)}
REPLAN_ON = ("dtype", "quantize", "quantize_dense", "group_size")  # choices that change the bytes the plan must fit
# the policy's fields on the form, in its order (labels: wording.POLICY_LABELS): widget id, kind (str: a place)
POLICY_FORM = {"batch_size": ("batch", int), "micro_batch_size": ("micro", int), "expert_batch_size": ("expert", int),
               "attention_on": ("attention", str), "ffn_on": ("ffn", str),
               "gpu_weight_fraction": ("gpu-weights", float), "gpu_kv_fraction": ("gpu-kv", float),
               "pages_per_layer": ("pages", int)}
INPUT_TYPES = {int: "integer", float: "number"}


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
        self._confirmed = None  # an existing results file the user agreed to replace

    def compose_body(self) -> ComposeResult:
        with Horizontal(id="body"):
            with Vertical(id="plan-left"):  # under 100 columns the Decode layer panel goes under the form
                with VerticalScroll(id="plan-form", classes="panel"):
                    yield Static("Memory budget", classes="form-head")
                    yield _row("GPU memory GB", Input(compact=True, id="gpu-mem", type="number"))
                    yield _row("CPU memory GB", Input(compact=True, id="cpu-mem", type="number"))
                    yield _row("Max new tokens", Input(compact=True, id="max-new", type="integer"))
                    yield Static("", id="max-new-hint", classes="hint")
                    yield Static("Policy (edit to try your own)", classes="form-head")
                    for key, (wid, kind) in POLICY_FORM.items():  # a place is picked from a list, a number typed
                        place = "gpu" if wid == "ffn" else "cpu"
                        widget = Select(PLACES, compact=True, id=wid, allow_blank=False, value=place) if kind is str \
                            else Input(compact=True, id=wid, type=INPUT_TYPES[kind])
                        yield _row(wording.POLICY_LABELS[key], widget)
                    with Collapsible(title="Advanced: dtype, executor, …", id="advanced", collapsed=True):
                        for key, (label, default, options) in ADVANCED.items():
                            choices = [(text, value) for value, text, _ in options]
                            yield _row(label, Select(choices, compact=True, id=key, allow_blank=False, value=default))
                            yield Static("", id=f"{key}-hint", classes="hint")
                    yield Static("Results file (.jsonl or .csv)", classes="form-head")
                    yield PathInput(compact=True, id="out")
                    yield Static("", id="out-note", classes="muted")
                if self.has_class("-narrow"):  # the app gives a screen its breakpoint's class before it composes
                    yield self._layer_panel()
            with Vertical(id="plan-right"):
                with VerticalScroll(id="plan-facts"):
                    yield Facts(id="prediction", classes="panel", label_width=11)
                    with Vertical(id="memory", classes="panel"):
                        yield LabelBar("GPU", id="mem-gpu", label_width=5, value_width=24)
                        yield LabelBar("CPU", id="mem-cpu", label_width=5, value_width=24)
                        yield Static("", id="usable", classes="muted")
                    if not self.has_class("-narrow"):
                        yield self._layer_panel()
                with Vertical(id="plan-bottom"):  # padded by the scrollbar's width: Check lines up with the panels
                    yield Static("", id="validation", classes="panel")
                    with Horizontal(classes="actions", id="plan-actions"):
                        yield button("Accept and run  ^N", "accept", "next", variant="primary", disabled=True)
                        yield button("Re-plan  ^R", "replan")

    def on_mount(self) -> None:
        for wid, title in (("plan-form", "Plan"), ("prediction", "Prediction"), ("memory", "Memory (planned / usable)"),
                           ("validation", "Check")):
            self.query_one(f"#{wid}").border_title = title
        for key, value in dataclasses.asdict(self.session.choices).items():
            value = value or ADVANCED[key][1]
            self.query_one(f"#{key}", Select).value = value
            self.query_one(f"#{key}-hint", Static).update(_hint(key, value))
        self._show_group_row()
        if self.cpu_mode:
            self.query_one("#ffn", Select).value = "cpu"  # what the plan will say, not a GPU while it plans
        self.query_one("#out", PathInput).show(str(self.session.chosen_out()))
        self.query_one("#max-new", Input).value = str(self.backend.max_new_tokens)
        if self.session.plan is not None:
            self.fill(self.session.plan)
        else:
            self.query_one("#prediction", Facts).set_rows([("", "Planning…")])
            o = self.session.options
            self.plan_now(tuple(int(v * GB) if v is not None else None for v in (o.gpu_mem, o.cpu_mem)))

    def _layer_panel(self) -> Vertical:
        cpu = self.cpu_mode
        bars = [LabelBar(CPU_MODE_LABELS.get(key, label) if cpu else label, id=f"res-{key}", value_width=10)
                for key, label in RESOURCE_LABELS.items()]
        for bar in bars[2:]:  # PCIe: no link without a GPU
            bar.display = not cpu
        panel = Vertical(*bars, id="layer", classes="panel")
        panel.border_title = "Decode layer: CPU time" if cpu else "Decode layer: busy time"
        return panel

    async def on_resize(self) -> None:
        """Across the 100-column breakpoint the Decode layer panel moves (under the form, narrow: so that at 80×24
        every panel shows whole) and the Prediction and Memory panels change their rows."""
        home = self.query_one("#plan-left" if self.has_class("-narrow") else "#plan-facts")
        layer = self.query_one("#layer")
        if layer.parent is not home:
            await layer.remove()
            await home.mount(self._layer_panel())
        if self.session.plan is not None and self.session.plan.prediction is not None:
            self.show(self.session.plan)

    def on_screen_resume(self) -> None:
        """Back from a run that failed for want of a CPU feature: the dtype choice is the way out."""
        if self.session.failure == "dtype":
            self.session.failure = ""
            self.query_one("#advanced", Collapsible).collapsed = False
            self.query_one("#dtype", Select).focus()
            self.status("This machine could not run the model in its stored dtype: choose float32 here, "
                        "then Ctrl+N.", "warn")

    def plan_now(self, budgets: tuple[int | None, int | None]) -> None:
        self._asked = self._budget_texts()
        self._gen += 1
        self.query_one("#accept", Button).disabled = True
        self.status("Planning…")
        self.make_plan(self._gen, *budgets)

    @work(thread=True, exclusive=True, exit_on_error=False, group="plan", description="plan")
    def make_plan(self, gen: int, gpu_budget: int | None, cpu_budget: int | None) -> None:
        s, b = self.session, self.backend

        # reached straight from the command line: the earlier steps' work (the backend shares concurrent asks)
        if s.model is None:
            s.model = b.open_model(s.options.model, s.machine, self.post_progress)
        if s.prompts is None:
            s.prompts = b.read_prompts(Path(s.options.prompts).expanduser())
        self.post_message(WorkProgress("counting the prompts' tokens with the model's tokenizer, then planning", 0, 1))
        b.set_aside_too_long(s.model, s.prompts)
        plan = b.plan(s.model, s.machine, s.prompts, gpu_budget, cpu_budget, s.choices)
        self.post_message(PlanReady(plan, gen))

    def on_work_progress(self, msg: WorkProgress) -> None:  # posted before its PlanReady, so never after it
        self.status(f"{msg.what[:1].upper()}{msg.what[1:]}…")

    def on_plan_ready(self, msg: PlanReady) -> None:
        if msg.gen != self._gen:
            return
        self.session.plan = msg.plan
        out = self.query_one("#out", PathInput)
        if self.session.out_auto and out.value != str(self.session.default_out()):
            out.show(str(self.session.default_out()))  # reached from the command line: prompts now known
        self._show_max_new_hint()
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
        budgets = self._budgets()
        negative = [label for label, b in zip(("GPU memory GB", "CPU memory GB"), budgets) if b is not None and b < 0]
        if negative:  # in GB, as typed: not the planner's bytes
            self._gen += 1
            self.show_problems([f"{name}: a budget is 0 or more GB (0 for none)" for name in negative])
            return
        self.plan_now(budgets)

    def fill(self, plan) -> None:
        values = {"gpu-mem": _gb_text(plan.gpu_budget), "cpu-mem": _gb_text(plan.cpu_budget),
                  "max-new": str(self.backend.max_new_tokens)}
        for key, (wid, kind) in POLICY_FORM.items():
            v = getattr(plan.policy, key)
            values[wid] = v if kind is str else _pct(v) if kind is float else str(v)
        for wid, v in values.items():
            self.query_one(f"#{wid}").value = v
        self.show(plan)

    def _budgets(self) -> tuple[int | None, int | None]:
        plan = self.session.plan

        def gb(wid: str, planned: int | None) -> int | None:
            text = self.query_one(f"#{wid}", Input).value
            if planned is not None and text == _gb_text(planned):
                return planned  # as filled in: the exact budget, not its rounding (17.2 GB is above a T4's 17.18)
            try:
                return int(float(text) * GB)
            except ValueError:
                return None

        return (gb("gpu-mem", plan and plan.gpu_budget), gb("cpu-mem", plan and plan.cpu_budget))

    def _budget_texts(self) -> tuple[str, str]:
        return self.query_one("#gpu-mem", Input).value, self.query_one("#cpu-mem", Input).value

    def _policy_fields(self) -> dict:
        def value(wid: str, kind: type):
            v = self.query_one(f"#{wid}").value  # a Select's place, or an Input's text
            if kind is str:
                return v
            if kind is float:  # a percentage, empty meaning 0
                return float(v.strip() or 0) / 100
            return int(float(v)) if v.strip() else None

        return {key: value(wid, kind) for key, (wid, kind) in POLICY_FORM.items()}

    @on(Input.Changed, "#gpu-mem, #cpu-mem")
    def budget_changed(self) -> None:
        plan = self.session.plan
        texts = self._budget_texts()
        if plan is None or texts in ((_gb_text(plan.gpu_budget), _gb_text(plan.cpu_budget)), self._asked):
            return  # filled from the plan, or already being planned for
        self._replan_soon()

    @on(Input.Changed, "#max-new")
    def max_new_changed(self, event: Input.Changed) -> None:
        """The run's max new tokens for prompts that set none: the workload changes, so the plan does."""
        prompts = self.session.prompts
        try:
            n = int(event.value)
        except ValueError:
            n = 0
        if n < 1:
            self.query_one("#max-new-hint", Static).update("a whole number, 1 or more")
            return
        self._show_max_new_hint()
        if n == self.backend.max_new_tokens or prompts is None:
            return
        self.backend.max_new_tokens = n
        prompts.default_max_new = n
        self._replan_soon()

    def _replan_soon(self) -> None:
        if self._replan_timer is not None:
            self._replan_timer.stop()
        self._replan_timer = self.set_timer(0.4, self.action_replan)

    def _show_max_new_hint(self) -> None:
        prompts = self.session.prompts
        own = sum(1 for e in prompts.prompts.entries if e.max_new_tokens) if prompts is not None else 0
        hint = "for every prompt" if not own else (
            "for prompts that set none" if own < prompts.count else "unused: every prompt sets its own")
        self.query_one("#max-new-hint", Static).update(hint)

    @on(Input.Changed, "#batch, #micro, #expert, #gpu-weights, #gpu-kv, #pages")
    @on(Select.Changed, "#attention, #ffn")
    def policy_changed(self) -> None:
        plan = self.session.plan
        if plan is None:
            return
        try:
            fields = self._policy_fields()
        except ValueError:
            self.show_problems(["a field holds something that is not a number"])
            return
        empty = [wording.POLICY_LABELS[k] for k, v in fields.items() if v is None]
        self._gen += 1  # a check still under way is moot
        if empty:
            self.show_problems([f"fill in {', '.join(empty)}"])
            return
        if _same(fields, {k: getattr(plan.policy, k) for k in fields}):
            self.show(plan)  # back to the plan's own values (filled in, or typed back): it stands again
            return
        self.query_one("#accept", Button).disabled = True
        self.check(self._gen, fields)

    def _show_group_row(self) -> None:
        """The dense weights' row only beside quantized experts; the int4 group only where int4 may be chosen."""
        experts = self.query_one("#quantize", Select).value
        int4 = experts in ("int4", "auto") or self.query_one("#quantize_dense", Select).value == "int4"
        for key, shown in (("quantize_dense", experts != "none"), ("group_size", int4)):
            self.query_one(f"#{key}", Select).parent.display = shown
            self.query_one(f"#{key}-hint", Static).display = shown

    @on(Select.Changed, "#dtype, #executor, #schedule, #quantize, #quantize_dense, #group_size")
    def choice_changed(self, event: Select.Changed) -> None:
        key = event.select.id
        self.query_one(f"#{key}-hint", Static).update(_hint(key, event.value))
        if key in ("quantize", "quantize_dense"):
            self._show_group_row()
        choices = self._choices()
        if choices == self.session.choices:
            return
        self.session.choices = choices
        if key in REPLAN_ON and self.session.plan is not None:
            self.action_replan()  # a wider dtype or a quantized format changes what fits

    def _choices(self) -> EngineChoices:
        def value(key: str) -> str | None:
            v = self.query_one(f"#{key}", Select).value
            return None if v == ADVANCED[key][1] or v == Select.BLANK else v

        quantize = value("quantize")
        dense = value("quantize_dense") if quantize else None
        return EngineChoices(dtype=value("dtype"), executor=value("executor"), schedule=value("schedule"),
                             quantize=quantize, quantize_dense=dense,
                             group_size=value("group_size") if quantize in ("int4", "auto") or dense == "int4" else None)

    @work(thread=True, exclusive=True, exit_on_error=False, group="check", description="validate policy")
    def check(self, gen: int, fields: dict) -> None:
        s = self.session
        self.post_message(Checked(self.backend.check(s.model, s.machine, s.plan, fields, s.choices), gen))

    def on_checked(self, msg: Checked) -> None:
        if msg.gen != self._gen:
            return
        if msg.plan.prediction is not None and not msg.plan.problems:
            self.session.plan = msg.plan
        self.show(msg.plan)

    @on(PathInput.Changed, "#out")
    def out_changed(self) -> None:
        self.query_one("#out-note", Static).update(self.backend.resume_info(self.query_one("#out", PathInput).path))

    def show(self, plan) -> None:
        pred = plan.prediction
        if pred is None:
            self.query_one("#prediction", Facts).set_rows([
                ("Prediction", Text("none: the policy is not valid — see Check", style=self.mapp.tone("warn")))])
            for bar in self.query(LabelBar):
                bar.update(0.0, "—")
            self.query_one("#usable", Static).update("")
        else:
            self._show_prediction(plan, pred)
        self.show_problems(plan.problems, plan.warnings)

    def _show_prediction(self, plan, pred) -> None:
        cpu_mode, narrow = self.cpu_mode, self.has_class("-narrow")
        p = plan.policy
        bottleneck = CPU_MODE_BOTTLENECK.get(pred.bottleneck, CPU_MODE_BOTTLENECK["compute"]) if cpu_mode \
            else pred.bottleneck_text
        band = f" ± {pred.band:.0%}" if pred.band else ""  # the fitted CPU model's band, as `mlight plan` shows it
        rows = [
            ("Throughput", Text(f"{pred.tokens_per_s:,.1f} tokens/s end to end{band}", style="bold")),
            ("Decode", f"{pred.decode_tokens_per_s:,.1f} tokens/s{band}"),
            ("Prefill", f"{pred.prefill_tokens_per_s:,.1f} prompt tokens/s"),
            ("Bottleneck", bottleneck),
            ("Policy", f"N={p.batch_size}, μ={p.micro_batch_size} "
                       f"({p.num_micro_batches} micro-batch{'es' if p.num_micro_batches != 1 else ''}), attention on "
                       f"{p.attention_on.upper()}, FFN on {p.ffn_on.upper()}"),
            ("Workload", f"{self.session.prompts.count} prompts, " + plan.workload_text),
        ]
        if plan.quantize:
            rows[4:4] = _quant_rows(plan)
        if plan.problems:
            rows[0] = ("Throughput", Text(f"{pred.tokens_per_s:,.1f} tokens/s, if it fitted (see Check)",
                                          style=self.mapp.tone("warn")))
        if cpu_mode:
            rows.append(("CPU mode", "no GPU: every stage runs on the CPU"))
        if narrow:
            # Prediction and Memory whole above Check at 80×24: the form shows the policy, the panels CPU mode
            rows = [row for row in rows if row[0] not in ("Policy", "CPU mode")]
        self.query_one("#prediction", Facts).set_rows(rows)
        gpu_share, cpu_share = self.backend.usable_shares()
        for key, used, budget, share in (("gpu", pred.gpu_bytes, plan.gpu_budget, gpu_share),
                                         ("cpu", pred.cpu_bytes, plan.cpu_budget, cpu_share)):
            usable = int(budget * share)
            text = f"{fmt.human_bytes(used)} / {fmt.human_bytes(usable)}"
            if key == "gpu" and cpu_mode:
                self.query_one("#mem-gpu", LabelBar).update(0.0, "no GPU (CPU mode)")
            else:
                self.query_one(f"#mem-{key}", LabelBar).update(used / usable if usable else 0.0, text)
        gpu_part = "" if cpu_mode else f"{gpu_share:.0%} of the GPU budget ({fmt.human_bytes(plan.gpu_budget)}), "
        keep = "the OS and the page cache" if cpu_mode else "the CUDA context, the OS and the page cache"
        usable = (f"usable: {gpu_part}{cpu_share:.0%} of the CPU budget ({fmt.human_bytes(plan.cpu_budget)}); "
                  f"the rest is left for {keep}")
        if narrow:  # one line: the budgets are in the form beside it
            usable = (f"usable: {cpu_share:.0%} of the CPU budget" if cpu_mode else
                      f"usable: {gpu_share:.0%} of GPU, {cpu_share:.0%} of CPU budget")
        self.query_one("#usable", Static).update(usable)
        top = max(pred.layer_seconds.values(), default=0.0) or 1.0
        for bar in self.query_one("#layer").query(LabelBar):
            sec = pred.layer_seconds.get(bar.id.removeprefix("res-"), 0.0)
            bar.update(sec / top, _ms(sec))

    def show_problems(self, problems: list[str], warnings: list[str] = ()) -> None:
        tone = self.mapp.tone
        lines = [Text.assemble((f"{glyph.bad} ", tone("error")), p) for p in problems] or [
            Text(f"{glyph.ok} fits the budget", style=tone("ok"))]
        skipped = self._skipped_text()
        warnings = [*warnings, *([skipped] if skipped else [])]
        lines += [Text(f"{glyph.warn} {w}", style=tone("warn")) for w in warnings]
        self.query_one("#validation", Static).update(Text("\n").join(lines))
        self.query_one("#accept", Button).disabled = bool(problems)
        if problems:
            self.status("This policy does not fit — fix the fields listed under Check, or Ctrl+R to re-plan.", "error")
        elif warnings:
            self.status("Ctrl+N accepts the plan — but read the warning under Check first.", "warn")
        else:
            self.status("Ctrl+N accepts the plan and starts the run.", "ok")

    def _skipped_text(self) -> str:
        """The prompts file's bad lines, which a run skips: said here too, for a Plan opened from the command line."""
        prompts = self.session.prompts
        bad = len(prompts.prompts.rejects) if prompts is not None else 0
        if not bad:
            return ""
        lines = "1 bad line" if bad == 1 else f"{bad} bad lines"
        out = self.query_one("#out", PathInput).path.name or "RESULTS"
        return f"{lines} in {prompts.path.name} will be skipped, into {out}.rejected.jsonl (Esc: Prompts lists them)"

    def action_next(self) -> None:
        plan = self.session.plan
        if plan is None or plan.problems or self.query_one("#accept", Button).disabled:
            self.status("No plan that fits yet — see Check.", "warn")
            return
        if not self.query_one("#out", PathInput).value.strip():
            self.status("Type the results file's name first (.jsonl or .csv).", "warn")
            self.query_one("#out", PathInput).focus()
            return
        out = self.query_one("#out", PathInput).path
        auto = out == self.session.default_out()
        try:
            if auto and not out.parent.exists():
                out.parent.mkdir(parents=True, exist_ok=True)  # the default results folder, made on first use
            self.backend.check_output(out)
        except Exception as e:  # a user error (folder missing, not writable, unknown suffix)
            self.status(self.mapp.describe_error(e), "error")
            return
        bad = len(self.session.prompts.prompts.rejects)
        if bad and not self.session.skip_agreed:
            self.session.skip_agreed = True  # asked: a second Ctrl+N is the yes
            self.status(f"Skip {'the bad line' if bad == 1 else f'the {bad} bad lines'} (see Check)? Ctrl+N again "
                        f"runs the {self.session.prompts.count} good prompts; Esc goes to Prompts to see them.", "warn")
            return
        run_file = out.with_name(out.name + ".run.jsonl")
        replace = out.exists() and not run_file.exists()
        if replace and self._confirmed != out:
            self._confirmed = out  # a second Ctrl+N on the same path confirms
            self.status(f"{out.name} already exists: Ctrl+N again replaces it, or change the results file.", "warn")
            return
        self.session.out_path, self.session.out_auto = out, auto
        self.mapp.next_step(self.STEP, replace=replace)

    def palette_commands(self):
        yield SystemCommand("Re-plan", "Ask the planner again for the current budgets", self.action_replan)


def _quant_rows(plan) -> list[tuple[str, str]]:
    """What the quantization choice settled on, why, and what it buys against the unquantized model."""
    group = f", group {plan.group_size or ADVANCED['group_size'][1]}" if plan.quantize == "int4" else ""
    rows = [("Experts", f"{plan.quantize}{group}: {plan.quant_why}")]
    if plan.quantize == "none":
        return rows
    if plan.quant_dense:
        rows.append(("Dense", f"{plan.quant_dense}: attention projections and LM head, CPU-only mode"))
    if plan.quant_speedup is not None:  # below 1 where this machine computes the format slower than it saves
        none = "none: " if plan.quant_speedup < 1 else ""
        rows.append(("Speed-up", f"{none}{plan.quant_speedup:.2f}× the unquantized model's "
                                 f"{plan.quant_baseline_tps:,.1f} tokens/s on this budget"))
    else:
        rows.append(("Speed-up", "unquantized, the model does not fit this budget at all"))
    return rows


def _hint(key: str, value) -> str:
    return next((line for v, _, line in ADVANCED[key][2] if v == value), "")


def _gb_text(n: int) -> str:
    return f"{n / GB:.1f}" if n >= GB else f"{n / GB:.3g}"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.2f}".rstrip("0").rstrip(".")


def _same(a: dict, b: dict) -> bool:
    """Equal field by field, floats to 1e-6 (percentages typed back in are not bit-exact)."""
    return all(abs(a[k] - b[k]) < 1e-6 if isinstance(b[k], float) else a[k] == b[k] for k in b)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds < 1 else f"{seconds:,.2f} s"
