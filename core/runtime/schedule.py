"""The decode step's (and prefill's) task graph, as data, for the engine and the simulator: each resource runs its
tasks one at a time in list order, a task once all its `deps` finished. Schedules (shared/paper.md): "cgopipe",
"s4" (FlexGen: the whole next layer's weights first), "s3" (one chain).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.model.limits import LOOKAHEAD  # CGOPipe: CPU attention this many micro-batches ahead (core.plan.hrm too)
from core.plan.policy import SCHEDULES
from core.telemetry import RESOURCES

RESOURCE_OF = {  # kind -> the resource it runs on
    "pre_attn": "compute",  # norm + QKV projection (+ RoPE) of one micro-batch
    "post_attn": "compute",  # O projection, norm, router, shared expert of one micro-batch
    "ffn": "compute",  # routed experts of one expert batch (one or more micro-batches)
    "gpu_attn": "compute",  # decode attention on the GPU
    "prefill": "compute",  # a whole layer's prefill of one micro-batch
    "cpu_attn": "cpu_attn",  # decode attention on the CPU, next to the KV cache
    "d1": "d2h",  # QKV of the new tokens to the CPU
    "kv_store": "d2h",  # KV written back to the CPU cache
    "d2": "h2d",  # attention output back to the GPU
    "weight_page": "h2d",  # one page of a layer's streamed expert weights (D3)
    "kv_load": "h2d",  # CPU-held KV to the GPU (D4)
}


@dataclass(frozen=True)
class Task:
    id: int  # position in the list
    kind: str  # a key of RESOURCE_OF
    resource: str  # a key of core.telemetry.RESOURCES
    layer: int
    micro_batch: int = -1  # first micro-batch of an ffn task's expert batch; -1 for per-layer tasks
    page: int = -1  # weight_page only
    deps: tuple[int, ...] = ()  # ids of earlier tasks

    def __post_init__(self):
        if self.kind not in RESOURCE_OF:
            raise ValueError(f"unknown task kind {self.kind!r}; expected one of {tuple(RESOURCE_OF)}")
        if self.resource not in RESOURCES:
            raise ValueError(f"unknown resource {self.resource!r}; expected one of {RESOURCES}")
        if any(d >= self.id or d < 0 for d in self.deps):
            raise ValueError(f"task {self.id} depends on a later or invalid task: {self.deps}")

    @property
    def name(self) -> str:
        at = f"{self.layer}" + (f",{self.micro_batch}" if self.micro_batch >= 0 else "") + (
            f",p{self.page}" if self.page >= 0 else "")
        return f"{self.kind}({at})"


class _Graph:
    """Tasks in order, by (kind, layer, index). A cross-resource dependency costs an event wait, so `add` keeps only
    those the in-order queues do not imply; `serial` (S3, CPU-only): each task also waits for the one before."""

    def __init__(self, serial: bool = False):
        self.tasks: list[Task] = []
        self.ids: dict[tuple, int] = {}
        self.waited: dict[tuple[str, str], int] = {}  # (resource, other resource) -> latest task waited for
        self.serial = serial

    def add(self, kind: str, layer: int, mb: int = -1, page: int = -1, deps=(), key=None) -> int:
        tid = len(self.tasks)
        if any(d is None for d in deps):  # a dependency not queued yet would deadlock an in-order executor
            raise ValueError(f"{kind}({layer},{mb}) depends on a task that is not in the graph yet")
        if self.serial and tid:
            deps = (*deps, tid - 1)
        res = RESOURCE_OF[kind]
        keep = []
        for d in sorted(set(deps), reverse=True):
            other = self.tasks[d].resource
            if other == res or d > self.waited.get((res, other), -1):  # on its own queue: that order, no wait
                keep.append(d)
                self.waited[(res, other)] = d
        deps = tuple(sorted(keep))
        self.tasks.append(Task(tid, kind, res, layer, mb, page, deps))
        self.ids[key or (kind, layer, mb if page < 0 else page)] = tid
        return tid

    def get(self, kind: str, layer: int, idx: int) -> int | None:
        return self.ids.get((kind, layer, idx))


def _page_slots(num_pages: int, n_mb: int) -> dict[int, list[int]]:
    """Page p follows micro-batch ⌊p·n/P⌋'s D2."""
    return {j: [p for p in range(num_pages) if p * n_mb // num_pages == j] for j in range(n_mb)}


def decode_step(schedule: str, *, num_layers: int, num_micro_batches: int, pages_per_layer: int = 1,
                micro_batches_per_expert_batch: int = 1, attention_on: str = "cpu", ffn_on: str = "gpu",
                streamed: bool = True) -> list[Task]:
    """`streamed` False: no weight pages."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    L, n, g = num_layers, num_micro_batches, micro_batches_per_expert_batch
    if L < 1 or n < 1 or pages_per_layer < 1 or g < 1 or n % g:
        raise ValueError(f"bad shape: layers {L}, micro-batches {n}, pages {pages_per_layer}, group {g}")
    if ffn_on == "cpu":
        return _cpu_only(L, n, g)
    pages = pages_per_layer if streamed else 0
    if attention_on == "cpu" and schedule == "cgopipe":
        return _cgopipe(L, n, g, pages)
    return _layer_by_layer(schedule, L, n, g, pages, gpu_attention=attention_on == "gpu")


def _ffn_deps_of_prev_layer(G: _Graph, i: int, j: int, g: int):
    return (G.get("ffn", i - 1, j // g * g),) if i > 0 else ()


def _buffer_free(G: _Graph, i: int, n: int, g: int):
    """Pages for layer i+1 reuse layer i−1's half of the 2×layer buffer: wait for its last expert batch."""
    return (G.get("ffn", i - 1, (n // g - 1) * g),) if i > 0 else ()


def _layer_pages(G: _Graph, layer: int, pages: int):
    return [G.get("weight_page", layer, p) for p in range(pages)]


def _cgopipe(L: int, n: int, g: int, pages: int) -> list[Task]:
    G = _Graph()
    done = 0  # positions (layer·n + micro-batch) whose pre-attention is in the graph

    def pre_until(pos: int):
        """Pre-attention, D1 and CPU attention up to `pos`, as far as layer i−1's FFN is queued (none waits later)."""
        nonlocal done
        while done < min(pos, L * n):
            i, j = divmod(done, n)
            if i > 0 and G.get("ffn", i - 1, j // g * g) is None:
                return
            a = G.add("pre_attn", i, j, deps=_ffn_deps_of_prev_layer(G, i, j, g))
            b = G.add("d1", i, j, deps=(a,))
            G.add("cpu_attn", i, j, deps=(b,))
            done += 1

    pre_until(LOOKAHEAD)  # prologue: two micro-batches ahead
    slots = _page_slots(pages, n)
    for i in range(L):
        nxt = (i + 1) % L  # the last layer prefetches the next step's layer 0
        for j in range(n):
            G.add("d2", i, j, deps=(G.get("cpu_attn", i, j),))
            for p in slots[j]:
                G.add("weight_page", nxt, page=p, deps=_buffer_free(G, i, n, g))
            # the h2d queue is in order: its last page landed means the layer's weights are all there
            G.add("post_attn", i, j, deps=(G.get("d2", i, j), *(_layer_pages(G, i, pages)[-1:] if i > 0 else ())))
            if (j + 1) % g == 0:
                G.add("ffn", i, j + 1 - g, deps=[G.get("post_attn", i, k) for k in range(j + 1 - g, j + 1)])
            pre_until(i * n + j + 1 + LOOKAHEAD)  # PreAttn(i, j+2), wrapping into layer i+1
    return G.tasks


def _layer_by_layer(schedule: str, L: int, n: int, g: int, pages: int, gpu_attention: bool) -> list[Task]:
    """S4: the next layer's weights first on the copy queue; S3: each layer's just before it, one task at a time.
    Attention on the GPU (any schedule): CPU-held KV over the link (D4) per micro-batch, the new token's KV back."""
    G = _Graph(serial=schedule == "s3")
    slots = _page_slots(pages, n)
    for i in range(L):
        nxt, s4 = (i + 1) % L, schedule == "s4"
        for p in range(pages if schedule != "cgopipe" else 0):  # S4: the whole next layer first; S3: this one's
            G.add("weight_page", nxt if s4 else i, page=p, deps=_buffer_free(G, i, n, g) if s4 else ())
        # this layer's pages where queued before its first use (past layer 0; S3; S4 with one layer)
        weights = [t for t in _layer_pages(G, i, pages) if t is not None] if (i > 0 or G.serial or L == 1) else []
        for j in range(n):
            if not gpu_attention:
                a = G.add("pre_attn", i, j, deps=_ffn_deps_of_prev_layer(G, i, j, g))
                b = G.add("d1", i, j, deps=(a,))
                c = G.add("cpu_attn", i, j, deps=(b,))
                d = G.add("d2", i, j, deps=(c,))
                G.add("post_attn", i, j, deps=(d, *weights))
            else:
                # position p = i·n + j uses ring buffer p mod 2: it waits for position p − 2's attention
                reuse = (G.get("gpu_attn", *divmod(i * n + j - 2, n)),) if i * n + j >= 2 else ()
                # at most two layers' new K/V of a micro-batch wait for the store
                reuse += (G.get("kv_store", i - 2, j),) if i > 1 else ()
                kv = G.add("kv_load", i, j, deps=reuse)
                if schedule == "cgopipe":
                    for p in slots[j]:
                        G.add("weight_page", nxt, page=p, deps=_buffer_free(G, i, n, g))
                a = G.add("pre_attn", i, j, deps=(*_ffn_deps_of_prev_layer(G, i, j, g), kv))
                b = G.add("gpu_attn", i, j, deps=(a, kv))
                G.add("kv_store", i, j, deps=(b,))
                G.add("post_attn", i, j, deps=(b, *weights))  # S3: after the store too (the task before it)
            if (j + 1) % g == 0:
                G.add("ffn", i, j + 1 - g, deps=[G.get("post_attn", i, k) for k in range(j + 1 - g, j + 1)])
    return G.tasks


def _cpu_only(L: int, n: int, g: int) -> list[Task]:
    """Everything on the CPU cores: one chain (dense work under "compute", attention under "cpu_attn")."""
    G = _Graph(serial=True)
    for i in range(L):
        for j in range(n):
            for kind in ("pre_attn", "cpu_attn", "post_attn"):
                G.add(kind, i, j)
            if (j + 1) % g == 0:
                G.add("ffn", i, j + 1 - g)
    return G.tasks


def prefill(*, num_layers: int, num_micro_batches: int, pages_per_layer: int = 1, ffn_on: str = "gpu",
            streamed: bool = True) -> list[Task]:
    """Layer by layer; layer i+1's weights stream while layer i computes."""
    L, n = num_layers, num_micro_batches
    G = _Graph(serial=ffn_on == "cpu")
    if ffn_on == "cpu":  # one chain
        for i in range(L):
            for j in range(n):
                G.add("prefill", i, j)
        return G.tasks
    pages = pages_per_layer if streamed else 0
    for p in range(pages):
        G.add("weight_page", 0, page=p)
    for i in range(L):
        # layer i+1 overwrites layer i−1; after the last layer, the next decode step's layer 0 goes in
        if L > 1:
            nxt = (i + 1) % L
            for p in range(pages):
                free = (G.get("prefill", i - 1, n - 1),) if i > 0 else ()
                G.add("weight_page", nxt, page=p, deps=free, key=None if nxt else ("next0", p))
        weights = _layer_pages(G, i, pages)
        for j in range(n):
            # and the store two prefills back: one micro-batch's state awaits the link, as the planner counts
            p = i * n + j - 2
            stored = (G.get("kv_store", p // n, p % n),) if p >= 0 else ()
            a = G.add("prefill", i, j, deps=(*weights, *((G.get("prefill", i - 1, j),) if i > 0 else ()), *stored))
            G.add("kv_store", i, j, deps=(a,))
    return G.tasks


def for_policy(policy, num_layers: int, schedule: str = "cgopipe") -> list[Task]:
    return decode_step(schedule, num_layers=num_layers, num_micro_batches=policy.num_micro_batches,
                       pages_per_layer=policy.pages_per_layer,
                       micro_batches_per_expert_batch=policy.micro_batches_per_expert_batch,
                       attention_on=policy.attention_on, ffn_on=policy.ffn_on,
                       streamed=policy.gpu_weight_fraction < 1.0)
