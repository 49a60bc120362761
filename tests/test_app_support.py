"""Helpers shared by the app's tests (no tests here; the name keeps it among the app's test files).

- `sync`: runs an async test function under asyncio.run.
- `settle(pilot)`: wait for every worker, then let messages land — no sleeps;
  `settle_until(pilot, done)` repeats that until `done(app)` (e.g. `run_over`); `wait_event(pilot, ev)`
  waits for a worker to reach a point it signals (a held scripted engine, an open file tree's loader).
- `write_prompts(path, n, max_new_tokens)`: a small prompts file from the MT-Bench demo prompts.
- `ScriptedEngine` / `ScriptedBackend`: a stand-in engine that replays fixed telemetry and results,
  for snapshots that must not depend on this machine's speed. The flow tests use the real engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import threading
from pathlib import Path

from textual.worker import WorkerFailed

from app.tui.backend import Backend
from core.assets import DEMO_PROMPTS
from core.telemetry import MemorySample, StepDone, WarningEvent



def sync(test):
    """Run an async test with asyncio.run (no pytest async plugin needed); fixtures pass through."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


async def settle(pilot, rounds: int = 2) -> None:
    """Wait until no worker is running and the messages they posted have been handled."""
    app = pilot.app
    for _ in range(rounds):
        try:
            await app.workers.wait_for_complete()
        except WorkerFailed:
            pass  # the screen shows the error; the test reads it from the status line
        await pilot.pause()


async def settle_until(pilot, done, limit: int = 500) -> None:
    """Settle until `done(app)` holds: a screen's worker may start only after the screen has mounted."""
    for _ in range(limit):
        await settle(pilot, rounds=1)
        if done(pilot.app):
            await settle(pilot, rounds=1)
            return
    raise AssertionError(f"still waiting; status: {status_text(pilot.app)}")


async def wait_event(pilot, event: threading.Event, timeout: float = 60) -> None:
    """Wait for a worker thread to reach a point (without waiting for workers to finish, as settle does:
    a worker held at that point would never finish), then let the messages it posted land."""
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, timeout), "the event never came"
    for _ in range(3):
        await pilot.pause()


async def pause_until(pilot, done, limit: int = 500) -> None:
    """Pause until `done(app)` holds, without waiting for workers (one may be held at a gate): on a loaded
    machine the messages a worker posted before it stopped can take more than a few pauses to land."""
    for _ in range(limit):
        if done(pilot.app):
            return
        await pilot.pause()
    raise AssertionError(f"still waiting; status: {status_text(pilot.app)}")


def run_over(app) -> bool:
    return app.session.run_state in ("done", "stopped", "failed")


def status_text(app) -> str:
    return str(app.screen.query_one("#status").render())


def write_prompts(path: Path, n: int, max_new_tokens: int) -> Path:
    lines = DEMO_PROMPTS.read_text(encoding="utf-8").splitlines()[:n]
    out = []
    for line in lines:
        rec = json.loads(line)
        rec["max_new_tokens"] = max_new_tokens
        out.append(json.dumps(rec))
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


class FrozenClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclasses.dataclass
class _Result:
    id: str
    prompt: str
    output: str
    output_token_ids: list
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def scripted_decode_timeline(gpu: bool = True) -> tuple[list, list[float]]:
    """A decode step's task graph and fixed task times (as an executor's buffer): CGOPipe over two layers
    and two micro-batches, or the CPU-only chain."""
    from core.runtime import schedule
    from core.runtime.simulate import replay

    tasks = schedule.decode_step("cgopipe", num_layers=2, num_micro_batches=2, pages_per_layer=2,
                                 ffn_on="gpu" if gpu else "cpu")
    costs = {"pre_attn": 0.004, "d1": 0.002, "cpu_attn": 0.009, "d2": 0.002, "post_attn": 0.005, "ffn": 0.012,
             "weight_page": 0.007}
    timeline = replay(tasks, costs)
    times = [x for span in timeline.spans for x in (100.0 + span.start, 100.0 + span.end)]
    return tasks, times


