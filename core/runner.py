"""Runs the model's layers for a prefill wave or a decode step over the engine's micro-batches.

`SequentialRunner` is the CPU mode: every task of the step in the schedule's order on this thread
(layer by layer, micro-batch by micro-batch), with busy time per resource measured as it goes.
Pipelined executors (threaded CPU, CUDA streams) implement the same two methods.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from core.attention import decode_attention, prefill_attention
from core.kvcache import KVCache
from core.layers import Rope, final_logits, post_attn, pre_attn
from core.spec import ModelSpec
from core.weights import ModelWeights


class MicroBatch:
    """One micro-batch's decode inputs: tokens, cache slots and positions, and its hidden state."""

    def __init__(self, tokens: list[int], slots: list[int], positions: list[int]):
        self.slots = torch.tensor(slots)
        self.positions = torch.tensor(positions)
        self.lengths = self.positions + 1
        self.tokens = torch.tensor(tokens)
        lo = slots[0]
        # consecutive slots read the cache as a view; otherwise rows are gathered
        self.rows = slice(lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else self.slots
        self.x: torch.Tensor | None = None

    def cache_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.rows] if isinstance(self.rows, slice) else t.index_select(0, self.rows)


class SequentialRunner:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, cache: KVCache, grouped: bool | None = None):
        self.spec, self.w, self.cache, self.grouped = spec, weights, cache, grouped
        self.rope = Rope(spec, cache.max_tokens, weights.dtype)
        self.scale = spec.head_dim ** -0.5

    # ---- tasks (shared with the pipelined executors) --------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.w.globals["embed"])

    def attend(self, layer: int, mb: MicroBatch, q, k, v) -> torch.Tensor:
        self.cache.write(layer, mb.slots, mb.positions, k, v)
        return decode_attention(q, mb.cache_rows(self.cache.k[layer]), mb.cache_rows(self.cache.v[layer]),
                                mb.lengths, self.scale)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return final_logits(self.spec, self.w.globals["norm"], self.w.lm_head, x)

    # ---- steps ----------------------------------------------------------------------------------
    def decode(self, tokens, slots, positions, ranges=None):
        """One token for every active request; lists are per micro-batch. Returns (logits [B, V], busy)."""
        busy = {"gpu": 0.0, "cpu_attn": 0.0}
        clock = time.perf_counter
        mbs = [MicroBatch(t, s, p) for t, s, p in zip(tokens, slots, positions)]
        t0 = clock()
        for mb in mbs:
            mb.x = self.embed(mb.tokens)
        busy["gpu"] += clock() - t0
        for i, lw in enumerate(self.w.layers):
            for mb in mbs:
                t0 = clock()
                q, k, v = pre_attn(self.spec, lw.tensors, mb.x, mb.positions, self.rope)
                t1 = clock()
                o = self.attend(i, mb, q, k, v)
                t2 = clock()
                mb.x = post_attn(self.spec, lw.tensors, mb.x, o, self.grouped)
                t3 = clock()
                busy["gpu"] += (t1 - t0) + (t3 - t2)
                busy["cpu_attn"] += t2 - t1
        t0 = clock()
        out = self.logits(torch.cat([mb.x for mb in mbs]))
        busy["gpu"] += clock() - t0
        return out, busy

    def prefill(self, prompts: list[list[int]], slots: list[int], chunk_tokens: int = 8192):
        """Whole prompts, packed without padding, in chunks of about `chunk_tokens`. Returns (last logits, busy)."""
        busy = {"gpu": 0.0, "cpu_attn": 0.0}
        outs, chunk = [], []
        for p, s in zip(prompts, slots):
            chunk.append((p, s))
            if sum(len(c[0]) for c in chunk) >= chunk_tokens:
                outs.append(self._prefill_chunk(chunk, busy))
                chunk = []
        if chunk:
            outs.append(self._prefill_chunk(chunk, busy))
        return torch.cat(outs), busy

    def _prefill_chunk(self, chunk, busy):
        clock = time.perf_counter
        t0 = clock()
        lens = [len(p) for p, _ in chunk]
        x = self.embed(torch.tensor([t for p, _ in chunk for t in p]))
        positions = torch.cat([torch.arange(n) for n in lens])
        busy["gpu"] += clock() - t0
        for i, lw in enumerate(self.w.layers):
            t0 = clock()
            q, k, v = pre_attn(self.spec, lw.tensors, x, positions, self.rope)
            t1 = clock()
            parts, start = [], 0
            for (p, slot), n in zip(chunk, lens):
                ks, vs = k[start:start + n], v[start:start + n]
                self.cache.write_prompt(i, slot, ks, vs)
                parts.append(prefill_attention(q[start:start + n], ks, vs, self.scale))
                start += n
            t2 = clock()
            x = post_attn(self.spec, lw.tensors, x, torch.cat(parts), self.grouped)
            busy["gpu"] += (t1 - t0) + (clock() - t2)
            busy["cpu_attn"] += t2 - t1
        t0 = clock()
        last = torch.tensor(lens).cumsum(0) - 1
        out = self.logits(x.index_select(0, last))
        busy["gpu"] += clock() - t0
        return out
