"""ARC's ghost lists (B1, B2): hashes recently evicted, oldest first, without their data.

A ghost list is only ever appended to (an eviction), trimmed from its oldest end (the
directory bounds), asked whether it holds a hash, and has a hash taken out anywhere (a ghost
hit). So it is kept as a plain dict of the live ghosts plus a deque of the order, not as an
``OrderedDict``: no linked node per entry to allocate, link and free, about half the memory
(the four lists of a 10,000-block tier are looked up on every hash, and that is memory-bound).

A ghost hit leaves a stale place in the deque, skipped when the oldest are dropped; ``_stale``
counts them per hash (a hash can be a ghost, hit, evicted and a ghost again: its earlier places
are stale, its last one live). When stale places outnumber the live ghosts the deque is rebuilt,
so memory stays bounded by the live ones. Order, membership and length are exactly those of the
``OrderedDict`` it replaces (tests/test_policies.py checks the policy against a plain-list
transcription of ARC).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from itertools import repeat, starmap


class Ghosts:
    """Recently evicted hashes, oldest first (see the module docstring)."""

    __slots__ = ("_live", "_order", "_stale", "_stale_count")

    def __init__(self) -> None:
        self._live: dict[int, None] = {}
        self._order: deque[int] = deque()
        self._stale: dict[int, int] = {}  # hash -> how many of its places in _order are stale
        self._stale_count = 0

    def add_many(self, hashes: Iterable[int]) -> None:
        """Each hash (distinct, none a ghost here already) becomes the newest ghost, in order."""
        hashes = tuple(hashes)
        self._live.update(zip(hashes, repeat(None)))
        self._order.extend(hashes)

    def add(self, block_hash: int) -> None:
        self._live[block_hash] = None
        self._order.append(block_hash)

    def discard(self, block_hash: int) -> None:
        """A ghost hit: ``block_hash`` (a ghost here) leaves the list."""
        del self._live[block_hash]
        self._stale[block_hash] = self._stale.get(block_hash, 0) + 1
        self._stale_count += 1
        if self._stale_count > len(self._live) + 64:
            self._compact()

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest ghosts (at most all of them)."""
        count = min(count, len(self._live))
        if count <= 0:
            return
        order, live = self._order, self._live
        if not self._stale:  # every place is live: one C-level pass
            deque(map(live.pop, starmap(order.popleft, repeat((), count))), 0)
            return
        stale = self._stale
        while count:
            h = order.popleft()
            left = stale.get(h)
            if left:  # an earlier place of a hash hit since: skip it
                if left == 1:
                    del stale[h]
                else:
                    stale[h] = left - 1
                self._stale_count -= 1
            else:
                del live[h]
                count -= 1

    def _compact(self) -> None:
        self._order = deque(self)
        self._stale.clear()
        self._stale_count = 0

    def isdisjoint(self, hashes: Iterable[int]) -> bool:
        return self._live.keys().isdisjoint(hashes)

    def clear(self) -> None:
        self._live.clear()
        self._order.clear()
        self._stale.clear()
        self._stale_count = 0

    def __iter__(self) -> Iterator[int]:
        """The live ghosts, oldest first."""
        if not self._stale:
            return iter(list(self._order))
        skip = dict(self._stale)
        out = []
        for h in self._order:
            left = skip.get(h)
            if left:
                skip[h] = left - 1
            else:
                out.append(h)
        return iter(out)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __deepcopy__(self, memo: dict[int, object]) -> Ghosts:
        clone = Ghosts()
        clone._live = dict(self._live)
        clone._order = deque(self._order)
        clone._stale = dict(self._stale)
        clone._stale_count = self._stale_count
        return clone