class ScriptedEngine:
    """Replays a fixed run: a prefill, decode steps with set busy shares and a fixed timeline, a warning,
    then results. It checks `should_stop` between steps as the engine does, so pause and stop work; a
    test may hold it after a step with `gate` (set to let it go on)."""

    context_length = 4096

    def __init__(self, gpu: bool = True, gate=None, hold_after: int = 12, held=None):
        self.tasks, self.times = scripted_decode_timeline(gpu)
        self.gate, self.hold_after = gate, hold_after
        self.held = held or threading.Event()  # set while the engine waits at the gate

    def prompt_token_ids(self, req) -> list[int]:
        return list(range(10 + len(req.prompt or "") // 8))

    def generate(self, requests, *, batch_size, micro_batch_size=None, on_event, should_stop=None):
        requests = list(requests)
        on_event(StepDone("prefill", 480, 0.5, {"gpu": 0.4, "cpu_attn": 0.05}, active=len(requests),
                          cpu_mem_bytes=350_000_000))
        on_event(MemorySample(gpu_used=0, gpu_budget=0, cpu_used=360_000_000, cpu_budget=20_000_000_000))
        on_event(WarningEvent("pinned memory refused; using pageable memory (copies are slower)"))
        for i in range(24):
            if should_stop is not None and should_stop():
                return
            on_event(StepDone("decode", len(requests), 0.1 + 0.01 * (i % 5),
                              {"gpu": 0.07, "cpu_attn": 0.02, "h2d": 0.005, "d2h": 0.002}, active=len(requests),
                              cpu_mem_bytes=360_000_000, tasks=self.tasks, times=self.times))
            if self.gate is not None and i + 1 == self.hold_after:
                self.held.set()
                self.gate.wait(60)
                self.held.clear()
        for i, r in enumerate(requests):
            n = r.max_new_tokens if i % 3 else max(1, r.max_new_tokens // 2)
            yield _Result(r.id, r.prompt, f"Scripted answer {i} to: {r.prompt[:40]}", list(range(n)),
                          len(self.prompt_token_ids(r)), n, "length" if i % 3 else "stop", 2.5 + i / 10)


class ScriptedBackend(Backend):
    """A real Backend (prompts, budgets, policy checks, run store, writers) with a fixed plan, a scripted
    engine and a stable model path: snapshots must not change when the planner's cost model is tuned."""

    def plan(self, model, machine, prompts, gpu_bytes, cpu_bytes, choices=None):
        from app.tui.backend import PlanView, budget_warnings
        from core.plan.policy import Policy, Prediction

        budget = self.budget(machine, gpu_bytes, cpu_bytes)
        gpu = machine.hardware.has_gpu
        policy = Policy(batch_size=16, micro_batch_size=4, expert_batch_size=8, attention_on="cpu",
                        ffn_on="gpu" if gpu else "cpu", gpu_weight_fraction=0.75 if gpu else 0.0,
                        pages_per_layer=2 if gpu else 1)
        layer = {"gpu": 0.00042, "cpu_attn": 0.00031, "h2d": 0.00012 if gpu else 0.0, "d2h": 0.00003 if gpu else 0.0}
        prediction = Prediction(tokens_per_s=1234.5, decode_tokens_per_s=1502.25, prefill_tokens_per_s=20480.0,
                                bottleneck="gpu", gpu_bytes=14_000_000 if gpu else 0, cpu_bytes=21_500_000,
                                layer_seconds=layer)
        quant = {}
        if choices is not None and choices.quantize:  # a fixed account of the format: the baseline at half the speed
            q = "int4" if choices.quantize == "auto" else choices.quantize
            label = f"int4-g{choices.group_size or 64}" if q == "int4" else q
            dense = getattr(choices, "quantize_dense", None)
            label += f" with {dense} dense weights" if dense else ""
            quant = {"quantize": q, "group_size": choices.group_size, "quant_baseline_tps": 617.25,
                     "quant_dense": dense, "quant_why": f"asked for {label}" if q == choices.quantize else
                     f"bfloat16 and int8 do not fit the budget; {label} is the least lossy format that does"}
        return PlanView(policy, prediction, budget.gpu_bytes, budget.cpu_bytes, self.workload(prompts, model),
                        warnings=budget_warnings(machine, budget.gpu_bytes, budget.cpu_bytes),
                        tokenized=self.prompt_lengths(model, prompts) is not None, **quant)

    def open_model(self, text, machine, progress=lambda e: None, should_stop=lambda: False):
        view = super().open_model(text, machine, progress, should_stop)
        self.real_model_path = view.path  # the tokenizer is read from here
        return dataclasses.replace(view, path=Path("~/.cache/mlight/demo-mixtral-v1"))

    def prompt_lengths(self, model, prompts):
        real = getattr(self, "real_model_path", None)
        return super().prompt_lengths(dataclasses.replace(model, path=real) if real and model else model, prompts)

    def __init__(self, *args, gate=None, fail_unless=None, **kw):
        super().__init__(*args, **kw)
        self.gate = gate  # a threading.Event the scripted engine waits on after 12 decode steps
        self.held = threading.Event()  # set while it waits there (`wait_event` in a test)
        self.fail_unless = fail_unless  # an EngineChoices test: loading fails (as bf16 on AVX2) unless it holds
        self.loaded: list = []  # the choices each engine was loaded with
        self.last_engine = None

    def engine(self, path, policy=None, progress=lambda e: None, choices=None):
        self.loaded.append(choices)
        if self.fail_unless is not None and not self.fail_unless(choices):
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert "
                               "or avx512bw, avx512vl and avx512dq")
        self.last_engine = ScriptedEngine(gpu=self.pinned_hardware.has_gpu, gate=self.gate, held=self.held)
        return self.last_engine
