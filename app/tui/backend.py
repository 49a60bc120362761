"""Every call the screens make into `core` (RunJob runs core's run loop), and the view-models they draw. Runs
share `mlight run`'s run store and manifest, so either resumes the other's unfinished run."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from app.tui import wording
from core.assets import DEMO_PROMPTS
from core.io import download, results, runstore
from core.io import prompts as prompt_files
from core.errors import MlightError, ModelError
from core.telemetry import EventSink, Progress, ignore

GB = 1e9  # decimal, as the planner and `--gpu-mem/--cpu-mem` count
DEFAULT_MAX_NEW_TOKENS = 128  # `mlight run`'s default, for prompts that do not set their own
CHARS_PER_TOKEN = 4.0  # planning estimate before any tokenizer is loaded (English BPE averages ~4)
PROMPT_SUFFIXES = frozenset(prompt_files.SUFFIX_FORMAT)  # the files the Prompts step's tree lists


@dataclass(frozen=True)
class MachineView:
    hardware: Any  # core.plan.hardware.HardwareSpec, what the planner is given
    gpu_rows: list[tuple[str, str]]
    cpu_rows: list[tuple[str, str]]
    cpu_mode: bool
    source: str  # where the numbers came from (measured, detected, preset)
    gpu_total: int = 0
    gpu_free: int = 0
    cpu_total: int = 0
    cpu_available: int = 0


@dataclass(frozen=True)
class ModelView:
    path: Path
    name: str  # what the run manifest calls it: "mlight-demo", the folder's name, or the repo id
    source: str  # demo | folder | hub
    spec: Any  # core.model.spec.ModelSpec
    disk_bytes: int
    fits: bool | None  # fits in free GPU + CPU memory at all (None: machine not known yet)
    fits_text: str

    @property
    def title(self) -> str:
        return "demo model (random weights)" if self.source == "demo" else self.name


@dataclass
class PromptsView:
    path: Path
    prompts: Any  # core.io.prompts.PromptSet
    texts: list[tuple[str, str, int | None]]  # the first 100: (id, prompt text, its own max_new_tokens or None)
    lengths: tuple[int, float, int]  # characters: min, mean, max
    default_max_new: int = DEFAULT_MAX_NEW_TOKENS  # for the entries that do not set their own

    @property
    def count(self) -> int:
        return len(self.prompts.entries)

    @property
    def preview(self) -> list[tuple[str, str, int]]:
        """(id, prompt text, max_new_tokens) of the first prompts, as the run will use them."""
        return [(rid, text, own or self.default_max_new) for rid, text, own in self.texts]

    @property
    def budget_tokens(self) -> int:
        return sum(e.max_new_tokens or self.default_max_new for e in self.prompts.entries)


@dataclass(frozen=True)
class EngineChoices:
    """The Plan screen's Advanced choices: how the engine computes (None: the engine's own default)."""

    dtype: str | None = None  # compute dtype of the weights: float32 | bfloat16 | float16
    executor: str | None = None  # sequential | threaded | cuda
    schedule: str | None = None  # cgopipe | s4 | s3
    quantize: str | None = None  # none | int8 | int4 | auto, where the engine offers it
    group_size: int | None = None  # int4's weights per scale (None: core's default, 64)
    quantize_dense: str | None = None  # int8 | int4: the dense weights too (CPU-only mode; `--quantize-dense`)

    def load_kwargs(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class PlanView:
    policy: Any  # core.plan.policy.Policy
    prediction: Any  # core.plan.policy.Prediction, None when the policy cannot be costed
    gpu_budget: int
    cpu_budget: int
    workload: Any  # core.plan.planner.Workload
    problems: list[str] = field(default_factory=list)  # what stops this policy from running
    warnings: list[str] = field(default_factory=list)  # what the user should know, but may go ahead with
    quantize: str | None = None  # the experts' format the plan is for (none | int8 | int4), when one was asked
    quant_why: str = ""  # why that format (for auto: the least lossy one that fits)
    group_size: int | None = None  # int4's weights per scale, as asked (None: core's default)
    quant_baseline_tps: float | None = None  # the unquantized model's planned tokens/s on this budget (None: unfit)
    quant_dense: str | None = None  # the dense weights' format the plan is for (int8 | int4; None: not quantized)
    tokenized: bool = False  # the workload's prompt lengths were counted by the model's tokenizer (else estimated)

    @property
    def quant_speedup(self) -> float | None:
        """The quantized plan's predicted speed against the unquantized model's on the same budget."""
        if not self.quantize or self.quantize == "none" or not self.quant_baseline_tps or self.prediction is None:
            return None
        return self.prediction.tokens_per_s / self.quant_baseline_tps

    @property
    def workload_text(self) -> str:
        w = self.workload
        if self.tokenized:
            return f"{w.prompt_len} prompt tokens on average (longest {w.longest_prompt}), {w.gen_len} new tokens each"
        return (f"≈{w.prompt_len} prompt tokens (longest ≈{w.longest_prompt}; estimated from characters), "
                f"{w.gen_len} new tokens each")


class Backend:
    """The app's door into `core`. `hardware` pins a HardwareSpec; `clock` drives the meter (frozen in snapshots)."""

    demo_prompts = DEMO_PROMPTS

    def __init__(self, hardware: Any = None, clock: Callable[[], float] = time.monotonic,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS):
        self.pinned_hardware = hardware
        self.clock = clock
        self.max_new_tokens = max_new_tokens
        self._engine: tuple[Path, Any] | None = None
        # opened straight on Plan, four screens ask for the same machine and model at once: one probe, one build
        self._lock = threading.RLock()
        self._memo: dict[tuple, Any] = {}

    def _once(self, key: tuple, make: Callable[[], Any], fresh: bool = False) -> Any:
        with self._lock:
            if fresh or key not in self._memo:
                self._memo[key] = make()  # an exception is not remembered: asking again retries
            return self._memo[key]

    def machine(self, refresh: bool = False, progress: EventSink = ignore) -> MachineView:
        """Detected and measured hardware (core caches the probe per machine), or the pinned spec."""
        from core.plan import hardware

        if self.pinned_hardware is not None:
            return machine_view(self.pinned_hardware)

        def measure() -> MachineView:
            progress(Progress("detecting GPUs, RAM and cores", 0, 2))
            base = hardware.detect()
            progress(Progress("measuring compute and host↔device bandwidth", 1, 2))
            return machine_view(hardware.probe(base, refresh=refresh))

        return self._once(("machine",), measure, fresh=refresh)

    def open_model(self, text: str | None, machine: MachineView | None, progress: EventSink = ignore,
                   should_stop: Callable[[], bool] = lambda: False) -> ModelView:
        """'demo' (or nothing), a checkpoint folder, a GGUF file, or a repo id (downloaded into the hub cache)."""
        kind = self.classify_model_text(text or "")

        def sink(ev) -> None:
            if should_stop():
                raise MlightError("download cancelled",
                                  "open the same repo id again to resume; finished files are kept")
            progress(ev)

        repo = None if kind == "demo" else text.strip()
        path, name = self._once(("model", repo or "demo"), lambda: download.resolve_model(repo, progress=sink))
        ck = self._checkpoint(Path(path))
        spec = ck.spec
        files = ck.gguf.paths if ck.gguf is not None else Path(path).glob("*.safetensors")
        disk = sum(f.stat().st_size for f in files)
        if disk == 0:
            raise ModelError(f"{path} has no .safetensors files",
                             "mlight reads safetensors or GGUF; get one of those versions of the model")
        fits, fits_text = None, "machine not measured yet"
        if machine is not None:
            room = machine.gpu_free + machine.cpu_available
            fits = spec.total_bytes <= room
            where = "CPU memory" if machine.cpu_mode else "GPU + CPU memory"
            fits_text = (f"fits: {_size(spec.total_bytes)} of weights, {_size(room)} of free {where}" if fits
                         else f"does not fit: {_size(spec.total_bytes)} of weights, only {_size(room)} of free {where}")
        source = kind if kind in ("demo", "folder") else "hub"
        return ModelView(Path(path), name, source, spec, disk, fits, fits_text)

    @staticmethod
    def classify_model_text(text: str) -> str:
        """'demo', 'folder' (exists here), 'repo' (owner/name), or 'missing'."""
        if text.strip().lower() in ("", "demo", ":demo"):
            return "demo"
        if Path(text).expanduser().exists():
            return "folder"
        return "repo" if download.looks_like_repo_id(text) else "missing"

    def check_options(self, model: str, prompts: str) -> dict[str, str]:
        """What is plainly wrong with `--model M --prompts F`, without loading anything: step name -> the problem."""
        problems = {}
        kind = self.classify_model_text(model)
        if kind == "missing":
            problems["Model"] = f"--model {model}: no such folder, and not an owner/name repo id"
        elif kind == "folder" and not (Path(model).expanduser() / "config.json").is_file():
            problems["Model"] = f"--model {model}: the folder has no config.json (not a checkpoint folder)"
        path = self.prompts_path(prompts)
        if not path.is_file():
            problems["Prompts"] = f"--prompts {prompts}: " + ("a folder, not a file" if path.is_dir() else "not found")
        return problems

    def prompts_path(self, text: str | Path) -> Path:
        """A prompts file as typed: 'demo' is the bundled demo prompts unless a file of that name is here."""
        path = Path(text).expanduser()
        return DEMO_PROMPTS if str(text) == prompt_files.DEMO and not path.exists() else path

    def read_prompts(self, path: Path) -> PromptsView:
        path = self.prompts_path(path)
        ps = prompt_files.read_prompts(path)
        texts = [_entry_text(e) for e in ps.entries]
        lengths = [len(t) for t in texts]
        stats = (min(lengths), sum(lengths) / len(lengths), max(lengths)) if lengths else (0, 0.0, 0)
        preview = [(e.id, t, e.max_new_tokens) for e, t in zip(ps.entries[:100], texts)]
        return PromptsView(Path(path), ps, preview, stats, self.max_new_tokens)

    def _checkpoint(self, path: Path):
        """The engine's own reading of a model path (a safetensors folder's spec, or a GGUF file's), once."""
        from core.runtime.loading import read_checkpoint

        return self._once(("checkpoint", str(path)), lambda: read_checkpoint(path, None))

    def tokenizer(self, model: ModelView) -> Any:
        """Read once (seconds: the Model step reads it ahead of Plan); a GGUF file's from its own metadata."""
        def read():
            from transformers import AutoTokenizer

            gguf = self._checkpoint(model.path).gguf
            if gguf is not None:
                from core.model.gguf.load import load_tokenizer

                return load_tokenizer(gguf)
            return AutoTokenizer.from_pretrained(str(model.path), local_files_only=True, trust_remote_code=False)

        return self._once(("tokenizer", str(model.path)), read)

    def prompt_lengths(self, model: ModelView | None, prompts: PromptsView) -> list[int] | None:
        """Prompt lengths in tokens as the engine sees them (chat template included); None without a tokenizer."""
        if model is None or not prompts.count:
            return None

        def count() -> dict[str, int]:
            tok = self.tokenizer(model)
            out = {}
            for e in prompts.prompts.entries:
                if e.messages is None:
                    out[e.id] = len(tok(e.prompt).input_ids)
                    continue
                # a later turn counts with empty earlier answers, its shortest conversation (`prepare_requests`)
                messages = e.request_kwargs({}, answers=("",) * len(e.earlier))["messages"]
                ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                out[e.id] = len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
            return out

        try:
            lengths = self._once(("lengths", str(model.path), prompts.prompts.sha256), count)
        except Exception:  # no tokenizer files, or one transformers cannot read: plan from the estimate
            return None
        return [lengths[e.id] for e in prompts.prompts.entries if e.id in lengths]  # set aside: not counted

    def set_aside_too_long(self, model: ModelView, prompts: PromptsView) -> int:
        """Set aside now, as the run would, the prompts too long for the model's context; returns how many."""
        counted = self.prompt_lengths(model, prompts)
        if counted is None:
            return 0
        lengths = dict(zip((e.id for e in prompts.prompts.entries), counted))
        before = len(prompts.prompts.rejects)
        prompt_files.reject_too_long(prompts.prompts, lambda e: lengths[e.id], model.spec.max_position)
        return len(prompts.prompts.rejects) - before

    def workload(self, prompts: PromptsView, model: ModelView | None = None) -> Any:
        """The planner's workload: prompt lengths by the model's tokenizer, else estimated from characters."""
        from core.plan.planner import Workload

        lo, mean, hi = prompts.lengths
        gens = [e.max_new_tokens or self.max_new_tokens for e in prompts.prompts.entries] or [self.max_new_tokens]
        lengths = self.prompt_lengths(model, prompts)
        if lengths:
            prompt_len, longest = math.ceil(sum(lengths) / len(lengths)), max(lengths)
        else:
            prompt_len, longest = math.ceil(mean / CHARS_PER_TOKEN), math.ceil(hi / CHARS_PER_TOKEN)
        return Workload(prompt_len=max(1, prompt_len), gen_len=max(1, round(sum(gens) / len(gens))),
                        max_prompt_len=max(1, longest), num_requests=max(1, prompts.count))

    def budget(self, machine: MachineView, gpu_bytes: int | None, cpu_bytes: int | None) -> Any:
        from core.plan.planner import Budget

        default = Budget.for_hardware(machine.hardware)
        return Budget(gpu_bytes=default.gpu_bytes if gpu_bytes is None else gpu_bytes,
                      cpu_bytes=default.cpu_bytes if cpu_bytes is None else cpu_bytes)

    def plan(self, model: ModelView, machine: MachineView, prompts: PromptsView,
             gpu_bytes: int | None, cpu_bytes: int | None, choices: EngineChoices = EngineChoices()) -> PlanView:
        """The planner's policy for these budgets (None: what the machine has)."""
        from core.plan.planner import plan

        budget = self.budget(machine, gpu_bytes, cpu_bytes)
        workload = self.workload(prompts, model)
        warnings = budget_warnings(machine, budget.gpu_bytes, budget.cpu_bytes)
        spec = _spec_as_run(model.spec, choices)
        view = PlanView(None, None, budget.gpu_bytes, budget.cpu_bytes, workload, warnings=warnings,
                        tokenized=self.prompt_lengths(model, prompts) is not None)
        # the app runs one process on one GPU (ranks=1), however many the machine has
        if not choices.quantize:
            view.policy, view.prediction = plan(spec, machine.hardware, workload, budget, ranks=1)
            return view
        from core.plan.quantize import choose  # the planner's format choice, as `mlight run --quantize` makes it

        c = choose(spec, machine.hardware, workload, budget, choices.quantize, choices.group_size, ranks=1,
                   dense=choices.quantize_dense)
        baseline = c.baseline.tokens_per_s if c.baseline is not None else None
        return dataclasses.replace(view, policy=c.policy, prediction=c.prediction, quantize=c.quantize, quant_why=c.why,
                                   group_size=choices.group_size, quant_baseline_tps=baseline, quant_dense=c.dense)

    def check(self, model: ModelView, machine: MachineView, base: PlanView, fields: dict,
              choices: EngineChoices = EngineChoices()) -> PlanView:
        """A user-edited policy, costed and validated; problems in the Plan screen's words."""
        from core.plan import planner
        from core.plan.policy import Policy

        budget = self.budget(machine, base.gpu_budget, base.cpu_budget)
        spec = _spec_as_run(model.spec, choices, base.quantize, base.group_size, base.quant_dense)
        policy = base.policy
        try:
            policy = Policy(**fields)
            overruns = planner.validate(policy, spec, machine.hardware, base.workload, budget)
        except (TypeError, ValueError, MlightError) as e:  # fields Policy refuses, or a policy the planner cannot cost
            return dataclasses.replace(base, policy=policy, prediction=None,
                                       problems=[wording.policy_problem(wording.for_screen(str(e)))])
        share = {"gpu": (budget.gpu_bytes, planner.GPU_USABLE), "cpu": (budget.cpu_bytes, planner.CPU_USABLE)}
        problems = [wording.overrun(o, *share[o.where]) for o in overruns]
        prediction = planner.predict(policy, spec, machine.hardware, base.workload)
        return dataclasses.replace(base, policy=policy, prediction=prediction, problems=problems)

    @staticmethod
    def usable_shares() -> tuple[float, float]:
        from core.plan.planner import CPU_USABLE, GPU_USABLE

        return GPU_USABLE, CPU_USABLE

    def check_output(self, out: Path) -> None:
        """Refuse, before any loading, an output that cannot be written or whose format is unknown."""
        results.output_format(out)
        runstore.RunStore(out).check_writable()

    @staticmethod
    def resume_info(out: Path) -> str:
        """A line about what a run on `out` will find there, or ''."""
        if not out.name:  # an empty field (Path('') is '.')
            return "Type the results file's name: .jsonl or .csv"
        run = runstore.RunStore(out).run_path
        if run.is_file():
            try:
                n = len(runstore.parse_run_file(run.read_bytes())[1])  # what a resume keeps
            except OSError:
                return ""
            return f"{run.name} holds {n} finished results of an unfinished run: kept, and the rest run"
        return f"{out.name} exists: Ctrl+N asks before replacing it" if out.exists() else ""

    def manifest(self, model: ModelView, prompts: PromptsView, plan: PlanView,
                 choices: EngineChoices = EngineChoices()) -> dict:
        """The same identity `mlight run` writes, so either can resume the other's unfinished run."""
        return runstore.manifest(model.path, model.name, prompts.prompts,
                        {"max_new_tokens": self.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                         "seed": None, "revision": None},
                        {"batch": plan.policy.batch_size, "micro_batch": plan.policy.micro_batch_size,
                         "executor": choices.executor, "schedule": choices.schedule, "dtype": choices.dtype,
                         "planned": plan.policy.to_dict()},
                        plan.quantize, plan.group_size, plan.quant_dense)

    def open_store(self, out: Path, model: ModelView, prompts: PromptsView, plan: PlanView, restart: bool = False,
                   choices: EngineChoices = EngineChoices()):
        """The run store on `out`, locked, resumed when it holds an unfinished run of the same job."""
        store = runstore.RunStore(out)
        store.acquire()
        try:
            store.start(self.manifest(model, prompts, plan, choices), restart=restart)
        except BaseException:
            store.release()
            raise
        return store

    def engine(self, path: Path, policy: Any = None, progress: EventSink = ignore,
               choices: EngineChoices = EngineChoices()) -> Any:
        """Loaded once per model and Advanced choices (a resume reloads no weights); `policy` applied each time."""
        from core.runtime.engine import Engine

        key = (Path(path), choices)
        if self._engine is not None and self._engine[0] == key:
            if policy is not None:
                self._engine[1].apply_policy(policy)
            return self._engine[1]
        if self._engine is not None:
            self._engine[1].close()
            self._engine = None
        engine = Engine.load(path, policy=policy, progress=progress, **choices.load_kwargs())
        self._engine = (key, engine)
        return engine

    def simulate(self, model: ModelView, machine: MachineView, plan: PlanView, engine: Any) -> Any:
        """The planner's replay of one decode step under the engine's schedule; None when it cannot be made."""
        from core.runtime import simulate

        name = getattr(getattr(engine, "config", None), "schedule", None) or "cgopipe"
        try:
            return simulate.simulate_decode(model.spec, machine.hardware, plan.policy,
                                            plan.workload.decode_context, name)
        except (ValueError, KeyError, MlightError):
            return None

    def requests(self, engine: Any, prompts: PromptsView) -> tuple[dict, list]:
        """Engine requests by id, as `mlight run` prepares them, and the prompts this call newly rejected."""
        ps = prompts.prompts
        before = len(ps.rejects)
        requests = runstore.prepare_requests(engine, ps, {"max_new_tokens": self.max_new_tokens})
        known = {(r.line, r.reason, r.id) for r in ps.rejects[:before]}
        return requests, [r for r in ps.rejects if (r.line, r.reason, r.id) not in known]

    @staticmethod
    def export(records: list[dict], path: Path) -> str:
        fmt = results.output_format(path)
        results.write_records(Path(path), records, fmt)
        return fmt


