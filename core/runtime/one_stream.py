"""A decode step of a few requests on the host with every kernel's arguments bound once (the CPU only).

At batch 1 the Python around a layer's kernels (task graph, checks, fresh tensors, all cold after the experts
streamed) took a quarter of the step. Here one micro-batch of M ≤ MAX_ROWS requests runs as a flat list of C calls
bound once per runner and M: the same kernels, arguments and order as the general path, into held buffers, so the
logits match it bit for bit (tests/test_one_stream.py); elsewhere the general path runs (`why_not` says why). The
list runs from one C loop (row_ops.c's mlight_run_calls): called one by one from Python, ctypes' conversions took
about 4 % of the step.
Legend: M = requests, D = hidden, H = query heads, Hkv = KV heads, hd = head dim, k = experts of a token.
"""

from __future__ import annotations

import ctypes
from functools import partial
import struct
import time

import torch

from core.model import gqa, mixer
from core.model.cpu import ffn, gguf_blocks, gguf_token, native, row_ops
from core.model.cpu.panel_linear import PanelWeight
from core.model.decoder import C_ROUTE_LOGITS
from core.model.kvcache import KVStore
from core.model.limits import LOGIT_CHUNK_BYTES
from core.model.moe import _swiglu
from core.model.quant.block_dense import BlockWeight
from core.model.quant.formats import NATIVE_GGUF_ROWS
from core.runtime.executors import SequentialExecutor, _sized

LAYER_KEYS = {"ln1", "ln2", "router", "qkv", "o"}  # and Qwen3's q/k norms; any other tensor (a bias, sinks) is not
PHASES = ("pre_attn", "cpu_attn", "post_attn", "ffn")
BF16 = torch.bfloat16
MAX_ROWS = 8  # requests a step: the token kernels' rows (gguf_token.ROWS) and tokens (gguf_token.TOKENS)


