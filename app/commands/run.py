"""`mlight run`: a prompts file through the engine into a JSONL or CSV file, resumably.
Bad input is refused before anything loads; Ctrl-C / SIGTERM / Ctrl-Break: the current step finishes, what
finished is saved, exit 130."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from core import platform
from core.errors import BudgetError, MlightError, UsageError
from core.io.download import resolve_model
from core.io.prompts import FORMATS, STDIN, PromptSet, bad_lines_error, read_prompts, reject_lines
from core.io.results import output_format
from core.io.runstore import RunStore, finish_run, manifest, prepare_requests, run_pending
from core.io.shards import other_parts
from core.model.quant.formats import DEFAULT_INT4_GROUP, INT4_GROUPS, QUANTIZE_CHOICES
from core.plan.policy import SCHEDULES
from core.telemetry import Progress, WarningEvent

EXECUTORS = ("sequential", "threaded", "cuda")
BATCH = 64  # requests in flight when neither --batch nor a memory budget says otherwise


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="generate for a prompts file", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder or Hugging Face repo id (default: the built-in demo model)")
    p.add_argument("--revision", help="repo revision (branch, tag or commit) when --model is a repo id")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help=".txt (one prompt a line), .jsonl (MT-Bench's question file too: every turn, each with the "
                        "earlier answers), .csv or .tsv; '-' reads stdin; 'demo' the 16 bundled MT-Bench prompts")
    p.add_argument("--prompts-format", choices=FORMATS, help="format of --prompts when its suffix does not say")
    p.add_argument("--out", required=True, metavar="FILE", help="results file: .jsonl or .csv")
    p.add_argument("--max-new-tokens", type=_positive, default=128, metavar="N",
                   help="tokens to generate per prompt, unless its line sets max_new_tokens (default: 128)")
    p.add_argument("--temperature", type=_non_negative, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=_probability, default=1.0, metavar="P", help="nucleus sampling, in (0, 1] (default: 1.0, off)")
    p.add_argument("--top-k", type=_whole, default=0, metavar="K", help="0 = off")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="random seed for sampling, unless a line sets its own (default: none; greedy needs none)")
    p.add_argument("--batch", type=_positive, default=None, metavar="N",
                   help="requests in flight (default: the planner's choice for --gpu-mem/--cpu-mem or, without a GPU, "
                        f"for this machine's memory; else {BATCH})")
    p.add_argument("--micro-batch", type=_positive, default=None, metavar="M", help="requests per micro-batch (default: the planner's with --gpu-mem/--cpu-mem, "
                        "else the whole batch)")
    p.add_argument("--gpu-mem", type=gigabytes(0), default=None, metavar="GB",
                   help="GPU memory budget (per GPU): plan batch sizes with the HRM planner and refuse what cannot fit")
    p.add_argument("--cpu-mem", type=gigabytes(None), default=None, metavar="GB",
                   help="CPU memory budget (see --gpu-mem)")
    p.add_argument("--dtype", default=None, help="weights dtype (default: the checkpoint's)")
    p.add_argument("--kernels", choices=("auto", "native", "torch"), default=None,
                   help="auto: mlight's C kernels where they run (default); native: fail where one cannot; torch: "
                        "torch's ops only, a GGUF file in float32 (the reference reading); sets MLIGHT_KERNELS")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="expert weights: none (the checkpoint's dtype), int8 (per channel), int4 (group-wise), or "
                        "auto: the least lossy format that fits the memory budget (--gpu-mem/--cpu-mem, else this "
                        "machine's). Quantized once, then read from the cache (default: none)")
    p.add_argument("--group-size", type=int, choices=INT4_GROUPS, default=None, metavar="G",
                   help=f"int4: weights per scale, one of {', '.join(map(str, INT4_GROUPS))} (default {DEFAULT_INT4_GROUP})")
    p.add_argument("--quantize-dense", nargs="?", const=True, choices=("int8", "int4"), default=None,
                   metavar="FORMAT", help="CPU-only mode: also store the attention projections and the LM head "
                        "quantized, in FORMAT (int8 or int4; default: --quantize's): faster decode at small batches, "
                        "less accurate, int4 far more so than int8 (see README)")
    p.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="how a step's tasks run (default: cuda when a GPU is present, else sequential)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="cgopipe (overlapped), s4 (FlexGen-style), s3 (no overlap) (default: cgopipe)")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                   help="CUDA graphs for the CUDA executor's decode steps (default: auto, where they pay)")
    p.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="CPU threads for torch (default: the cores other work leaves free, re-checked as it runs)")
    p.add_argument("--skip-bad", action="store_true",
                   help="run the good lines and write the bad ones with reasons to OUT.rejected.jsonl")
    p.add_argument("--restart", action="store_true",
                   help="discard an unfinished run (or an existing OUT) for this output and start over")
    p.add_argument("--tensor-parallel", type=_positive, default=1, metavar="K",
                   help="split the model over K ranks (one per GPU; gloo on the CPU). Alone it starts K local "
                        "ranks; under torchrun, K consecutive ranks share a model and the groups split the prompts (default: 1)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run over a Ray cluster with Ray Data ('auto', or the cluster's address); needs mlight[ray]")
    p.add_argument("--ray-actors", type=_positive, default=None, metavar="N",
                   help="engine replicas on the Ray cluster (default: one per GPU, else one per node)")
    return p


def _number(cast, ok, must: str, what: str = "a number", unit: str = ""):
    """An argparse type: `text` read by `cast` and refused, in one line, unless `ok(value)`."""

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {must}{unit}, got {v if cast is int else text}{unit}")
        return v

    return parse


_positive = _number(int, lambda v: v >= 1, "at least 1", "a whole number")
_probability = _number(float, lambda v: 0 < v <= 1, "in (0, 1]")
_non_negative = _number(float, lambda v: v >= 0, "0 or more")
_whole = _number(int, lambda v: v >= 0, "0 or more", "a whole number")


def gigabytes(least: float | None):
    """A memory budget in GB as typed: at least `least` (None: more than 0), said back in GB."""
    return _number(float, lambda v: (v >= least if least is not None else v > 0) and v != float("inf"),
                   "more than 0" if least is None else f"{least:g} or more", "a number of GB", " GB")


class _Stopper:
    """Ctrl-C, SIGTERM or Ctrl-Break: while generating, ask the engine to stop after its step; otherwise (or on a
    second signal) stop right away with KeyboardInterrupt."""

    def __init__(self):
        self.generating = False
        self.requested = False
        self.old = {}

    def __call__(self, signum, frame):
        if self.generating and not self.requested:
            self.requested = True
            return
        raise KeyboardInterrupt

    def install(self):
        for sig in platform.stop_signals():  # Ctrl-C, and SIGTERM (POSIX) or Ctrl-Break (Windows)
            with contextlib.suppress(ValueError, OSError):  # not the main thread, or not settable here
                self.old[sig] = signal.signal(sig, self)
        return self

    def restore(self):
        for sig, handler in self.old.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, handler)


def _say(msg: str) -> None:
    print(f"mlight run: {msg}", file=sys.stderr, flush=True)


class _Line:
    """One stderr line redrawn in place, on a terminal only (logs get the summary lines)."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.open = False

    def draw(self, text: str) -> None:
        """`text` cut and padded to the terminal's width less a column, so that `\r` redraws it in place."""
        if not self.tty:
            return
        try:
            width = os.get_terminal_size(sys.stderr.fileno()).columns
        except (OSError, ValueError, AttributeError):  # not a terminal (a test, a pipe): $COLUMNS, else 80
            width = shutil.get_terminal_size().columns
        width = max(width - 1, 1)
        print("\r" + text[:width].ljust(width), end="", file=sys.stderr, flush=True)
        self.open = True

    def end(self) -> None:
        if self.open:
            print(file=sys.stderr, flush=True)
            self.open = False


