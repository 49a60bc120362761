"""Model weights laid out for paging: one flat buffer per decoder layer, experts `[E, ...]` last, cut into pages.
Buffers start and end on page boundaries, so what streams is page-locked at its exact size (torch's pinned allocator
rounds up).
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import ModelError, UnsupportedModelError, UsageError
from core.model.cpu import hugepages
from core.model.families import family_module
from core.model.limits import LAYOUT_ALIGN as _ALIGN  # elements (bytes in a quantized layout)
from core.model.safetensors_io import Checkpoint
from core.model.quant.experts import ExpertScheme, QuantExperts
from core.model.quant.cache import CacheEntry
from core.model.quant.dense_spec import DENSE_NAMES as PACKED_DENSE  # prepacked with the experts in the CPU-only mode
from core.model.quant.formats import _ITEMSIZE, Format, fit_group, quantize
from core.model.spec import EXPERT_TENSORS, ModelSpec, torch_dtype
from core.telemetry import EventSink, Progress, WarningEvent, ignore


@dataclass(frozen=True)
class LayerLayout:
    """name -> (offset, shape) in a layer's flat buffer; with a `scheme`, bytes (`dtypes`: each entry's dtype)."""

    entries: tuple[tuple[str, int, tuple[int, ...]], ...]
    numel: int
    expert_start: int  # experts (w13, w2 — or their quantized parts) occupy [expert_start, numel)
    dtypes: tuple[tuple[str, str], ...] = ()  # byte layouts: entry name -> dtype name
    scheme: ExpertScheme | None = None

    @classmethod
    def for_spec(cls, spec: ModelSpec, layer: int, scheme: ExpertScheme | None = None,
                 dtype: torch.dtype | None = None) -> "LayerLayout":
        """`layer`'s layout; with `scheme`, bytes: experts in it, dense in `dtype`."""
        shapes = spec.layer_shapes(layer)
        dt = None if scheme is None else str(dtype or spec.torch_dtype).replace("torch.", "")
        dense = [(n, dt, s) for n, s in shapes.items() if n not in EXPERT_TENSORS]
        if scheme is None:
            experts = [(n, dt, s) for n, s in shapes.items() if n in EXPERT_TENSORS]
        else:  # the experts' parts, then their biases (gpt-oss) in the compute dtype; none in a dense layer
            experts = (scheme.parts(spec.num_experts) + [(n, dt, shapes[n]) for n in ("b13", "b2") if n in shapes]
                       if spec.is_moe(layer) else [])
        entries, dtypes, off = [], [], 0
        for name, dt, shape in dense + experts:
            entries.append((name, off, shape))
            dtypes.append((name, dt))
            off += math.ceil(math.prod(shape) * (_ITEMSIZE[dt] if dt else 1) / _ALIGN) * _ALIGN
        expert_start = entries[len(dense)][1] if experts else off
        return cls(tuple(entries), off, expert_start, () if scheme is None else tuple(dtypes), scheme)

    def buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """A page-aligned buffer, gaps zeroed: a scan of it (engine._check_fp16_range) must not read stale memory."""
        dtype = dtype if self.scheme is None else torch.uint8
        flat = page_aligned(self.numel, dtype, huge_from=self.expert_start * dtype.itemsize)
        end = 0
        for name, off, shape in sorted(self.entries, key=lambda e: e[1]):
            if off > end:
                flat[end:off].zero_()
            end = max(end, off + math.prod(shape) * self._unit(name))
        if end < self.numel:
            flat[end:].zero_()
        return flat

    def _unit(self, name: str) -> int:
        return _ITEMSIZE[dict(self.dtypes)[name]] if self.scheme is not None else 1

    @property
    def expert_numel(self) -> int:
        return self.numel - self.expert_start

    def _view(self, buf: torch.Tensor, name: str, off: int, shape: tuple[int, ...]) -> torch.Tensor:
        part = buf[off:off + math.prod(shape) * self._unit(name)]
        return (part if self.scheme is None else part.view(torch_dtype(dict(self.dtypes)[name]))).view(shape)

    def views(self, flat: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
        return {name: self._view(flat, name, off, shape) for name, off, shape in self.entries
                if names is None or name in names}

    def expert_entries(self) -> list[tuple[str, int, tuple[int, ...], int]]:
        """(name, offset, shape, one expert's size) per expert tensor, in the flat buffer's units."""
        return [(name, off, shape, math.prod(shape[1:]) * self._unit(name))
                for name, off, shape in self.entries if off >= self.expert_start]

    def expert_views(self, region: torch.Tensor, dtype: torch.dtype | None = None, scratch: dict | None = None) -> dict:
        """The experts over a buffer of the expert region alone: {"w13", "w2"}, or {"quant": QuantExperts}."""
        views = {name: self._view(region, name, off - self.expert_start, shape)
                 for name, off, shape in self.entries if off >= self.expert_start}
        if self.scheme is None or not views:
            return views
        biases = {n: views.pop(n) for n in ("b13", "b2") if n in views}
        return {"quant": QuantExperts(self.scheme, views, dtype, scratch), **biases}

    def page_bounds(self, pages: int) -> list[tuple[int, int]]:
        n = self.expert_numel
        if not n:  # a dense layer streams nothing; its pages are empty
            return [(0, 0)] * pages
        step = math.ceil(n / pages)
        return [(s, min(s + step, n)) for s in range(0, n, step)]


class LayerWeights:
    """One decoder layer: its flat buffer, named views and pages (and `quant`, QuantExperts over its experts)."""

    def __init__(self, layout: LayerLayout, flat: torch.Tensor, pages: int, dtype: torch.dtype | None = None,
                 scratch: dict | None = None):
        self.layout = layout
        self.flat = flat
        self.tensors = layout.views(flat)
        self.experts = flat[layout.expert_start:]
        self.packed = None  # experts prepacked for the CPU (then `experts` and `pages` are gone)
        self.quant = layout.expert_views(self.experts, dtype, scratch).get("quant") if layout.scheme is not None else None
        self.dense_flat = None  # the non-expert part converted to the math dtype (widen_dense)
        self.block_dense: dict[str, torch.Tensor] = {}  # projections a GGUF loader kept as blocks, not in `flat`
        self.held = 0  # bytes of quantized dense weights held outside the flat buffer (--quantize-dense)
        self.repage(pages)

    def repage(self, pages: int) -> None:
        if self.packed is not None:
            raise RuntimeError("this layer's experts were packed for the CPU; they no longer stream")
        self.pages = [self.experts[a:b] for a, b in self.layout.page_bounds(pages)]

    def pack_for_cpu(self, quantize_dense=None, swiglu: bool = False) -> None:
        """Prepack the experts for the CPU, the flat buffer keeping the rest (memory peaks at the model plus a layer);
        `quantize_dense(name, w)`: the projections quantized too; `swiglu`: the fused kernel."""
        from core.model.moe import pack_cpu_experts

        if self.quant is not None:
            if not self.quant.pack_cpu():  # no CPU kernel: projections kept as blocks are written expanded
                for name, w in self.block_dense.items():
                    self.tensors[name].copy_(w.dequantized())
                self.block_dense = {}
                return
            # projections kept as blocks left their part of the buffer unwritten (never resident): the experts
            # can stay where they were read to, rather than be copied out while every layer's buffer is held
            unwritten = all(n in self.block_dense for n in PACKED_DENSE if n in self.tensors)
            self.quant.detach_parts(copy=not unwritten)
            self.packed = self.quant
        else:
            has_experts = "w13" in self.tensors
            fused = swiglu and "b13" not in self.tensors and "b2" not in self.tensors
            self.packed = pack_cpu_experts(self.tensors["w13"], self.tensors["w2"], fused) if has_experts else []
        biases = {n: self.tensors[n].clone() for n in ("b13", "b2") if n in self.tensors}  # not packed, still used
        # the projections held apart in their kernel's layout (cpu.kernels.pack_dense), the flat buffer keeping
        # only the rest: the dense weights are never twice in RAM, as the planner counts them once
        self._hold_dense_apart(quantize_dense or (lambda name, w: w), biases)

    def _hold_dense_apart(self, convert, biases: dict) -> None:
        from core.model.cpu.kernels import pack_dense

        views = self.layout.views(self.flat, names=self._dense_names())
        packed = {}
        for name in PACKED_DENSE:
            if name in self.block_dense:
                packed[name] = self.block_dense[name]
            elif name in views:
                q = convert(name, views[name])
                packed[name] = q if q is not views[name] else pack_dense(views[name].clone())
        rest = [(n, t) for n, t in views.items() if n not in packed]
        sizes = [-(-t.numel() * t.element_size() // 64) * 64 for _, t in rest]
        buf = torch.empty(sum(sizes), dtype=torch.uint8)
        self.tensors, off = {}, 0
        for (n, t), size in zip(rest, sizes):
            self.tensors[n] = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
            off += size
        self.flat, self.experts, self.pages = buf, None, []
        self.tensors |= packed | biases
        self.held = sum(getattr(q, "held_bytes", q.numel() * q.element_size()) for q in packed.values())

    def _dense_names(self) -> set[str]:
        return {n for n, off, _ in self.layout.entries if off < self.layout.expert_start}

    def dense(self) -> dict[str, torch.Tensor]:
        names = self._dense_names()
        return {n: t for n, t in self.tensors.items() if n in names}

    def expert_set(self) -> dict:
        """What the expert compute reads: {"w13", "w2"}, {"packed"} or {"quant"}, with biases; {} if dense."""
        biases = {n: self.tensors[n] for n in ("b13", "b2") if n in self.tensors}
        if self.quant is not None:
            return {"quant": self.quant, **biases}
        if self.packed is not None:
            return {"packed": self.packed, **biases}
        return {n: self.tensors[n] for n in EXPERT_TENSORS if n in self.tensors}

    def widen_dense(self, math: torch.dtype, pack: bool = False) -> None:
        """The non-expert part in `math` (for slow bf16 matmuls); `pack`: experts in the fp32 C kernel's layout."""
        from core.model.cpu import ffn

        dense_names = self._dense_names()
        dense = self.flat[:self.layout.expert_start].to(math)
        widened = self.layout.views(dense, names=dense_names)
        if pack:
            self.packed = ffn.NativeExperts(self.tensors["w13"], self.tensors["w2"])
            self.tensors, self.flat, self.experts, self.pages = widened, dense, None, []
        else:
            experts = {n for n, _, _ in self.layout.entries} - dense_names
            self.tensors = {**self.layout.views(self.flat, names=experts), **widened}
            self.dense_flat = dense

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class ModelWeights:
    def __init__(self, spec: ModelSpec, layers: list[LayerWeights], globals_: dict[str, torch.Tensor],
                 dtype: torch.dtype):
        self.spec, self.layers, self.globals, self.dtype = spec, layers, globals_, dtype
        self.block_dense: dict[str, torch.Tensor] = {}  # the LM head as a GGUF file's blocks (LayerWeights')
        self.math_dtype = dtype  # what the non-expert weights and the activations compute in (see widen_dense)
        self.pins: dict[int, tuple] = {}  # layer -> (device, page-locked view of its streamed experts)
        self.pin_seconds = 0.0  # spent page-locking over this model's life: paid by the first run that streams
        # pins outlive runs; a model dropped without `unpin` still gives them back (freed memory would stay locked)
        weakref.finalize(self, _unpin_all, self.pins)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def pinned(self) -> bool:
        return bool(self.pins)

    def pin_for_streaming(self, dev, resident: list[int], progress: EventSink = ignore) -> list[int]:
        """Page-lock, once, each layer's bytes from its first streamed expert on; returns the layers it could not."""
        todo = {}  # layer -> offset where its streamed bytes start (None: packed)
        for i, r in enumerate(resident):
            lw, held = self.layers[i], self.pins.get(i)
            starts = [off + r * per for _, off, _, per in lw.layout.expert_entries()]
            if r >= self.spec.num_experts or not starts and lw.packed is None:
                continue  # streams nothing
            start = None if lw.packed is not None else min(starts)
            if start is None or held is None or held[0] is not dev or held[1].data_ptr() > lw.flat[start:].data_ptr():
                todo[i] = start  # not locked yet, or only a shorter range
        if not todo:
            return []
        what, failed, t0 = "page-locking host memory for GPU copies", [], time.perf_counter()
        for n, (i, start) in enumerate(todo.items()):
            progress(Progress(what, n, len(todo), "layers"))
            if start is None:
                failed.append(i)
                continue
            held = self.pins.pop(i, None)
            if held is not None:  # a shorter range: registrations must not overlap, so replace it
                held[0].unpin(held[1])
            view = self.layers[i].flat[start:]
            if dev.pin(view):
                self.pins[i] = (dev, view)
            else:
                failed.append(i)
        seconds = time.perf_counter() - t0
        self.pin_seconds += seconds
        progress(Progress(f"{what}: {self.pinned_bytes / 1e9:.2f} GB in {seconds:.1f} s", len(todo), len(todo),
                          "layers"))
        return failed

    def unpin(self) -> None:
        _unpin_all(self.pins)

    @property
    def pinned_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for _, v in self.pins.values())

    def repage(self, pages: int) -> None:
        for lw in self.layers:
            lw.repage(pages)

    @property
    def packed(self) -> bool:
        return any(lw.packed is not None for lw in self.layers)

    @property
    def scheme(self):
        """How the experts are stored (core.model.quant.experts.ExpertScheme), None when unquantized."""
        return self.layers[0].layout.scheme

    def pack_for_cpu(self, progress: EventSink = ignore, dense_format=None, dense_cache=None) -> None:
        from core.model.cpu.kernels import pack_dense

        quant, what = None, "packing experts for the CPU"
        if dense_format is not None:
            from core.model.quant.dense import quantize_dense, takes

            def quant(name, w):
                if dense_cache is None or not takes(w, dense_format):
                    return quantize_dense(w, dense_format)
                return dense_cache.weight(name, w)

            what = (f"quantizing dense weights to {dense_format.label}" if dense_cache is None or not dense_cache.cached
                    else "loading quantized dense weights (cached)")
        with dense_cache or contextlib.nullcontext():  # written whole, or dropped
            for i, lw in enumerate(self.layers):
                lw.pack_for_cpu(None if quant is None else lambda name, w, i=i: quant(f"layers.{i}.{name}", w),
                                swiglu=self.spec.expert_act == "swiglu")
                progress(Progress(what, i + 1, len(self.layers) + 1, "layers"))
            if "lm_head" in self.block_dense:
                self.globals["lm_head"] = self.block_dense["lm_head"]
            elif "lm_head" in self.globals:  # a tied head is the embedding too: that one stays a plain tensor
                head = self.globals["lm_head"]
                q = quant("lm_head", head) if quant is not None else head
                self.globals["lm_head"] = q if q is not head else pack_dense(head)
        progress(Progress(what, len(self.layers) + 1, len(self.layers) + 1, "layers"))

    def widen_dense(self, math: torch.dtype, pack: bool = False, progress: EventSink = ignore) -> None:
        if math == self.math_dtype:
            return
        for i, lw in enumerate(self.layers):
            lw.widen_dense(math, pack=pack and "w13" in lw.tensors)
            if pack:
                progress(Progress("packing experts for the CPU", i + 1, len(self.layers), "layers"))
        self.globals = {n: t.to(math) for n, t in self.globals.items()}
        self.math_dtype = math

    def packs_widened(self) -> bool:
        from core.model.cpu import ffn

        moe = [lw for lw in self.layers if "w13" in lw.tensors]
        return (self.scheme is None and self.spec.expert_act == "swiglu" and bool(moe)
                and all("b13" not in lw.tensors and "b2" not in lw.tensors and lw.packed is None
                        and ffn.takes_widened(lw.tensors["w13"], lw.tensors["w2"]) for lw in moe))

    @property
    def nbytes(self) -> int:
        dense = sum(lw.dense_flat.numel() * lw.dense_flat.element_size() for lw in self.layers
                    if lw.dense_flat is not None)
        return dense + sum(lw.flat.numel() * lw.flat.element_size() + lw.held for lw in self.layers) + sum(
            getattr(t, "held_bytes", t.numel() * t.element_size()) for t in self.globals.values())


PAGE = 4096


def page_aligned(numel: int, dtype: torch.dtype, huge_from: int | None = None) -> torch.Tensor:
    """Whole pages of its own, so a part can be page-locked without touching a neighbour's. Past `huge_from` (bytes:
    the streamed experts) on huge pages; not the dense head, which a GGUF's projections held as blocks elsewhere
    leave unwritten, and huge pages would make resident."""
    size, total = dtype.itemsize, -(-(numel * dtype.itemsize) // PAGE) * PAGE + PAGE
    if huge_from is None:
        raw = torch.empty(total, dtype=torch.uint8)
    else:  # from a page boundary, so that the buffer starts on one too (skip below is 0)
        raw = hugepages.empty((total,), torch.uint8, huge_from=-(-huge_from // PAGE) * PAGE)
    skip = -raw.data_ptr() % PAGE
    return raw[skip:skip + numel * size].view(dtype)


def _unpin_all(pins: dict) -> None:
    for dev, view in pins.values():
        dev.unpin(view)
    pins.clear()


def load_weights(model_dir, spec: ModelSpec, *, dtype: torch.dtype | None = None, pages_per_layer: int = 1,
                 progress: EventSink = ignore, quant: Format | None = None,
                 use_cache: bool = True, shard=None) -> ModelWeights:
    """A checkpoint in paged per-layer buffers. `shard`: a tensor-parallel rank's part; `quant`: experts quantized
    as read (or from the cache): memory peaks at the quantized model plus a layer."""
    if pages_per_layer < 1:
        raise ValueError(f"pages_per_layer must be >= 1, got {pages_per_layer}")
    mxfp4 = spec.quant_method == "mxfp4" and spec.family == "gpt_oss"  # experts read as the 4-bit blocks they are
    if spec.quant_method and not mxfp4:
        raise UnsupportedModelError(
            f"this checkpoint's weights are quantized ({spec.quant_method}) and mlight cannot read {spec.quant_method} "
            "weights yet", "use the model's bf16 release or dequantize it to bf16")
    if mxfp4 and quant is not None:
        raise UsageError(f"this checkpoint's experts are already quantized ({spec.quant_method})",
                         "leave out --quantize to run them as they are")
    dtype = dtype or spec.torch_dtype
    ckpt = Checkpoint(model_dir)
    keys = ckpt.keys()
    fam = family_module(spec)
    for note in getattr(fam, "notes", lambda s, k: [])(spec, keys):
        progress(WarningEvent(note))
    full = spec  # the checkpoint's model (`spec`: a tensor-parallel rank's part of it)
    if shard is not None:
        if mxfp4:
            raise UsageError("tensor parallelism over a 4-bit MXFP4 checkpoint is not supported yet",
                             "use the model's bf16 release, or run it without --tensor-parallel")
        from core.model.shard import local_spec

        spec = local_spec(full, shard)
    D, I = spec.hidden_size, spec.expert_intermediate  # a read MXFP4 scheme, or what `quant` fits
    fmt = Format("mxfp4") if mxfp4 else None if quant is None else fit_group(quant, D, I)
    scheme = None if fmt is None else ExpertScheme.uniform(fmt, D, I)
    total = spec.num_layers + 1
    key = {"scheme": repr(scheme), "dtype": str(dtype)} | ({"shard": f"{shard.rank}/{shard.size}"} if shard else {})
    entry = CacheEntry(Path(model_dir), key) if quant is not None and use_cache else None
    cached = Checkpoint(entry.dir) if entry is not None and entry.complete else None

    globals_ = {name: torch.empty(shape, dtype=dtype) for name, shape in spec.global_shapes().items()}
    writer = None
    if cached is not None:
        for name, t in globals_.items():
            cached.copy_into(name, t)
    else:
        _fill(ckpt, fam.global_pieces(full, keys), globals_)
        if entry is not None:
            writer = entry.writer([(n, dtype, tuple(t.shape)) for n, t in globals_.items()]
                                  + [(f"layers.{i}", torch.uint8, (LayerLayout.for_spec(spec, i, scheme, dtype).numel,))
                                     for i in range(spec.num_layers)])
            for name, t in globals_.items():
                writer.write(name, t)
    what = "loading weights" if scheme is None or mxfp4 else (
        "loading quantized weights (cached)" if cached is not None else f"quantizing experts to {scheme.label}")
    progress(Progress(what, 1, total, "layers"))
    staging: dict[LayerLayout, LayerWeights] = {}  # one layer in the compute dtype, reused (per distinct shape)
    layers, scratch = [], {}
    with writer or contextlib.nullcontext():  # the cache entry written whole, or dropped
        for i in range(spec.num_layers):
            layout = LayerLayout.for_spec(spec, i, scheme, dtype)
            flat = layout.buffer(dtype)
            lw = LayerWeights(layout, flat, pages_per_layer, dtype, scratch)
            if cached is not None:
                cached.copy_into(f"layers.{i}", flat)
            elif quant is not None:
                plain = LayerLayout.for_spec(spec, i, None, dtype)
                if plain not in staging:
                    staging[plain] = LayerWeights(plain, torch.empty(plain.numel, dtype=dtype), 1)
                _fill_layer(ckpt, fam, full, i, keys, staging[plain].tensors, shard)
                _quantize_layer(staging[plain], lw)
                if writer is not None:
                    writer.write(f"layers.{i}", flat)
            else:
                _fill_layer(ckpt, fam, full, i, keys, lw.tensors, shard)
            layers.append(lw)
            progress(Progress(what, i + 2, total, "layers"))
    return ModelWeights(spec, layers, globals_, dtype)


_QUANT_ROWS = 256  # rows quantized at a time: bounds the float32 temporaries to about a MB per matrix


def _quantize_layer(src: LayerWeights, dst: LayerWeights) -> None:
    for name, t in dst.tensors.items():
        if name in src.tensors:
            t.copy_(src.tensors[name])
    for m in dst.layout.scheme.matrices if dst.quant is not None else ():  # a dense layer has no experts
        w = src.tensors[m.name]
        parts = {p.suffix: dst.tensors[f"{m.name}.{p.suffix}"] for p in m.fmt.parts(m.n, m.k)}
        for e in range(w.shape[0]):
            for r in range(0, m.n, _QUANT_ROWS):
                q = quantize(m.fmt, w[e, r:r + _QUANT_ROWS])
                for suffix, t in q.items():
                    parts[suffix][e, r:r + _QUANT_ROWS].copy_(t)


def _fill_layer(ckpt: Checkpoint, fam, spec: ModelSpec, i: int, keys, dest: dict[str, torch.Tensor], shard) -> None:
    picks = shard.selections(spec, i) if shard is not None else None
    _fill(ckpt, fam.layer_pieces(spec, i, keys), dest, picks, spec.layer_shapes(i))
    if shard is not None and shard.rank:  # biases added once after the sum over ranks: rank 0 holds them
        for name in shard.leader_only(spec, i):
            dest[name].zero_()


def _fill(ckpt: Checkpoint, pieces, dest: dict[str, torch.Tensor], picks=None, shapes=None) -> None:
    """Copy the pieces into `dest`, each cut to a tensor-parallel rank's `picks` of the tensors of full `shapes`."""
    covered: dict[str, int] = {}
    for p in pieces:
        for target, narrow in _targets(p, dest, picks, shapes):
            try:
                ckpt.copy_into(p.src, target, view=p.view, transpose=p.transpose, select=p.select,
                               fit=p.fit, narrow=narrow)
            except RuntimeError as e:  # a reshape that does not fit: config and weights disagree
                raise ModelError(f"tensor {p.src} does not fit {p.dest}: {e}",
                                 "the config.json does not match the weights") from e
            covered[p.dest] = covered.get(p.dest, 0) + target.numel()
    for name, t in dest.items():
        if covered.get(name, 0) != t.numel():
            raise ModelError(f"the checkpoint does not provide all of {name}",
                             "it is incomplete or not the architecture its config.json names")


def _targets(p, dest: dict[str, torch.Tensor], picks, shapes):
    if not picks or p.dest not in picks:
        yield (dest[p.dest][p.index] if p.index else dest[p.dest]), None
        return
    from core.model.shard import cuts

    dim, keep = picks[p.dest]
    for c in cuts(tuple(p.index), shapes[p.dest], dim, keep):
        target = dest[p.dest][c.dst_index]
        if c.dst_dim < 0:  # the whole piece lands at one local position
            yield target, None
        else:
            yield target.narrow(c.dst_dim, c.dst_start, c.length), (c.src_dim, c.src_start, c.length)