def why_not(r, M: int = 1) -> str:
    """Why runner `r`'s decode step of one micro-batch of M requests cannot run as bound calls ("" where it can)."""
    spec = r.spec
    if r.dev.accelerator or type(r.ex) is not SequentialExecutor or r.tp is not None or r.graphs is not None:
        return "not the host alone on the sequential executor"
    if not 1 <= M <= MAX_ROWS:
        return f"{M} requests a step, more than {MAX_ROWS}"
    if r.widen_attn is not None or r.widen_ffn is not None or r.act is not _swiglu:
        return "the CPU computes in a wider dtype, or the experts' activation is not plain SwiGLU"
    if (spec.qk_norm not in ("none", "head") or spec.clip_qkv is not None or spec.attn_gate or spec.norm != "rms"
            or spec.shared_intermediate or spec.router != "softmax" or not spec.router_softmax_fp32
            or spec.router_fp32 or spec.router_norm not in ("sum", "none")
            or M * spec.num_experts > C_ROUTE_LOGITS or spec.num_experts > row_ops.ROUTE_MAX_EXPERTS
            or spec.top_k > gguf_blocks.MAX_EXPERTS):
        return "the family's layer has more than norm, QKV, RoPE, attention, O, softmax router and experts"
    if any(mixer.module(spec, i) is not gqa or not spec.is_moe(i) or mixer.window(spec, i)
           for i in range(spec.num_layers)):
        return "a layer without grouped-query attention over every token, or without experts"
    rope = r.rope
    if rope.pairs or rope.switch or rope.cos.dtype != BF16 or rope.cos.shape[1] != spec.head_dim:
        return "RoPE is not over whole heads in halves"
    if r.globals["embed"].dtype != BF16 or type(r.globals["embed"]) is not torch.Tensor:
        return "the embedding is not a bf16 tensor"
    libs = (row_ops.library(), native.library(), gguf_token.library(), ffn.library())
    if libs[0] is None or libs[1] is None or not all(lib is None or lib.openmp or torch.get_num_threads() == 1
                                                     for lib in libs):
        return "the row and attention kernels are not built here"
    for i in range(spec.num_layers):
        w, st = r.dense[i], r.cache.layers[i]
        norms = ("ln1", "ln2", "router", *(("q_norm", "k_norm") if spec.qk_norm == "head" else ()))
        if set(w) != LAYER_KEYS.union(norms) or any(type(w[n]) is not torch.Tensor or w[n].dtype != BF16
                                                   or not w[n].is_contiguous() for n in norms):
            return f"layer {i}'s tensors are not just bf16 norms, router, QKV and O"
        if not all(_linear_ok(w[n], M) for n in ("qkv", "o")):
            return f"layer {i}'s projections at {M} rows are not on the GGUF token kernel, nor bf16 panels"
        if _experts_of(r, i, M) is None:
            return f"layer {i}'s experts at {M} tokens are not on the GGUF token kernel nor the bf16 expert kernel"
        if (type(st) is not KVStore or st.window or st.k.dtype != BF16 or st.v.dtype != BF16
                or not (st.k.is_contiguous() and st.v.is_contiguous()) or st.k.shape != r.cache.layers[0].k.shape
                or spec.num_heads // spec.num_kv_heads > native.MAX_G or spec.head_dim > native.MAX_D):
            return f"layer {i}'s KV cache is not one the C attention reads in place"
    if not _linear_ok(r.lm_head, M) or {"norm_b", "lm_head_b"} & set(r.globals) or r.globals["norm"].dtype != BF16:
        return "the LM head is not on the GGUF token kernel nor bf16 panels, after a bf16 norm"
    kinds = [(t.kind, t.layer) for t in r._graph("decode", 1)[0]]
    if kinds != [(p, i) for i in range(spec.num_layers) for p in PHASES]:
        return "the decode graph has tasks besides each layer's four"
    return ""


def _linear_ok(w, M: int) -> bool:
    """Whether kernels.linear of M rows through w is one C call a segment (BlockWeight.linear), or the panels'."""
    if type(w) is PanelWeight:
        return ffn.library() is not None
    return (type(w) is BlockWeight and M <= NATIVE_GGUF_ROWS and gguf_blocks.library() is not None
            and all(s.raw.stride(1) == 1 and s.kind in gguf_blocks.KINDS for s in w.segments))


def _experts_of(r, i: int, M: int):
    """Layer i's experts as ("gguf", QuantExperts) or ("panels", NativeExperts), where M tokens take one call."""
    parts = r._expert_parts(i)
    if len(parts) != 1 or parts[0].get("b13") is not None or parts[0].get("b2") is not None:
        return None
    q, packed = parts[0].get("quant"), parts[0].get("packed")
    if getattr(packed, "fused_swiglu", False) and type(packed) is ffn.NativeExperts and ffn.library() is not None:
        return "panels", packed
    if (q is None or not q.blocks or len(q.scheme.up) != 1 or M > gguf_token.TOKENS
            or not gguf_token.takes_tokens(q.scheme.up[0].fmt.name, q.scheme.down.fmt.name, M, r.spec.top_k)):
        return None
    return "gguf", q


class OneStream:
    """Runner `r`'s decode step for M requests as bound calls (where `why_not(r, M)` is ""). It holds addresses,
    not the runner, which owns it: no cycle outlives a run (core.runtime.frozen_heap)."""

    def __init__(self, r, M: int = 1):
        spec = r.spec
        self.threads = n = torch.get_num_threads()
        D, H, Hkv, hd, k = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.top_k
        d1, qs, kvs, G = gqa.d1_width(spec), spec.q_size, spec.kv_size, spec.num_heads // spec.num_kv_heads
        cap = r.cache.layers[0].k.shape[2]
        new = partial(torch.empty, dtype=BF16)
        i64 = partial(torch.zeros, dtype=torch.int64)
        self.M = M
        self.x, self.h, self.qkv, self.payload = new((M, D)), new((M, D)), new((M, d1)), new((M, d1))
        self.attn, self.o, self.y, self.rw = new((M, qs)), new((M, D)), new((M, D)), new((M, k))
        self.ids, self.tokens, self.slots, self.positions, self.lengths = i64((M, k)), i64(M), i64(M), i64(M), i64(M)
        self.first, self.at, self.heads_at = i64((M, 1)), i64((M, Hkv)), torch.arange(Hkv, dtype=torch.int64) * cap
        self._first = self.first[:, 0]  # the view made once, not a step
        self.cos, self.sin = new((M, hd)), new((M, hd))  # this step's RoPE rows, gathered as Rope.tables gathers them
        self.slot_rows, self.threads_attn = Hkv * cap, max(1, min(n, M))
        self.bounds = i64(self.threads_attn + 1)
        self._tokens, self._slots, self._positions, self._lengths, self._bounds = (t.numpy() for t in (
            self.tokens, self.slots, self.positions, self.lengths, self.bounds))
        self.longest = i64(1).numpy()  # the step's longest attended length, read by the attention call
        experts = [_experts_of(r, i, M) for i in range(spec.num_layers)]
        # one float32 scratch for every call (they run one at a time): the largest any of them asks
        linears = [r.lm_head, *(r.dense[i][m] for i in range(spec.num_layers) for m in ("qkv", "o"))]
        sizes = [self.threads_attn * G * cap] + [_linear_scratch(w, M, n) for w in linears]
        sizes += [_experts_scratch(kind, e, M, D, k, n) for kind, e in experts]
        self.scratch = torch.empty(max(sizes) + 64)
        s, a = self.scratch.data_ptr(), lambda t: t.data_ptr()  # noqa: E731
        row, attn, longest = row_ops.library(), native.library(), _Live(self.longest.ctypes.data)
        x, h, qkv, pay, out, rw, ids, slots, lengths, bounds = (a(t) for t in (
            self.x, self.h, self.qkv, self.payload, self.attn, self.rw, self.ids, self.slots, self.lengths,
            self.bounds))
        # the final norm and the head as final_logits runs them: bf16 logits a chunk of rows, copied out in fp32
        V = r.lm_head.shape[0]
        self.logits = new((M, V))
        per = max(1, LOGIT_CHUNK_BYTES // (V * 2))
        self.head = [partial(row.rms_norm, x, M, D, D, a(r.globals["norm"]), spec.norm_eps, h, D, n)]
        for c in range(0, M, per):
            self.head += _linear(r.lm_head, h + 2 * c * D, min(per, M - c), D, a(self.logits) + 2 * c * V, V, s, n)
        self.phases = []
        for i in range(spec.num_layers):
            w, st = r.dense[i], r.cache.layers[i]
            kc, vc = a(st.k), a(st.v)
            # Qwen3: each token's head norms in place first (gqa._pre_into's values); then q and k roped side by
            # side and joined with v in one C pass, with torch's RoPE roundings (gqa.pre)
            norms = (("q_norm", 0, H), ("k_norm", qs, Hkv)) if spec.qk_norm == "head" else ()
            mix = [partial(row.rms_norm, qkv + 2 * (t * d1 + off), heads, hd, hd, a(w[name]), spec.norm_eps,
                           qkv + 2 * (t * d1 + off), hd, n) for t in range(M) for name, off, heads in norms]
            mix.append(partial(row.rope_join, qkv, M, d1, H + Hkv, hd, a(self.cos), a(self.sin), hd, kvs, pay, d1, n))

            s0, s1 = st.k.stride(0), st.k.stride(1)
            if self.threads_attn == 1:  # the calling thread runs every request (native.decode_attention)
                attention = partial(attn.fn, pay, 1, d1, kc, vc, 1, slots, lengths, 0, M, Hkv, G, hd, s0, s1,
                                    spec.scale, out, 1, s, longest)
            else:  # torch's OpenMP team, the requests split by `bounds`
                attention = partial(attn.parts, pay, 1, d1, kc, vc, 1, slots, lengths, bounds, self.threads_attn, Hkv,
                                    G, hd, s0, s1, spec.scale, out, 1, s, longest)

            self.phases += [
                [partial(row.rms_norm, x, M, D, D, a(w["ln1"]), spec.norm_eps, h, D, n),
                 *_linear(w["qkv"], h, M, D, qkv, d1, s, n), *mix],
                [partial(row.kv_write, kc, vc, pay + 2 * qs, pay + 2 * (qs + kvs), a(self.at), M * Hkv, Hkv, 2 * d1,
                         2 * hd, n), attention],
                [*_linear(w["o"], out, M, qs, a(self.o), D, s, n), partial(row.add_bf16, x, a(self.o), M * D),
                 partial(row.rms_norm, x, M, D, D, a(w["ln2"]), spec.norm_eps, h, D, n),
                 partial(row.softmax_route, h, 1, M, D, D, a(w["router"]), spec.num_experts, k,
                         int(spec.router_norm == "sum"), spec.routed_scale, rw, ids)],
                [_experts(*experts[i], h, M, rw, ids, a(self.y), D, k, s, n),
                 partial(row.add_bf16, x, a(self.y), M * D)],
            ]
        self._cos, self._sin = r.rope.cos, r.rope.sin
        self.table = _table([*self.phases, self.head], row.call_sigs)
        self.ends = (ctypes.c_double * (len(self.phases) + 2))()  # mlight_run_calls' clock: the start, each phase's end
        self.run = partial(row.run_calls, self.table.data_ptr(), self.table.shape[0], self.ends)

    def step(self, r, tokens: list[int], slots: list[int], positions: list[int]):
        """Runner r's step for `slots`' requests at `positions`: (logits [M, V] in r's host buffer, busy seconds per
        resource); the executor's `times` hold the graph's timeline, as after a run."""
        lengths = [p + 1 for p in positions]
        # element by element into the held tensors (numpy views): a tensor made of a list, or a Python scalar
        # operand (a 0-d tensor), would allocate every step
        for a, values in ((self._tokens, tokens), (self._slots, slots), (self._positions, positions),
                          (self._lengths, lengths)):
            for m, v in enumerate(values):
                a[m] = v
        if self.threads_attn > 1:
            for j, v in enumerate(native.cuts(lengths, self.threads_attn)):
                self._bounds[j] = v
        self.longest[0] = max(lengths)
        torch.index_select(r.globals["embed"], 0, self.tokens, out=self.x)
        torch.index_select(self._cos, 0, self.positions, out=self.cos)
        torch.index_select(self._sin, 0, self.positions, out=self.sin)
        torch.add(self.positions, self.slots, alpha=self.slot_rows, out=self._first)  # the KV write's rows
        torch.add(self.first, self.heads_at, out=self.at)
        tasks, _ = r._graph("decode", 1)
        times, busy, w, t0 = _sized(r.ex.times, len(tasks)), {}, self.ends, time.perf_counter()
        refused = self.run()
        if refused:
            j = int(self.table[refused - 1, 4])
            raise RuntimeError(f"{f'{tasks[j].kind} of layer {tasks[j].layer}' if j < len(tasks) else 'the LM head'}: "
                               "a kernel refused its bound call")
        for j, task in enumerate(tasks):  # the phases' ends, from the C loop's clock onto perf_counter's
            times[2 * j], times[2 * j + 1] = a, b = t0 + w[j] - w[0], t0 + w[j + 1] - w[0]
            busy[task.resource] = busy.get(task.resource, 0.0) + b - a
        r.last_tasks = tasks
        out = r.host["logits_dec"][:self.M]
        return out.copy_(self.logits), busy


class _Live(int):
    """An int64's address whose value the C loop passes at call time (its `live`): such a call runs only there."""


_CODES = {ctypes.c_void_p: "P", ctypes.c_int64: "I", ctypes.c_int: "C", ctypes.c_float: "F", None: "v"}


def _table(phases: list[list], sigs: list[str]) -> torch.Tensor:
    """The phases' bound calls as mlight_run_calls' table (row_ops.c's Call), a row a call, the last of a phase
    stamping its end."""
    rows = []
    for j, calls in enumerate(phases):
        for i, call in enumerate(calls):
            fn, args = getattr(call.func, "__wrapped__", call.func), call.args
            codes = [_CODES[t] for t in fn.argtypes]
            if len(args) != len(codes):
                raise TypeError(f"{fn.__name__} takes {len(codes)} arguments, got {len(args)}")
            at = [struct.unpack("q", struct.pack("d", v))[0] if c == "F" else int(v or 0) for v, c in zip(args, codes)]
            live = [k for k, v in enumerate(args) if type(v) is _Live] or [-1]
            rows.append([sigs.index("".join(codes) + ">" + _CODES[fn.restype]), ctypes.cast(fn, ctypes.c_void_p).value,
                         live[0], j if i == len(calls) - 1 else -1, j, *at, *[0] * (24 - len(at))])
    return torch.tensor(rows, dtype=torch.int64)


def _linear_scratch(w, M: int, n: int) -> int:
    K = w.shape[1]
    if type(w) is PanelWeight:
        return -(-ffn.library().sized("linear_scratch", M, K, n) // 4)
    return max(gguf_token.library().linear_scratch(M, K, n) if gguf_token.takes_rows(g.kind, M, K) else
               gguf_blocks.library().scratch(M, K, n) for g in w.segments)


def _linear(w, x: int, M: int, K: int, out: int, N: int, s: int, n: int) -> list:
    """`kernels.linear` of rows x [M, K] through w into out [M, N], as BlockWeight.linear or the panels run it."""
    if type(w) is PanelWeight:
        return [partial(ffn.library().linear, x, M, K, K, w.panels.data_ptr(), N, None, out, N, s, n)]
    calls = []
    for g in w.segments:
        raw, at = g.raw, out + 2 * g.r0
        if gguf_token.takes_rows(g.kind, M, K):
            calls.append(partial(gguf_token.library().linear, gguf_blocks.KINDS[g.kind], x, 1, K, M, K, raw.data_ptr(),
                                 raw.stride(0), raw.shape[0], at, 1, N, s, n, 2))
        else:
            path = gguf_blocks.PATHS[{None: "fp32", 32: "int8", 256: "int16"}[gguf_blocks.int8_group(g.kind, BF16, M)]]
            calls.append(partial(gguf_blocks.library().linear, gguf_blocks.KINDS[g.kind], x, 1, K, M, K, raw.data_ptr(),
                                 raw.stride(0), raw.shape[0], at, 1, N, s, n, path))
    return calls


def _experts_scratch(kind: str, e, M: int, D: int, k: int, n: int) -> int:
    if kind == "panels":
        return -(-ffn.library().sized("scratch", M, k, e.E, e.D, e.I, n) // 4)
    return gguf_token.library().tokens_scratch(M, D, e.parts["w13.raw"].shape[1] // 2, k, n)


def _experts(kind: str, e, h: int, M: int, rw: int, ids: int, y: int, D: int, k: int, s: int, n: int):
    """The tokens' k experts weighed and summed into y, as core.model.moe.experts runs them for M ≤ TOKENS."""
    if kind == "panels":
        return partial(ffn.library().ffn, h, M, k, ids, rw, 1, e.E, e.D, e.I, e.w13.data_ptr(), e.w13.stride(0),
                       e.w2.data_ptr(), e.w2.stride(0), y, s, n)
    w13, w2 = e.parts["w13.raw"], e.parts["w2.raw"]
    return partial(gguf_token.library().tokens, gguf_blocks.KINDS[e.scheme.up[0].fmt.name],
                   gguf_blocks.KINDS[e.scheme.down.fmt.name], h, 1, D, M, D, w13.shape[1] // 2, k, ids, rw, 1,
                   w13.data_ptr(), w13.stride(0), w13.stride(1), w2.data_ptr(), w2.stride(0), w2.stride(1), y, 1, D,
                   s, n, gguf_blocks.PATHS["int8"])
