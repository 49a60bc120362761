"""Model weights laid out for paging: one flat buffer per decoder layer, cut into pages.

Every decoder layer's tensors live in a single 1-D buffer (`LayerWeights.flat`) at offsets fixed by
a `LayerLayout`; the named tensors are views into it, experts stacked `[E, ...]` at the end. The
expert region — the part that stays in CPU memory and streams to the GPU — is cut into `n` equal
pages (the paper's paged weights); the same layout gives views over any other buffer of that size,
such as one half of the GPU's 2×layer expert buffer. The small non-expert part (norms, attention,
router, shared expert) is what the GPU keeps resident.

Memory: each buffer is allocated once and filled straight from the checkpoint's memory map, so peak
RSS stays near the model's size. With CUDA present the buffers are pinned; when pinning fails
(Windows caps pinned memory) they fall back to pageable memory and a warning is published.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.errors import ModelError, UnsupportedModelError
from core.model.families import family_module
from core.model.safetensors_io import Checkpoint
from core.model.spec import EXPERT_TENSORS, ModelSpec
from core.telemetry import EventSink, Progress, WarningEvent, ignore

_ALIGN = 64  # elements; keeps every view's start aligned for vector loads


@dataclass(frozen=True)
class LayerLayout:
    """Where each canonical tensor of a layer sits in the flat buffer: name -> (offset, shape)."""

    entries: tuple[tuple[str, int, tuple[int, ...]], ...]
    numel: int
    expert_start: int  # experts (w13, w2) occupy [expert_start, numel)

    @classmethod
    def for_spec(cls, spec: ModelSpec, layer: int | None = None) -> "LayerLayout":
        """The layout of `layer` (default: the first MoE layer, whose expert region every MoE layer shares)."""
        if layer is None:
            layer = next((i for i in range(spec.num_layers) if spec.is_moe(i)), 0)
        entries, off, expert_start = [], 0, None
        for name, shape in spec.layer_shapes(layer).items():  # experts come last in layer_shapes
            if name in EXPERT_TENSORS and expert_start is None:
                expert_start = off
            entries.append((name, off, shape))
            off += math.ceil(math.prod(shape) / _ALIGN) * _ALIGN
        return cls(tuple(entries), off, off if expert_start is None else expert_start)

    @property
    def expert_numel(self) -> int:
        return self.numel - self.expert_start

    def views(self, flat: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
        return {name: flat[off:off + math.prod(shape)].view(shape) for name, off, shape in self.entries
                if names is None or name in names}

    def expert_views(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of w13 and w2 over a buffer holding only the expert region."""
        return {name: region[off - self.expert_start:off - self.expert_start + math.prod(shape)].view(shape)
                for name, off, shape in self.entries if name in EXPERT_TENSORS}

    def page_bounds(self, pages: int) -> list[tuple[int, int]]:
        """Element ranges, relative to the expert region, of its `pages` near-equal cuts."""
        n = self.expert_numel
        if not n:  # a dense layer streams nothing; its pages are empty
            return [(0, 0)] * pages
        step = math.ceil(n / pages)
        return [(s, min(s + step, n)) for s in range(0, n, step)]


class LayerWeights:
    """One decoder layer: its flat buffer, named views, and its pages."""

    def __init__(self, layout: LayerLayout, flat: torch.Tensor, pages: int):
        self.layout = layout
        self.flat = flat
        self.tensors = layout.views(flat)
        self.experts = flat[layout.expert_start:]
        self.packed = None  # experts prepacked for the CPU (then `experts` and `pages` are gone)
        self.repage(pages)

    def repage(self, pages: int) -> None:
        """Cut the expert region into `pages` pages (views; nothing moves)."""
        if self.packed is not None:
            raise RuntimeError("this layer's experts were packed for the CPU; they no longer stream")
        self.pages = [self.experts[a:b] for a, b in self.layout.page_bounds(pages)]

    def pack_for_cpu(self) -> None:
        """Prepack the experts for the CPU and keep only the non-expert part of the flat buffer.

        One layer at a time, so memory peaks at the model plus one layer's experts, never two copies."""
        from core.model.moe import pack_experts

        has_experts = "w13" in self.tensors
        self.packed = pack_experts(self.tensors["w13"], self.tensors["w2"]) if has_experts else []
        biases = {n: self.tensors[n].clone() for n in ("b13", "b2") if n in self.tensors}  # not packed, still used
        dense = self.flat[:self.layout.expert_start].clone()
        self.flat, self.experts, self.pages = dense, None, []
        self.tensors = self.layout.views(dense, names={n for n, _, _ in self.layout.entries if n not in EXPERT_TENSORS})
        self.tensors.update(biases)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str):
        return self.tensors.get(name)


