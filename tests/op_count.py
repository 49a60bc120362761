"""What a decode step asks of the device, per layer: the launch budget (issue 42, item 2).

Counted while a `PipelineRunner` runs one step, without changing what it runs:
- ops: the aten operations its tasks dispatch on device data, each a kernel launch on a GPU (views and
  allocations launch nothing and are left out; a fused kernel registered as one torch op counts once);
- copies: the device's copies (`Device.copy`: D1, D2, weight pages, KV loads and stores);
- waits: event waits — a stream waiting on another stream's event, and a host task (CPU attention) waiting
  for a copy to land — issued for a layer's tasks;
- host syncs: the caller's thread blocking on the device (`host_wait`, `synchronize`) outside any task, and
  every read of device data on the host (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`) anywhere in the step.
Per layer, by task kind; the step's own work (embeddings, logits, the executor's set-up and end) apart.

It wraps the runner's task function, the device's copy and wait calls and the executor's dependency waits
for the duration of one step, and restores them after. The host's C row kernels (core.model.cpu.row_ops) are
off in the device's tasks meanwhile: the emulated device's tensors are CPU tensors, so they would take them,
where a GPU runs the torch forms (the same roundings). Written for the emulated device (CI, `bench/`) and CUDA
alike; it has not met a GPU yet, where `torch.profiler`'s kernel counts are the check. Legend: n =
micro-batches, p = weight pages per layer, L = layers.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from core.model import layers
from core.model.cpu import row_ops

# ops that launch nothing on a GPU: allocations and metadata (views are found by their schema)
_FREE = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default,
         torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default, torch.ops.aten.lift_fresh.default,
         torch.ops.aten._unsafe_view.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default}
_HOST = {"cpu_attn"}  # task kinds that run on the host, next to the KV cache: not the device's work
_READS = ("tolist", "cpu", "numpy")  # Tensor methods that read device data on the host (a sync on a GPU)


@dataclass
class LayerCounts:
    ops: collections.Counter = field(default_factory=collections.Counter)  # task kind -> ops
    copies: collections.Counter = field(default_factory=collections.Counter)  # task kind -> device copies
    waits: collections.Counter = field(default_factory=collections.Counter)  # task kind -> event waits
    names: collections.Counter = field(default_factory=collections.Counter)  # "kind:aten op" -> count (diagnostics)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_waits(self) -> int:
        return sum(self.waits.values())


@dataclass
class StepCounts:
    layers: list[LayerCounts]
    micro_batches: int  # n
    pages: int  # p: weight pages per layer (1 when nothing streams)
    host_syncs: int  # the caller blocking on the device, and host reads of device data
    step: LayerCounts  # work outside any layer's tasks: embeddings, logits, the executor's start and end
    seconds: float  # host wall time of the step

    def ops_per_micro_batch(self, layer: int) -> float:
        """GPU-stream operations of one micro-batch in one layer (pre- and post-attention and its FFN share)."""
        return self.layers[layer].total_ops / self.micro_batches

    def waits(self, layer: int) -> int:
        return self.layers[layer].total_waits

    def seconds_per_layer(self) -> float:
        return self.seconds / len(self.layers)

    def table(self) -> list[dict]:
        """One row per layer: ops per micro-batch by kind, copies, waits (for printing and pricing)."""
        n = self.micro_batches
        return [{"layer": i, "ops_per_mb": lc.total_ops / n, **{f"ops_{k}": v / n for k, v in sorted(lc.ops.items())},
                 "copies": sum(lc.copies.values()), "waits": lc.total_waits} for i, lc in enumerate(self.layers)]


def _tensors(*trees):
    return [a for a in tree_flatten(trees)[0] if isinstance(a, torch.Tensor)]


class _Ops(TorchDispatchMode):
    """Counts the aten ops a task dispatches (one mode per task call, on the thread that runs it)."""

    def __init__(self, rec: "_Recorder", into: LayerCounts, kind: str, outer: bool = False):
        super().__init__()
        self.rec, self.into, self.kind = rec, into, kind
        self.outer = outer  # the caller's mode: a task's own mode above it counts the task's ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.outer and getattr(self.rec._tls, "task", None) is not None or getattr(self.rec._tls, "quiet", False):
            pass  # a task's own mode above this one counted it; a fused op's parts
        elif not any(map(self.rec.on_device, _tensors((args, kwargs), out))):
            pass  # host work: CPU attention, a KV load's gather into staging, the caller's own tensors
        elif func is torch.ops.aten._local_scalar_dense.default:
            self.rec.read()
        elif not (func.is_view or func in _FREE):
            self.into.ops[self.kind] += 1
            self.into.names[f"{self.kind}:{func.__name__}"] += 1
        return out


class _Recorder:
    def __init__(self, runner, L: int):
        self.runner, self.dev, self.ex = runner, runner.dev, runner.ex
        self.layers = [LayerCounts() for _ in range(L)]
        self.step = LayerCounts()
        self.host_syncs = 0
        self._tls = threading.local()  # .task: the task this thread is waiting for or running
        self._lock = threading.Lock()

    def on_device(self, t) -> bool:
        """Device memory: the emulated device's own blocks (its tensors are CPU tensors), else the device type."""
        if not (isinstance(t, torch.Tensor) and self.dev.accelerator):
            return False
        mine = getattr(self.dev, "is_device", None)
        if mine is None:
            return t.device.type == self.dev.torch_device.type
        try:
            return mine(t)
        except RuntimeError:  # no storage (a sparse or meta tensor): not the device's
            return False

    def _counts(self):
        task = getattr(self._tls, "task", None)
        if task is None or task.layer < 0:
            return self.step, getattr(task, "kind", "step")
        return self.layers[task.layer], task.kind

    def _on_device_task(self) -> bool:
        task = getattr(self._tls, "task", None)
        return self.dev.accelerator and task is not None and task.kind not in _HOST

    def read(self) -> None:
        with self._lock:
            self.host_syncs += 1

    @contextlib.contextmanager
    def _as(self, task):
        prev = getattr(self._tls, "task", None)
        self._tls.task = task
        try:
            yield
        finally:
            self._tls.task = prev

    @contextlib.contextmanager
    def installed(self):
        patched: list[tuple[object, str]] = []

        def patch(obj, name, make):
            setattr(obj, name, make(getattr(obj, name)))
            patched.append((obj, name))

        def run(orig):
            def wrapped(task):
                into, kind = self.layers[task.layer] if task.layer >= 0 else self.step, task.kind
                with self._as(task), _Ops(self, into, kind):
                    return orig(task)
            return wrapped

        def wait_deps(orig):
            def wrapped(step, task):
                with self._as(task):
                    return orig(step, task)
            return wrapped

        def counted(what, host=False):
            def make(orig):
                def wrapped(*a, **kw):
                    into, kind = self._counts()
                    if host and getattr(self._tls, "task", None) is None:
                        self.read()  # the caller's thread blocked on the device
                    else:
                        with self._lock:
                            getattr(into, what)[kind] += 1
                    return orig(*a, **kw)
                return wrapped
            return make

        patch(self.runner, "_run", run)
        fused = layers._FUSED
        if fused is not None:  # one kernel on a GPU; the CPU's autograd layer writes it out below this mode
            def one_kernel(x, *a):
                task = getattr(self._tls, "task", None)
                if self.on_device(x) and task is not None:
                    into, kind = self._counts()
                    with self._lock:
                        into.ops[kind] += 1
                        into.names[f"{kind}:_fused_rms_norm"] += 1
                self._tls.quiet = True  # what it is written out into, below: not counted again
                try:
                    return fused(x, *a)
                finally:
                    self._tls.quiet = False
            layers._FUSED = one_kernel
        if hasattr(self.ex, "_wait_deps"):
            patch(self.ex, "_wait_deps", wait_deps)
        patch(self.dev, "copy", counted("copies"))
        patch(self.dev, "host_wait", counted("waits", host=True))
        patch(self.dev, "synchronize", counted("waits", host=True))
        for s in getattr(self.ex, "streams", {}).values():  # a stream waiting on another's event
            with contextlib.suppress(AttributeError, TypeError):
                patch(s, "wait_event", counted("waits"))
        reads = {m: getattr(torch.Tensor, m) for m in _READS}

        def read_of(orig):
            def wrapped(t, *a, **kw):
                if self.on_device(t):
                    self.read()
                return orig(t, *a, **kw)
            return wrapped

        for m, orig in reads.items():
            setattr(torch.Tensor, m, read_of(orig))
        library = row_ops.library
        row_ops.library = lambda: None if self._on_device_task() else library()
        try:
            with _Ops(self, self.step, "step", outer=True):  # the caller's own device work: embeddings, logits
                yield self
        finally:
            if fused is not None:
                layers._FUSED = fused
            row_ops.library = library
            for m, orig in reads.items():
                setattr(torch.Tensor, m, orig)
            for obj, name in reversed(patched):
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)


