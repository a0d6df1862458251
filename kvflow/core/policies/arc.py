"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) for a tier whose size the state owns.

The state counts slots and decides *when* to evict; this policy only orders the residents
and remembers recently evicted hashes, so it decides *what* to evict:

- ``T1``: residents seen once recently; ``T2``: residents seen at least twice.
- ``B1`` / ``B2``: ghosts, hashes recently evicted from ``T1`` / ``T2`` (no data).
- ``p``: the adaptive target size of ``T1``. A ghost hit in ``B1`` means recency was
  evicted too eagerly, so ``p`` grows; a ghost hit in ``B2`` shrinks it.

Differences from the paper, all because the state, not the policy, performs evictions:

- ``victims`` plays the paper's REPLACE ``n`` times on read-only cursors and never mutates;
  the evictions happen later, when ``evolve`` calls ``remove`` for each victim.
- Pinned or in-flight entries are skipped (``evictable``). If the preferred list has no
  evictable entry left, the other one is used.
- REPLACE's tie rule (``x in B2 and |T1| == p``) needs the incoming hash, which ``victims``
  does not get; ties go to ``T2``.
- The directory bounds are kept as in the paper whenever the residents fit in
  ``capacity``: ``|T1| + |B1| <= capacity`` and ``|T1| + |T2| + |B1| + |B2| <= 2 * capacity``.
  Residents are never dropped to honour them; only ghosts are trimmed (oldest first).