class ModelWeights:
    """All weights of a model in the layout the engine runs from."""

    def __init__(self, spec: ModelSpec, layers: list[LayerWeights], globals_: dict[str, torch.Tensor],
                 dtype: torch.dtype, pinned: bool):
        self.spec, self.layers, self.globals, self.dtype, self.pinned = spec, layers, globals_, dtype, pinned

    def repage(self, pages: int) -> None:
        for lw in self.layers:
            lw.repage(pages)

    @property
    def packed(self) -> bool:
        return any(lw.packed is not None for lw in self.layers)

    @property
    def expert_layout(self) -> LayerLayout:
        """The layout of an MoE layer: its expert region is what streams (the same in every MoE layer)."""
        return LayerLayout.for_spec(self.spec)

    def pack_for_cpu(self, progress: EventSink = ignore) -> None:
        for i, lw in enumerate(self.layers):
            lw.pack_for_cpu()
            progress(Progress("packing experts for the CPU", i + 1, len(self.layers), "layers"))

    @property
    def lm_head(self) -> torch.Tensor:
        return self.globals.get("lm_head", self.globals["embed"])

    @property
    def nbytes(self) -> int:
        return sum(lw.flat.numel() * lw.flat.element_size() for lw in self.layers) + sum(
            t.numel() * t.element_size() for t in self.globals.values())


def _alloc(numel: int, dtype: torch.dtype, pin: bool, sink: EventSink) -> tuple[torch.Tensor, bool]:
    if pin:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True), True
        except RuntimeError as e:
            sink(WarningEvent(f"pinned memory unavailable ({str(e).splitlines()[0]}); using pageable memory, "
                              "host-to-device copies will be slower"))
    return torch.empty(numel, dtype=dtype), False


def load_weights(model_dir, spec: ModelSpec, *, dtype: torch.dtype | None = None, pages_per_layer: int = 1,
                 pin: bool | None = None, progress: EventSink = ignore) -> ModelWeights:
    """Read a checkpoint into paged per-layer buffers (and plain tensors for embeddings and head)."""
    if pages_per_layer < 1:
        raise ValueError(f"pages_per_layer must be >= 1, got {pages_per_layer}")
    if spec.quant_method:
        raise UnsupportedModelError(
            f"this checkpoint's weights are quantized ({spec.quant_method}) and mlight cannot read {spec.quant_method} "
            "weights yet", "use the model's bf16 release (for gpt-oss, a -BF16 checkpoint) or dequantize it to bf16")
    dtype = dtype or spec.torch_dtype
    pin = torch.cuda.is_available() if pin is None else pin
    ckpt = Checkpoint(model_dir)
    keys = ckpt.keys()
    fam = family_module(spec)
    for note in getattr(fam, "notes", lambda s, k: [])(spec, keys):
        progress(WarningEvent(note))
    layouts: dict[tuple, LayerLayout] = {}
    total = spec.num_layers + 1
    globals_ = {}
    for name, shape in spec.global_shapes().items():
        globals_[name] = torch.empty(shape, dtype=dtype)
    _fill(ckpt, fam.global_pieces(spec, keys), globals_)
    progress(Progress("loading weights", 1, total, "layers"))
    layers, pinned = [], pin
    for i in range(spec.num_layers):
        shapes = tuple(spec.layer_shapes(i).items())
        layout = layouts.setdefault(shapes, LayerLayout.for_spec(spec, i))
        flat, ok = _alloc(layout.numel, dtype, pinned, progress)
        pinned = pinned and ok
        lw = LayerWeights(layout, flat, pages_per_layer)
        _fill(ckpt, fam.layer_pieces(spec, i, keys), lw.tensors)
        layers.append(lw)
        progress(Progress("loading weights", i + 2, total, "layers"))
    return ModelWeights(spec, layers, globals_, dtype, pinned)


def _fill(ckpt: Checkpoint, pieces, dest: dict[str, torch.Tensor]) -> None:
    covered: dict[str, int] = {}
    for p in pieces:
        target = dest[p.dest][p.index] if p.index else dest[p.dest]
        try:
            ckpt.copy_into(p.src, target, view=p.view, transpose=p.transpose, select=p.select, fit=p.fit)
        except RuntimeError as e:  # a reshape that does not fit: config and weights disagree
            raise ModelError(f"tensor {p.src} does not fit {p.dest}: {e}",
                             "the config.json does not match the weights") from e
        covered[p.dest] = covered.get(p.dest, 0) + target.numel()
    for name, t in dest.items():
        if covered.get(name, 0) != t.numel():
            raise ModelError(f"the checkpoint does not provide all of {name}",
                             "it is incomplete or not the architecture its config.json names")
