"""``evolve`` for the job events: a job queued, submitted, a rank's result, its end (or its
fence, F15), a late result, a fence lifted. Each checks the event (when asked), reads the job's
next state from ``JOB_TRANSITIONS`` and moves the job's entries with ``kvflow.core.state.moves``.
Pure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvflow.core.errors import IllegalTransition
from kvflow.core.events import (
    DiskEvicted,
    DiskIndexed,
    DiskLoadQueued,
    DiskStoreQueued,
    EntriesRefused,
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    LateResultIgnored,
    LoadQueued,
    RankSucceeded,
    RemoteIndexed,
    RemoteLoadQueued,
    RemoteStoreQueued,
    StoreQueued,
)
from kvflow.core.jobs import (
    DISK_LOAD,
    DISK_STORE,
    FILLING,
    LOAD,
    REMOTE_LOAD,
    REMOTE_STORE,
    SHARED_TIERS,
    STORE,
    Direction,
    every_rank,
    has_rank,
    is_rank,
    with_rank,
)
from kvflow.core.state import disk as disk_tier
from kvflow.core.state import legality as lg
from kvflow.core.state.digest import FORGET, REMEMBER
from kvflow.core.state.model import Job, State
from kvflow.core.state.moves import (
    WRITERS,
    ensure_request,
    entry_move,
    note_chain_whole,
    pin,
    unpin,
)
from kvflow.core.state.tables import (
    ABANDONED,
    ABSENT,
    FENCED,
    JOB_TRANSITIONS,
    NEW,
    OUTCOME_JOB_STATES,
    QUEUED,
    RESIDENT,
    STORE_QUEUED,
    STORING,
)

# What the queue events do to their entries, read from BLOCK_TRANSITIONS once (see
# moves.entry_move; None: the entries stay as they are)
_QUEUE_STORE = entry_move(ABSENT, "store_queued")
_QUEUE_REMOTE_LOAD = entry_move(ABSENT, "remote_load_queued")
_QUEUE_LOAD = entry_move(RESIDENT, "load_queued")
_QUEUE_REMOTE_STORE = entry_move(RESIDENT, "remote_store_queued")
_QUEUE_DISK_LOAD = entry_move(ABSENT, "disk_load_queued")
_QUEUE_DISK_STORE = entry_move(RESIDENT, "disk_store_queued")
# submitting a job: a filling job's entries are STORE_QUEUED, any other's RESIDENT
_SUBMIT_FILLING = entry_move(STORE_QUEUED, "jobs_submitted")
_SUBMIT_OTHER = entry_move(RESIDENT, "jobs_submitted")

# --- jobs -----------------------------------------------------------------------------------


def _add_job(
    state: State,
    event: lg.QueuedJob,
    direction: Direction,
    tag: str,
    request_id: str | None,
    device_blocks: tuple[int, ...],
    disk_slots: tuple[int, ...] = (),
) -> Job:
    """The job the event queues (in the state the table gives it), holding its device blocks;
    its request (``None`` for remote jobs and lazy stores) is created if new and lists it."""
    job_id = event.job_id
    job = Job(
        job_id, direction, request_id, event.hashes, device_blocks, event.slots, JOB_TRANSITIONS[NEW][tag],
        disk_slots=disk_slots,
    )  # fmt: skip
    state.jobs[job_id] = job
    state.queued[job_id] = None
    state.last_job_id = job_id
    held = state._held
    if held is not None:
        if len(state.jobs) == 1:  # the only live job: no index is kept (see State.held)
            state._held = None
        else:
            for d in device_blocks:
                held[d] = job_id
    req = ensure_request(state, request_id)
    if req is not None:
        req.jobs[job_id] = None
    return job


def _end_job(state: State, job: Job, forgotten: bool) -> None:
    """A terminal job leaves the state: its holds end, its request forgets it (unless
    ``forgotten``: a job fenced, or abandoned by a reset, was forgotten by its request then)."""
    job_id, device_blocks = job.job_id, job.device_blocks
    del state.jobs[job_id]
    state.queued.pop(job_id, None)  # (a job cancelled before submission)
    held = state._held
    if held is not None:  # (see State.held)
        for d in device_blocks:
            del held[d]
    if job.request_id is not None and not forgotten:
        del state.requests[job.request_id].jobs[job_id]


def _fence_slots(state: State, job: Job) -> None:
    """Fence the job's slots: none is handed out again while its copy may still run."""
    fenced_slots, jid = state.fenced_slots, job.job_id
    for s in dict.fromkeys(job.slots):  # a load may read one slot twice
        fenced_slots[s] = fenced_slots.get(s, ()) + (jid,)


