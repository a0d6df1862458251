"""Decisions of the disk tier (behind the CPU tier): what a lookup loads from it, what is copied
to it and into which disk slots, which entries leave it for room, and what a warm restart
brings back. Pure. (What the state keeps of the disk tier: ``kvflow.core.state.disk``.)

Blocks reach the disk only from host slots and come back only into host slots: a *disk load*
fills CPU-tier entries as a store does, and the next lookup hits them there; a *disk store*
copies resident entries (pinned while it reads them). With ``disk_store_mode="ahead_of_eviction"``
(the default) the blocks copied are the CPU tier's coldest once it is nearly full, so a block the
CPU tier evicts is usually on disk already (a spill that never makes an eviction wait);
``"write_through"`` copies every block whose CPU-tier store completes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.core.commands import DiskRestored
from kvflow.core.decide.checks import Emit
from kvflow.core.decide.remote import coldest_lacking, coldest_window, host_slots_for, pushes_key
from kvflow.core.errors import Rejected
from kvflow.core.events import DiskEvicted, DiskIndexed, DiskLoadQueued, DiskStoreQueued
from kvflow.core.jobs import DISK_STORE
from kvflow.core.state.model import State
from kvflow.core.values import is_int


def disk_run(state: State, window: Sequence[int]) -> list[int]:
    """The blocks of ``window`` (a lookup's blocks after its CPU-tier hits) to load from the
    disk tier: in prefix order, those the disk index holds and no job is writing, up to the
    first block that is neither there nor already on its way to the CPU tier."""
    disk = state.disk
    if disk is None:
        return []
    slot_of, indexed, busy = state.slot_of, disk.slot_of, disk.busy
    run = []
    for h in window:
        if h in slot_of:
            continue  # pending here already (being stored or loaded)
        s = indexed.get(h)
        if s is None or s in busy:
            break
        run.append(h)
    return run


def disk_loads(state: State, window: Sequence[int], emit: Emit) -> int | None:
    """Queue the disk load of ``disk_run(window)``: each block takes a free host slot, else
    evicts the policy's next victim, never a pinned block nor one of the run (F16); what finds
    no slot is not loaded. Returns the job id, or None."""
    admitted = host_slots_for(state, disk_run(state, window), emit)
    if not admitted:
        return None
    assert state.disk is not None
    job_id = state.next_job_id
    hashes = tuple(admitted)
    indexed = state.disk.slot_of
    emit(
        DiskLoadQueued(
            seq=state.next_seq,
            job_id=job_id,
            hashes=hashes,
            slots=state.next_slots(len(hashes)),
            disk_slots=tuple(indexed[h] for h in hashes),
        )
    )
    return job_id


def disk_store(state: State, hashes: Sequence[int], emit: Emit) -> int | None:
    """Copy to the disk tier the resident blocks of ``hashes`` it lacks (and no disk store is
    already copying), each into a free disk slot; when none is free, the least recently used
    entries no job is using leave the index first. Returns the job id, or None."""
    disk = state.disk
    if disk is None:
        return None
    copying = _copying_to_disk(state)
    todo = [h for h in dict.fromkeys(hashes) if h not in disk.slot_of and h not in copying and state.is_resident(h)]
    if not todo:
        return None
    short = len(todo) - len(disk.free)
    if short > 0:
        leaving = disk.evictable(short)
        if leaving:
            emit(
                DiskEvicted(
                    seq=state.next_seq,
                    hashes=tuple(leaving),
                    disk_slots=tuple(disk.slot_of[h] for h in leaving),
                )
            )
        todo = todo[: len(disk.free)]
    if not todo:
        return None
    job_id = state.next_job_id
    chosen = tuple(todo)
    emit(
        DiskStoreQueued(
            seq=state.next_seq,
            job_id=job_id,
            hashes=chosen,
            slots=state.slots_of(chosen),
            disk_slots=disk.next_slots(len(chosen)),
        )
    )
    return job_id


def _copying_to_disk(state: State) -> set[int]:
    return {h for job in state.jobs.values() if job.direction == DISK_STORE for h in job.hashes}


def disk_write_through(state: State, hashes: Sequence[int], emit: Emit) -> int | None:
    """``disk_store_mode="write_through"``: the blocks whose CPU-tier store just completed."""
    if state.disk is None or state.config.disk_store_mode != "write_through":
        return None
    return disk_store(state, hashes, emit)


def spill_ahead_of_eviction(state: State, emit: Emit) -> None:
    """``disk_store_mode="ahead_of_eviction"``: once the CPU tier has fewer free slots than
    ``coldest_window``, its coldest resident blocks that the disk tier lacks are copied there.
    Pinned by that job, they are not evicted until it ends; eviction takes the next victim
    meanwhile."""
    if state.disk is None or state.config.disk_store_mode != "ahead_of_eviction":
        return
    window = coldest_window(state)
    if len(state.free_slots) >= window:
        return
    key = pushes_key(state, DISK_STORE, state.tally.disk.digest())
    if state.pushes_settled.get(DISK_STORE) == key:
        return
    todo = coldest_lacking(state, window, state.disk.slot_of, DISK_STORE)
    if todo:
        disk_store(state, todo, emit)
    else:
        state.pushes_settled[DISK_STORE] = key


def decide_disk_restored(state: State, cmd: DiskRestored, emit: Emit) -> int:
    """A warm restart: the entries the disk tier's journal vouches for join the index, those
    whose slot is free and whose block it does not hold yet. Returns how many joined."""
    disk = state.disk
    if disk is None:
        raise Rejected("disk_restored: this configuration has no disk tier (disk_blocks=0)")
    hashes, slots = cmd.block_hashes, cmd.disk_slots
    if len(hashes) != len(slots):
        raise Rejected(f"disk_restored: {len(hashes)} hashes but {len(slots)} disk slots")
    capacity = state.config.disk_blocks
    for s in slots:
        if not is_int(s) or not 0 <= s < capacity:
            raise Rejected(f"disk_restored: disk slot {s!r} is outside 0..{capacity - 1}")
    free = disk.free
    new: dict[int, int] = {}
    taken: set[int] = set()
    for h, s in zip(hashes, slots):
        if h in disk.slot_of or h in new or s in taken or s not in free:
            continue
        new[h] = s
        taken.add(s)
    if new:
        emit(DiskIndexed(seq=state.next_seq, hashes=tuple(new), disk_slots=tuple(new.values())))
    return len(new)