class _ProgressLine(_Line):
    """Progress events; `logged`: also a line every 10 % where stderr is no terminal (`mlight download`)."""

    def __init__(self, command: str = "run", logged: bool = False):
        super().__init__()
        self.command, self.logged, self.step = command, logged, -1

    def __call__(self, ev) -> None:
        if isinstance(ev, WarningEvent):
            self.end()  # the progress line first
            print(f"mlight {self.command}: warning: {ev.message}", file=sys.stderr, flush=True)
        elif isinstance(ev, Progress):
            rate = getattr(ev, "rate", 0.0)
            pct = 100 * ev.done // ev.total if ev.total else 100
            mb = f"{ev.done / 1e6:.1f}/{ev.total / 1e6:.1f} MB ({pct}%)" + (f" {rate / 1e6:.1f} MB/s" if rate else "")
            text = f"{ev.what}: " + (mb if ev.unit == "B" else f"{ev.done}/{ev.total}")
            self.draw(text)
            if self.logged and not self.tty and pct // 10 != self.step:
                self.step = pct // 10
                print(text, file=sys.stderr, flush=True)
            if ev.done >= ev.total:
                self.end()


def run(args) -> int:
    from core.runtime.distributed.world import from_env

    world = from_env(args.tensor_parallel)
    if args.ray:
        if world is not None:
            raise UsageError("--ray and torchrun are two ways to use several machines; use one",
                             "run `mlight run --ray ...` once, outside torchrun")
        from app.commands.run_ray import run as run_ray

        return run_ray(args)
    if world is not None:  # a rank of a torchrun job, or of the ranks --tensor-parallel started
        from app.commands.run_parallel import run as run_rank

        return run_rank(args, world)
    out = Path(args.out)
    if args.tensor_parallel > 1:
        from core.runtime.distributed.launch import launch_local

        # what is quick to check is checked before K processes start (the ranks check it all again)
        RunStore(out).check_writable()
        check_files(args, out, ("--tensor-parallel starts several ranks, which cannot share stdin",
                                "give the prompts as a file"))
        prompts = _read(args, out)
        refuse_turns(prompts, "--tensor-parallel")
        return launch_local(args.tensor_parallel, [sys.executable, "-m", "app.cli", *args.argv])
    return with_run(args, out, _plan_batches, functools.partial(_generate, args, check_files(args, out)))


