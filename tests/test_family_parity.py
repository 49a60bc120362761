"""Issue 14's families on every executor and schedule, against transformers, with each family's quirk
shown to be exercised by the very batch that passes: a prompt longer than gpt-oss's sliding window,
dense layers streamed beside MoE ones, routing groups that change the experts, linear-attention and
LongRoPE state carried across slot refill (7 requests through 4 slots)."""

from __future__ import annotations

import pytest
import torch

from checkpoints import NEW_FAMILIES, reference_greedy
from core.model import routing
from core.runtime.engine import Engine, Request
from test_engine_parity import MAX_NEW, PROMPTS

RUNS = [  # (executor, schedule, pages per layer, layers with resident experts, micro-batches per expert batch)
    ("threaded", "cgopipe", 2, 0, 2),  # every expert streamed in pages, expert batches of two micro-batches
    ("threaded", "s4", 1, 1, 1),  # attention on the "GPU" over mirrored state rows, layer 0 resident
    ("sequential", "s3", 3, None, 1),
]


def _requests():
    return [Request(id=f"r{i}", prompt=p, max_new_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_every_executor_and_schedule_gives_transformers_tokens(family, checkpoint_factory, monkeypatch):
    path = checkpoint_factory(family)
    reqs = _requests()
    limited = []
    if family in ("deepseek_v2", "deepseek_v3", "glm4_moe"):  # record tokens whose experts the group limit changes
        def watch(spec, h, w, fused=False, _route=routing.route):
            got = _route(spec, h, w, fused)
            if spec.router_groups > 1:
                import dataclasses
                free = _route(dataclasses.replace(spec, router_groups=1, router_topk_groups=1), h, w)[1]
                limited.append(int((got[1].sort().values != free.sort().values).any(-1).sum()))
            return got
        monkeypatch.setattr(routing, "route", watch)
    for executor, schedule, pages, resident, group in RUNS:
        engine = Engine.load(path, executor=executor, schedule=schedule, pages_per_layer=pages,
                             resident_layers=resident, expert_group=group)
        engine.eos_ids = set()
        try:
            got = {r.id: r.output_token_ids for r in engine.generate(reqs, batch_size=4, micro_batch_size=2)}
        finally:
            engine.close()
        for r in reqs:
            want = reference_greedy(path, engine.prompt_token_ids(r), r.max_new_tokens)
            assert got[r.id] == want, f"{family} {executor}/{schedule} {r.id}"
    spec = engine.spec
    longest = max(len(engine.prompt_token_ids(r)) for r in reqs)
    assert len(reqs) > 4  # slots are refilled: a new request starts from its own state, not its slot's last
    if spec.sliding_window:
        assert longest > spec.sliding_window  # prompts overflow the window's ring
    if spec.dense_layers:
        assert 0 in spec.dense_layers and spec.moe_layers < spec.num_layers
    if spec.router_groups > 1:
        assert sum(limited) > 0  # some tokens' experts differ from an unlimited top-k
    if spec.rope.kind == "longrope":
        assert min(len(engine.prompt_token_ids(r)) for r in reqs) < spec.rope.original_max < longest
