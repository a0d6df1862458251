"""Legality checks for ``evolve``: is this event allowed in the current state?

Each check reads the lifecycle tables (kvflow.core.state.tables) and raises
:class:`~kvflow.core.errors.IllegalTransition` naming the state and the event; none mutates, so
``evolve`` runs every check of an event before it changes anything. The bulk checks use
C-level set and dict operations and walk block by block only to name the offender.
"""

from __future__ import annotations

from kvflow.core.errors import IllegalTransition
from kvflow.core.events import Event, LoadQueued, RemoteLoadQueued, StoreQueued, event_name
from kvflow.core.state.bulk import all_in
from kvflow.core.state.model import Job, State
from kvflow.core.state.tables import (
    ABSENT,
    BLOCK_TRANSITIONS,
    JOB_TRANSITIONS,
    RESIDENT,
    BlockState,
    JobState,
)

# the event tags legal on a RESIDENT entry (for the bulk check)
_RESIDENT_TAGS = frozenset(BLOCK_TRANSITIONS[RESIDENT])


def illegal(state: State, event: Event, what: str, detail: str) -> IllegalTransition:
    return IllegalTransition(what, f"{event_name(event)}#{event.seq}", detail)


def block_next(state: State, event: Event, tag: str, current: BlockState, block_hash: int) -> BlockState:
    """The next state of an entry in ``current`` under ``tag``, read from the table."""
    nxt = BLOCK_TRANSITIONS[current].get(tag)
    if nxt is None:
        raise illegal(state, event, current.name, f"block {block_hash}")
    return nxt


def job_next(state: State, event: Event, tag: str, job: Job) -> JobState:
    """The next state of ``job`` under ``tag``, read from the table."""
    nxt = JOB_TRANSITIONS[job.state].get(tag)
    if nxt is None:
        raise illegal(state, event, job.state.name, f"job {job.job_id}")
    return nxt


def check_block(state: State, event: Event, tag: str, block_hash: int) -> None:
    block_next(state, event, tag, state.block_state(block_hash), block_hash)


def check_job(state: State, event: Event, tag: str, job_id: int) -> tuple[Job, JobState]:
    """The live job ``job_id`` and its next state under ``tag``, read from the table (the
    caller applies that very state: the table is read once per job)."""
    job = state.jobs.get(job_id)
    if job is None:
        if 0 < job_id <= state.last_job_id:
            raise illegal(state, event, "TERMINAL", f"job {job_id} is already terminal")
        raise illegal(state, event, "NEW", f"job {job_id} was never queued")
    return job, job_next(state, event, tag, job)


def check_resident(state: State, event: Event, tag: str, hashes: tuple[int, ...]) -> None:
    """Every hash must be RESIDENT and ``tag`` legal there."""
    pending = state.pending
    if tag in _RESIDENT_TAGS and all_in(state.slot_of, hashes):
        if not pending or pending.keys().isdisjoint(hashes):
            return
    for h in hashes:
        check_block(state, event, tag, h)
    raise illegal(state, event, "RESIDENT", f"event {tag} does not apply to resident blocks")


def check_new_job(state: State, event: StoreQueued | LoadQueued) -> None:
    """The next job id, one device block and one slot per hash, device blocks no live job
    holds, each named once."""
    if event.job_id != state.last_job_id + 1:
        raise illegal(state, event, "NEW", f"job id {event.job_id} is not {state.last_job_id + 1}")
    device_blocks = event.device_blocks
    if not (len(event.hashes) == len(device_blocks) == len(event.slots)) or not event.hashes:
        raise illegal(state, event, "NEW", "hashes, device_blocks and slots must match, non-empty")
    held = state.held
    # (an empty dict's isdisjoint still hashes every block: most of the time no job holds any)
    if (not held or held.keys().isdisjoint(device_blocks)) and len(set(device_blocks)) == len(device_blocks):
        return
    for d in device_blocks:
        if d in held:
            raise illegal(state, event, "HELD", f"device block {d} is held by job {held[d]}")
    raise illegal(state, event, "HELD", "device blocks repeat within one job")


def check_new_entries(state: State, event: StoreQueued | RemoteLoadQueued) -> None:
    """A store names blocks that are not on the tier, each once, and takes the next free
    slots, in allocation order."""
    hashes, slot_of = event.hashes, state.slot_of
    if not slot_of.keys().isdisjoint(hashes) or len(set(hashes)) != len(hashes):
        h = next((h for h in hashes if h in slot_of), hashes[0])
        current = state.block_state(h)
        if current is ABSENT:  # repeated within the event
            raise illegal(state, event, "STORE_QUEUED", f"block {h} is stored twice in one event")
        raise illegal(state, event, current.name, f"block {h} is already on the tier")
    slots = event.slots
    n = len(slots)
    free = state.free_slots
    if n > len(free) or tuple(free[len(free) - n :][::-1]) != slots:
        raise illegal(state, event, "SLOTS", f"slots {list(slots)[:8]} are not the next free slots")
