"""Least-recently-used eviction: the tier's blocks in recency order, coldest first.

An ``OrderedDict`` keeps the order: ``move_to_end`` is a touch, and its cold end is found at
once however many blocks came and went (a plain dict's re-insertions leave holes at its front
that every scan would have to skip).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import filterfalse, islice

from kvflow.core.policies.base import AlreadyResident, RunPolicy


class LRUPolicy(RunPolicy):
    """Evicts the least recently inserted-or-touched resident block first.

    The chain rule (F14) is the caller's part: touching a chain deepest first leaves its head
    the most recent, so tails go before heads.
    """

    __slots__ = ("_order",)

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        """LRU keeps nothing beyond the residents, so it does not need ``capacity``."""
        self._order: OrderedDict[int, None] = OrderedDict()  # the keys, coldest first

    def _insert(self, hashes: tuple[int, ...]) -> None:
        """The most recent, in order. All or nothing: a hash resident already, or named
        twice, changes nothing."""
        order = self._order
        before = len(order)
        for block_hash in hashes:
            order[block_hash] = None  # (a resident one keeps its place: the count falls short)
        if len(order) != before + len(hashes):
            while len(order) > before:  # the new ones, the newest, are taken back
                order.popitem()
            seen: set[int] = set()
            for block_hash in hashes:
                if block_hash in order or block_hash in seen:
                    raise AlreadyResident(block_hash)
                seen.add(block_hash)

    def _touch(self, hashes: tuple[int, ...]) -> None:
        """The most recent, in order."""
        move_to_end = self._order.move_to_end
        for block_hash in hashes:
            move_to_end(block_hash)

    # LRU has no notion of frequency: a reorder is a touch
    _refresh = _touch

    def _remove(self, hashes: tuple[int, ...]) -> None:
        order = self._order
        for block_hash in hashes:
            del order[block_hash]

    def victims(self, num_blocks: int, pinned: Callable[[int], bool]) -> list[int] | None:
        """The ``num_blocks`` coldest hashes that are not ``pinned``, coldest first."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._order):
            return None
        chosen = list(islice(filterfalse(pinned, self._order), num_blocks))
        return chosen if len(chosen) == num_blocks else None

    def resident(self) -> list[int]:
        """Coldest first."""
        return list(self._order)

    def snapshot(self) -> tuple[str, list[int]]:
        """``(name, resident hashes coldest first)``."""
        return (self.name, list(self._order))

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._order

    def __repr__(self) -> str:
        return f"LRUPolicy(resident={len(self)})"