``p`` is an int (the paper's ``max(1, |B2| / |B1|)`` step uses floor division), so the
snapshot, and with it the state digest, is exact.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import repeat

from kvflow.core.errors import ConfigError
from kvflow.core.policies.arc_runs import drop_run, ghost_steps, is_newest, move_run, refresh_run
from kvflow.core.policies.arc_victims import replace_choices
from kvflow.core.values import is_int


class ARCPolicy:
    """ARC ordering plus ghost lists; see the module docstring for how it maps onto the state."""

    __slots__ = ("_b1", "_b2", "_last_moved", "_p", "_unjoined", "_t1", "_t2", "capacity")

    name = "arc"

    def __init__(self, capacity: int) -> None:
        """``capacity`` is the tier's size in blocks: it bounds ``p`` and the ghost lists."""
        if not is_int(capacity) or capacity < 0:
            raise ConfigError(f"arc policy capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        # OrderedDicts, coldest first: O(1) move_to_end / popitem at both ends, and the cold
        # end is found in O(1) (a plain dict leaves holes at the front that iteration skips).
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._p = 0
        # The last bulk insert / touch / refresh's hashes while nothing else changed since
        # (else None): each is its list's newest, as a refresh of them leaves it, so a refresh
        # of them changes nothing (a chain touched then refreshed: a third of the benchmark's
        # refreshed hashes). Not a touch: it moves a refreshed T1 member to T2.
        self._last_moved: tuple[int, ...] | None = None
        # The last store's hashes, not yet added to T1 / T2 (see _join_stored), or None:
        # (the hashes stored, those bound for T1, those bound for T2, each in stored order).
        self._unjoined: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def p(self) -> int:
        """The adaptive target size of ``T1``, in ``[0, capacity]``."""
        return self._p

    def insert(self, block_hash: int) -> None:
        """``block_hash`` became resident. A ghost hit adapts ``p`` and goes to ``T2``
        (it was wanted again after eviction); a first sighting goes to ``T1``.

        Raises ``ValueError`` if it is already resident: the state and the policy disagree.
        """
        self.insert_many((block_hash,))

    def touch(self, block_hash: int) -> None:
        """A resident hash was used: it becomes the most recent of ``T2``.
        ``KeyError`` if it is not resident."""
        if self._unjoined is not None:
            self._join_stored()
        self._last_moved = None
        t1 = self._t1
        if block_hash in t1:
            del t1[block_hash]
            self._t2[block_hash] = None
        else:
            self._t2.move_to_end(block_hash)

    def refresh(self, block_hash: int) -> None:
        """Reorder without a new use: the most recent of its own list (T1 stays T1).
        ``KeyError`` if it is not resident."""
        if self._unjoined is not None:
            self._join_stored()
        self._last_moved = None
        t1 = self._t1
        if block_hash in t1:
            t1.move_to_end(block_hash)
        else:
            self._t2.move_to_end(block_hash)

    def remove(self, block_hash: int, ghost: bool = True) -> None:
        """``block_hash`` left the tier. An eviction (``ghost=True``) remembers it in ``B1`` or
        ``B2`` so a quick return adapts ``p``; any other removal (a reset, a failed entry)
        says nothing about the workload and leaves no ghost. ``KeyError`` if not resident."""
        if self._unjoined is not None:
            self._join_stored()
        self._last_moved = None
        t1 = self._t1
        t2 = self._t2
        if block_hash in t1:
            del t1[block_hash]
            if ghost:
                self._b1[block_hash] = None
        else:
            del t2[block_hash]
            if ghost:
                self._b2[block_hash] = None
        # Moving T -> B keeps L1 and L1 + L2, so the bounds still hold unless the residents
        # alone exceeded the capacity (a state that overfilled the tier).
        if ghost and len(t1) + len(t2) >= self.capacity:
            self._trim_ghosts()

    def _trim_ghosts(self, to_t1: int = 0, to_t2: int = 0) -> None:
        """Drop the oldest ghosts until the directory bounds hold (see module docstring):
        B1's for ``|T1| + |B1| <= capacity``, then B2's (B1's once B2 is empty) for the
        total, as the paper's one-at-a-time loops would, in bulk. ``to_t1`` / ``to_t2``:
        residents stored but not yet added to T1 / T2 (a store being admitted).

        Once after a run of first sightings equals once after each while the residents
        fit: the bounds held before (they always do while the residents fit), each
        sighting raises ``|T1| + |B1|`` and the total by one, and each trim step takes back
        one, from B1 for the first bound and from B2 for the second (B2 always suffices
        there: ``|T1| + |B1| <= capacity`` and ``|T2| <= capacity`` leave the total over
        ``2 * capacity`` by at most ``|B2|``)."""
        # (``popitem(False)`` drops the oldest. The counts are tested inline rather than in
        # a helper: a Python call costs about two drops, and the usual trim is one run;
        # conditional expressions rather than min(): a builtin taking keywords costs
        # about four times as much.)
        capacity = self.capacity
        b1, b2 = self._b1, self._b2
        t1_size = len(self._t1) + to_t1
        over_l1 = t1_size + len(b1) - capacity
        if over_l1 > 0:
            deque(map(b1.popitem, repeat(False, over_l1 if over_l1 < len(b1) else len(b1))), 0)
        excess = t1_size + len(self._t2) + to_t2 + len(b1) + len(b2) - 2 * capacity
        if excess > 0:
            from_b2 = excess if excess < len(b2) else len(b2)
            deque(map(b2.popitem, repeat(False, from_b2)), 0)
            from_b1 = excess - from_b2
            if from_b1:
                deque(map(b1.popitem, repeat(False, from_b1 if from_b1 < len(b1) else len(b1))), 0)

    def victims(self, num_blocks: int, pinned: Callable[[int], bool] | None) -> list[int] | None:
        """The paper's REPLACE choice made ``num_blocks`` times, skipping ``pinned``
        entries, or ``None`` if fewer are unpinned (all-or-nothing, F8). Does not mutate.
        ``pinned=None``: nothing is pinned, so no call per hash (the usual eviction).
        (The scans: kvflow.core.policies.arc_victims.)"""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if self._unjoined is not None:
            self._join_stored()
        return replace_choices(self._t1, self._t2, self._p, num_blocks, pinned)

    # Bulk forms, one call per event: each equals the single-hash method applied to every
    # hash in order (tests/core/test_policies.py checks it on random histories and against the
    # list reference), for the inputs evolve hands them: hashes resident where the single
    # method needs them resident, distinct where the event makes them so (a store's, an
    # eviction's). Their cost is per call plus C-level work per hash where CPython has it:
    # ``map`` over ``move_to_end`` (a fast-call method) beats a bytecode loop, but over
    # ``__setitem__`` / ``__delitem__`` (slot wrappers, an argument tuple per call) it loses
    # to ``d[h] = None`` in a loop (measured with callgrind), so those stay loops.

    def insert_many(self, hashes: tuple[int, ...]) -> None:
        """``insert`` for each hash in order. All-or-nothing: a hash already resident, or
        named twice, raises ``ValueError`` and changes nothing."""
        if self._unjoined is not None:
            self._join_stored()
        self._check_new(hashes)
        self.admit_new_many(hashes)

    def admit_new_many(self, hashes: tuple[int, ...]) -> None:
        """``insert_many`` of hashes the caller knows to be new: none resident, none named
        twice. The state's stores are (their entries were pending, never resident, and
        ``check_invariants`` compares the policy's residents with the state's), so they
        skip ``insert_many``'s checks, a lookup or two per hash. Unchecked: a resident or
        repeated hash would be tracked twice.

        The hashes join their lists (ghost hits T2, first sightings T1) when the policy is
        next used (``_join_stored``): a request's end refreshes its chain deepest first,
        and then they join in that order instead of being moved there one by one."""
        if self._unjoined is not None:
            self._join_stored()
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if len(t1) + len(t2) + len(hashes) > self.capacity:
            for h in hashes:  # residents overfill the tier: ghosts trimmed as each one lands
                self._insert_one(h)
        elif (not b1 or b1.keys().isdisjoint(hashes)) and (not b2 or b2.keys().isdisjoint(hashes)):
            # The usual store, first sightings only: bound for T1, one trim (_trim_ghosts).
            # (An empty ghost list is not searched: B2 stays empty until T2 is evicted from.)
            self._unjoined = (hashes, hashes, ())
            self._trim_ghosts(len(hashes))
        else:
            self._unjoined = (hashes, *self._ghost_runs(hashes))
        # (ghost hits are T2's newest, first sightings T1's, each in this order)
        self._last_moved = hashes

    def _join_stored(self, refreshed: tuple[int, ...] = ()) -> int:
        """Add the last store's hashes to their lists: in the order stored or, if
        ``refreshed`` (a refresh's hashes) begins with them in reverse, in that order,
        which is where that refresh would move them. Returns how many hashes of
        ``refreshed`` that covered."""
        stored, to_t1, to_t2 = self._unjoined  # type: ignore[misc]
        self._unjoined = None
        covered = len(stored) if refreshed[: len(stored)] == stored[::-1] else 0
        t1, t2 = self._t1, self._t2
        for h in reversed(to_t1) if covered else to_t1:
            t1[h] = None
        for h in reversed(to_t2) if covered else to_t2:
            t2[h] = None
        return covered

    def _ghost_runs(self, hashes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``admit_new_many`` of hashes that fit, some of them ghosts: a run of one kind
        (B1 hits, B2 hits, first sightings) at a time, in order. Returns the hashes bound
        for T1 and those bound for T2, each in order (added by ``_join_stored``).

        Each run is classified when it is reached: the trimming after a run of first
        sightings may drop a ghost that a later hash names, which then is a first sighting
        too, as one by one. A run of ghost hits trims nothing (each moves B -> T2, leaving
        ``|T1| + |B1|`` no larger and the total unchanged) and changes no other hash's list.
        """
        b1, b2, capacity = self._b1, self._b2, self.capacity
        to_t1: tuple[int, ...] = ()
        to_t2: tuple[int, ...] = ()
        start = 0
        while start < len(hashes):
            rest = hashes[start:] if start else hashes
            if rest[0] in b1:
                run = drop_run(b1, rest)
                # each hit grows p by max(1, |B2| // |B1|), |B1| counting that hit; p only
                # grows in the run, so capping once at the end caps every step
                self._p = min(capacity, self._p + ghost_steps(len(b2), len(b1) + run, run))
                to_t2 += rest[:run]
            elif rest[0] in b2:
                run = drop_run(b2, rest)
                self._p = max(0, self._p - ghost_steps(len(b1), len(b2) + run, run))
                to_t2 += rest[:run]
            else:
                run = 0
                for h in rest:  # first sightings, up to the next ghost
                    if h in b1 or h in b2:
                        break
                    run += 1
                to_t1 += rest[:run]
                self._trim_ghosts(len(to_t1), len(to_t2))  # (once for the run)
            start += run
        return to_t1, to_t2

    def _check_new(self, hashes: tuple[int, ...]) -> None:
        """``ValueError`` naming the first hash of ``hashes`` that is resident or repeated."""
        t1, t2 = self._t1, self._t2
        if t1.keys().isdisjoint(hashes) and t2.keys().isdisjoint(hashes) and len(set(hashes)) == len(hashes):
            return
        seen: set[int] = set()
        for h in hashes:
            if h in t1 or h in t2 or h in seen:
                raise ValueError(f"block hash {h} is already resident in the arc policy")
            seen.add(h)

    def _insert_one(self, block_hash: int) -> None:
        """``insert`` of a hash known to be new, the paper's steps as written."""
        if block_hash in self._b1:
            # Step computed with the hit still counted in B1, as in the paper.
            self._p = min(self.capacity, self._p + max(1, len(self._b2) // len(self._b1)))
            del self._b1[block_hash]
            self._t2[block_hash] = None
        elif block_hash in self._b2:
            self._p = max(0, self._p - max(1, len(self._b1) // len(self._b2)))
            del self._b2[block_hash]
            self._t2[block_hash] = None
        else:
            self._t1[block_hash] = None
            self._trim_ghosts()

    # touch_many / refresh_many / remove_many take the hashes a run at a time, a run being
    # hashes of one list (kvflow.core.policies.arc_runs), so that no hash's list is tested apart
    # from its move: a request's chain is its new blocks (T1) then its hits (T2).

    def touch_many(self, hashes: tuple[int, ...]) -> None:
        """``touch`` for each hash (resident; repeats allowed): each becomes the most recent
        of T2, in order."""
        if self._unjoined is not None:
            self._join_stored()
        t1, t2 = self._t1, self._t2
        self._last_moved = None  # (a hash not resident raises with the moves half done)
        from_t1 = bool(hashes) and hashes[0] in t1
        start = 0
        while start < len(hashes):
            rest = hashes[start:] if start else hashes
            moved = move_run(t1, t2, rest) if from_t1 else refresh_run(t2, rest)
            if not moved:  # the run before ended at this hash, and it is not here either
                raise KeyError(rest[0])
            start += moved
            from_t1 = not from_t1
        self._last_moved = hashes

    def refresh_many(self, hashes: tuple[int, ...]) -> None:
        """``refresh`` for each hash (resident; repeats allowed). T1's and T2's orders are
        independent: each list's members move to its end, in order."""
        if hashes == self._last_moved:
            return  # (moving each to its list's end again, in order, leaves them where they are)
        start = 0 if self._unjoined is None else self._join_stored(hashes)
        t1, t2 = self._t1, self._t2
        self._last_moved = None  # (a hash not resident raises with the moves half done)
        home = t1 if start < len(hashes) and hashes[start] in t1 else t2
        while start < len(hashes):
            rest = hashes[start:] if start else hashes
            if home is t2 and is_newest(t2, rest):
                break  # hits touched when the request began, nothing touched since
            moved = refresh_run(home, rest)
            if not moved:  # the run before ended at this hash, and it is not here either
                raise KeyError(rest[0])
            start += moved
            home = t2 if home is t1 else t1
        self._last_moved = hashes

    def remove_many(self, hashes: tuple[int, ...]) -> None:
        """``remove`` (an eviction: ghosts kept) for each hash (distinct, resident)."""
        if self._unjoined is not None:
            self._join_stored()
        self._last_moved = None
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if len(t1) + len(t2) > self.capacity:  # an overfilled tier trims ghosts as it shrinks
            for h in hashes:
                self.remove(h)
            return
        # Each becomes its list's newest ghost; the residents only shrink, so no trimming.
        # The usual eviction takes one list's cold end: no per-hash test of which list.
        source, ghosts = (t1, b1) if hashes and hashes[0] in t1 else (t2, b2)
        try:
            for h in hashes:
                del source[h]
                ghosts[h] = None
        except KeyError:  # from the other list on (or not resident: raised again below)
            for h in hashes[hashes.index(h) :]:
                if h in t1:
                    del t1[h]
                    b1[h] = None
                else:
                    del t2[h]
                    b2[h] = None

    def resident(self) -> list[int]:
        """Resident hashes: ``T1`` then ``T2``, each coldest first."""
        if self._unjoined is not None:
            self._join_stored()
        return [*self._t1, *self._t2]

    def snapshot(self) -> tuple[str, list[int], list[int], list[int], list[int], int]:
        """``(name, T1, T2, B1, B2, p)``, lists coldest first: everything that drives
        decisions, ghosts included, so two runs that differ only in history still differ."""
        if self._unjoined is not None:
            self._join_stored()
        return (self.name, list(self._t1), list(self._t2), list(self._b1), list(self._b2), self._p)

    def clear(self) -> None:
        """Forget everything, ghosts and ``p`` included (reset)."""
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._p = 0
        self._last_moved = None
        self._unjoined = None

    def __len__(self) -> int:
        stored = () if self._unjoined is None else self._unjoined[0]
        return len(self._t1) + len(self._t2) + len(stored)

    def __contains__(self, block_hash: object) -> bool:
        if self._unjoined is not None:
            self._join_stored()
        return block_hash in self._t1 or block_hash in self._t2

    def __repr__(self) -> str:
        if self._unjoined is not None:
            self._join_stored()
        return (
            f"ARCPolicy(capacity={self.capacity}, p={self._p}, t1={len(self._t1)}, "
            f"t2={len(self._t2)}, b1={len(self._b1)}, b2={len(self._b2)})"
        )
