"""Requests dealt into micro-batches (the paper's Algorithm 2): each to the one with the fewest tokens, to balance."""

from __future__ import annotations


class SlotTable:
    def __init__(self, slots: int, micro_batch_size: int):
        if slots < 1 or micro_batch_size < 1:
            raise ValueError("batch and micro-batch sizes must be >= 1")
        self.micro_batch_size = min(micro_batch_size, slots)
        self.ranges = [(lo, min(lo + self.micro_batch_size, slots)) for lo in range(0, slots, self.micro_batch_size)]
        self.owner: list[object | None] = [None] * slots  # request occupying each slot
        self.tokens = [0] * len(self.ranges)  # tokens held by each micro-batch

    def micro_batch_of(self, slot: int) -> int:
        return slot // self.micro_batch_size

    def free_slots(self) -> int:
        return sum(o is None for o in self.owner)

    def place(self, request, tokens: int, among: int | None = None) -> int:
        """A slot in the emptiest micro-batch (of the first `among`)."""
        room = [j for j, (lo, hi) in enumerate(self.ranges[:among]) if None in self.owner[lo:hi]]
        if not room:
            raise RuntimeError("no free slot")
        best = min(room, key=self.tokens.__getitem__)  # the first of equals
        lo, hi = self.ranges[best]
        slot = next(s for s in range(lo, hi) if self.owner[s] is None)
        self.owner[slot] = request
        self.tokens[best] += tokens
        return slot

    def release(self, slot: int, tokens: int) -> None:
        self.owner[slot] = None
        self.tokens[self.micro_batch_of(slot)] -= tokens

    def compact(self) -> list[tuple[int, int]]:
        """Each micro-batch's requests into its first slots, highest into lowest free."""
        moves = []
        for lo, hi in self.ranges:
            used = [s for s in range(lo, hi) if self.owner[s] is not None]
            holes = [s for s in range(lo, lo + len(used)) if self.owner[s] is None]
            for src, dst in zip([s for s in reversed(used) if s >= lo + len(used)], holes):  # highest first
                self.owner[dst], self.owner[src] = self.owner[src], None
                moves.append((src, dst))
        return moves
