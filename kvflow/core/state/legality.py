"""Legality checks for ``evolve``: is this event allowed in the current state?

Each check reads the lifecycle tables (kvflow.core.state.tables) and raises
:class:`~kvflow.core.errors.IllegalTransition` naming the state, the event and the first
offending block or job; none mutates, so ``evolve`` runs every check of an event before it
changes anything.
"""

from __future__ import annotations

from kvflow.core.errors import IllegalTransition
from kvflow.core.events import (
    DiskLoadQueued,
    DiskStoreQueued,
    Event,
    LoadQueued,
    RemoteLoadQueued,
    RemoteStoreQueued,
    StoreQueued,
    event_name,
)
from kvflow.core.state.model import Job, State
from kvflow.core.state.tables import (
    ABSENT,
    BLOCK_TRANSITIONS,
    JOB_TRANSITIONS,
    RESIDENT,
    BlockState,
    JobState,
)

# the events that queue a job
QueuedJob = StoreQueued | LoadQueued | RemoteLoadQueued | RemoteStoreQueued | DiskLoadQueued | DiskStoreQueued


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
    """Every hash must be RESIDENT (on the tier, not pending) and ``tag`` legal there; the
    blocks are walked one by one only to name the first that is not."""
    if (
        tag in BLOCK_TRANSITIONS[RESIDENT]
        and state.slot_of.keys() >= set(hashes)
        and state.pending.keys().isdisjoint(hashes)
    ):
        return
    for h in hashes:
        current = state.block_state(h)
        if current is not RESIDENT:
            raise illegal(state, event, current.name, f"block {h} is not resident")
        block_next(state, event, tag, current, h)


def check_job_id(state: State, event: QueuedJob) -> None:
    """A queued job takes the next job id."""
    if event.job_id != state.next_job_id:
        raise illegal(state, event, "NEW", f"job id {event.job_id} is not {state.next_job_id}")


def check_new_job(state: State, event: StoreQueued | LoadQueued) -> None:
    """The next job id, one device block and one slot per hash, device blocks no live job
    holds, each named once."""
    check_job_id(state, event)
    device_blocks = event.device_blocks
    if not (len(event.hashes) == len(device_blocks) == len(event.slots)) or not event.hashes:
        raise illegal(state, event, "NEW", "hashes, device_blocks and slots must match, non-empty")
    held = state.held
    for d in device_blocks:
        if d in held:
            raise illegal(state, event, "HELD", f"device block {d} is held by job {held[d]}")
    if len(set(device_blocks)) != len(device_blocks):
        raise illegal(state, event, "HELD", "device blocks repeat within one job")


def check_new_entries(state: State, event: StoreQueued | RemoteLoadQueued | DiskLoadQueued) -> None:
    """A store names blocks that are not on the tier, each once, and takes the next free
    slots, in allocation order."""
    hashes = event.hashes
    named: set[int] = set(hashes)
    if len(named) != len(hashes) or not state.slot_of.keys().isdisjoint(named):
        _name_entry_on_tier(state, event)
    slots = event.slots
    if len(slots) > len(state.free_slots) or state.next_slots(len(slots)) != slots:
        raise illegal(state, event, "SLOTS", f"slots {list(slots)[:8]} are not the next free slots")


def _name_entry_on_tier(state: State, event: StoreQueued | RemoteLoadQueued | DiskLoadQueued) -> None:
    """Raise naming the first block of the event already on the tier or named twice."""
    named: set[int] = set()
    for h in event.hashes:
        current = state.block_state(h)
        if current is not ABSENT:
            raise illegal(state, event, current.name, f"block {h} is already on the tier")
        if h in named:
            raise illegal(state, event, "STORE_QUEUED", f"block {h} is stored twice in one event")
        named.add(h)