def check_files(args, out: Path, no_stdin: tuple[str, str] | None = None, micro: bool = True) -> str:
    """Refuse, before anything loads, what is quick to check (`no_stdin`: why stdin cannot be read); the format."""
    fmt = output_format(out)
    if no_stdin and args.prompts == STDIN:
        raise UsageError(*no_stdin)
    if micro and args.micro_batch and args.batch and args.micro_batch > args.batch:
        raise UsageError(f"--micro-batch {args.micro_batch} is larger than --batch {args.batch}",
                         "use a micro-batch no larger than the batch")
    if args.prompts != STDIN and _same_file(Path(args.prompts), out):
        raise UsageError(f"--out {out} is the prompts file itself", "write the results to another file")
    return fmt


def with_run(args, out: Path, plan, generate) -> int:
    """One job's run file (`mlight run`, `--ray`): lock, prompts, model, `plan`, start or resume, then `generate`
    unless the job already finished. A failure drops a run file with no result yet; the lock is always released."""
    stopper = _Stopper().install()
    store = RunStore(out)
    try:
        store.acquire()
        prompts = _read(args, out)
        progress = _ProgressLine()
        model_dir, model_name = resolve_model(args.model, args.revision, progress=progress)
        plan(args, prompts, model_dir)
        store.start(_manifest(args, prompts, model_dir, model_name), restart=args.restart)
        if store.finished is not None:
            _say(f"all {store.finished.get('results', len(prompts.entries))} requests are already done: "
                 f"{store.out} holds their results (--restart runs them again)")
            return 0
        try:
            return generate(store, prompts, model_dir, model_name, progress, stopper)
        except BaseException:
            store.abandon()
            raise
    finally:
        stopper.restore()
        store.release()


def _say_other_parts(out: Path, replicas: int) -> None:
    for p in other_parts(out, replicas):
        _say(f"note: {p.name} holds results of a run with another number of replicas; they are not reused "
             "(rerun with that many ranks to resume it)")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and a.samefile(b))
    except OSError:
        return False


def _read(args, out: Path) -> PromptSet:
    """The prompts, refused here if a line is bad and --skip-bad does not say to run the rest."""
    data = sys.stdin.buffer.read() if args.prompts == STDIN else None
    prompts = read_prompts(args.prompts, data=data, fmt=args.prompts_format)
    _refuse_rejects(prompts, args.skip_bad, out)
    return prompts


def _refuse_rejects(prompts: PromptSet, skip_bad: bool, out: Path) -> None:
    error = bad_lines_error(prompts, RunStore(out).rejected_path.name)
    if error is None or (skip_bad and prompts.entries):
        return
    for line in reject_lines(prompts.rejects):
        print(line, file=sys.stderr)
    raise error