def _fence(state: State, job: Job) -> None:
    """The job's outcome is applied but its copy may still run (F15): its slots and
    device blocks stay fenced; its request forgets it."""
    _fence_slots(state, job)
    if job.request_id is not None:
        del state.requests[job.request_id].jobs[job.job_id]


def _release_fenced_slots(state: State, job: Job) -> None:
    """The fence ends: each of the job's slots no other fence uses is free again, unless
    its entry still owns it (a fenced load's block may still be resident)."""
    fenced_slots = state.fenced_slots
    free, slot_of = state.free_slots, state.slot_of
    jid = job.job_id
    for h, s in reversed(dict.fromkeys(zip(job.hashes, job.slots))):
        users = tuple(j for j in fenced_slots[s] if j != jid)
        if users:
            fenced_slots[s] = users  # another fenced job still uses this slot
        else:
            del fenced_slots[s]
            if slot_of.get(h) != s:
                free.give_back((s,))


# --- one function per job event ------------------------------------------------------------


def _store_queued(state: State, event: StoreQueued, check: bool) -> None:
    request_id = event.request_id
    if check:
        lg.check_new_job(state, event)
        lg.check_new_entries(state, event)
        req = state.requests.get(request_id) if request_id is not None else None
        if req is not None and req.finished:
            raise lg.illegal(state, event, "FINISHED", f"request {request_id} is finished")
    job = _add_job(state, event, STORE, "store_queued", request_id, event.device_blocks)
    if _QUEUE_STORE is not None:
        _QUEUE_STORE(state, event.hashes, job)  # (on the tier from now on)
        if request_id is not None:
            note_chain_whole(state, state.requests[request_id], event.hashes)


def _load_queued(state: State, event: LoadQueued, check: bool) -> None:
    req = state.requests.get(event.request_id)
    n = len(event.hashes)
    if check:
        lg.check_new_job(state, event)
        if req is None or req.finished:
            raise lg.illegal(state, event, "NO_REQUEST", f"request {event.request_id} is not live")
        if req.offered[:n] != event.hashes:  # (offered hits are pinned, hence RESIDENT)
            raise lg.illegal(state, event, "PINS", "a load must take the request's offered hits, in order")
        if state.slots_of(event.hashes) != event.slots:
            raise lg.illegal(state, event, "RESIDENT", "the load's slots are not where its blocks live")
    if req is None:
        raise lg.illegal(state, event, "NO_REQUEST", f"request {event.request_id} is not live")
    # the request's pins move from "offered" to the job (counts are unchanged)
    req.offered = req.offered[n:]
    req.loading[event.job_id] = event.hashes
    job = _add_job(state, event, LOAD, "load_queued", event.request_id, event.device_blocks)
    if _QUEUE_LOAD is not None:
        _QUEUE_LOAD(state, event.hashes, job)


def _check_remote_job(state: State, event: RemoteLoadQueued | RemoteStoreQueued) -> None:
    lg.check_job_id(state, event)
    if len(event.hashes) != len(event.slots) or not event.hashes:
        raise lg.illegal(state, event, "NEW", "hashes and slots must match, non-empty")