def _spec_as_run(spec: Any, choices: EngineChoices, quantize: str | None = None, group_size: int | None = None,
                 dense: str | None = None) -> Any:
    """The model as the engine will hold it: the Advanced dtype and quantized experts/dense weights change its bytes."""
    from core.plan.quantize import spec_in_format

    if choices.dtype and choices.dtype != spec.dtype:
        spec = dataclasses.replace(spec, dtype=choices.dtype)
    return spec_in_format(spec, quantize or "none", dense, group_size)


def budget_warnings(machine: MachineView, gpu_budget: int, cpu_budget: int) -> list[str]:
    """Budgets above what the machine has: planning for them gives a plan this machine cannot run."""
    out = []
    if machine.cpu_mode and gpu_budget > 0:
        out.append(f"GPU memory {_size(gpu_budget)}: this machine has no GPU, so that budget goes unused")
    elif not machine.cpu_mode and gpu_budget > machine.gpu_total:
        out.append(f"GPU memory {_size(gpu_budget)} is more than the {_size(machine.gpu_total)} this machine's "
                   "GPU has: the run would run out of GPU memory")
    if machine.cpu_total and cpu_budget > machine.cpu_total:
        out.append(f"CPU memory {_size(cpu_budget)} is more than this machine's {_size(machine.cpu_total)} of "
                   "RAM: a run planned for it would swap or be killed")
    return out


