"""The disk tier as the state knows it: which block each disk slot holds, which slots are free,
and which a live (or fenced) disk job is using. Pure.

The disk tier is reached only through host slots: a *disk load* fills CPU-tier entries exactly
as a store does (visible when it completes, gone if it fails) while it reads its disk slots; a
*disk store* reads resident entries (pinned meanwhile) into free disk slots, and its blocks join
the index when it completes. Unlike the remote tier, kvflow owns the disk's capacity: it assigns
the slots, and when none is free the least recently used entry no job is using leaves the index
(``DiskEvicted``) so its slot can be written again. A disk slot a job uses is never handed out
or evicted while that job's copy may run: a fenced job (F15) keeps its disk slots until its
fence lifts, as it keeps its host slots.

A disk holds millions of slots, so nothing here costs a slot per slot: the never-used slots are a
range (``DiskFree``), and the state digest's part of the disk is a running hash of what was done
to it, in order (``kvflow.core.state.digest.Tally.disk``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import TYPE_CHECKING

from kvflow.core.jobs import DISK_LOAD, DISK_STORE

if TYPE_CHECKING:
    from kvflow.core.state.model import Job, State

# what the digest's running record of the disk says was done (see ``record``)
TAKEN, STORED, LOADED, DROPPED, RELEASED, EVICTED, INDEXED = range(7)


class DiskFree:
    """The free disk slots as a stack: slots given back first (the last on top), then the
    never-used ones from ``fresh`` up, less those a warm restart ``placed`` there."""

    __slots__ = ("capacity", "fresh", "freed", "placed")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.fresh = 0  # slots fresh..capacity-1 were never handed out (unless placed)
        self.freed: dict[int, None] = {}  # slots given back, the top last
        self.placed: dict[int, None] = {}  # never-used slots a warm restart's entries hold

    def __len__(self) -> int:
        return self.capacity - self.fresh - len(self.placed) + len(self.freed)

    def __contains__(self, slot: object) -> bool:
        if slot in self.freed:
            return True
        return type(slot) is int and self.fresh <= slot < self.capacity and slot not in self.placed

    def __iter__(self) -> Iterator[int]:
        """Every free slot (O(capacity): tests and invariants read it)."""
        return chain(reversed(self.freed), (s for s in range(self.fresh, self.capacity) if s not in self.placed))

    def top(self, n: int) -> tuple[int, ...]:
        """The slots the next ``n`` disk-stored blocks take: the last given back first, then
        never-used ones from ``fresh`` up. Fewer if fewer are free."""
        out = list(reversed(list(self.freed)[-n:])) if self.freed else []
        s = self.fresh
        while len(out) < n and s < self.capacity:
            if s not in self.placed:
                out.append(s)
            s += 1
        return tuple(out)

    def take(self, slots: tuple[int, ...]) -> None:
        """``slots`` (``top(len(slots))``) are handed out."""
        freed, placed = self.freed, self.placed
        for s in slots:
            if s in freed:
                del freed[s]
            else:
                while self.fresh < s or self.fresh in placed:
                    placed.pop(self.fresh, None)
                    self.fresh += 1
                self.fresh = s + 1

    def give_back(self, slots: Iterable[int]) -> None:
        self.freed.update(dict.fromkeys(slots))

    def place(self, slot: int) -> None:
        """A warm restart's entry holds ``slot`` (free)."""
        if slot in self.freed:
            del self.freed[slot]
        else:
            self.placed[slot] = None

    def copy(self) -> DiskFree:
        clone = DiskFree(self.capacity)
        clone.fresh, clone.freed, clone.placed = self.fresh, dict(self.freed), dict(self.placed)
        return clone


