"""Least-recently-used eviction: the tier's blocks in recency order, coldest first.

An ``OrderedDict`` keeps the order: ``move_to_end`` is a touch, and its cold end is found at
once however many blocks came and went (a plain dict's re-insertions leave holes at its front
that every scan would have to skip).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import filterfalse, islice

from kvflow.core.policies.base import Policy


class LRUPolicy(Policy):
    """Evicts the least recently inserted-or-touched resident block first.

    The chain rule (F14) is the caller's part: touching a chain deepest first leaves its head
    the most recent, so tails go before heads.
    """

    __slots__ = ("_order",)

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        """LRU keeps nothing beyond the residents, so it does not need ``capacity``."""
        self._order: OrderedDict[int, None] = OrderedDict()  # the keys, coldest first

    def insert(self, block_hash: int) -> None:
        """The most recent. ``ValueError`` if already resident: the state and the policy
        disagree, and keeping the old place would corrupt the order."""
        if block_hash in self._order:
            raise ValueError(f"block hash {block_hash} is already resident in the lru policy")
        self._order[block_hash] = None

    def touch(self, block_hash: int) -> None:
        """The most recent. ``KeyError`` if not resident."""
        self._order.move_to_end(block_hash)

    # LRU has no notion of frequency: a reorder is a touch
    refresh = touch

    def remove(self, block_hash: int) -> None:
        """``KeyError`` if not resident."""
        del self._order[block_hash]

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