def _remote_load_queued(state: State, event: RemoteLoadQueued, check: bool) -> None:
    if check:
        _check_remote_job(state, event)
        lg.check_new_entries(state, event)
    job = _add_job(state, event, REMOTE_LOAD, "remote_load_queued", None, ())
    if _QUEUE_REMOTE_LOAD is not None:
        _QUEUE_REMOTE_LOAD(state, event.hashes, job)


def _remote_store_queued(state: State, event: RemoteStoreQueued, check: bool) -> None:
    if check:
        _check_remote_job(state, event)
        lg.check_resident(state, event, "remote_store_queued", event.hashes)
        if state.slots_of(event.hashes) != event.slots:
            raise lg.illegal(state, event, "RESIDENT", "the remote store's slots are not where its blocks live")
        if len(set(event.hashes)) != len(event.hashes):
            raise lg.illegal(state, event, "RESIDENT", "a block is stored twice in one event")
    job = _add_job(state, event, REMOTE_STORE, "remote_store_queued", None, ())
    if _QUEUE_REMOTE_STORE is not None:
        _QUEUE_REMOTE_STORE(state, event.hashes, job)
    pin(state, event.hashes)  # its slots are read until the job ends


def remember_remote(state: State, hashes: tuple[int, ...]) -> None:
    """Add to the remote index (the most recent last); beyond its capacity the oldest go."""
    remote = state.remote
    state.tally.indexed(REMEMBER, hashes)
    for h in hashes:
        remote.pop(h, None)
        remote[h] = None
    excess = len(remote) - state.config.remote_blocks
    if excess > 0:
        for h in list(remote)[:excess]:
            del remote[h]


def _remote_indexed(state: State, event: RemoteIndexed, check: bool) -> None:
    remember_remote(state, event.hashes)


def _check_disk_job(state: State, event: DiskLoadQueued | DiskStoreQueued) -> disk_tier.DiskIndex:
    disk = state.disk
    if disk is None:
        raise lg.illegal(state, event, "NEW", "no disk tier in this configuration")
    lg.check_job_id(state, event)
    n = len(event.hashes)
    if not n or len(event.slots) != n or len(event.disk_slots) != n:
        raise lg.illegal(state, event, "NEW", "hashes, slots and disk slots must match, non-empty")
    if len(set(event.hashes)) != n or len(set(event.disk_slots)) != n:
        raise lg.illegal(state, event, "NEW", "a block or a disk slot is named twice")
    if not disk.busy.keys().isdisjoint(event.disk_slots):
        raise lg.illegal(state, event, "NEW", "a disk slot another job uses")
    return disk


def _disk_load_queued(state: State, event: DiskLoadQueued, check: bool) -> None:
    if check:
        disk = _check_disk_job(state, event)
        lg.check_new_entries(state, event)
        if any(disk.slot_of.get(h) != s for h, s in zip(event.hashes, event.disk_slots)):
            raise lg.illegal(state, event, "NEW", "the disk slots are not where the disk index holds the blocks")
    job = _add_job(state, event, DISK_LOAD, "disk_load_queued", None, (), event.disk_slots)
    if _QUEUE_DISK_LOAD is not None:
        _QUEUE_DISK_LOAD(state, event.hashes, job)
    disk_tier.take_slots(state, job)


def _disk_store_queued(state: State, event: DiskStoreQueued, check: bool) -> None:
    if check:
        disk = _check_disk_job(state, event)
        lg.check_resident(state, event, "disk_store_queued", event.hashes)
        if state.slots_of(event.hashes) != event.slots:
            raise lg.illegal(state, event, "RESIDENT", "the disk store's slots are not where its blocks live")
        if disk.next_slots(len(event.disk_slots)) != event.disk_slots:
            raise lg.illegal(state, event, "NEW", "a disk store takes the next free disk slots")
    job = _add_job(state, event, DISK_STORE, "disk_store_queued", None, (), event.disk_slots)
    if _QUEUE_DISK_STORE is not None:
        _QUEUE_DISK_STORE(state, event.hashes, job)
    pin(state, event.hashes)  # its slots are read until the job ends
    disk_tier.take_slots(state, job)