def _entry_text(e: Any) -> str:
    if e.prompt is not None:
        return e.prompt
    if (getattr(e, "turn", None) or 1) > 1:  # a later turn of a question (core.io.turns): its own question
        return f"turn {e.turn}: {e.messages[-1]['content']}"
    return " / ".join(m["content"] for m in e.messages)


def _size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 1e6:.1f} MB"


def _rate(hw: Any, name: str) -> str:
    value = getattr(hw, name)
    tag = "measured" if name in hw.measured else "datasheet"
    if name.endswith("_bw"):
        unit = f"{value / 1e9:,.1f} GB/s"
    else:
        unit = f"{value / 1e12:,.1f} TFLOP/s" if value >= 1e12 else f"{value / 1e9:,.1f} GFLOP/s"
    return f"{unit} ({tag})"


def _cpu_compute(hw: Any) -> str:
    """bf16 and fp32 matmul rates: they part by 10-100x between an AVX2 CPU and one with AMX."""
    rates = [(short, hw.cpu_matmul[name]) for name, short in (("float32", "fp32"), ("bfloat16", "bf16"))
             if hw.cpu_matmul.get(name)]
    if not rates:
        return _rate(hw, "cpu_flops")
    return " · ".join(f"{short} {v / 1e9:,.0f}" for short, v in rates) + " GFLOP/s (measured)"


