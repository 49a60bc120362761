"""One run of the engine over the prompts on a worker thread, each result saved as it finishes. Pause blocks the
engine between steps inside `should_stop`; telemetry is posted at most every POST_EVERY_S, so the UI never floods."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Callable

from textual.message import Message

from app.tui.backend import EngineChoices
from app.tui.meter import RunMeter
from app.tui.messages import RunEnded, RunLog, RunUpdate, SimulatedStep
from core.telemetry import WarningEvent

POST_EVERY_S = 0.2


class RunJob:
    def __init__(self, backend: Any, model: Any, prompts: Any, plan: Any, out: Path,
                 post: Callable[[Message], None], previous: Any = None, replace: bool = False,
                 choices: EngineChoices = EngineChoices(), machine: Any = None):
        self.backend, self.model, self.prompts, self.plan, self.out = backend, model, prompts, plan, Path(out)
        self.choices, self.machine = choices, machine
        self.post = post
        self._go = threading.Event()  # cleared while paused
        self._go.set()
        self._stop = threading.Event()
        self._last_post = 0.0
        from core.plan.tracking import Tracker

        tracker = None if plan.prediction is None else Tracker(plan.prediction, model.spec.num_layers)
        self.meter = RunMeter(prompts.count, prompts.budget_tokens, gpu_budget=plan.gpu_budget,
                              cpu_budget=plan.cpu_budget, clock=backend.clock, previous=previous,
                              batch_size=plan.policy.batch_size, tracker=tracker)
        self.records: dict[str, dict] = {}  # id -> record, everything finished (earlier sessions too)
        self.state = "loading"
        self.replace = replace  # start over on an output that already holds a finished run

    # ---- controls (main thread) -----------------------------------------------------------------
    def pause(self) -> None:
        if self.state == "running":
            self._go.clear()
            self._set_state("paused")

    def resume(self) -> None:
        if self.state == "paused":
            self._set_state("running")
            self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()  # a paused run must wake up to stop
        if self.state in ("running", "paused", "loading"):
            self._set_state("stopping")

    # ---- the run (worker thread) ----------------------------------------------------------------
    def _should_stop(self) -> bool:
        self._go.wait()  # paused: hold the engine here, between two steps
        return self._stop.is_set()

    def _set_state(self, state: str) -> None:
        self.state = state
        self.meter.set_state(state)
        self._post_update(force=True)

    def _post_update(self, force: bool = False) -> None:
        now = time.monotonic()  # real time, even when the display clock is frozen in tests
        if force or now - self._last_post >= POST_EVERY_S:
            self._last_post = now
            self.post(RunUpdate(self.meter.snapshot()))

    def _sink(self, ev) -> None:
        self.meter.on_event(ev)
        if isinstance(ev, WarningEvent):
            self.post(RunLog(ev.message, "warn"))
        self._post_update()

    def run(self) -> str:
        """Run to the end or to a stop; returns "done" or "stopped". Errors propagate (the screen shows them)."""
        b = self.backend
        self._set_state("loading")
        try:
            store = b.open_store(self.out, self.model, self.prompts, self.plan, restart=self.replace,
                                 choices=self._choices())
        except BaseException:
            self._set_state("failed")
            raise
        try:
            self.records = dict(store.done)
            if store.resumed and store.done:
                self.post(RunLog(f"Resuming: {len(store.done)} results already in {store.run_path.name} are kept; "
                                 "running the rest.", "ok"))
            elif store.resumed:
                self.post(RunLog("Resuming: nothing had finished yet, so every prompt runs.", "ok"))
            self.meter.done = sum(1 for e in self.prompts.prompts.entries if e.id in self.records)
            for record in self.records.values():
                self._count_saved(record)
            bad = self.prompts.prompts.rejects
            if bad:
                self.post(RunLog(f"{len(bad)} bad line{'s' if len(bad) > 1 else ''} of {self.prompts.path.name} "
                                 f"skipped (as agreed); they go to {self.out.name}.rejected.jsonl", "warn"))
            todo = [e for e in self.prompts.prompts.entries if e.id not in self.records]
            self.meter.batch_size = min(self.plan.policy.batch_size, len(todo))
            self._post_update(force=True)
            engine = b.engine(self.model.path, self.plan.policy, progress=self._sink, choices=self._choices())
            if self.machine is not None:
                self.post(SimulatedStep(b.simulate(self.model, self.machine, self.plan, engine)))
            requests, rejects = b.requests(engine, self.prompts)
            for r in rejects:
                self.post(RunLog(f"line {r.line}: {r.reason} — skipped", "warn"))
            if self._stop.is_set():
                return self._end("stopped", store)
            self._set_state("running" if self._go.is_set() else "paused")
            todo = [requests[e.id] for e in self.prompts.prompts.entries if e.id not in self.records]
            max_new = {r.id: r.max_new_tokens for r in todo}
            has_stop = {r.id: bool(getattr(r, "stop", None)) for r in todo}
            self.meter.expect([(r.id, len(engine.prompt_token_ids(r)), r.max_new_tokens) for r in todo],
                              min(self.plan.policy.batch_size, len(todo)))
            from core.io.runstore import finish_run, run_pending
            from core.runtime.fold_back import RunSums, fold_back

            def saved(record: dict) -> None:  # durable in the run file before it is counted
                rid = str(record["id"])
                self.records[rid] = record
                out = int(record.get("output_tokens", 0))
                self._count_saved(record)
                # "stop" without stop strings: the end-of-text token, sampled but not output
                eos = record.get("finish_reason") == "stop" and not has_stop.get(rid, False)
                self.meter.add_result(out, max_new.get(rid, out), rid, eos)
                self._post_update()

            sums = RunSums(forward=self._sink)  # the run's own figures, for this machine's history at its end
            # core's run loop, as `mlight run`'s: it saves each result and runs later turns in waves
            run_pending(engine, self.prompts.prompts, _TimedSaves(store, b.clock, self.meter.result_saved), requests,
                        batch_size=self.plan.policy.batch_size,
                        micro_batch_size=self.plan.policy.micro_batch_size, on_event=sums,
                        should_stop=self._should_stop, on_result=saved)
            if self._stop.is_set() and len(self.records) < self.prompts.count:
                return self._end("stopped", store)
            finish_run(store, self.prompts.prompts, self.model.name)  # the output in the prompts' order, atomically
            fold_back(engine, sums, self.plan.policy.micro_batch_size)
            return self._end("done", None)
        except BaseException:
            self.state = "failed"
            self.meter.set_state("failed")
            store.close()
            raise
        finally:
            store.release()

    def _count_saved(self, record: dict) -> None:
        """The finished results' tokens: what the results file will hold, earlier sessions included."""
        self.meter.saved_out += int(record.get("output_tokens", 0))
        self.meter.saved_in += int(record.get("prompt_tokens", 0))

    def _choices(self) -> EngineChoices:
        # the plan settled "auto" on a format: the engine loads that one (a group size only for int4)
        q = self.plan.quantize if self.plan.quantize not in (None, "none") else None
        return dataclasses.replace(self.choices, quantize=q, group_size=self.plan.group_size if q == "int4" else None,
                                   quantize_dense=self.plan.quant_dense if q else None)

    def _end(self, state: str, store) -> str:
        if store is not None:
            store.close()  # the run file stays: the next run on this output resumes it
        self.state = state
        self.meter.set_state(state)
        self.post(RunEnded(state, self.meter.snapshot()))
        return state

    def ordered_records(self) -> list[dict]:
        order = {e.id: i for i, e in enumerate(self.prompts.prompts.entries)}
        return sorted(self.records.values(), key=lambda r: order.get(str(r["id"]), len(order)))


class _TimedSaves:
    """The run store as the run loop uses it, each append timed on the run's clock for the ETA."""

    def __init__(self, store: Any, clock: Callable[[], float], saved: Callable[[float], None]):
        self._store, self._clock, self._saved = store, clock, saved

    def append(self, record: dict) -> None:
        start = self._clock()
        self._store.append(record)
        self._saved(self._clock() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
