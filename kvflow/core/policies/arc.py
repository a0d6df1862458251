"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) for a tier whose size the state owns.

The state counts slots and decides *when* to evict; this policy only orders the residents
and remembers recently evicted hashes, so it decides *what* to evict:

- ``T1``: residents seen once recently; ``T2``: residents seen at least twice.
- ``B1`` / ``B2``: ghosts, hashes recently evicted from ``T1`` / ``T2`` (no data).
- ``p``: the adaptive target size of ``T1``. A ghost hit in ``B1`` means recency was
  evicted too eagerly, so ``p`` grows; a ghost hit in ``B2`` shrinks it.

Differences from the paper, all because the state, not the policy, performs evictions:

- ``victims`` plays the paper's REPLACE ``n`` times on read-only cursors and never mutates;
  the evictions happen later, when the state calls ``remove`` for each victim.
- Pinned entries are skipped. If the preferred list has no evictable entry left, the other
  one is used.
- REPLACE's tie rule (``x in B2 and |T1| == p``) needs the incoming hash, which ``victims``
  does not get; ties go to ``T2``.
- The directory bounds are kept as in the paper whenever the residents fit in
  ``capacity``: ``|T1| + |B1| <= capacity`` and ``|T1| + |T2| + |B1| + |B2| <= 2 * capacity``.
  Residents are never dropped to honour them; only ghosts are trimmed (oldest first).

``p`` is an int (the paper's ``max(1, |B2| / |B1|)`` step uses floor division), so the
snapshot, and with it the state digest, is exact.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import filterfalse, islice

from kvflow.core.errors import ConfigError
from kvflow.core.policies.base import AlreadyResident, RunPolicy
from kvflow.core.values import is_int


class ARCPolicy(RunPolicy):
    """ARC ordering plus ghost lists; see the module docstring for how it maps onto the state."""

    __slots__ = ("_b1", "_b2", "_p", "_t1", "_t2", "capacity")

    name = "arc"

    def __init__(self, capacity: int) -> None:
        """``capacity`` is the tier's size in blocks: it bounds ``p`` and the ghost lists."""
        if not is_int(capacity) or capacity < 0:
            raise ConfigError(f"arc policy capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        # OrderedDicts, coldest first: the cold end is found at once and move_to_end is O(1)
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._p = 0

    @property
    def p(self) -> int:
        """The adaptive target size of ``T1``, in ``[0, capacity]``."""
        return self._p

    def _insert(self, hashes: tuple[int, ...]) -> None:
        """A ghost hit adapts ``p`` and goes to ``T2`` (it was wanted again after eviction);
        a first sighting goes to ``T1``."""
        t1, t2, b1, b2, capacity = self._t1, self._t2, self._b1, self._b2, self.capacity
        # First sightings trim the ghosts once per run rather than once each: the same oldest
        # ghosts go either way (no ghost is added meanwhile), but a trim still owed must happen
        # before a ghost is looked up, since it may drop that very ghost.
        owed = False
        for block_hash in hashes:
            if block_hash in t1 or block_hash in t2:
                raise AlreadyResident(block_hash)
            if owed and (block_hash in b1 or block_hash in b2):
                self._trim_ghosts()
                owed = False
            if block_hash in b1:
                # the step is computed with the hit still counted in B1, as in the paper
                self._p = min(capacity, self._p + max(1, len(b2) // len(b1)))
                del b1[block_hash]
                t2[block_hash] = None
            elif block_hash in b2:
                self._p = max(0, self._p - max(1, len(b1) // len(b2)))
                del b2[block_hash]
                t2[block_hash] = None
            else:
                t1[block_hash] = None
                owed = True
        if owed:
            self._trim_ghosts()

    def _touch(self, hashes: tuple[int, ...]) -> None:
        """The most recent of ``T2``."""
        t1, t2 = self._t1, self._t2
        for block_hash in hashes:
            if block_hash in t1:
                del t1[block_hash]
                t2[block_hash] = None
            else:
                t2.move_to_end(block_hash)

    def _refresh(self, hashes: tuple[int, ...]) -> None:
        """The most recent of its own list (T1 stays T1)."""
        t1, t2 = self._t1, self._t2
        for block_hash in hashes:
            if block_hash in t1:
                t1.move_to_end(block_hash)
            else:
                t2.move_to_end(block_hash)

    def _remove(self, hashes: tuple[int, ...]) -> None:
        """Remembered in ``B1`` or ``B2``, so a quick return adapts ``p``."""
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for block_hash in hashes:
            if block_hash in t1:
                del t1[block_hash]
                b1[block_hash] = None
            else:
                del t2[block_hash]
                b2[block_hash] = None
            # Moving T -> B keeps |T1| + |B1| and the total, so the bounds still hold unless
            # the residents alone exceeded the capacity (a state that overfilled the tier).
            if len(t1) + len(t2) >= self.capacity:
                self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        """Drop the oldest ghosts until the directory bounds hold (module docstring): B1's
        for ``|T1| + |B1| <= capacity``, then B2's (B1's once B2 is empty) for the total."""
        b1, b2, capacity = self._b1, self._b2, self.capacity
        n1, n2, m1, m2 = len(self._t1), len(self._t2), len(b1), len(b2)
        while m1 and n1 + m1 > capacity:
            b1.popitem(False)  # (the oldest)
            m1 -= 1
        while (m1 or m2) and n1 + n2 + m1 + m2 > 2 * capacity:
            if m2:
                b2.popitem(False)
                m2 -= 1
            else:
                b1.popitem(False)
                m1 -= 1

    def victims(self, num_blocks: int, pinned: Callable[[int], bool]) -> list[int] | None:
        """The paper's REPLACE choice made ``num_blocks`` times: ``T1``'s coldest while
        ``|T1|`` (less the victims taken from it) exceeds ``p``, else ``T2``'s coldest; when
        the preferred list has nothing evictable left, the other's. Does not mutate.

        So the choices come in three runs: ``T1``'s coldest evictable, until ``|T1|`` is
        down to ``p``; then ``T2``'s; then, if ``T2`` had too few, ``T1``'s next ones."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._t1) + len(self._t2):
            return None
        cold1 = filterfalse(pinned, self._t1)  # each list's evictable entries, coldest first
        cold2 = filterfalse(pinned, self._t2)
        chosen = list(islice(cold1, min(num_blocks, max(0, len(self._t1) - self._p))))
        chosen += islice(cold2, num_blocks - len(chosen))
        chosen += islice(cold1, num_blocks - len(chosen))
        return chosen if len(chosen) == num_blocks else None

    def resident(self) -> list[int]:
        """``T1`` then ``T2``, each coldest first."""
        return [*self._t1, *self._t2]

    def snapshot(self) -> tuple[str, list[int], list[int], list[int], list[int], int]:
        """``(name, T1, T2, B1, B2, p)``, lists coldest first: everything that drives
        decisions, ghosts included, so two runs that differ only in history still differ."""
        return (self.name, list(self._t1), list(self._t2), list(self._b1), list(self._b2), self._p)

    def clear(self) -> None:
        """Forget everything, ghosts and ``p`` included."""
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._p = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._t1 or block_hash in self._t2

    def __repr__(self) -> str:
        return (
            f"ARCPolicy(capacity={self.capacity}, p={self._p}, t1={len(self._t1)}, "
            f"t2={len(self._t2)}, b1={len(self._b1)}, b2={len(self._b2)})"
        )