def _disk_evicted(state: State, event: DiskEvicted, check: bool) -> None:
    disk = state.disk
    if disk is None:
        raise lg.illegal(state, event, "ABSENT", "no disk tier in this configuration")
    if check:
        slot_of = disk.slot_of
        if len(event.hashes) != len(event.disk_slots) or len(set(event.hashes)) != len(event.hashes):
            raise lg.illegal(state, event, "ABSENT", "hashes and disk slots must match, each named once")
        for h, s in zip(event.hashes, event.disk_slots):
            if slot_of.get(h) != s:
                raise lg.illegal(state, event, "ABSENT", f"block {h} is not in disk slot {s}")
            if s in disk.busy:
                raise lg.illegal(state, event, "ABSENT", f"disk slot {s} is in use by job {disk.busy[s]}")
    disk_tier.evict(state, event.hashes, event.disk_slots)


def _disk_indexed(state: State, event: DiskIndexed, check: bool) -> None:
    disk = state.disk
    if disk is None:
        raise lg.illegal(state, event, "ABSENT", "no disk tier in this configuration")
    if check:
        n = len(event.hashes)
        if len(event.disk_slots) != n or len(set(event.hashes)) != n or len(set(event.disk_slots)) != n:
            raise lg.illegal(state, event, "ABSENT", "hashes and disk slots must match, each named once")
        if not disk.slot_of.keys().isdisjoint(event.hashes):
            raise lg.illegal(state, event, "ABSENT", "a block the disk index holds already")
        if any(s not in disk.free for s in event.disk_slots):
            raise lg.illegal(state, event, "ABSENT", "a disk slot that is not free")
    disk_tier.index(state, event.hashes, event.disk_slots)


def _entries_refused(state: State, event: EntriesRefused, check: bool) -> None:
    dropped, disk = event.dropped, state.disk
    if check:
        n = len(event.hashes)
        if not n or len(event.reasons) != n or len(event.job_ids) != n:
            raise lg.illegal(state, event, "ABSENT", "hashes, reasons and job ids must match, non-empty")
        if event.tier not in SHARED_TIERS:
            raise lg.illegal(state, event, "ABSENT", f"no shared tier {event.tier!r}")
        if event.tier == "disk" and disk is None:
            raise lg.illegal(state, event, "ABSENT", "no disk tier in this configuration")
        if len(set(dropped)) != len(dropped) or not set(event.hashes).issuperset(dropped):
            raise lg.illegal(state, event, "ABSENT", "the dropped hashes are refused ones, each named once")
        for h in dropped:
            if event.tier == "remote" and h not in state.remote:
                raise lg.illegal(state, event, "ABSENT", f"block {h} is not in the remote index")
            if event.tier == "disk":
                assert disk is not None
                if h not in disk.slot_of:
                    raise lg.illegal(state, event, "ABSENT", f"block {h} is not in the disk index")
                if disk.slot_of[h] in disk.busy:
                    raise lg.illegal(state, event, "ABSENT", f"block {h}'s disk slot is in use by a job")
    if not dropped:
        return
    if event.tier == "remote":
        state.tally.indexed(FORGET, dropped)
        for h in dropped:
            del state.remote[h]
    else:
        assert disk is not None
        disk_tier.evict(state, dropped, tuple(disk.slot_of[h] for h in dropped))


def _check_submission(state: State, event: JobsSubmitted) -> None:
    """Each job is live, queued, the table lets it be submitted, and it is named once."""
    job_ids = event.job_ids
    for jid in job_ids:
        job, _ = lg.check_job(state, event, "jobs_submitted", jid)
        if jid not in state.queued:
            raise lg.illegal(state, event, job.state.name, f"job {jid} is not queued")
    if len(set(job_ids)) != len(job_ids):
        raise lg.illegal(state, event, "IN_FLIGHT", "a job is submitted twice in one event")


