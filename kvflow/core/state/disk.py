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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.core.jobs import DISK_LOAD, DISK_STORE

if TYPE_CHECKING:
    from kvflow.core.state.model import Job, State


class DiskIndex:
    """``slot_of``: hash -> disk slot, least recently used first (a completed disk store or a
    load moves its blocks last). ``free``: unused disk slots as a stack (a fresh tier hands out
    0, 1, 2...). ``busy``: disk slot -> the job whose copy uses it."""

    __slots__ = ("busy", "free", "slot_of")

    def __init__(self, capacity: int) -> None:
        self.slot_of: dict[int, int] = {}
        self.free: list[int] = list(range(capacity - 1, -1, -1))
        self.busy: dict[int, int] = {}

    def next_slots(self, n: int) -> tuple[int, ...]:
        """The disk slots the next ``n`` disk-stored blocks take (the top of the free stack)."""
        free = self.free
        return tuple(reversed(free[len(free) - n :]))

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
        clone.slot_of, clone.free, clone.busy = dict(self.slot_of), list(self.free), dict(self.busy)
        return clone

    def canonical(self) -> tuple[object, ...]:
        """The index in its order (the least recently used goes first), the free stack and the
        slots in use: everything the disk decisions read."""
        return (list(self.slot_of.items()), list(self.free), sorted(self.busy.items()))


def take_slots(state: State, job: Job) -> None:
    """A disk job was queued: its disk slots are in use (a store's leave the free stack)."""
    disk = state.disk
    assert disk is not None
    busy, jid = disk.busy, job.job_id
    for s in job.disk_slots:
        busy[s] = jid
    if job.direction == DISK_STORE:
        n = len(job.disk_slots)
        del disk.free[len(disk.free) - n :]


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
                    disk.free.append(old)
                slot_of[h] = s
    elif job.direction == DISK_LOAD:
        for h, s in zip(job.hashes, job.disk_slots):
            if slot_of.get(h) == s:
                del slot_of[h]
                if completed:
                    slot_of[h] = s


def release_slots(state: State, job: Job) -> None:
    """The job's copy is over: its disk slots are no longer in use; those no entry holds go
    back to the free stack."""
    disk = state.disk
    if disk is None or not job.disk_slots:
        return
    slot_of, busy, free = disk.slot_of, disk.busy, disk.free
    for h, s in reversed(tuple(zip(job.hashes, job.disk_slots))):
        if busy.get(s) == job.job_id:
            del busy[s]
            if slot_of.get(h) != s:
                free.append(s)
