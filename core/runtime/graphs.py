"""CUDA graphs for a step's GPU segments: eager the first time, captured the second, replayed after; a segment kind
whose capture fails stays eager and warns once. They save host time, which a step waits for only where launches
take longer than the streamed weights (`choose`).
"""

from __future__ import annotations

from collections import namedtuple
from typing import Callable, Sequence

from core.runtime.device import CaptureError, Device
from core.telemetry import EventSink, WarningEvent, ignore

MODES = ("auto", "on", "off")
HOST_OP_SECONDS = 25e-6  # host seconds a GPU-stream op costs (22–29 µs measured on an H200)
EAGER_OPS_PER_LAYER = 40  # eager ops of one micro-batch through one layer: the launch budget (any E)
# below this share of the link's time for a layer's weights, the copies hide the launches, and capture costs memory
PAYS_ABOVE = 0.5


def choose(mode: str, *, micro_batches: int, streamed_bytes_per_layer: float,
           h2d_bytes_per_s: float) -> tuple[bool, str]:
    """(use graphs, why)."""
    if mode != "auto":
        return mode == "on", f"graphs {mode} as asked"
    host = micro_batches * EAGER_OPS_PER_LAYER * HOST_OP_SECONDS
    link = streamed_bytes_per_layer / h2d_bytes_per_s
    why = (f"{micro_batches} micro-batches × {EAGER_OPS_PER_LAYER} ops × {HOST_OP_SECONDS * 1e6:.0f} µs = "
           f"{host * 1e3:.2f} ms of launches a layer against {link * 1e3:.2f} ms of weights over the link")
    if host > PAYS_ABOVE * link:
        return True, why + ": the launches bound the step, graphs pay"
    return False, why + ": the link hides the launches, graphs do not pay"


_Segment = namedtuple("_Segment", "static graph out")  # static input buffers, the captured graph, its outputs


def _layout(out) -> tuple:  # tensors (and Nones) as shapes and dtypes
    return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in out)


class Graphs:
    """A runner's captured segments; `run` is called from inside launched work."""

    def __init__(self, dev: Device, warn: EventSink = ignore):
        self.dev, self.warn = dev, warn
        self._seen: dict[tuple, tuple] = {}  # keys run eagerly once (warmed up) -> their outputs' layout
        self._segments: dict[tuple, _Segment] = {}
        # static buffers per ("in" or "out", segment, slot, layout), shared by a slot's layers: they run in a chain
        self._static: dict[tuple, list] = {}
        self.refused: dict[str, str] = {}  # segment kind -> why it runs eagerly
        self.captures = self.replays = 0

    def run(self, segment: str, layer, slot: int, fn: Callable, inputs: Sequence) -> tuple:
        """Eager or replayed (outputs valid until the slot's next run); `layer` keys what fn reads beside `inputs`."""
        if segment in self.refused:
            return fn(*inputs)
        key = (segment, layer, slot, _layout(inputs))
        seg = self._segments.get(key)
        if seg is None:
            if key not in self._seen:  # warm-up
                out = fn(*inputs)
                self._seen[key] = _layout(out)
                return out
            seg = self._capture(key, fn, inputs)
            if seg is None:
                return fn(*inputs)
        for buf, x in zip(seg.static, inputs):
            if buf is not None and buf is not x:
                buf.copy_(x)
        self.dev.replay(seg.graph)
        self.replays += 1
        return seg.out

    def _buffers(self, key: tuple, layout: tuple) -> list:
        if key not in self._static:
            self._static[key] = [None if x is None else self.dev.empty(x[0], x[1]) for x in layout]
        return self._static[key]

    def _capture(self, key: tuple, fn: Callable, inputs: Sequence) -> _Segment | None:
        segment, _, slot, shapes = key
        ins = self._buffers(("in", segment, slot, shapes), shapes)
        outs = self._buffers(("out", segment, slot, self._seen[key]), self._seen[key])
        for buf, x in zip(ins, inputs):  # captured over the current inputs' values (a GPU runs nothing yet)
            if buf is not None:
                buf.copy_(x)

        def captured():  # the outputs into the slot's buffers: the graph's own memory is then scratch only
            got = fn(*[x if b is None else b for b, x in zip(ins, inputs)])
            if _layout(got) != self._seen[key]:
                raise CaptureError(f"its outputs changed shape since its first run ({_layout(got)})")
            for buf, t in zip(outs, got):
                if buf is not None:
                    buf.copy_(t)
            return tuple(outs)

        try:
            graph, out = self.dev.capture(captured)
        except (CaptureError, RuntimeError) as e:  # the driver's refusals are RuntimeErrors on a GPU
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.refused[segment] = why
            self.warn(WarningEvent(f"the {segment} segment runs without CUDA graphs: {why}"))
            return None
        self.captures += 1
        return self._segments.setdefault(key, _Segment(ins, graph, out))


def streamed_bytes_per_layer(weights, resident: list[int] | None, num_experts: int) -> float:  # on average
    if resident is None:
        return 0.0
    total = 0
    for lw, r in zip(weights.layers, resident):
        experts = lw.flat.numel() - lw.layout.expert_start if lw.packed is None else 0
        total += experts * lw.flat.element_size() * max(0, num_experts - r) / max(1, num_experts)
    return total / max(1, len(weights.layers))