def _jobs_submitted(state: State, event: JobsSubmitted, check: bool) -> None:
    jobs, queued, job_ids = state.jobs, state.queued, event.job_ids
    if check:
        _check_submission(state, event)
    deadline = event.deadline_ms
    for jid in job_ids:
        job = jobs[jid]
        job.state = JOB_TRANSITIONS[job.state]["jobs_submitted"]
        job.deadline_ms = deadline
        del queued[jid]
        # a store's entries follow their job (STORE_QUEUED -> STORING: the job's state tells)
        write = _SUBMIT_FILLING if job.direction in FILLING else _SUBMIT_OTHER
        if write is not None:
            write(state, (), job)


def _check_terminal(state: State, event: JobCompleted | JobFailed | JobTimedOut, job: Job) -> None:
    """The end describes ``job`` (whose table allows it: ``_terminal`` read that first)."""
    world = state.config.world_size
    if isinstance(event, JobFailed) and event.fenced:
        if not is_rank(event.rank, world):
            raise lg.illegal(state, event, job.state.name, f"rank {event.rank} out of range")
        if with_rank(job.reported, event.rank) == every_rank(world):
            raise lg.illegal(state, event, job.state.name, "every rank has reported: nothing to fence")
    if (
        job.hashes != event.hashes
        or job.direction != event.direction
        or job.device_blocks != event.device_blocks
    ):
        raise lg.illegal(state, event, job.state.name, f"event does not describe job {job.job_id}")
    if event.abandoned != job.abandoned:
        raise lg.illegal(state, event, job.state.name, f"job {job.job_id} abandoned is {job.abandoned}")
    # (Its entries need no check: a live store's hashes stay pending on it and a live load's
    # stay pinned, hence RESIDENT, until this event: the invariants every earlier event kept.)
    if isinstance(event, JobCompleted):
        if not is_rank(event.rank, world):
            raise lg.illegal(state, event, job.state.name, f"rank {event.rank} out of range")
        if with_rank(job.acks, event.rank) != every_rank(world):
            raise lg.illegal(state, event, job.state.name, f"job {job.job_id} lacks rank results")


_END_TAGS = {kind: str(kind.__struct_config__.tag) for kind in (JobCompleted, JobFailed, JobTimedOut)}
"""Each job end's tag (its ``event_name``), read once."""


def _terminal(state: State, event: JobCompleted | JobFailed | JobTimedOut, check: bool) -> None:
    tag = _END_TAGS[type(event)]
    completed = isinstance(event, JobCompleted)
    fenced = not isinstance(event, JobCompleted) and event.fenced
    job_tag = tag + ":fenced" if fenced else tag  # (how JOB_TRANSITIONS names a fenced outcome)
    if check:
        job, nxt = lg.check_job(state, event, job_tag, event.job_id)
        _check_terminal(state, event, job)
    else:  # (the decider's own event: its job is live, the table allows it)
        job = state.jobs[event.job_id]
        nxt = JOB_TRANSITIONS[job.state][job_tag]
    was = job.state
    if nxt not in OUTCOME_JOB_STATES:
        raise IllegalTransition(
            was.name, f"{tag}#{event.seq}", "the job table must end or fence the job here"
        )
    job.state = nxt
    abandoned = was is ABANDONED
    if fenced:
        if isinstance(event, JobFailed):
            job.reported = with_rank(job.reported, event.rank)
        if abandoned:
            return  # already fenced by the reset (its entries left the tier then)
        _fence(state, job)  # memory stays fenced; the outcome below applies now
    else:
        _end_job(state, job, abandoned)
        if abandoned:
            # its entries left the tier at the reset; only its fenced slots come back now
            _release_fenced_slots(state, job)
            disk_tier.release_slots(state, job)
            return
    direction = job.direction
    if job.disk_slots:
        disk_tier.apply_outcome(state, job, completed)
        if not fenced:
            disk_tier.release_slots(state, job)
    if direction in FILLING:
        write = WRITERS[STORE_QUEUED if was is QUEUED else STORING][tag]
        if write is not None:
            write(state, job.hashes, job)
        if direction == REMOTE_LOAD and not completed:
            # a dead key never loops lookup -> load -> fail: it leaves the remote index now
            state.tally.indexed(FORGET, job.hashes)
            for h in job.hashes:
                state.remote.pop(h, None)
        return
    write = WRITERS[RESIDENT][tag]
    if write is not None:
        write(state, job.hashes, job)
    unpin(state, job.hashes)
    if direction == REMOTE_STORE:
        if completed:
            remember_remote(state, job.hashes)
    elif job.request_id is not None:
        del state.requests[job.request_id].loading[job.job_id]


