"""Least-recently-used eviction: the tier's entries in recency order, coldest first.

Part of the pure state (see ``base.py``): mutated only by ``evolve``, queried by ``decide``.
An ``OrderedDict`` keeps the order rather than a plain ``dict``: re-inserting into a plain
dict leaves holes at its front that every ``victims`` call would have to skip (measured
~170 µs per call on a churned 100k-entry dict against ~0.5 µs here), and ``move_to_end`` is
also the fastest touch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import filterfalse, islice


class LRUPolicy:
    """Evicts the least recently inserted-or-touched resident hash first.

    The chain rule (F14) is the caller's part: touching a chain deepest-first leaves the
    head most recent, so tails go before heads.
    """

    __slots__ = ("_last_moved", "_order", "_unjoined")

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        """``capacity`` is accepted so every policy is built the same way; LRU keeps no
        history beyond the residents, so it does not need it."""
        # Values are unused: the keys' order (coldest first) is the whole state.
        self._order: OrderedDict[int, None] = OrderedDict()
        # The hashes of the last bulk insert / touch / refresh while nothing else has changed
        # the order since (else None): they are then the newest keys, in the order a
        # refresh of them gives, so refreshing them again changes nothing. The usual case:
        # a chain touched, then refreshed by the next event (a third of the benchmark's
        # refreshed hashes); one tuple comparison then replaces a move per hash.
        self._last_moved: tuple[int, ...] | None = None
        # The last store's hashes, not yet added to the order (see admit_new_many), or None.
        self._unjoined: tuple[int, ...] | None = None

    def insert(self, block_hash: int) -> None:
        """``block_hash`` became resident and is the most recent.

        Raises ``ValueError`` if it is already tracked: the state and the policy disagree,
        and silently keeping the old position would corrupt the order.
        """
        if self._unjoined is not None:
            self._join_stored()
        order = self._order
        if block_hash in order:
            raise ValueError(f"block hash {block_hash} is already resident in the lru policy")
        order[block_hash] = None
        self._last_moved = None

    def touch(self, block_hash: int) -> None:
        """``block_hash`` was used: it becomes the most recent. ``KeyError`` if not resident."""
        if self._unjoined is not None:
            self._join_stored()
        self._last_moved = None
        self._order.move_to_end(block_hash)

    def insert_many(self, hashes: tuple[int, ...]) -> None:
        """``insert`` for each hash in order. All-or-nothing: a hash already resident, or
        repeated in ``hashes``, raises ``ValueError`` and changes nothing."""
        if self._unjoined is not None:
            self._join_stored()
        order = self._order
        before = len(order)
        for h in hashes:
            order[h] = None  # a tracked hash keeps its place, so the count falls short
        if len(order) != before + len(hashes):
            while len(order) > before:  # the new ones are the newest: take them back
                order.popitem()
            raise ValueError(f"a block hash of {list(hashes)[:4]} is already resident in the lru policy")
        self._last_moved = hashes

    def admit_new_many(self, hashes: tuple[int, ...]) -> None:
        """``insert_many`` of hashes the caller knows to be new (the state's stores). They
        join the order when the policy is next used (``_join_stored``): a request's end
        refreshes its chain deepest first, and they then join in that order instead of
        being inserted and moved one by one (as ARCPolicy.admit_new_many)."""
        if self._unjoined is not None:
            self._join_stored()
        self._unjoined = self._last_moved = hashes

    def _join_stored(self, refreshed: tuple[int, ...] = ()) -> int:
        """Add the last store's hashes to the order's newest end: in the order stored or,
        if ``refreshed`` (a refresh's hashes) begins with them in reverse, in that order,
        which is where that refresh would move them. Returns how many hashes of
        ``refreshed`` that covered."""
        stored, order = self._unjoined or (), self._order
        self._unjoined = None
        covered = len(stored) if refreshed[: len(stored)] == stored[::-1] else 0
        for h in reversed(stored) if covered else stored:
            order[h] = None
        return covered

    # LRU has no notion of frequency: a reorder is a touch (the same functions: no extra call).
    refresh = touch

    def touch_many(self, hashes: tuple[int, ...]) -> None:
        """``touch`` for each hash in order."""
        if hashes == self._last_moved:
            return  # (moving each to the end again, in order, would leave them where they are)
        start = 0 if self._unjoined is None else self._join_stored(hashes)
        self._last_moved = None  # (a hash not resident raises with the moves half done)
        deque(map(self._order.move_to_end, hashes[start:] if start else hashes), 0)
        self._last_moved = hashes

    refresh_many = touch_many

    def remove_many(self, hashes: tuple[int, ...]) -> None:
        """``remove`` for each hash."""
        if self._unjoined is not None:
            self._join_stored()
        self._last_moved = None
        order = self._order
        for h in hashes:
            del order[h]

    def remove(self, block_hash: int, ghost: bool = True) -> None:
        """``block_hash`` left the tier. ``ghost`` is accepted for interface parity with
        ARC (LRU remembers nothing about evicted hashes). ``KeyError`` if not resident."""
        if self._unjoined is not None:
            self._join_stored()
        self._last_moved = None
        del self._order[block_hash]

    def victims(self, num_blocks: int, pinned: Callable[[int], bool] | None) -> list[int] | None:
        """The ``num_blocks`` coldest hashes that are not ``pinned``, coldest first, or
        ``None`` if there are fewer (all-or-nothing, F8). Scans from the cold end and stops
        at ``num_blocks`` (at C level: ``pinned`` is typically a dict's ``__contains__``).
        ``pinned=None``: nothing is pinned, so no call per hash (the usual eviction)."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if self._unjoined is not None:
            self._join_stored()
        if num_blocks > len(self._order):
            return None
        unpinned = self._order if pinned is None else filterfalse(pinned, self._order)
        chosen = list(islice(unpinned, num_blocks))
        return chosen if len(chosen) == num_blocks else None

    def resident(self) -> list[int]:
        """Resident hashes, coldest first."""
        if self._unjoined is not None:
            self._join_stored()
        return list(self._order)

    def snapshot(self) -> tuple[str, list[int]]:
        """``(name, resident hashes coldest first)``: everything that drives decisions."""
        if self._unjoined is not None:
            self._join_stored()
        return (self.name, list(self._order))

    def clear(self) -> None:
        """Forget everything (reset)."""
        self._order.clear()
        self._last_moved = self._unjoined = None

    def __len__(self) -> int:
        return len(self._order) + (0 if self._unjoined is None else len(self._unjoined))

    def __contains__(self, block_hash: object) -> bool:
        if self._unjoined is not None:
            self._join_stored()
        return block_hash in self._order

    def __repr__(self) -> str:
        return f"LRUPolicy(resident={len(self)})"