def count_step(runner, tokens, slots, positions) -> StepCounts:
    """Run one decode step of `runner` (core.runtime.pipeline.PipelineRunner; per-micro-batch lists, as its
    `decode` takes them) and count what it asked of the device. Returns the step's counts; the logits are
    the runner's (see `PipelineRunner.decode`)."""
    rec = _Recorder(runner, runner.spec.num_layers)
    with rec.installed():
        t0 = time.perf_counter()
        runner.decode(tokens, slots, positions)
        seconds = time.perf_counter() - t0
    return StepCounts(rec.layers, len(tokens), runner.pages if runner.streamed else 0, rec.host_syncs, rec.step,
                      seconds)


def steady_step(engine, *, micro_batches: int = 2, micro_batch_size: int = 2, prompt: int = 5, warm_steps: int = 1,
                repeat: int = 1, prepare=None) -> StepCounts:
    """The counts of a steady decode step of `engine` (core.runtime.engine.Engine): a runner for n × μ requests
    of `prompt` tokens (`prepare(runner)` called on it first), their prefill, `warm_steps` decode steps, then
    `repeat` counted ones: the last one's counts, with the least of their host seconds."""
    n, mu = micro_batches, micro_batch_size
    runner = engine.runner(slots=n * mu, micro_batch_size=mu, max_tokens=prompt + warm_steps + repeat + 1)
    if prepare is not None:
        prepare(runner)
    slots = [list(range(j * mu, (j + 1) * mu)) for j in range(n)]
    prompts = [[5 + (i % 7)] * prompt for i in range(n * mu)]
    runner.prefill(prompts, [s for mb in slots for s in mb], slots)
    tokens = [[7] * mu for _ in range(n)]
    for s in range(warm_steps):
        runner.decode(tokens, slots, [[prompt + s] * mu for _ in range(n)])
    best = None
    for s in range(warm_steps, warm_steps + repeat):
        c = count_step(runner, tokens, slots, [[prompt + s] * mu for _ in range(n)])
        best = c if best is None else dataclasses.replace(c, seconds=min(best.seconds, c.seconds))
    return best