def _rank_succeeded(state: State, event: RankSucceeded, check: bool) -> None:
    job, nxt = lg.check_job(state, event, "rank_succeeded", event.job_id)
    world, rank = state.config.world_size, event.rank
    if not is_rank(rank, world):
        raise lg.illegal(state, event, job.state.name, f"rank {rank} out of range")
    if has_rank(job.acks, rank):
        raise lg.illegal(state, event, job.state.name, f"rank {rank} cannot report again")
    if with_rank(job.acks, rank) == every_rank(world):
        raise lg.illegal(state, event, job.state.name, "the last rank's success is JobCompleted")
    job.state = nxt
    job.acks = with_rank(job.acks, rank)
    job.reported = with_rank(job.reported, rank)


def _late(state: State, event: LateResultIgnored, check: bool) -> None:
    job = state.jobs.get(event.job_id)
    if job is not None and job.state is FENCED:
        # a fenced job's rank reports: that rank's copy is over
        if not is_rank(event.rank, state.config.world_size):
            raise lg.illegal(state, event, job.state.name, f"rank {event.rank} out of range")
        job.state = lg.job_next(state, event, "late_result_ignored", job)
        job.reported = with_rank(job.reported, event.rank)
    elif job is not None:
        # legal for a live job only as a repeat of a rank that already reported success
        if not (is_rank(event.rank, state.config.world_size) and has_rank(job.acks, event.rank)):
            raise lg.illegal(state, event, job.state.name, f"job {event.job_id} is live")
        job.state = lg.job_next(state, event, "late_result_ignored", job)
    elif not 0 < event.job_id <= state.last_job_id:
        raise lg.illegal(state, event, "NEW", f"job {event.job_id} was never queued")


def _fence_lifted(state: State, event: FenceLifted, check: bool) -> None:
    job, nxt = lg.check_job(state, event, "fence_lifted", event.job_id)
    if job.device_blocks != event.device_blocks or job.slots != event.slots:
        raise lg.illegal(state, event, job.state.name, f"event does not describe job {job.job_id}")
    if event.reason == "copy over" and job.reported != every_rank(state.config.world_size):
        raise lg.illegal(state, event, job.state.name, f"job {job.job_id}: not every rank has reported")
    job.state = nxt
    _end_job(state, job, forgotten=True)  # its request forgot it when it was fenced
    _release_fenced_slots(state, job)
    disk_tier.release_slots(state, job)


JOB_EVOLVERS: dict[type, Callable[[State, Any, bool], None]] = {
    StoreQueued: _store_queued,
    RemoteLoadQueued: _remote_load_queued,
    RemoteStoreQueued: _remote_store_queued,
    RemoteIndexed: _remote_indexed,
    DiskLoadQueued: _disk_load_queued,
    DiskStoreQueued: _disk_store_queued,
    DiskEvicted: _disk_evicted,
    DiskIndexed: _disk_indexed,
    EntriesRefused: _entries_refused,
    LoadQueued: _load_queued,
    JobsSubmitted: _jobs_submitted,
    RankSucceeded: _rank_succeeded,
    JobCompleted: _terminal,
    JobFailed: _terminal,
    JobTimedOut: _terminal,
    LateResultIgnored: _late,
    FenceLifted: _fence_lifted,
}
