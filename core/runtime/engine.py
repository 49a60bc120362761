"""The batch generation engine: `Request`s in, `Result`s out as each finishes; the per-layer work is a
`PipelineRunner`'s."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import psutil
import torch

from core.runtime import graphs as cuda_graphs, loading
from core.runtime.batching import SlotTable
from core.errors import GpuMemoryError, MlightError, UsageError
from core.model.kvcache import KVCache
from core.model.gguf.load import load_tokenizer as load_gguf_tokenizer
from core.model.quant.formats import parse_choice
from core.model.cpu import compute as cpu_compute
from core.model.cpu.threads import Governor, worker_setup
from core.plan.hardware import cached_cpu_rates, cached_probe, gpu_compute_dtype
from core.plan.policy import SCHEDULES, expert_split, kv_gpu_layers
from core.runtime.cuda_executor import CudaExecutor
from core.runtime.device import Device, default_device_kind, resolve_device
from core.runtime.executors import SequentialExecutor, TaskFailed, ThreadedExecutor
from core.runtime.frozen_heap import frozen_heap
from core.runtime.pipeline import PipelineRunner
from core.model.sampling import greedy, sample
from core.model.spec import DTYPE_BYTES, ModelSpec, torch_dtype
from core.telemetry import RESOURCES, EventSink, RequestDone, StepDone, WarningEvent, ignore
from core.model.weights import ModelWeights


@dataclass
class Request:
    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if (self.prompt is None) == (self.messages is None):
            raise UsageError(f"request {self.id!r} needs exactly one of `prompt` or `messages`")
        if self.max_new_tokens < 1:
            raise UsageError(f"request {self.id!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise UsageError(f"request {self.id!r}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")


@dataclass
class Result:
    id: str
    prompt: str
    output: str
    output_token_ids: list[int]
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Seq:  # a request in flight
    req: Request
    prompt_ids: list[int]
    max_total: int  # prompt + generated tokens it may reach
    out: list[int] = field(default_factory=list)
    slot: int = -1
    started: float = 0.0
    finish: str | None = None
    text: str | None = None
    gen: torch.Generator | None = None

    def reset(self) -> None:
        self.out.clear()
        self.finish = self.text = None
        if self.req.temperature > 0:
            self.gen = torch.Generator().manual_seed(self.req.seed if self.req.seed is not None else 0)

    @property
    def next_position(self) -> int:  # where the last sampled token goes in the cache
        return len(self.prompt_ids) + len(self.out) - 1


EXECUTORS = ("sequential", "threaded", "cuda")


@dataclass(frozen=True)
class RunConfig:
    """On the CPU the default is the plain chain; a schedule or the threaded executor runs a graph, real copies."""

    device: str = "cpu"  # "cpu" | "cuda" | "emulated" (core.runtime.device)
    executor: str = "sequential"
    schedule: str = "cgopipe"
    attention_on: str = "cpu"  # "gpu" for S4 (FlexGen: KV prefetched to the device)
    ffn_on: str = "gpu"  # "cpu": everything in one chain on the CPU
    resident_layers: int | None = None  # layers whose experts all stay on the device; None = all
    expert_group: int = 1  # micro-batches whose tokens meet at the experts together
    resident_experts: tuple[int, ...] | None = None  # per layer, experts kept on the device (wins over resident_layers)
    kv_gpu_layers: int = 0  # attention on the GPU: layers whose KV cache lives there (the policy's r_c)
    graphs: str = "auto"  # CUDA graphs for the decode segments: "on", "off", or where they pay (core.runtime.graphs)

    def __post_init__(self):
        for what, value, known in (("executor", self.executor, EXECUTORS), ("schedule", self.schedule, SCHEDULES),
                                   ("graphs setting", self.graphs, cuda_graphs.MODES)):
            if value not in known:
                raise UsageError(f"unknown {what} {value!r}", f"use one of {', '.join(known)}")
        if self.executor == "cuda" and self.device == "cpu":
            raise UsageError("--executor cuda needs a CUDA GPU, and none is available",
                             "use --executor sequential or threaded")

    def resident(self, num_layers: int, num_experts: int) -> list[int] | None:
        """Experts kept on the device per layer; None: all."""
        if self.resident_experts is not None:
            return list(self.resident_experts)
        if self.resident_layers is None:
            return None
        return [num_experts if i < self.resident_layers else 0 for i in range(num_layers)]


class Engine:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, tokenizer, *, eos_ids: set[int], config: RunConfig,
                 device: Device, cpu, policy=None):
        self.spec, self.weights, self.tokenizer, self.eos_ids = spec, weights, tokenizer, eos_ids
        self.config, self.dev, self.cpu = config, device, cpu
        self.context_length = spec.max_position
        self.policy = policy  # the planner's Policy this engine was loaded with, if any
        self.tp = None  # tensor parallel: this rank's core.runtime.distributed.tensor_parallel.ShardOps
        self.rank_spec = spec  # the model this process runs: with tensor parallelism, its heads and expert slices
        self.threads = Governor()  # torch threads = the free cores, re-checked between steps
        self._executor = None
        self.graphs_why = ""  # why the last runner runs with or without CUDA graphs (core.runtime.graphs.choose)
        self._h2d_rate: float | None = None

    def executor(self):
        kind = self.config.executor
        if self._executor is None and kind == "sequential":
            self._executor = SequentialExecutor()
        elif self._executor is None:
            # the threads feeding the device share a core (half when the CPU plays the GPU), attention the rest
            setup = worker_setup(self.config.device if kind == "threaded" else self.dev.kind)
            if self.threads.fixed is None:
                self.threads = Governor(fixed=setup.threads)
            self._executor = (ThreadedExecutor(RESOURCES, setup=setup) if kind == "threaded"
                              else CudaExecutor(self.dev, placement=setup))
        return self._executor

    def apply_policy(self, policy) -> None:
        """Run later `generate` calls under a (new) planner Policy without reloading the weights."""
        changes = {"expert_group": policy.micro_batches_per_expert_batch}
        if policy.ffn_on == "gpu" and self.dev.accelerator:
            changes.update(_placement(policy, self.spec))
        self.configure(pages_per_layer=None if self.weights.packed else policy.pages_per_layer, **changes)
        self.policy = policy

    def configure(self, *, pages_per_layer: int | None = None, **changes) -> None:
        if "resident_layers" in changes and "resident_experts" not in changes:
            changes["resident_experts"] = None
        config = dataclasses.replace(self.config, **changes)
        if config.executor != self.config.executor:
            self._stop_executor()  # the next generate starts the new one; the pins stay (locked once per model)
        if self.weights.packed and config.ffn_on != "cpu":
            raise UsageError("this engine packed its experts for the CPU-only mode, so they cannot stream",
                             "load the model again with the executor and schedule you want")
        self.config = config
        if pages_per_layer is not None:
            self.weights.repage(pages_per_layer)

    @property
    def pin_seconds(self) -> float:  # the first run's: later runs find the weights locked
        return self.weights.pin_seconds

    @property
    def pinned_bytes(self) -> int:
        return self.weights.pinned_bytes

    def _stop_executor(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None

    def close(self) -> None:
        """Unpin the weights too: freed while registered, they would stay locked."""
        self._stop_executor()
        self.weights.unpin()

    @classmethod
    def load(cls, model_dir, *, dtype: str | torch.dtype | None = None, device: "str | Device | None" = None,
             pages_per_layer: int = 1, executor: str | None = None, schedule: str | None = None,
             resident_layers: int | None = None, expert_group: int = 1, policy=None, resident_experts=None,
             quantize: str | None = None, group_size: int | None = None, use_cache: bool = True,
             cpu_math: str | None = None, threads: int | None = None, progress: EventSink = ignore, tp=None,
             quantize_dense: bool | str = False, graphs: str = "auto") -> "Engine":
        """Load a checkpoint (arguments: docs/CONTRACTS.md); a planner `Policy` sets the placement."""
        model_dir = Path(model_dir)
        ck = loading.read_checkpoint(model_dir, tp)
        config, dev, pages_per_layer = _run_for(ck.spec, policy, device, executor, schedule, pages_per_layer,
                                                resident_layers, expert_group, resident_experts, graphs)
        tokenizer = load_gguf_tokenizer(ck.gguf) if ck.gguf is not None else loading.load_tokenizer(model_dir)
        dtype, quant, dense_fmt = _dtypes(dtype, quantize, group_size, quantize_dense, dev, ck.spec, progress)
        weights, spec = loading.read_weights(ck, dtype, quant, quantize, pages_per_layer, use_cache, progress,
                                             cpu_only=config.ffn_on == "cpu")
        config = loading.fit_on_device(config, dev, ck, spec, weights, quant)
        cpu = cpu_compute.choose(weights.dtype_name, rates=cached_cpu_rates(), math=cpu_math)
        cpu, spec = loading.ready_for_cpu(config, ck, spec, weights, cpu, quant, dense_fmt, quantize_dense, use_cache,
                                          progress)
        loading.prepare_kernels(config, progress)
        engine = cls(spec, weights, tokenizer, eos_ids=loading.eos_ids(model_dir, spec, tokenizer), config=config,
                     device=dev, cpu=cpu, policy=policy)
        if threads is not None:
            engine.threads = Governor(fixed=threads)
        if tp is not None:
            engine.tp, engine.rank_spec = loading.shard_ops(tp, ck.shard, spec, quant)
        return engine

    def runner(self, slots: int, micro_batch_size: int, max_tokens: int,
               on_event: EventSink = ignore) -> PipelineRunner:
        c, spec = self.config, self.rank_spec
        kv_gpu = c.kv_gpu_layers if c.attention_on == "gpu" else 0
        cache = KVCache(spec, slots, max_tokens, self.weights.dtype, gpu_layers=kv_gpu)
        r = PipelineRunner(spec, self.weights, cache, executor=self.executor(), schedule=c.schedule,
                           attention_on=c.attention_on, ffn_on=c.ffn_on, micro_batch_size=micro_batch_size,
                           expert_group=c.expert_group, resident_experts=c.resident(spec.num_layers, spec.num_experts),
                           kv_gpu_layers=kv_gpu, device=self.dev, warn=on_event, tp=self.tp,
                           cpu_math=torch_dtype(self.cpu.math), direct_rows=self.cpu.direct_rows)
        if c.executor == "cuda" and self._graphs_pay(-(-slots // micro_batch_size)):
            r.graphs = cuda_graphs.Graphs(self.dev, warn=on_event)
        return r

    def _graphs_pay(self, micro_batches: int) -> bool:
        c = self.config
        if c.graphs != "auto" or self.dev.kind != "cuda":
            self.graphs_why = f"graphs {c.graphs}" + ("" if c.graphs != "auto" else ": only on a GPU")
            return c.graphs == "on"
        spec = self.rank_spec
        link = cuda_graphs.streamed_bytes_per_layer(self.weights, c.resident(spec.num_layers, spec.num_experts),
                                                    spec.num_experts)
        if self._h2d_rate is None:  # the probe's cache read once per engine (detect() asks the driver)
            hw = cached_probe()  # else a PCIe 4.0 x16 link's practical 25 GB/s
            self._h2d_rate = hw.h2d_bw if hw is not None and hw.h2d_bw > 0 else 25e9
        pays, self.graphs_why = cuda_graphs.choose("auto", micro_batches=micro_batches,
                                                   streamed_bytes_per_layer=link, h2d_bytes_per_s=self._h2d_rate)
        return pays

    def prompt_token_ids(self, req: Request) -> list[int]:
        if req.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise UsageError(f"request {req.id!r} has `messages` but the model's tokenizer has no chat template",
                                 "give a plain `prompt` instead")
            ids = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(req.prompt).input_ids)

    def generate(self, requests: Iterable[Request], *, batch_size: int | None = None,
                 micro_batch_size: int | None = None, on_event: EventSink = ignore,
                 should_stop: Callable[[], bool] | None = None) -> Iterator[Result]:
        """Yield each request's Result as it finishes; batch sizes default to the policy's, else 64 / the batch. Out
        of device memory, the unfinished requests start again in a batch half the size (or the group's)."""
        if batch_size is None:
            batch_size = self.policy.batch_size if self.policy else 64
        if micro_batch_size is None and self.policy is not None:
            micro_batch_size = self.policy.micro_batch_size
        seqs = [self._admit_check(r) for r in requests]
        if not seqs:
            return
        slots = max(1, min(batch_size, len(seqs)))
        mu = min(micro_batch_size or slots, slots)
        max_tokens = max(s.max_total for s in seqs)
        waiting = sorted(seqs, key=lambda s: -len(s.prompt_ids))  # longest first (Algorithm 2)
        active: list[_Seq] = []
        proc = psutil.Process()
        with frozen_heap():
            while waiting or active:
                table, runner, shrink = self._start(slots, mu, max_tokens, on_event)
                if shrink is None:
                    shrink = yield from self._steps(runner, table, waiting, active, proc, on_event, should_stop, slots)
                if shrink is None:  # every request done, or the run was asked to stop
                    return
                runner = table = None  # gone before the next runner is built: the retry has the device to itself
                slots, mu = self._restart_smaller(*shrink, mu, waiting, active, on_event)

    def _start(self, slots: int, mu: int, max_tokens: int, on_event: EventSink):
        """(table, runner, None); where the runner does not fit (on some rank), (…, (smaller batch, rank))."""
        table, shrink = SlotTable(slots, mu), None
        try:
            runner = self.runner(slots, mu, max_tokens, on_event)
        except torch.cuda.OutOfMemoryError as e:
            if slots == 1 and self.tp is None:
                raise GpuMemoryError(
                    "out of GPU memory with a batch of one request: the model's fixed GPU buffers (resident experts, "
                    "weight pages) do not fit", "keep fewer experts on the GPU (plan with a smaller --gpu-mem, or a "
                    "policy with a lower GPU expert share), or run on the CPU (hide the GPU: "
                    "CUDA_VISIBLE_DEVICES=)") from e
            runner, shrink = None, (slots // 2, -1)
        if self.tp is not None:  # the group's ranks all built their runners, or all retry alike
            agreed = self.tp.tp.outcome(False, slots, slots if shrink is None else shrink[0])
            shrink = (agreed.slots, agreed.failed_rank) if agreed.slots < slots else None
        return table, runner, shrink

    def _restart_smaller(self, slots: int, failed_rank: int, mu: int, waiting, active, on_event) -> tuple[int, int]:
        """The unfinished requests wait again for a batch of `slots` (under one: `failed_rank` cannot run one)."""
        if slots < 1:
            from core.runtime.distributed.tensor_parallel import GroupOutOfMemory

            raise GroupOutOfMemory(f"rank {failed_rank} ran out of GPU memory with a batch of one request",
                                   "give each rank more GPU memory (more GPUs: --tensor-parallel), or shorten the "
                                   "prompts and --max-new-tokens")
        gc.collect()  # device memory that nothing references any more (cycles included) goes back to the device
        self.dev.empty_cache()
        mu = max(1, min(mu, slots))
        on_event(WarningEvent(f"out of GPU memory; continuing with batch {slots}, micro-batch {mu}"))
        for s in active:
            s.reset()
        waiting[:0] = sorted(active, key=lambda s: -len(s.prompt_ids))
        active.clear()
        return slots, mu

    def _steps(self, runner, table, waiting, active, proc, on_event, should_stop, slots):
        """Step, yielding results, until done or stopped (None); out of device memory, (smaller batch, rank or -1)."""
        while waiting or active:
            stop = should_stop is not None and should_stop()
            if stop and self.tp is None:  # tensor parallel: the group agrees on stopping after the step
                return None
            self.threads.tick()
            try:
                finished = self._step(runner, table, waiting, active, proc, on_event, stop, slots)
            except _GroupAgreed as e:  # every rank stops at the same step, or goes on with the same smaller batch
                return e.args[0]
            except TaskFailed as e:
                if not _is_oom(e) or slots == 1 or self.tp is not None:
                    raise
                return slots // 2, -1
            yield from finished
        return None

    def _step(self, runner, table, waiting, active, proc, on_event, stop, slots) -> list[Result]:
        """One step: refill free slots and prefill them, else decode; sample; retire the finished."""
        admitted = self._refill(table, waiting, active)
        t0, moved = time.perf_counter(), dict(runner.bytes)
        if not admitted and not waiting:  # nothing to refill the holes with: compact
            self._compact(runner, table, active)
        by_slot = sorted(admitted or active, key=lambda s: s.slot)
        groups = [list(g) for _, g in itertools.groupby(by_slot, key=lambda s: table.micro_batch_of(s.slot))]
        seqs = [s for g in groups for s in g]  # in the order of the logits' rows
        if admitted:  # a freshly prefilled request may already be done; the next step admits again
            kind, tokens, row = "prefill", sum(len(s.prompt_ids) for s in seqs), itertools.count()
            run = functools.partial(runner.prefill, [s.prompt_ids for s in seqs], [s.slot for s in seqs],
                                    [[next(row) for _ in g] for g in groups])  # each micro-batch's rows of seqs
        else:
            kind, tokens = "decode", len(active)
            run = functools.partial(runner.decode, [[s.out[-1] for s in g] for g in groups],
                                    [[s.slot for s in g] for g in groups],
                                    [[s.next_position for s in g] for g in groups])
        logits, busy = self._agreed(runner, stop, slots, run)
        self._check_finite(logits)
        self._choose(seqs, logits)
        on_event(StepDone(kind, tokens, time.perf_counter() - t0, busy, runner.bytes["h2d"] - moved["h2d"],
                          runner.bytes["d2h"] - moved["d2h"], len(active), self.dev.memory_allocated(),
                          proc.memory_info().rss, tasks=runner.last_tasks, times=runner.ex.times))
        return self._retire(active, table, on_event)

    @staticmethod
    def _refill(table: SlotTable, waiting: list[_Seq], active: list[_Seq]) -> list[_Seq]:
        """Place waiting requests into free slots; they join `active` at once, so a failed step restarts them too."""
        # a smaller last wave: in as few micro-batches as hold it, as planner.last_wave prices it
        last_wave = not active and 0 < len(waiting) <= table.free_slots()
        among = -(-len(waiting) // table.micro_batch_size) if last_wave else None
        admitted = []
        while waiting and table.free_slots():
            s = waiting.pop(0)
            s.slot = table.place(s, len(s.prompt_ids), among)
            s.started = time.perf_counter()
            admitted.append(s)
        active += admitted
        return admitted

    @staticmethod
    def _compact(runner, table, active) -> None:
        """Requests (and their cache rows) into each micro-batch's first slots: attention reads them in place."""
        moves = table.compact()
        if moves:
            at = {s.slot: s for s in active}
            runner.move_rows([(a, b, at[a].next_position) for a, b in moves])
            for a, b in moves:
                at[a].slot = b

    def _agreed(self, runner, stop: bool, slots: int, compute):
        """Run a step; tensor parallel, the group agrees on its outcome first (see distributed.tensor_parallel)."""
        if self.tp is None:
            return compute()
        from core.runtime.distributed.tensor_parallel import step_collectives

        tp, want, out = self.tp.tp, slots, None
        start = tp.issued
        try:
            out = compute()
        except (TaskFailed, torch.cuda.OutOfMemoryError) as e:
            if not (isinstance(e, torch.cuda.OutOfMemoryError) or _is_oom(e)):
                raise
            tp.drain(step_collectives(runner)[tp.issued - start:])
            want = slots // 2  # 0: not even one request fits
        agreed = tp.outcome(stop, slots, want)
        if agreed.stop or agreed.slots < slots:
            raise _GroupAgreed(None if agreed.stop else (agreed.slots, agreed.failed_rank))
        return out

    def _admit_check(self, req: Request) -> _Seq:
        ids = self.prompt_token_ids(req)
        if not ids:
            raise UsageError(f"request {req.id!r} has an empty prompt")
        if len(ids) >= self.context_length:
            raise UsageError(f"request {req.id!r} has {len(ids)} prompt tokens; the model's context is "
                             f"{self.context_length}", "shorten the prompt")
        s = _Seq(req, ids, min(len(ids) + req.max_new_tokens, self.context_length))
        s.reset()
        return s

    def _check_finite(self, logits: torch.Tensor) -> None:
        if self.weights.dtype == torch.float16 and self.spec.torch_dtype != torch.float16 and \
                not torch.isfinite(logits).all():
            raise MlightError("the model overflowed float16 (this GPU has no bf16, so the bf16 checkpoint runs in "
                              "float16) and its outputs are no longer numbers", "run with --dtype float32")

    def _choose(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        best = greedy(logits).tolist()
        toks = [best[row] if s.req.temperature <= 0 else sample(logits[row], s.req.temperature, s.req.top_k,
                                                                 s.req.top_p, s.gen) for row, s in enumerate(seqs)]
        if self.tp is not None:
            toks = self.tp.tp.tokens(toks)
        for s, tok in zip(seqs, toks):
            if tok in self.eos_ids:
                s.finish = "stop"
                continue
            s.out.append(tok)
            if s.req.stop:
                text = self.tokenizer.decode(s.out, skip_special_tokens=True)
                hits = [text.find(x) for x in s.req.stop if x and x in text]
                if hits:
                    s.text, s.finish = text[:min(hits)], "stop"
                    continue
            if len(s.prompt_ids) + len(s.out) >= s.max_total:
                s.finish = "length"

    def _retire(self, active: list[_Seq], table: SlotTable, on_event: EventSink) -> list[Result]:
        done = [s for s in active if s.finish]
        active[:] = [s for s in active if not s.finish]
        results, now = [], time.perf_counter()
        for s in done:
            table.release(s.slot, len(s.prompt_ids))
            text = s.text if s.text is not None else self.tokenizer.decode(s.out, skip_special_tokens=True)
            prompt = s.req.prompt if s.req.prompt is not None else self.tokenizer.apply_chat_template(
                s.req.messages, add_generation_prompt=True, tokenize=False)
            res = Result(s.req.id, prompt, text, list(s.out), len(s.prompt_ids), len(s.out), s.finish,
                         round(now - s.started, 6))
            on_event(RequestDone(res.id, res.prompt_tokens, res.output_tokens, res.seconds, res.finish_reason))
            results.append(res)
        return results


def _run_for(spec: ModelSpec, policy, device, executor, schedule, pages_per_layer, resident_layers, expert_group,
             resident_experts, graphs) -> tuple[RunConfig, Device, int]:
    """Where and how the model runs: the planner's policy over the explicit arguments; (config, device, paging)."""
    placement = {}
    if policy is not None:
        pages_per_layer, expert_group = policy.pages_per_layer, policy.micro_batches_per_expert_batch
        if policy.ffn_on == "gpu":  # on the CPU alone every expert is "resident"
            placement = _placement(policy, spec)
        elif device is None and executor is None:  # a CPU-only plan runs the CPU-only mode
            device = "cpu"
        if schedule is None and policy.attention_on == "gpu":
            schedule = "s4"
    dev = device if isinstance(device, Device) else None
    kind = dev.kind if dev else device
    if kind is None:  # the executor's device, else core.runtime.device.default_device_kind
        kind = "cuda" if executor == "cuda" and default_device_kind() == "cpu" else (
            "cpu" if executor in ("sequential", "threaded") else default_device_kind())
    kind = "cuda" if kind.startswith("cuda") else kind
    executor = executor or ("sequential" if kind == "cpu" else "cuda")
    plain_cpu = kind == "cpu" and executor == "sequential" and schedule is None
    schedule = schedule or "cgopipe"
    config = RunConfig(device=kind, executor=executor, schedule=schedule, attention_on="gpu" if schedule == "s4"
                       else "cpu", ffn_on="cpu" if plain_cpu else "gpu", resident_layers=resident_layers,
                       expert_group=expert_group, graphs=graphs)
    dev = dev or resolve_device(device if device is not None else kind)
    if resident_experts is not None:  # explicit: also for the CPU as a device (threaded executor)
        placement = {"resident_experts": tuple(resident_experts)}
    if placement and (dev.accelerator or resident_experts is not None):
        config = dataclasses.replace(config, **placement)
    return config, dev, pages_per_layer


def _dtypes(dtype, quantize, group_size, quantize_dense, dev: Device, spec: ModelSpec, progress: EventSink):
    """(dtype, the experts' quantized format, the dense projections'); None: as loaded."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise UsageError(f"unknown dtype {dtype!r}", f"use one of {', '.join(sorted(DTYPE_BYTES))}")
        dtype = torch_dtype(dtype)
    quant = parse_choice(quantize, group_size)
    if quantize_dense and quant is None:
        raise UsageError("--quantize-dense needs a format", "pass --quantize int8 or --quantize int4 with it")
    dense_fmt = (quant if quantize_dense is True else parse_choice(quantize_dense, group_size)) if quantize_dense \
        else None
    if dev.accelerator:  # bf16 becomes fp16 where there are no bf16 tensor cores (a T4)
        want, dtype = dtype or spec.torch_dtype, gpu_compute_dtype(dtype or spec.torch_dtype, dev.capability)
        if dtype != want:
            progress(WarningEvent(f"{dev.name} (compute capability {dev.capability[0]}.{dev.capability[1]}) has no "
                                  f"bf16 tensor cores: computing in float16"))
    return dtype, quant, dense_fmt


def _placement(policy, spec: ModelSpec) -> dict:
    """RunConfig fields for a policy's resident experts (r_w) and GPU-held KV layers (r_c)."""
    dense = [i for i in range(spec.num_layers) if not spec.is_moe(i)]
    return {"resident_experts": tuple(expert_split(policy.gpu_weight_fraction, spec.num_layers, spec.num_experts,
                                                   dense)),
            "kv_gpu_layers": kv_gpu_layers(policy.gpu_kv_fraction, spec.num_layers)}


class _GroupAgreed(Exception):
    """Tensor parallel: the group agreed to stop (args[0] None) or to go on with args[0] = (requests, OOM rank)."""


def _is_oom(e: BaseException) -> bool:
    cause = e.__cause__
    return isinstance(cause, torch.cuda.OutOfMemoryError) or "out of memory" in str(cause).lower()
