"""The CGOPipe runtime: a decode step (or a prefill) as a task graph of core.runtime.schedule, each task a step of
core.model.decoder, over buffers allocated once per runner as core.plan.planner counts them. Reuse is safe because
the graph orders every writer after the last reader (expert halves alternate by layer: schedule._buffer_free; ring
position p = i·n + j uses buffer p mod 2: schedule._layer_by_layer). B = requests in a micro-batch, D = hidden.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from core.model import decoder, limits, mixer, mla
from core.model.cpu.kernels import Widen
from core.model.kvcache import KVCache, Rows, layer_store, load_rows
from core.model.layers import final_logits
from core.model.limits import STAGING_ALIGN as _ALIGN  # bytes between buffers of the staging arena
from core.model.moe import (HAS_GROUPED_MM, Scratch as ExpertScratch, activation, cuda_grouped_mm_works, device_experts,
                            experts)
from core.model.quant.experts import QuantExperts
from core.model.rope import for_spec
from core.model.spec import ModelSpec, torch_dtype
from core.model.weights import LayerLayout, ModelWeights, page_aligned
from core.runtime import one_stream, schedule as sched
from core.runtime.device import Device, HostDevice
from core.telemetry import EventSink, WarningEvent, ignore


class _MB:
    """State of one micro-batch through a step."""

    def __init__(self, tokens, slots, positions, dev: Device, on_device: bool, ring: bool):
        self.B = len(slots)
        self.tokens_d = dev.tensor(tokens)
        self.rows = Rows(slots, positions)  # in the host stores
        move, where = dev.to_device, dev.torch_device
        # in the device-resident stores (attention on the GPU), and in a ring buffer's first B rows
        self.rows_d = Rows(slots, positions, move, where) if on_device else None
        self.rows_ring = Rows(range(self.B), positions, move, where) if ring else None
        # positions for RoPE, lengths for LongRoPE's table: uploaded once, with whichever rows live on the device
        on_dev = self.rows if not dev.accelerator else (self.rows_d or self.rows_ring
                                                         or Rows(slots, positions, move, where))
        self.positions_d, self.lengths_d = on_dev.positions, on_dev.lengths
        self.x = None  # device hidden [B, D]
        self.payload = self.keep = None  # device, from pre-attention: for attention / for post-attention
        self.o = None
        self.ffn: decoder.FfnInput | None = None  # post-attention results, for the FFN
        self.new_state: dict[int, tuple] = {}  # layer -> this token's state awaiting the host store (S4)


class _PrefillMB:
    """A prefill micro-batch: whole prompts packed without padding."""

    def __init__(self, prompts, slots, dev: Device, call_lengths: bool = False):
        self.lens = [len(p) for p in prompts]
        self.slots = list(slots)
        self.tokens_d = dev.tensor([t for p in prompts for t in p])
        self.positions_d = dev.to_device(torch.cat([torch.arange(n) for n in self.lens]))
        # LongRoPE picks its table by each token's prompt length
        self.calls_d = dev.to_device(torch.cat([torch.full((n,), n) for n in self.lens])) if call_lengths else None
        self.ends_d = dev.to_device(torch.tensor(self.lens).cumsum(0) - 1)
        self.x = None
        self.kv: dict[int, list] = {}  # layer -> per prompt its state parts (device tensors), awaiting the store


class ExpertSlab:
    """`count` experts of a layer in one buffer, each expert tensor's rows back to back: a layer's resident experts
    or a half of the streaming buffer. Units: the weights' elements, or a quantized layout's bytes."""

    def __init__(self, layout: LayerLayout, count: int):
        self.layout, self.count = layout, count
        self.parts = layout.expert_entries()  # (name, offset in the layer buffer, shape, one expert's size)
        self.per_expert = sum(per for *_, per in self.parts)
        self.numel = count * self.per_expert

    def views(self, buf: torch.Tensor, n: int, dtype: torch.dtype, scratch: dict) -> dict:
        """The first n experts in `buf` (a slab of `count`): {"w13", "w2"} (+ biases), or {"quant"} (+ biases)."""
        out, off = {}, 0
        for name, _, shape, per in self.parts:
            region = buf[off:off + n * per]
            if self.layout.scheme is not None:  # bytes: view them as this part's own dtype
                region = region.view(torch_dtype(dict(self.layout.dtypes)[name]))
            out[name] = region.view(n, *shape[1:])
            off += self.count * per
        if self.layout.scheme is None:
            return out
        biases = {b: out.pop(b) for b in ("b13", "b2") if b in out}
        return {"quant": QuantExperts(self.layout.scheme, out, dtype, scratch), **biases}

    def pieces(self, buf: torch.Tensor, flat: torch.Tensor, first: int, last: int, pages: int) -> list[list[tuple]]:
        """Per page (of `pages` near-equal ones), the (dst, src) copies filling this slab with experts first..last−1
        of a layer buffer `flat`."""
        n = last - first
        spans, off, cum = [], 0, 0  # (start in the stream, length, dst, src) per expert tensor
        for _, at, _, per in self.parts:
            length = n * per
            spans.append((cum, length, buf[off:off + length], flat[at + first * per:at + last * per]))
            off += self.count * per
            cum += length
        step = max(1, math.ceil(cum / pages))
        out = []
        for p in range(pages):
            a, b = p * step, min(cum, (p + 1) * step)
            page = []
            for start, length, dst, s in spans:
                lo, hi = max(a, start), min(b, start + length)
                if lo < hi:
                    page.append((dst[lo - start:hi - start], s[lo - start:hi - start]))
            out.append(page)
        return out


class PipelineRunner:
    """Runs decode steps and prefills of one engine over a fixed policy-shaped task graph."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, cache: KVCache, *, executor, schedule: str = "cgopipe",
                 attention_on: str = "cpu", ffn_on: str = "gpu", micro_batch_size: int = 1, expert_group: int = 1,
                 resident_experts=None, kv_gpu_layers: int = 0, device: Device | None = None, warn: EventSink = ignore,
                 tp=None, cpu_math: torch.dtype | None = None, direct_rows: int = 2):
        if schedule not in sched.SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}")
        self.spec, self.w, self.cache, self.ex = spec, weights, cache, executor
        self.schedule, self.attention_on, self.ffn_on = schedule, attention_on, ffn_on
        self.dev = dev = device or HostDevice()
        # a host prefill runs a layer a chunk at a time (limits.prefill_chunk), one size on every tensor-parallel rank
        self._prefill_chunk = 0 if dev.accelerator else limits.PREFILL_CHUNK_TOKENS if tp is not None else (
            limits.prefill_chunk(spec.hidden_size, spec.q_size, spec.kv_size, spec.expert_intermediate,
                                 spec.shared_intermediate, spec.dense_intermediate, spec.num_experts, spec.top_k))
        self.warn = warn
        self.act = activation(spec)  # the experts' gate activation (gpt-oss clamps its SwiGLU)
        self.expert_group = expert_group
        self.tp = tp  # tensor parallel: core.runtime.distributed.tensor_parallel.ShardOps, or None
        self._full_norm, self._attention_out, self._ffn_out = ((tp.full_norm, tp.attention_out, tp.ffn_out)
                                                               if tp is not None else (None, None, None))
        L, E = spec.num_layers, spec.num_experts
        self.pages = max(1, len(weights.layers[0].pages))  # packed CPU experts have no pages
        # experts kept on the device per layer (a layer without experts has nothing to stream)
        self.resident = [E if resident_experts is None or ffn_on == "cpu" or not spec.is_moe(i) else
                         max(0, min(E, int(resident_experts[i]))) for i in range(L)]
        self.streamed = ffn_on == "gpu" and min(self.resident) < E
        self.kv_gpu_layers = kv_gpu_layers if attention_on == "gpu" else 0
        self.mu, n_mb = micro_batch_size, -(-cache.slots // micro_batch_size)
        self.rope = for_spec(spec, cache.max_tokens, weights.math_dtype)
        self.rope.cos, self.rope.sin = dev.to_device(self.rope.cos), dev.to_device(self.rope.sin)
        self.rope.sign = dev.to_device(self.rope.sign)
        # the CPU computes in `cpu_math` where the storage dtype is slow: one Widen per thread using it
        cpu_math = cpu_math or weights.math_dtype
        kv_dtype = next((s.k.dtype for s in cache.layers if hasattr(s, "k")), weights.dtype)
        self.widen_attn = Widen(cpu_math, direct_rows) if cpu_math != kv_dtype else None
        self.widen_ffn = (Widen(weights.math_dtype, direct_rows) if not dev.accelerator
                          and weights.math_dtype != weights.dtype else None)
        self.dense = [self._device_dense(lw) for lw in weights.layers]
        self.globals = {n: dev.to_device(t) for n, t in weights.globals.items()}
        self.lm_head = self.globals.get("lm_head", self.globals["embed"])
        self._unpinned = 0  # host bytes for GPU copies that could not be page-locked
        self.host_w = [lw.tensors for lw in weights.layers]  # CPU attention reads sinks, conv and decay weights here
        self._host_kinds = list({_kind(st): st for st in cache.layers if st is not None}.values())
        self._place_experts()
        self._layer0_half: int | None = None  # half holding layer 0's experts for the next step
        self.layer0_loads = 0  # synchronous loads of layer 0 before a step (the first step's, ideally only)
        self._base = 0  # half of layer 0 in the current step
        self._graphs: dict[tuple, tuple[list, set]] = {}
        self._buffers(n_mb)
        self.bytes = {"h2d": 0, "d2h": 0}
        self._step: list[_MB] | None = None
        self._scratch = ExpertScratch()  # the decode FFN's gather/scatter buffers (FFN tasks run one at a time)
        self._pre: list[_PrefillMB] | None = None
        self.last_tasks: list = []  # the last step's task graph (with the executor's `times`: its timeline)
        self.graphs = None  # core.runtime.graphs.Graphs: decode segments captured and replayed (the engine's choice)
        self._one: dict = {}  # requests a step -> its bound calls (one_stream), made at the first; False where none
        self._logits_done = dev.event() if dev.accelerator else None
        # functions, not bound methods: a cycle would outlive the run, device buffers and all (frozen_heap)
        self._fns = dict(_TASK_FNS)

    # ---- memory -------------------------------------------------------------------------------------
    def _device_dense(self, lw) -> dict:
        """A layer's non-expert weights on the device (on a GPU: an fp32 router stays fp32; MLA's q_a, kv_a joined)."""
        w = lw.dense()
        if self.dev.accelerator:
            if self.spec.router_fp32 and "router" in w:
                w = {**w, "router": w["router"].float()}
            w = mla.join_down(w)
        return {n: self.dev.to_device(t) for n, t in w.items()}

    def _place_experts(self) -> None:
        """Resident experts on the device; the streaming buffer's halves and page copies, by each layer's layout."""
        dev, E, w, spec = self.dev, self.spec.num_experts, self.w, self.spec
        self.ebuf, self.resident_parts = None, []
        scratch: dict = {}  # quantized experts: one expert's expansion, shared by every layer
        for i, (lw, r) in enumerate(zip(w.layers, self.resident)):
            if r == 0 or not spec.is_moe(i):
                self.resident_parts.append([])
            elif r == E and (self.ffn_on == "cpu" or not dev.accelerator):
                # the host's own tensors, "resident" (plain, packed for its kernels, or quantized)
                self.resident_parts.append([lw.expert_set()])
            else:
                slab = ExpertSlab(lw.layout, r)
                buf = dev.empty(slab.numel, lw.flat.dtype)
                for dst, src in slab.pieces(buf, lw.flat, 0, r, 1)[0]:
                    dev.copy(dst, src, non_blocking=False)
                self.resident_parts.append([slab.views(buf, r, w.dtype, scratch)])
        if not self.streamed:
            return
        slabs = [ExpertSlab(lw.layout, E - r) if r < E else None for lw, r in zip(w.layers, self.resident)]
        size = max(sl.numel for sl in slabs if sl is not None)  # the layer that streams most
        storage = next(lw.flat.dtype for lw, sl in zip(w.layers, slabs) if sl is not None)
        self.ebuf = [dev.empty(size, storage) for _ in range(2)]
        # per half, per layer: views of its streamed experts, and the page copies that fill them
        self.stream_views = [[sl.views(b, sl.count, w.dtype, scratch) if sl else None for sl in slabs]
                             for b in self.ebuf]
        self.page_copies = [[sl.pieces(b, lw.flat, E - sl.count, E, self.pages) if sl else None
                             for lw, sl in zip(w.layers, slabs)] for b in self.ebuf]
        if dev.accelerator:  # page-lock what streams, at its exact size, once per loaded model
            for i in w.pin_for_streaming(dev, self.resident, self.warn):
                lw = w.layers[i]
                self._unpinned += ExpertSlab(lw.layout, E - self.resident[i]).numel * lw.flat.element_size()

    def _warn_unpinned(self) -> None:
        limit = self.dev.pin_limit_bytes
        why = (f"this system lets a process page-lock {limit / 1e9:.1f} GB and {self.dev.pinned_bytes / 1e9:.1f} GB "
               "already are" if limit is not None and self.dev.pinned_bytes + self._unpinned > limit
               else "the operating system refused")
        self.warn(WarningEvent(f"could not page-lock {self._unpinned / 1e6:,.0f} MB of host memory for GPU copies "
                               f"({why}); those copies go through pageable memory and will be slower — a smaller "
                               "batch or more resident experts need less"))

    def _buffers(self, n_mb: int) -> None:
        """The host's staging in one arena, pinned once at its exact size; then the device's buffers."""
        s, dt, mu, dev = self.spec, self.w.dtype, self.mu, self.dev
        d1, d2 = mixer.max_widths(s)  # the widest layer's payloads
        want: list[tuple[str, tuple, torch.dtype]] = []
        cpu_attn = self.attention_on == "cpu" and self.ffn_on == "gpu"
        if cpu_attn:
            want += [(f"qkv_h{j}", (mu * d1,), dt) for j in range(n_mb)]
            want += [(f"o_h{j}", (mu * d2,), dt) for j in range(n_mb)]
        want += [("logits_dec", (self.cache.slots, s.vocab_size), torch.float32),
                 ("logits_pre", (self.cache.slots, s.vocab_size), torch.float32)]
        ring = self.attention_on == "gpu" and self.kv_gpu_layers < s.num_layers
        if ring:
            # every layer's kind, as the planner counts them (zero-row stores: shapes, no memory)
            self._kinds = {_kind(st): st for st in (layer_store(s, i, 0, self.cache.max_tokens, dt)
                                                     for i in range(s.num_layers))}
            # a ring slot: one micro-batch's state of any layer; the out buffer: one micro-batch's new entries
            ring_bytes = max(_offsets(st.shapes(mu, self.cache.max_tokens))[1] for st in self._kinds.values())
            want += [(f"state_in{r}", (ring_bytes,), torch.uint8) for r in range(2)]
            want += [("state_out", (max(_offsets(st.new_shapes(mu))[1] for st in self._kinds.values()),), torch.uint8)]
        arena, self.host = _arena(want)
        if dev.accelerator:
            if dev.pin(arena):
                weakref.finalize(self, dev.unpin, arena)  # unpinned when this runner is gone
            else:
                self._unpinned += arena.numel()
        if self._unpinned:
            self._warn_unpinned()
        self.qkv_h = [self.host[f"qkv_h{j}"] for j in range(n_mb)] if cpu_attn else []
        self.o_h = [self.host[f"o_h{j}"] for j in range(n_mb)] if cpu_attn else []
        self.qkv_d = [dev.empty((mu * d1,), dt) for _ in range(n_mb)] if cpu_attn else []
        self.o_d = [dev.empty((mu * d2,), dt) for _ in range(n_mb)] if cpu_attn else []
        # zeros, not empty: masked positions still enter p @ v (as 0 × v), and 0 × NaN is NaN
        self.state_dev = [layer_store(s, i, self.cache.slots, self.cache.max_tokens, dt, alloc=dev.zeros)
                          for i in range(self.kv_gpu_layers)] if self.attention_on == "gpu" else []
        self.state_ring = [dev.zeros(ring_bytes, torch.uint8) for _ in range(2)] if ring else []
        if ring:
            self._stage_free = [dev.event() for _ in range(2)]  # last copy out of each state staging slot
            self._kv_out_done = dev.event()
            # per ring slot: (device, host staging) typed regions per layer kind; the new entries' staging
            self._ring_parts = [(self._typed_parts(b, False), self._typed_parts(self.host[f"state_in{r}"], False))
                                for r, b in enumerate(self.state_ring)]
            self._out_parts = self._typed_parts(self.host["state_out"], True)

    def _typed_parts(self, buf: torch.Tensor, new: bool) -> dict:
        """Per layer kind, its tensors' flat typed regions in a uint8 buffer, carved once."""
        mu, T = self.mu, self.cache.max_tokens
        return {key: [t.view(-1) for t in _carve(buf, st.new_shapes(mu) if new else st.shapes(mu, T))]
                for key, st in self._kinds.items()}

    # ---- graphs ---------------------------------------------------------------------------------
    def _graph(self, kind: str, n: int):
        key = (kind, n)
        if key not in self._graphs:
            L = self.spec.num_layers
            g = self.expert_group if n % self.expert_group == 0 else 1
            if kind == "decode":
                tasks = sched.decode_step(self.schedule, num_layers=L, num_micro_batches=n,
                                          pages_per_layer=self.pages, micro_batches_per_expert_batch=g,
                                          attention_on=self.attention_on, ffn_on=self.ffn_on, streamed=self.streamed)
            else:
                tasks = sched.prefill(num_layers=L, num_micro_batches=n, pages_per_layer=self.pages,
                                      ffn_on=self.ffn_on, streamed=self.streamed)
            first_use = min((t.id for t in tasks if t.layer == 0 and t.kind in ("pre_attn", "prefill", "kv_load")),
                            default=0)
            # layer 0's pages listed before its first use are this step's; after, the next step's prefetch
            current = {t.id for t in tasks if t.kind == "weight_page" and t.layer == 0 and t.id < first_use}
            self._graphs[key] = (tasks, current)
        return self._graphs[key]

    def _half(self, layer: int) -> int:
        return (self._base + layer) % 2

    def _expert_parts(self, layer: int) -> list[dict]:
        parts = list(self.resident_parts[layer])
        if self.streamed and self.resident[layer] < self.spec.num_experts:
            parts.append(self.stream_views[self._half(layer)][layer])
        return parts

    # ---- steps ----------------------------------------------------------------------------------
    def decode(self, tokens, slots, positions):
        """One token for every active request (per-micro-batch lists): (logits [B, V] until the next decode, busy)."""
        if len(tokens) == 1 and (one := self._one_stream(len(tokens[0]))) is not None:
            return one.step(self, tokens[0], slots[0], positions[0])
        on_device, ring = bool(self.state_dev), bool(self.state_ring)
        self._step = [_MB(t, s, p, self.dev, on_device, ring) for t, s, p in zip(tokens, slots, positions)]
        self._ring_views = {}  # (layer, micro-batch) -> the device view its kv_load filled, for its attention
        for mb in self._step:  # each store kind's lengths, padding mask and reading, once per step, outside the tasks
            for st in self._host_kinds:
                mb.rows.kept(st)
                if st.kind in ("kv", "window"):
                    mb.rows.plan(st, self.widen_attn is not None and st.k.dtype != self.widen_attn.math)
        with self.dev.compute():
            for mb in self._step:
                mb.x = F.embedding(mb.tokens_d, self.globals["embed"])
                for rows in (mb.rows_d, mb.rows_ring):
                    for st in self._kinds.values() if rows is not None and self.state_ring else ():
                        rows.kept(st)
        tasks, self._current_pages = self._graph("decode", len(self._step))
        self.rope.keep = len(self._step)  # each micro-batch's RoPE rows once a step, in every layer
        busy, logits = self._run_step(tasks, lambda: [mb.x for mb in self._step], "logits_dec")
        self._step = None
        return logits, busy

    def _one_stream(self, M: int) -> one_stream.OneStream | None:
        """A step of M requests as bound calls (one_stream), made where they apply and remade for new threads."""
        one = self._one.get(M)
        if one is None or (one and one.threads != torch.get_num_threads()):
            one = self._one[M] = one_stream.OneStream(self, M) if not one_stream.why_not(self, M) else False
        return one or None

    def _run_step(self, tasks, finals, buffer: str):
        """(busy, logits of `finals()`): behind the step's work where the executor takes a tail, else after it."""
        self._start_step()
        if getattr(self.ex, "takes_tail", False):
            rows = []
            busy = self.ex.run(tasks, self._run, then=lambda: rows.append(self._logits_enqueue(finals(), buffer)))
            out = busy, self.host[buffer][:rows[0]]
        else:
            busy = self.ex.run(tasks, self._run)
            out = busy, self._logits(finals(), buffer)
        self.last_tasks = tasks
        if self.streamed:  # where the graph prefetched the next step's layer 0 (a one-layer prefill keeps it in place)
            L, prefill = self.spec.num_layers, buffer == "logits_pre"
            prefetched = any(t.kind == "weight_page" and t.layer == 0 and t.id not in self._current_pages
                             for t in tasks)
            self._layer0_half = self._base if prefill and L == 1 else (self._base + L) % 2 if prefetched else None
        return out

    def move_rows(self, moves) -> None:
        """[(from slot, to slot, cached tokens)]: move requests' state between slots in every store."""
        with self.dev.compute():
            for store in (*self.cache.layers, *self.state_dev):
                if store is not None:
                    for src, dst, tokens in moves:
                        store.move(src, dst, tokens)

    def prefill(self, prompts, slots, micro_batches):
        """Whole prompts (grouped into `micro_batches` lists of indices). Returns (last-token logits, busy)."""
        self._pre = [_PrefillMB([prompts[i] for i in idx], [slots[i] for i in idx], self.dev, bool(self.rope.switch))
                     for idx in micro_batches]
        with self.dev.compute():
            for mb in self._pre:
                mb.x = F.embedding(mb.tokens_d, self.globals["embed"])
        tasks, self._current_pages = self._graph("prefill", len(self._pre))
        self.rope.keep = 1  # a prefill's tables are large and its gathers few beside its tokens
        busy, staged = self._run_step(tasks, self._prefill_finals, "logits_pre")
        order = torch.tensor([i for idx in micro_batches for i in idx])
        out = torch.empty_like(staged)
        out[order] = staged
        self._pre = None
        return out, busy

    def _prefill_finals(self) -> list[torch.Tensor]:
        with self.dev.compute():
            return [mb.x.index_select(0, mb.ends_d) for mb in self._pre]

    def _logits(self, xs: list[torch.Tensor], buffer: str) -> torch.Tensor:
        """fp32 logits of the final hidden states, micro-batch by micro-batch into one reused host buffer."""
        rows = self._logits_enqueue(xs, buffer)
        if self.dev.accelerator:  # bounded: a hung kernel is DeviceStalled, not a hang
            self._logits_done.record(self.dev.current_stream())
            self.dev.host_wait(self._logits_done, what="the step's logits (its last kernels and copies)")
        return self.host[buffer][:rows]

    def _logits_enqueue(self, xs: list[torch.Tensor], buffer: str) -> int:
        """The logits of `xs` into host `buffer` (a device's enqueued, with their copies); the rows they fill."""
        g, out, row = self.globals, self.host[buffer], 0
        with self.dev.compute():
            for x in xs:
                n = x.shape[0]
                head = (self.spec, g["norm"], self.lm_head, x, g.get("norm_b"), g.get("lm_head_b"))
                if self.dev.accelerator:
                    self.dev.copy(out[row:row + n], final_logits(*head))
                else:  # the CPU is the device: straight into the reused host buffer
                    final_logits(*head, out=out[row:row + n])
                row += n
        return row

    def _start_step(self) -> None:
        """Layer 0's streamed experts: half 0 where this graph loads them, else the last step's prefetch, else now."""
        if not self.streamed:
            return
        self._base = 0 if self._current_pages or self._layer0_half is None else self._layer0_half
        if not self._current_pages and self._layer0_half is None:
            self.layer0_loads += 1
            if self.resident[0] < self.spec.num_experts:
                for page in self.page_copies[0][0]:
                    for dst, src in page:
                        self._send(dst, src, "h2d")

    def _run(self, task) -> None:
        self._fns[task.kind](self, task)

    # ---- tasks ----------------------------------------------------------------------------------
    def _pre_attn(self, t):
        mb, i, j = self._step[t.micro_batch], t.layer, t.micro_batch

        def segment(x, positions, lengths):  # what a CUDA graph captures (core.runtime.graphs)
            # D1 sends one contiguous block: the mixer writes the payload into it where it can
            buf = self._payload(self.qkv_d, j, mb.B, mixer.d1_width(self.spec, i)) if self.qkv_d else None
            payload, keep = decoder.pre_attn(self.spec, i, self.dense[i], x, positions, self.rope, lengths,
                                             self._full_norm, out=buf)
            if buf is None:
                return payload, keep
            if payload.data_ptr() != buf.data_ptr():
                buf.copy_(payload)
            return None, keep

        inputs = (mb.x, mb.positions_d, mb.lengths_d)
        mb.payload, mb.keep = (segment(*inputs) if self.graphs is None else
                               self.graphs.run("pre_attn", i, j, segment, inputs))

    @staticmethod
    def _payload(bufs: list[torch.Tensor], j: int, B: int, width: int) -> torch.Tensor:
        """Micro-batch j's [B, width] block at the start of its flat buffer (contiguous, whatever the width)."""
        return bufs[j][:B * width].view(B, width)

    # D1 and D2 land in fixed buffers; only the event waits order reader after copy (tests remove one)
    def _d1(self, t):
        self._send_payload(t, mixer.d1_width(self.spec, t.layer), self.qkv_h, self.qkv_d, "d2h")

    def _cpu_attn(self, t):
        mb, i = self._step[t.micro_batch], t.layer
        payload = (self._payload(self.qkv_h, t.micro_batch, mb.B, mixer.d1_width(self.spec, i)) if self.qkv_h
                   else mb.payload)
        o = decoder.attend(self.spec, i, self.host_w[i], payload, self.cache.layers[i], mb.rows, self.widen_attn)
        if self.ffn_on == "cpu":
            mb.o = o
        else:
            self._payload(self.o_h, t.micro_batch, mb.B, o.shape[1]).copy_(o)

    def _d2(self, t):
        self._send_payload(t, mixer.d2_width(self.spec, t.layer), self.o_d, self.o_h, "h2d")

    def _send_payload(self, t, width: int, dst: list, src: list, link: str) -> None:
        B, j = self._step[t.micro_batch].B, t.micro_batch
        self._send(self._payload(dst, j, B, width), self._payload(src, j, B, width), link)

    def _send(self, dst: torch.Tensor, src: torch.Tensor, link: str) -> None:
        """One copy between host and device, its bytes counted on `link` ("h2d" | "d2h")."""
        self.dev.copy(dst, src)
        self.bytes[link] += dst.numel() * dst.element_size()

    def _post_attn(self, t):
        mb, i = self._step[t.micro_batch], t.layer
        o = self._payload(self.o_d, t.micro_batch, mb.B, mixer.d2_width(self.spec, i)) if self.o_d else mb.o

        def segment(x, o, keep):  # what a CUDA graph captures (core.runtime.graphs): FfnInput's tensors
            # the shared expert's output joins the routed experts' before the residual add, as the reference does
            f = decoder.post_attn(self.spec, i, self.dense[i], x, o, keep, self._attention_out,
                                  fused_route=self.dev.accelerator)
            return f.x, f.h, f.weights, f.idx, f.dense

        inputs, j = (mb.x, o, mb.keep), t.micro_batch
        out = segment(*inputs) if self.graphs is None else self.graphs.run("post_attn", i, j, segment, inputs)
        mb.ffn, mb.keep = decoder.FfnInput(*out), None

    def _ffn(self, t):
        g = self._group_size(t)
        mbs = self._step[t.micro_batch:t.micro_batch + g]
        if not self.spec.is_moe(t.layer):  # a dense layer: its MLP ran with the post-attention work
            outs = [None] * len(mbs)
        elif g == 1:
            f, parts = mbs[0].ffn, self._expert_parts(t.layer)

            def segment(h, rw, ridx):  # what a CUDA graph captures (core.runtime.graphs)
                return (self._experts(parts, h, rw, ridx, self._scratch),)

            # streamed experts sit in the half this step gave the layer: a graph per half
            at = (t.layer, self._half(t.layer) if self.streamed else 0)
            inputs, j = (f.h, f.weights, f.idx), t.micro_batch
            outs = segment(*inputs) if self.graphs is None else self.graphs.run("ffn", at, j, segment, inputs)
        else:  # the expert batch's inputs side by side: on the host in reused buffers (the scratch is host memory;
            # the device's caching allocator reuses its own)
            fs, sc, rows = [m.ffn for m in mbs], None if self.dev.accelerator else self._scratch, sum(m.B for m in mbs)
            h, rw, ridx = (torch.cat([getattr(f, n) for f in fs], out=None if sc is None else
                                     sc.get("cat_" + n, (rows, getattr(fs[0], n).shape[1]), getattr(fs[0], n).dtype))
                           for n in ("h", "weights", "idx"))
            outs = self._experts(self._expert_parts(t.layer), h, rw, ridx, sc).split([m.B for m in mbs])
        ys = [decoder.ffn_output(m.ffn, y) for m, y in zip(mbs, outs)]
        if self._ffn_out is not None:  # each rank holds a slice of every expert: sum the partial outputs, once
            ys = self._ffn_out(torch.cat(ys)).split([m.B for m in mbs]) if g > 1 else [self._ffn_out(ys[0])]
        for m, y in zip(mbs, ys):
            m.x = m.ffn.x.add_(y)  # post_attn's residual stream is this task's own
            m.ffn = None

    def _experts(self, parts: list[dict], h, rw, ridx, scratch=None):
        if len(parts) == 1 and not self.dev.accelerator:
            p = parts[0]
            return experts(h, p.get("w13"), p.get("w2"), rw, ridx, packed=p.get("packed"),
                           b13=p.get("b13"), b2=p.get("b2"), act=self.act, quant=p.get("quant"), widen=self.widen_ffn,
                           scratch=scratch)
        return device_experts(h, parts, rw, ridx, grouped_mm=self._grouped_mm(h), act=self.act)

    def _grouped_mm(self, h) -> bool:  # whether grouped_mm has a kernel for h's dtype on this device
        if not HAS_GROUPED_MM:
            return False
        if self.dev.kind == "cuda":
            return cuda_grouped_mm_works(self.dev.index, h.dtype)
        if self.dev.kind == "emulated":  # as CUDA's kernels: bf16 on SM80+
            return h.dtype == torch.bfloat16 and self.dev.capability >= (8, 0)
        return h.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def _group_size(self, t) -> int:
        return self.expert_group if len(self._step) % self.expert_group == 0 else 1

    def _weight_page(self, t):
        layer = t.layer
        if self.resident[layer] >= self.spec.num_experts:
            return
        half = self._half(layer) if (layer != 0 or t.id in self._current_pages) else (
            (self._base + self.spec.num_layers) % 2)
        for dst, src in self.page_copies[half][layer][t.page]:
            self._send(dst, src, "h2d")

    def _kv_load(self, t):
        mb, i, store = self._step[t.micro_batch], t.layer, self.cache.layers[t.layer]
        if i < self.kv_gpu_layers:
            return
        slot, shapes = (i * len(self._step) + t.micro_batch) % 2, store.shapes(mb.B, mb.rows.span[1])
        dev_view, host_view = (store.over([p[:math.prod(s)].view(s) for p, (s, _) in zip(parts[_kind(store)], shapes)])
                               for parts in self._ring_parts[slot])
        self._ring_views[(i, t.micro_batch)] = dev_view
        self.dev.host_wait(self._stage_free[slot])  # the copy out of this staging slot two loads ago
        # gather into pinned staging, the new token's place included (nothing uninitialised: 0 × NaN is NaN) ...
        load_rows(store, host_view, mb.rows, mb.rows.span[1])
        for d, h in zip(dev_view.tensors, host_view.tensors):  # ... then one contiguous asynchronous copy each
            self._send(d, h, "h2d")
        self._stage_free[slot].record(self.dev.current_stream())

    def _gpu_attn(self, t):
        mb, i = self._step[t.micro_batch], t.layer
        if i < self.kv_gpu_layers:
            mb.o = decoder.attend(self.spec, i, self.dense[i], mb.payload, self.state_dev[i], mb.rows_d)
            return
        store = self._ring_views.pop((i, t.micro_batch))
        mb.o = decoder.attend(self.spec, i, self.dense[i], mb.payload, store, mb.rows_ring)
        # the store runs on another queue, possibly after the position two on reused this ring slot
        mb.new_state[i] = store.new_entries(mb.rows_ring)

    def _kv_store(self, t):
        if self._pre is not None:  # prefill: the micro-batch's whole prompts
            return self._store_prompts(t)
        if t.layer < self.kv_gpu_layers:
            return  # attention wrote the device store
        mb, store = self._step[t.micro_batch], self.cache.layers[t.layer]
        parts = mb.new_state.pop(t.layer)
        staged = [h[:p.numel()].view(p.shape) for h, p in zip(self._out_parts[_kind(store)], parts)]
        for h, p in zip(staged, parts):
            self._send(h, p, "d2h")
        self._kv_out_done.record(self.dev.current_stream())
        self.dev.host_wait(self._kv_out_done)  # the CPU store's write needs the bytes on the host
        store.put_new(mb.rows, staged)

    def _store_prompts(self, t):
        mb, i = self._pre[t.micro_batch], t.layer
        on_device = i < self.kv_gpu_layers
        store = self.state_dev[i] if on_device else self.cache.layers[i]
        for slot, parts in zip(mb.slots, mb.kv.pop(i)):
            if not on_device:
                parts = [self.dev.to_host(p) for p in parts]  # prefill only: a blocking copy is fine here
                self.bytes["d2h"] += sum(p.numel() * p.element_size() for p in parts)
            store.write_prompt(slot, *parts)

    def _prefill(self, t):
        mb, i = self._pre[t.micro_batch], t.layer
        parts = self._expert_parts(i) if self.spec.is_moe(i) else None
        w = self.dense[i]
        mb.x, states = decoder.prefill_mix(self.spec, i, w, mb.x, mb.positions_d, self.rope, mb.lens, mb.calls_d,
                                           self._full_norm, self._attention_out, self._prefill_chunk)
        # the FFN's intermediates are the peak: the layer holds nothing else then (the planner counts on it)
        mb.x = decoder.prefill_ffn(self.spec, i, w, mb.x, lambda h, rw, idx: self._experts(parts, h, rw, idx),
                                   self._ffn_out, self._prefill_chunk)
        mb.kv[i] = states
        if self.ffn_on == "cpu":  # the CPU-only chain has no kv_store task: write the cache here
            self._store_prompts(t)


_TASK_FNS = {kind: getattr(PipelineRunner, "_" + kind) for kind in sched.RESOURCE_OF}  # task kind -> its step


def _kind(store) -> tuple[str, int]:
    return store.kind, store.window


def _offsets(shapes) -> tuple[list[int], int]:
    """Byte offsets of tensors of these (shape, dtype) laid back to back, each start aligned to _ALIGN; the end."""
    offs, end = [], 0
    for shape, dtype in shapes:
        end = -(-end // _ALIGN) * _ALIGN
        offs.append(end)
        end += math.prod(shape) * dtype.itemsize
    return offs, end


def _carve(buf: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Contiguous tensors of these (shape, dtype) at the start of a uint8 buffer, at `_offsets`."""
    return [buf[o:o + math.prod(s) * d.itemsize].view(d).view(s) for o, (s, d) in zip(_offsets(shapes)[0], shapes)]


def _arena(want: list[tuple[str, tuple, torch.dtype]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Host buffers carved from one allocation, so that they are page-locked once, at their exact size."""
    shapes = [(shape, dtype) for _, shape, dtype in want]
    # whole pages of its own: page-locking rounds out to pages, and a neighbour's pages locked with it could
    # be freed back to the OS while still registered (the next copy or unregistration then fails)
    arena = page_aligned(max(_offsets(shapes)[1], 1), torch.uint8)
    return arena, dict(zip((name for name, _, _ in want), _carve(arena, shapes)))