class DiskIndex:
    """``slot_of``: hash -> disk slot, least recently used first (a completed disk store or a
    load moves its blocks last). ``free``: the free slots (``DiskFree``). ``busy``: disk slot ->
    the job whose copy uses it."""

    __slots__ = ("busy", "free", "slot_of")

    def __init__(self, capacity: int) -> None:
        self.slot_of: dict[int, int] = {}
        self.free = DiskFree(capacity)
        self.busy: dict[int, int] = {}

    def next_slots(self, n: int) -> tuple[int, ...]:
        """The disk slots the next ``n`` disk-stored blocks take."""
        return self.free.top(n)

    def evictable(self, n: int) -> list[int]:
        """Up to ``n`` indexed hashes, least recently used first, whose slot no job uses."""
        out: list[int] = []
        if n <= 0:
            return out
        busy = self.busy
        for h, s in self.slot_of.items():
            if s not in busy:
                out.append(h)
                if len(out) == n:
                    break
        return out

    def copy(self) -> DiskIndex:
        clone = DiskIndex.__new__(DiskIndex)
        clone.slot_of, clone.free, clone.busy = dict(self.slot_of), self.free.copy(), dict(self.busy)
        return clone

    def canonical(self) -> tuple[object, ...]:
        """The index in its order (the least recently used goes first), the free stack and the
        slots in use: everything the disk decisions read."""
        free = self.free
        return (list(self.slot_of.items()), list(free.freed), free.fresh, sorted(free.placed), sorted(self.busy.items()))


def record(state: State, what: int, hashes: tuple[int, ...], slots: tuple[int, ...]) -> None:
    """The digest's running record of the disk: ``what`` was done to these entries."""
    state.tally.disked(what, hashes, slots)


def take_slots(state: State, job: Job) -> None:
    """A disk job was queued: its disk slots are in use (a store's leave the free stack)."""
    disk = state.disk
    assert disk is not None
    busy, jid = disk.busy, job.job_id
    for s in job.disk_slots:
        busy[s] = jid
    if job.direction == DISK_STORE:
        disk.free.take(job.disk_slots)
    record(state, TAKEN, job.hashes, job.disk_slots)


def apply_outcome(state: State, job: Job, completed: bool) -> None:
    """A disk job ended: a completed store indexes its blocks, a completed load makes its
    blocks the most recently used, a failed load drops its blocks from the index at once (what
    it read was unusable or unreadable: never tried again in a loop)."""
    disk = state.disk
    assert disk is not None
    slot_of = disk.slot_of
    if job.direction == DISK_STORE:
        if completed:
            for h, s in zip(job.hashes, job.disk_slots):
                old = slot_of.pop(h, None)
                if old is not None and old not in disk.busy:
                    disk.free.give_back((old,))
                slot_of[h] = s
            record(state, STORED, job.hashes, job.disk_slots)
    elif job.direction == DISK_LOAD:
        for h, s in zip(job.hashes, job.disk_slots):
            if slot_of.get(h) == s:
                del slot_of[h]
                if completed:
                    slot_of[h] = s
        record(state, LOADED if completed else DROPPED, job.hashes, job.disk_slots)


def release_slots(state: State, job: Job) -> None:
    """The job's copy is over: its disk slots are no longer in use; those no entry holds go
    back to the free stack."""
    disk = state.disk
    if disk is None or not job.disk_slots:
        return
    slot_of, busy = disk.slot_of, disk.busy
    back = []
    for h, s in reversed(tuple(zip(job.hashes, job.disk_slots))):
        if busy.get(s) == job.job_id:
            del busy[s]
            if slot_of.get(h) != s:
                back.append(s)
    disk.free.give_back(back)
    record(state, RELEASED, job.hashes, job.disk_slots)


def evict(state: State, hashes: tuple[int, ...], slots: tuple[int, ...]) -> None:
    """These entries leave the index; their slots are free again."""
    disk = state.disk
    assert disk is not None
    for h in hashes:
        del disk.slot_of[h]
    disk.free.give_back(slots)
    record(state, EVICTED, hashes, slots)


def index(state: State, hashes: tuple[int, ...], slots: tuple[int, ...]) -> None:
    """A warm restart's entries join the index in their (free) slots."""
    disk = state.disk
    assert disk is not None
    for h, s in zip(hashes, slots):
        disk.free.place(s)
        disk.slot_of[h] = s
    record(state, INDEXED, hashes, slots)