def machine_view(hw: Any) -> MachineView:
    cpu_avail = hw.cpu_mem_available_bytes if hw.cpu_mem_available_bytes is not None else hw.cpu_mem_bytes
    cpu_rows = [
        ("RAM", f"{_size(cpu_avail)} available of {_size(hw.cpu_mem_bytes)}"),
        ("Cores", str(hw.cpu_cores)),
        *([("Instructions", hw.cpu_isa_text(name_up_to=1))] if hw.cpu_isa else []),  # `mlight hw` names them all
        ("Compute", _cpu_compute(hw)),
        ("Memory read", _rate(hw, "cpu_bw")),
    ]
    if not hw.has_gpu:
        gpu_rows = [("GPU", "none — CPU mode"),
                    ("", "Every stage runs on the CPU: the demo model and small models work; "
                         "large models need a GPU to be fast.")]
        gpu_total = gpu_free = 0
    else:
        gpu_total = hw.gpu_mem_bytes * hw.gpu_count
        free_each = hw.gpu_mem_free_bytes if hw.gpu_mem_free_bytes is not None else hw.gpu_mem_bytes
        gpu_free = free_each * hw.gpu_count
        many = f" × {hw.gpu_count}" if hw.gpu_count > 1 else ""
        gpu_rows = [
            ("GPU", f"{hw.gpu_name}{many}"),
            ("Memory", f"{_size(free_each)} free of {_size(hw.gpu_mem_bytes)}" + (" each" if many else "")),
            ("PCIe link", hw.pcie or "unknown"),
            ("Host → device", _rate(hw, "h2d_bw")),
            ("Device → host", _rate(hw, "d2h_bw")),
            ("Compute", _rate(hw, "gpu_flops")),
        ]
    source = {"probe": "Detected and measured on this machine (cached; r measures again).",
              "detect": "Detected on this machine; rates are datasheet estimates (r measures them).",
              "preset": f"Preset machine “{hw.name}”: datasheet values, not this machine."}.get(hw.source, hw.source)
    return MachineView(hw, gpu_rows, cpu_rows, not hw.has_gpu, source, gpu_total, gpu_free,
                       hw.cpu_mem_bytes, cpu_avail)
