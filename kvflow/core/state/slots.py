"""The tier's free slots: the stack allocation takes from, kept without a slot per slot.

A fresh tier hands out 0, 1, 2... (contiguous host runs keep the executor's copies at full
speed) and a slot given back is handed out again first. As a list that is the stack
``[capacity - 1, ..., fresh] + given back``, its top last: the never-used part is a range, so
``FreeSlots`` keeps it as its lower end ``fresh`` and holds only the slots given back. A tier of
billions of slots costs nothing until its slots are used, and the stack's part of the state digest
is a running sum kept as slots come and go (``tally``). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain, islice

from kvflow.core.state.digest import pair_sum


class FreeSlots:
    """``State.free_slots``: ``len``, ``in`` and iteration (bottom first) as the stack's list;
    ``top(n)`` is what the next ``n`` new entries take, ``take`` and ``give_back`` change it."""

    __slots__ = ("capacity", "fresh", "freed", "tally")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.fresh = 0  # slots fresh..capacity-1 were never handed out: free, below the rest
        self.freed: dict[int, None] = {}  # slots given back, the top last (a dict: ``in`` at once)
        # sum of pair_sum(position in ``freed``, slot): the stack's order, kept for the digest
        self.tally = 0

    def __len__(self) -> int:
        return self.capacity - self.fresh + len(self.freed)

    def __contains__(self, slot: object) -> bool:
        return slot in self.freed or (type(slot) is int and self.fresh <= slot < self.capacity)

    def __iter__(self) -> Iterator[int]:
        """Bottom first, as the stack's list: the never-used slots highest first, then the
        slots given back in the order they came back (O(capacity): tests and the full digest
        of traces before version 4 read it)."""
        return chain(range(self.capacity - 1, self.fresh - 1, -1), self.freed)

    def __repr__(self) -> str:
        return f"FreeSlots({len(self)} free: never used from {self.fresh}, {len(self.freed)} given back)"

    def top(self, n: int) -> tuple[int, ...]:
        """The slots the next ``n`` new entries take, in order: the top of the stack first
        (the last given back), then never-used ones from ``fresh`` up. Fewer if fewer are free."""
        out = tuple(islice(reversed(self.freed), n)) if self.freed else ()
        if len(out) < n:
            out += tuple(range(self.fresh, min(self.fresh + n - len(out), self.capacity)))
        return out

    def take(self, n: int) -> None:
        """The top ``n`` slots (``top(n)``, at least ``n`` free) are handed out."""
        freed = self.freed
        k = min(n, len(freed))
        if k:
            last = len(freed) - 1
            popped = [freed.popitem()[0] for _ in range(k)]  # (a dict pops its last item)
            self.tally -= pair_sum(range(last, last - k, -1), popped)
        self.fresh += n - k

    def give_back(self, slots: Iterable[int]) -> None:
        """``slots`` (none free) go on top, in order."""
        freed = self.freed
        first = len(freed)
        back = list(slots)
        freed.update(dict.fromkeys(back))
        self.tally += pair_sum(range(first, first + len(back)), back)

    def copy(self) -> FreeSlots:
        clone = FreeSlots(self.capacity)
        clone.fresh, clone.freed, clone.tally = self.fresh, dict(self.freed), self.tally
        return clone
