"""Compacting a sparse batch: once nothing waits, finished requests' slots are closed up by moving the
requests left (and their cached state) into each micro-batch's first slots, so that CPU attention reads
neighbouring cache rows in place. Greedy tokens must still be transformers' own, for each kind of
layer state a move has to carry (K/V, a sliding window's ring, MLA's latent, a linear layer's state).
"""

from __future__ import annotations

import pytest

from checkpoints import reference_greedy
from core.runtime.batching import SlotTable
from core.runtime.engine import Engine, Request

from test_engine_parity import MAX_NEW, PROMPTS


def test_the_highest_requests_fill_the_lowest_holes_within_each_micro_batch():
    table = SlotTable(slots=8, micro_batch_size=4)
    for s in range(8):
        table.place(f"r{s}", 10)
    before = list(table.owner)
    for s in (0, 2, 5):
        table.release(s, 10)
    loads = list(table.tokens)
    assert table.compact() == [(3, 0), (7, 5)]  # slot 1 stays; 2 is past the two requests left
    assert [o is not None for o in table.owner] == [True, True, False, False, True, True, True, False]
    assert table.owner[0] == before[3] and table.owner[5] == before[7] and table.tokens == loads
    assert table.compact() == []


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v2", "qwen3_next"])
def test_compacted_requests_keep_their_state(family, checkpoint_factory, monkeypatch):
    path = checkpoint_factory(family)
    engine = Engine.load(path)
    engine.eos_ids = set()
    decodes, moves = [], []
    real = engine.runner

    def runner(*args, **kwargs):
        r = real(*args, **kwargs)
        decode, move = r.decode, r.move_rows
        r.decode = lambda tokens, slots, positions: (decodes.append(slots), decode(tokens, slots, positions))[1]
        r.move_rows = lambda m: (moves.append(m), move(m))[1]
        return r

    monkeypatch.setattr(engine, "runner", runner)
    reqs = [Request(id=f"r{i}", prompt=p, max_new_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
    results = {r.id: r for r in engine.generate(reqs, batch_size=7, micro_batch_size=4)}
    assert moves, "requests finishing early must leave holes to close"
    for step in decodes:  # every decode reads each micro-batch's first slots, with no gap
        for group, lo in zip(step, (0, 4)):
            assert group == list(range(lo, lo + len(group))), step
    for r in reqs:
        assert results[r.id].output_token_ids == reference_greedy(path, engine.prompt_token_ids(r), r.max_new_tokens)
