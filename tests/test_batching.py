"""Algorithm 2 in the slot table: longest request first, into the micro-batch holding the fewest tokens."""

from __future__ import annotations

from core.runtime.batching import SlotTable


def test_requests_are_dealt_to_the_emptiest_micro_batch():
    table = SlotTable(slots=6, micro_batch_size=2)
    lengths = [418, 300, 120, 90, 77, 10]  # already longest first, as the engine sorts them
    slots = [table.place(f"r{i}", n) for i, n in enumerate(lengths)]
    groups = [table.micro_batch_of(s) for s in slots]
    assert groups[:3] == [0, 1, 2]  # the three longest open one micro-batch each
    assert table.tokens == [418 + 10, 300 + 77, 120 + 90]  # then each goes where the load is lowest
    assert max(table.tokens) - min(table.tokens) < lengths[0]


def test_a_freed_slot_is_refilled_and_a_full_micro_batch_is_skipped():
    table = SlotTable(slots=4, micro_batch_size=2)
    a, b, c, d = (table.place(x, n) for x, n in [("a", 100), ("b", 90), ("c", 10), ("d", 5)])
    assert table.free_slots() == 0
    table.release(c, 10)
    assert table.free_slots() == 1
    assert table.micro_batch_of(c) == table.micro_batch_of(b)  # c (10) joined b (90), the lighter one
    e = table.place("e", 50)  # the only free slot, whatever the loads
    assert e == c and table.owner[e] == "e" and table.tokens[table.micro_batch_of(e)] == 90 + 50