def refuse_turns(prompts: PromptSet, how: str) -> None:
    """Multi-turn questions run in waves within one process (core.io.turns); `how` splits the work."""
    if any(e.turn is not None for e in prompts.entries):
        raise UsageError(f"{prompts.source} has multi-turn questions (`turns`), which {how} cannot run yet: each "
                         "later turn waits for the answer to the one before", f"run them without {how}")


def _plan_batches(args, prompts: PromptSet, model_dir: Path) -> None:
    """With a memory budget, let the planner pick the batch sizes the user left open, or refuse a budget nothing
    fits in before any weight is loaded. Without a GPU the planner picks the CPU batch even without a budget."""
    args.policy = None
    quantize = args.quantize
    budgeted = args.gpu_mem is not None or args.cpu_mem is not None or quantize == "auto"
    import torch

    if not budgeted and not (args.batch is None and args.executor in (None, "sequential") and args.schedule is None
                             and not torch.cuda.is_available()):
        args.batch = args.batch or BATCH
        return
    from core.model.families import load_spec
    from core.plan import cpu_history, planner
    from core.plan.hardware import resolve
    from core.plan.quantize import choose

    workload = planner.Workload(**workload_estimate(args, prompts.entries))
    hw = resolve("local")
    if not budgeted:
        try:  # best effort: a model the planner cannot read (a GGUF file) or cannot fit runs at the default batch
            spec = load_spec(model_dir)
            policy, pred = planner.plan(spec, hw, workload, planner.Budget.for_hardware(hw))
        except MlightError:
            args.batch = BATCH
            return
        args.batch = policy.batch_size
        args.micro_batch = args.micro_batch or min(policy.micro_batch_size, args.batch)
        words = cpu_history.spread_words(cpu_history.behind(hw, spec))
        if words:  # calibrated: the prediction and how far this machine's own runs have strayed from theirs
            _say(f"planned batch {args.batch}: predicted {pred.quote()} ({words})")
        return
    ranks = args.tensor_parallel  # one engine over this many GPUs (ranks), each given --gpu-mem
    budget = planner.Budget.for_hardware(hw, args.gpu_mem * max(1, hw.gpu_count) if args.gpu_mem is not None else None,
                                         args.cpu_mem)
    replicas = getattr(args, "replicas_here", 1)  # data-parallel replicas sharing this machine's memory
    budget = dataclasses.replace(budget, cpu_bytes=budget.cpu_bytes // replicas)
    try:
        choice = choose(load_spec(model_dir), hw, workload, budget, quantize, args.group_size, ranks=ranks,
                        dense=args.quantize_dense)
    except BudgetError as e:
        raise BudgetError(e.problem, "raise --gpu-mem / --cpu-mem, lower --max-new-tokens"
                          + (", or pass --quantize int4" if quantize in ("none", "int8") else "")) from e
    if quantize == "auto":
        _say(f"--quantize auto: {choice.why}")
        args.quantize = choice.quantize
        args.quantize_dense = choice.dense  # what auto chose for the dense weights (none with unquantized experts)
        if args.gpu_mem is None and args.cpu_mem is None:  # the format only: batch sizes as without a budget
            args.batch = args.batch or BATCH
            return
    args.policy = choice.policy  # Engine.load takes paging, resident experts and placement from it
    args.batch = args.batch or choice.policy.batch_size
    args.micro_batch = args.micro_batch or min(choice.policy.micro_batch_size, args.batch)


def workload_estimate(args, entries) -> dict:
    """The planner's Workload fields before the tokenizer is loaded: ~3 bytes a token, on the safe (long) side;
    a later turn also holds the answers to the turns before it, at most `gen` tokens each."""
    gen = max([e.max_new_tokens or args.max_new_tokens for e in entries] or [args.max_new_tokens])
    lens = [max(1, len((e.prompt or "".join(m["content"] for m in e.messages or ())).encode()) // 3 + 1)
            + gen * len(e.earlier) for e in entries]
    return {"prompt_len": max(1, sum(lens) // max(1, len(lens))), "gen_len": gen, "max_prompt_len": max(lens + [1]),
            "num_requests": len(entries)}


def sampling(args) -> dict:
    """The command's generation settings, each the default for prompts that do not set their own."""
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed}


def _manifest(args, prompts: PromptSet, model_dir: Path, model_name: str) -> dict:
    policy = getattr(args, "policy", None)
    return manifest(model_dir, model_name, prompts,
                    {**sampling(args), "revision": args.revision},
                    {"batch": args.batch, "micro_batch": args.micro_batch, "executor": args.executor,
                     "schedule": args.schedule, "dtype": args.dtype,
                     "planned": policy.to_dict() if policy is not None else None},
                    args.quantize, args.group_size, args.quantize_dense)


def _load_engine(args, model_dir: Path, progress, tp=None):
    from core.runtime.engine import Engine

    given = {"tp": tp, "executor": args.executor, "schedule": args.schedule, "dtype": args.dtype,
             "policy": getattr(args, "policy", None), "threads": args.threads,
             "quantize_dense": args.quantize_dense}  # without --quantize Engine.load says what to pass
    kw = {k: v for k, v in given.items() if v}
    if args.quantize != "none":
        kw["quantize"], kw["group_size"] = args.quantize, args.group_size
    if args.graphs != "auto":
        kw["graphs"] = args.graphs
    return Engine.load(model_dir, progress=progress, **kw)


def _generate(args, fmt: str, store: RunStore, prompts: PromptSet, model_dir: Path, model_name: str,
              progress, stopper: _Stopper) -> int:
    _say_other_parts(store.out, 1)
    engine = _load_engine(args, model_dir, progress)
    requests = prepare_requests(engine, prompts, sampling(args))
    _refuse_rejects(prompts, args.skip_bad, store.out)
    total, t0, before = len(prompts.entries), time.perf_counter(), len(store.done)
    if store.resumed:
        _say(resuming_line(before, total))
    from core.runtime.fold_back import RunSums, fold_back

    counter = _Counter(total, before)
    meter = RunSums()  # sums of the engine's own step figures: folded into the machine's history at the end
    stopper.generating = True
    try:
        finished = run_pending(engine, prompts, store, requests, batch_size=args.batch,
                               micro_batch_size=args.micro_batch, should_stop=lambda: stopper.requested,
                               on_result=counter, on_event=meter)
    except KeyboardInterrupt:  # a second Ctrl-C: stopped mid-step; every saved result is complete
        finished = False
    finally:
        stopper.generating = False
        counter.end()
    code = end_run(store, prompts, model_name, fmt, finished, before, counter.tokens, t0)
    if code == 0:
        fold_back(engine, meter, args.micro_batch or (engine.policy.micro_batch_size if engine.policy else args.batch))
    return code


def end_run(store: RunStore, prompts: PromptSet, model_name: str, fmt: str, finished: bool, before: int,
            tokens: int, t0: float, where: str = "") -> int:
    """Write the output of a finished run and say what it did, or say what a stopped one saved: 0 or 130."""
    done = sum(1 for e in prompts.entries if e.id in store.done)
    if not finished:
        store.close()
        _say(f"interrupted: {done} of {len(prompts.entries)} requests done, saved in {store.run_path.name}; "
             "rerun the same command to finish the rest")
        return 130
    records = finish_run(store, prompts, model_name, fmt)
    _say(final_line(len(records), store, len(prompts.rejects), done - before, tokens, time.perf_counter() - t0,
                    where))
    return 0


def resuming_line(before: int, total: int) -> str:
    if not before:
        return f"resuming: the earlier run on this output finished none of the {total:,} requests; running them all"
    return (f"resuming: {before:,} of {total:,} requests already done by an earlier run; running the other "
            f"{total - before:,}")


def final_line(results: int, store: RunStore, rejects: int, generated: int, tokens: int, secs: float,
               where: str = "") -> str:
    """The summary: what the output holds, then what this run (not an earlier, resumed one) did `where`."""
    rej = f", {rejects:,} rejected → {store.rejected_path.name}" if rejects else ""
    return (f"{results:,} results in {store.out}{rej} (this run: {generated:,} generated{where}, {tokens:,} new "
            f"tokens, {secs:.1f} s)")


class _Counter(_Line):
    def __init__(self, total: int, before: int = 0):
        super().__init__()
        self.t0 = time.perf_counter()
        self.total, self.done, self.tokens = total, before, 0

    def __call__(self, record: dict) -> None:
        self.done += 1
        self.tokens += record["output_tokens"]
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.draw(f"{self.done:,}/{self.total:,} requests done ({rate:,.1f} tokens/s)")
