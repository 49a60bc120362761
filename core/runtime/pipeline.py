"""The CGOPipe runtime: a decode step (or a prefill) as a task graph, run by an executor.

`core.runtime.schedule` says which tasks run, on which resource, after which others; this module says what
each task does and owns the buffers they share. The same code runs on CUDA (dense work on the GPU,
attention on the CPU next to the KV cache, weights streamed over PCIe) and on the CPU, where the
"device" is the CPU itself and every copy between "device" and "host" buffers is still a real copy,
so the threaded executor proves the graph's dependencies: a missing one gives wrong tokens.

Buffers and why they are safe to reuse (the graph orders every reuse after the last reader):
- per micro-batch j: `qkv_h[j]` (D1 target, read by CPU attention), `o_h[j]` (attention output),
  `o_d[j]` (D2 target, read by post-attention); the next writer of each is downstream of its reader.
- the 2×layer expert buffer: halves alternate layer by layer (across steps too); a page for layer
  i+1 overwrites layer i−1's half only after that layer's last FFN (`schedule._buffer_free`).
- layers below `resident_layers` keep their experts on the device and are never transferred.
Legend: B = requests in a micro-batch, D = hidden, T = cached tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.runtime import schedule as sched
from core.model.attention import decode_attention, padding_mask, prefill_attention
from core.model.cpu.kernels import Widen
from core.model.kvcache import KVCache
from core.model.layers import Rope, final_logits, norm
from core.model.layers import pre_attn as dense_pre_attn
from core.model.moe import experts, route, shared_expert
from core.model.spec import ModelSpec
from core.model.weights import LayerLayout, ModelWeights


class _MB:
    """State of one micro-batch through a step."""

    def __init__(self, tokens, slots, positions, device):
        self.B = len(slots)
        self.slots = torch.tensor(slots)
        self.positions = torch.tensor(positions)
        self.lengths = self.positions + 1
        self.span = (min(positions) + 1, max(positions) + 1)  # on the host: attention needs no device sync
        ragged = self.span[0] < self.span[1]
        self.pad = padding_mask(self.lengths, self.span[1]) if ragged else None  # same for every layer
        self.pad_d = self.pad.to(device) if ragged else None
        self.tokens_d = torch.tensor(tokens, device=device)
        self.positions_d = self.positions.to(device)
        self.lengths_d = self.lengths.to(device)
        lo = slots[0]
        self.rows = slice(lo, lo + len(slots)) if list(slots) == list(range(lo, lo + len(slots))) else self.slots
        self.x = None  # device hidden [B, D]
        self.q = self.k = self.v = None  # device, from pre-attention
        self.hq = self.hk = self.hv = None  # host copies (D1)
        self.h = self.rw = self.ridx = self.shared = None  # post-attention results, for the FFN
        self.new_kv: dict[int, tuple] = {}  # layer -> this token's (k, v) awaiting the KV store (S4)

    def cache_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.rows] if isinstance(self.rows, slice) else t.index_select(0, self.rows)


class _PrefillMB:
    """A prefill micro-batch: whole prompts packed without padding."""

    def __init__(self, prompts, slots, device):
        self.lens = [len(p) for p in prompts]
        self.slots = list(slots)
        self.tokens_d = torch.tensor([t for p in prompts for t in p], device=device)
        self.positions_d = torch.cat([torch.arange(n) for n in self.lens]).to(device)
        self.x = None
        self.kv = []  # per layer: (k, v) device tensors [T, Hkv, hd] for the KV store


class PipelineRunner:
    """Runs decode steps and prefills of one engine over a fixed policy-shaped task graph."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, cache: KVCache, *, executor, schedule: str = "cgopipe",
                 attention_on: str = "cpu", ffn_on: str = "gpu", micro_batch_size: int = 1, expert_group: int = 1,
                 resident_layers: int | None = None, device: str | torch.device = "cpu", grouped: bool | None = None,
                 tp=None, cpu_math: torch.dtype | None = None, direct_rows: int = 2):
        if schedule not in sched.SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}")
        self.spec, self.w, self.cache, self.ex = spec, weights, cache, executor
        self.schedule, self.attention_on, self.ffn_on = schedule, attention_on, ffn_on
        self.device = torch.device(device)
        self.grouped = grouped
        self.expert_group = expert_group
        self.tp = tp  # tensor parallel: core.runtime.distributed.tensor_parallel.ShardOps, or None
        self._full_norm = tp.full_norm if tp is not None else None
        self._attention_out = tp.attention_out if tp is not None else _noop
        L = spec.num_layers
        self.pages = max(1, len(weights.layers[0].pages))  # packed CPU experts have no pages
        self.resident = L if resident_layers is None else max(0, min(L, resident_layers))
        self.streamed = self.resident < L and ffn_on == "gpu"
        self.layout: LayerLayout = weights.layers[0].layout
        self.scale = spec.head_dim ** -0.5
        on_host = self.device.type == "cpu"
        self.rope = Rope(spec, cache.max_tokens, weights.math_dtype, device=self.device)
        # the CPU computes in `cpu_math` where it is slow in the storage dtype: attention widens the KV
        # it reads (any schedule), the CPU-only FFN widens expert tiles; one Widen per thread using it
        cpu_math = cpu_math or weights.math_dtype
        kv_dtype = next((t.dtype for t in cache.k if t is not None), weights.dtype)
        self.widen_attn = Widen(cpu_math, direct_rows) if cpu_math != kv_dtype else None
        self.widen_ffn = (Widen(weights.math_dtype, direct_rows) if on_host and weights.math_dtype != weights.dtype
                          else None)
        # dense (non-expert) weights and the globals live on the device for the whole run
        self.dense = [{n: self._to_dev(t) for n, t in lw.dense().items()}
                      for lw in weights.layers]
        self.globals = {n: self._to_dev(t) for n, t in weights.globals.items()}
        self.lm_head = self.globals.get("lm_head", self.globals["embed"])
        self.resident_experts = [lw.expert_set(self._to_dev) if (i < self.resident or ffn_on == "cpu") else None
                                 for i, lw in enumerate(weights.layers)]
        self.ebuf = None
        # layers may differ in layout (a GGUF's expert types vary by layer): each layer indexes its own
        self.layouts = list(dict.fromkeys(lw.layout for lw in weights.layers))
        self._layout_of = [self.layouts.index(lw.layout) for lw in weights.layers]
        if self.streamed:
            # quantized layers stream their bytes as they are; the device expands them (QuantExperts)
            size = max(layout.expert_numel for layout in self.layouts)
            self.ebuf = [torch.empty(size, dtype=self.layout.storage_dtype or weights.dtype, device=self.device)
                         for _ in range(2)]
            scratch = {}  # one expert's expansion, shared by both halves and every layout
            self.ebuf_views = [[lo.expert_views(b[:lo.expert_numel], weights.dtype, scratch) for lo in self.layouts]
                               for b in self.ebuf]
            self.page_bounds = [lo.page_bounds(self.pages) for lo in self.layouts]
        self._layer0_half: int | None = None  # half holding layer 0's experts for the next step
        self._base = 0  # half of layer 0 in the current step
        self._graphs: dict[tuple, tuple[list, set]] = {}
        pin = self.device.type == "cuda"
        mu, n_mb = micro_batch_size, -(-cache.slots // micro_batch_size)
        qkv = spec.q_size + 2 * spec.kv_size
        self.qkv_h = [torch.empty((mu, qkv), dtype=weights.dtype, pin_memory=pin) for _ in range(n_mb)]
        self.o_h = [torch.empty((mu, spec.q_size), dtype=weights.dtype, pin_memory=pin) for _ in range(n_mb)]
        self.o_d = [torch.empty((mu, spec.q_size), dtype=weights.dtype, device=self.device) for _ in range(n_mb)]
        self.kv_d = {}  # (layer parity, micro-batch) -> (k, v) device buffers, attention on the GPU only
        self.bytes = {"h2d": 0, "d2h": 0}
        self._step: list[_MB] | None = None
        self._pre: list[_PrefillMB] | None = None
        self.last_tasks: list = []  # the last step's task graph
        self.fault = None  # tests: a callable run before every task, to inject failures
        self._copy_kw = {"non_blocking": not on_host}
        self._fns = {
            "pre_attn": self._pre_attn, "d1": self._d1, "cpu_attn": self._cpu_attn, "d2": self._d2,
            "post_attn": self._post_attn, "ffn": self._ffn, "weight_page": self._weight_page,
            "gpu_attn": self._gpu_attn, "kv_load": self._kv_load, "kv_store": self._kv_store,
            "prefill": self._prefill,
        }

    def _to_dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

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
            # pages of layer 0 listed before layer 0's first use are for this step (S3, prefill);
            # listed after, they prefetch the next step's layer 0 (CGOPipe, S4)
            current = {t.id for t in tasks if t.kind == "weight_page" and t.layer == 0 and t.id < first_use}
            self._graphs[key] = (tasks, current)
        return self._graphs[key]

    def _half(self, layer: int) -> int:
        return (self._base + layer) % 2

    def _expert_weights(self, layer: int) -> dict:
        if self.resident_experts[layer] is not None:
            return self.resident_experts[layer]
        return self.ebuf_views[self._half(layer)][self._layout_of[layer]]

    # ---- steps ----------------------------------------------------------------------------------
    def decode(self, tokens, slots, positions):
        """One token for every active request; per-micro-batch lists. Returns (logits [B, V] on the CPU, busy)."""
        self._step = [_MB(t, s, p, self.device) for t, s, p in zip(tokens, slots, positions)]
        tasks, self._current_pages = self._graph("decode", len(self._step))
        if self.attention_on == "gpu":
            for j, mb in enumerate(self._step):
                for parity in (0, 1):
                    self._kv_buffers(parity, j, mb.B)
        self._start_step(needs_layer0=not self._current_pages)
        for mb in self._step:
            mb.x = F.embedding(mb.tokens_d, self.globals["embed"])
        busy = self.ex.run(tasks, self._run)
        self.last_tasks = tasks  # with the executor's `times`: the step's timeline (telemetry)
        self._end_step(prefetched_layer0=any(t.kind == "weight_page" and t.layer == 0 and t.id not in
                                             self._current_pages for t in tasks))
        x = torch.cat([mb.x for mb in self._step])
        logits = final_logits(self.spec, self.globals["norm"], self.lm_head, x).cpu()
        self._step = None
        return logits, busy

    def prefill(self, prompts, slots, micro_batches):
        """Whole prompts (grouped into `micro_batches` lists of indices). Returns (last-token logits, busy)."""
        self._pre = [_PrefillMB([prompts[i] for i in idx], [slots[i] for i in idx], self.device) for idx in micro_batches]
        tasks, self._current_pages = self._graph("prefill", len(self._pre))
        self._start_step(needs_layer0=not self._current_pages)
        for mb in self._pre:
            mb.x = F.embedding(mb.tokens_d, self.globals["embed"])
        busy = self.ex.run(tasks, self._run)
        self.last_tasks = tasks
        self._layer0_half = None  # prefill leaves the last layers in the buffer
        last = []
        for mb in self._pre:
            ends = torch.tensor(mb.lens, device=self.device).cumsum(0) - 1
            last.append(mb.x.index_select(0, ends))
        logits = final_logits(self.spec, self.globals["norm"], self.lm_head, torch.cat(last)).cpu()
        order = [i for idx in micro_batches for i in idx]
        out = torch.empty_like(logits)
        out[torch.tensor(order)] = logits
        self._pre = None
        return out, busy

    def _start_step(self, needs_layer0: bool) -> None:
        if not self.streamed:
            return
        if not needs_layer0:  # this graph loads layer 0 itself
            self._base = 0
            return
        if self._layer0_half is None:  # first step, or after a prefill: load layer 0 now
            self._base = 0
            if self.resident == 0:
                src = self.w.layers[0].experts
                self.ebuf[0][:src.numel()].copy_(src)
                self.bytes["h2d"] += src.numel() * src.element_size()
        else:
            self._base = self._layer0_half

    def _end_step(self, prefetched_layer0: bool) -> None:
        if self.streamed:
            self._layer0_half = (self._base + self.spec.num_layers) % 2 if prefetched_layer0 else None

    def _run(self, task) -> None:
        if self.fault is not None:
            self.fault(task)
        self._fns[task.kind](task)

    # ---- tasks ----------------------------------------------------------------------------------
    def _pre_attn(self, t):
        mb = self._step[t.micro_batch]
        mb.q, mb.k, mb.v = dense_pre_attn(self.spec, self.dense[t.layer], mb.x, mb.positions_d, self.rope,
                                          self._full_norm)

    def _d1(self, t):
        mb = self._step[t.micro_batch]
        q, kv = self.spec.q_size, self.spec.kv_size
        buf = self.qkv_h[t.micro_batch][:mb.B]
        buf[:, :q].copy_(mb.q.reshape(mb.B, -1), **self._copy_kw)
        buf[:, q:q + kv].copy_(mb.k.reshape(mb.B, -1), **self._copy_kw)
        buf[:, q + kv:].copy_(mb.v.reshape(mb.B, -1), **self._copy_kw)
        H, Hkv, hd = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        mb.hq, mb.hk, mb.hv = (buf[:, :q].view(mb.B, H, hd), buf[:, q:q + kv].view(mb.B, Hkv, hd),
                               buf[:, q + kv:].view(mb.B, Hkv, hd))
        self.bytes["d2h"] += buf.numel() * buf.element_size()

    def _cpu_attn(self, t):
        mb, i = self._step[t.micro_batch], t.layer
        q, k, v = (mb.hq, mb.hk, mb.hv) if mb.hq is not None else (mb.q, mb.k, mb.v)
        self.cache.write(i, mb.slots, mb.positions, k, v)
        o = decode_attention(q, mb.cache_rows(self.cache.k[i]), mb.cache_rows(self.cache.v[i]), mb.lengths, self.scale,
                             mb.span, mb.pad, widen=self.widen_attn)
        if self.ffn_on == "cpu":
            mb.o = o
        else:
            self.o_h[t.micro_batch][:mb.B].copy_(o)

    def _d2(self, t):
        mb = self._step[t.micro_batch]
        self.o_d[t.micro_batch][:mb.B].copy_(self.o_h[t.micro_batch][:mb.B], **self._copy_kw)
        mb.o = self.o_d[t.micro_batch][:mb.B]
        self.bytes["h2d"] += mb.o.numel() * mb.o.element_size()

    def _post_attn(self, t):
        mb, w = self._step[t.micro_batch], self.dense[t.layer]
        x = mb.x + self._attention_out(F.linear(mb.o, w["o"]))
        h = norm(self.spec, x, w["ln2"])
        mb.rw, mb.ridx = route(self.spec, h, w)
        # the shared expert's output joins the routed experts' before the residual add, as the reference does
        mb.shared = shared_expert(self.spec, w, h) if self.spec.shared_intermediate else None
        mb.x, mb.h = x, h

    def _ffn(self, t):
        g = self._group_size(t)
        mbs = self._step[t.micro_batch:t.micro_batch + g]
        ew = self._expert_weights(t.layer)
        if g == 1:
            parts = [_experts(ew, mbs[0].h, mbs[0].rw, mbs[0].ridx, self.grouped, self.widen_ffn)]
        else:
            out = _experts(ew, torch.cat([m.h for m in mbs]), torch.cat([m.rw for m in mbs]),
                           torch.cat([m.ridx for m in mbs]), self.grouped, self.widen_ffn)
            parts = out.split([m.B for m in mbs])
        parts = [y if m.shared is None else y + m.shared for m, y in zip(mbs, parts)]
        if self.tp is not None:  # each rank holds a slice of every expert: sum the partial outputs, once
            parts = self.tp.ffn_out(torch.cat(parts)).split([m.B for m in mbs]) if g > 1 else [self.tp.ffn_out(parts[0])]
        for m, y in zip(mbs, parts):
            m.x = m.x + y

    def _group_size(self, t) -> int:
        n = len(self._step)
        return self.expert_group if n % self.expert_group == 0 else 1

    def _weight_page(self, t):
        layer = t.layer
        if self.resident_experts[layer] is not None:
            return
        half = self._half(layer) if (layer != 0 or t.id in self._current_pages) else (
            (self._base + self.spec.num_layers) % 2)
        a, b = self.page_bounds[self._layout_of[layer]][t.page]
        dst = self.ebuf[half][a:b]
        dst.copy_(self.w.layers[layer].pages[t.page], **self._copy_kw)
        self.bytes["h2d"] += dst.numel() * dst.element_size()

    def _kv_buffers(self, layer: int, j: int, B: int):
        """Device KV rows of micro-batch j for layers of one parity; sized before the step's tasks run."""
        key = (layer % 2, j)
        buf = self.kv_d.get(key)
        if buf is None or buf[0].shape[0] < B:
            shape = (B, self.spec.num_kv_heads, self.cache.max_tokens, self.spec.head_dim)
            # zeros, not empty: masked positions still enter p @ v (as 0 × v), and 0 × NaN is NaN
            buf = (torch.zeros(shape, dtype=self.w.dtype, device=self.device),
                   torch.zeros(shape, dtype=self.w.dtype, device=self.device))
            self.kv_d[key] = buf
        return buf

    def _kv_load(self, t):
        mb, i = self._step[t.micro_batch], t.layer
        T = mb.span[1] - 1  # tokens already cached
        kd, vd = self.kv_d[(i % 2, t.micro_batch)]
        if T:
            kd[:mb.B, :, :T].copy_(mb.cache_rows(self.cache.k[i])[:, :, :T], **self._copy_kw)
            vd[:mb.B, :, :T].copy_(mb.cache_rows(self.cache.v[i])[:, :, :T], **self._copy_kw)
            self.bytes["h2d"] += 2 * mb.B * T * self.spec.kv_size * self.w.dtype.itemsize

    def _gpu_attn(self, t):
        mb, i = self._step[t.micro_batch], t.layer
        kd, vd = self.kv_d[(i % 2, t.micro_batch)]
        rows = torch.arange(mb.B, device=self.device)
        kd[rows, :, mb.positions_d] = mb.k
        vd[rows, :, mb.positions_d] = mb.v
        # the store runs on another queue, possibly after the next layer's pre-attention replaced mb.k
        mb.new_kv[i] = (mb.k, mb.v)
        mb.o = decode_attention(mb.q, kd[:mb.B], vd[:mb.B], mb.lengths_d, self.scale, mb.span, mb.pad_d)

    def _kv_store(self, t):
        if self._pre is not None:  # prefill: the micro-batch's whole prompts
            mb = self._pre[t.micro_batch]
            k, v = mb.kv[t.layer]
            k, v = k.to("cpu"), v.to("cpu")
            start = 0
            for n, slot in zip(mb.lens, mb.slots):
                self.cache.write_prompt(t.layer, slot, k[start:start + n], v[start:start + n])
                start += n
            mb.kv[t.layer] = None
            self.bytes["d2h"] += 2 * k.numel() * k.element_size()
            return
        mb = self._step[t.micro_batch]
        k, v = mb.new_kv.pop(t.layer)
        self.cache.write(t.layer, mb.slots, mb.positions, k.to("cpu"), v.to("cpu"))
        self.bytes["d2h"] += 2 * k.numel() * k.element_size()

    def _prefill(self, t):
        mb, i = self._pre[t.micro_batch], t.layer
        w = self.dense[i]
        q, k, v = dense_pre_attn(self.spec, w, mb.x, mb.positions_d, self.rope, self._full_norm)
        parts, start = [], 0
        for n in mb.lens:
            parts.append(prefill_attention(q[start:start + n], k[start:start + n], v[start:start + n], self.scale))
            start += n
        while len(mb.kv) <= i:
            mb.kv.append(None)
        mb.kv[i] = (k, v)
        x = mb.x + self._attention_out(F.linear(torch.cat(parts), w["o"]))
        h = norm(self.spec, x, w["ln2"])
        rw, ridx = route(self.spec, h, w)
        ew = self._expert_weights(i)
        y = _experts(ew, h, rw, ridx, self.grouped, self.widen_ffn)
        if self.spec.shared_intermediate:
            y = y + shared_expert(self.spec, w, h)
        mb.x = x + (y if self.tp is None else self.tp.ffn_out(y))
        if self.ffn_on == "cpu":  # the CPU-only chain has no kv_store task: write the cache here
            self._kv_store(t)


def _noop(t):
    return t


def _experts(ew: dict, h, rw, ridx, grouped, widen=None):
    return experts(h, ew.get("w13"), ew.get("w2"), rw, ridx, grouped=grouped, packed=ew.get("packed"),
                   quant=ew.get("quant"), widen=widen)
