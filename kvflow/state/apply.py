"""``evolve(state, event)``: apply one event. Every next state is read from the tables.

An event names a job, some entries, or both. ``evolve`` first checks the whole event
(kvflow.state.legality), then reads each next state from ``JOB_TRANSITIONS`` /
``BLOCK_TRANSITIONS`` and applies it: a job's state is the table's value; an entry's move
from one state to another is done by the one writer for that pair (``_ENTRY_MOVES``). So the
diagram ``kvflow diagram`` prints, the table tests and this code cannot disagree. An illegal
event raises :class:`~kvflow.errors.IllegalTransition` and leaves the state as it was.

The state is mutated in place (folding a log must run at millions of block changes per
second); ``State.copy()`` gives an independent snapshot. Pure: no I/O, no clock, no
randomness, no logging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvflow.errors import IllegalTransition
from kvflow.events import (
    LOAD,
    STORE,
    BlocksCorrupt,
    BlocksEvicted,
    BlocksTouched,
    Event,
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    LateResultIgnored,
    LoadQueued,
    PinsAcquired,
    PinsReleased,
    RankSucceeded,
    RequestClosed,
    RequestFinished,
    RequestOpened,
    RequestResumed,
    Reset,
    StoreQueued,
    StoreRejected,
    event_name,
)
from kvflow.state import legality as lg
from kvflow.state.model import Job, Request, State
from kvflow.state.tables import (
    ABSENT,
    BLOCK_TRANSITIONS,
    JOB_TRANSITIONS,
    OUTCOME_JOB_STATES,
    RESIDENT,
    STORE_QUEUED,
    STORING,
    BlockState,
    JobState,
)

# --- entry moves: the one writer for each (from, to) pair of BLOCK_TRANSITIONS ----------
# The entries are stored column-wise (slot_of, pending, pin_count; the policy orders the
# RESIDENT ones), so a move is a few dict operations per hash. (Plain loops of subscript
# stores and deletes: in CPython 3.11 they beat map() over __setitem__ / __delitem__.)


def _admit(state: State, hashes: tuple[int, ...], job: Job) -> None:
    """ABSENT -> STORE_QUEUED: the store job's slots are taken, its hashes pending on it."""
    free = state.free_slots
    del free[len(free) - len(job.slots) :]
    state.slot_of.update(zip(hashes, job.slots))
    pending, job_id = state.pending, job.job_id
    for h in hashes:
        pending[h] = job_id


def _publish(state: State, hashes: tuple[int, ...], job: Job) -> None:
    """STORING -> RESIDENT: visible from now on, the most recent in the policy.

    F14: a touch that named these entries while they were being stored is applied now, so
    a chain's order is the engine's touch whatever order its stores land in."""
    pending = state.pending
    for h in hashes:
        del pending[h]
    state.policy.insert_many(hashes)
    if state.deferred_touches:
        deferred = state.deferred_touches.pop(job.job_id, None)
        if deferred is not None:
            touched, reuse = deferred
            slot_of, pending = state.slot_of, state.pending
            resident = tuple(h for h in touched if h in slot_of and h not in pending)
            if reuse:
                state.policy.touch_many(resident)
            else:
                state.policy.refresh_many(resident)


def _free(state: State, hashes: tuple[int, ...]) -> None:
    """The entries leave their slots; a slot a fenced copy may still use stays out of the
    free list until that fence is lifted (F15)."""
    slots = map(state.slot_of.pop, reversed(hashes))
    quarantine = state.quarantine
    if quarantine:
        state.free_slots.extend([s for s in slots if s not in quarantine])
    else:
        state.free_slots.extend(slots)


def _drop_pending(state: State, hashes: tuple[int, ...], job: Job) -> None:
    """STORE_QUEUED / STORING -> ABSENT: never visible; the slots are free again (or fenced,
    when the job's copy may still be writing them)."""
    if state.deferred_touches:
        state.deferred_touches.pop(job.job_id, None)
    pending = state.pending
    for h in hashes:
        del pending[h]
    _free(state, hashes)


def _evict(state: State, hashes: tuple[int, ...], job: Job | None) -> None:
    """RESIDENT -> ABSENT: the slots are free again; the policy forgets (or ghosts) them."""
    _free(state, hashes)
    state.policy.remove_many(hashes)
    if state.bad:
        for h in hashes:
            state.bad.pop(h, None)


_ENTRY_MOVES: dict[tuple[BlockState, BlockState], Callable[..., None] | None] = {
    (ABSENT, STORE_QUEUED): _admit,
    (STORE_QUEUED, STORING): None,  # nothing to write: the store job's own state tells them apart
    (STORING, RESIDENT): _publish,
    (STORE_QUEUED, ABSENT): _drop_pending,
    (STORING, ABSENT): _drop_pending,
    (RESIDENT, ABSENT): _evict,
}


def _move(state: State, current: BlockState, tag: str, hashes: tuple[int, ...], job: Job | None) -> None:
    """Move entries that are all in ``current`` to where the table says ``tag`` takes them
    (a self-loop leaves them as they are: the event's own effect does the rest)."""
    nxt = BLOCK_TRANSITIONS[current][tag]
    if nxt is not current:
        write = _ENTRY_MOVES[current, nxt]
        if write is not None:
            write(state, hashes, job)


# --- jobs and requests ------------------------------------------------------------------


def _request(state: State, request_id: str | None) -> Request | None:
    if request_id is None:
        return None
    req = state.requests.get(request_id)
    if req is None:
        req = state.requests[request_id] = Request(request_id)
    return req


def _add_job(state: State, event: StoreQueued | LoadQueued, direction: str, tag: str) -> Job:
    job = Job(event.job_id, direction, event.request_id, event.hashes, event.device_blocks, event.slots)
    job.state = JOB_TRANSITIONS[JobState.NEW][tag]
    state.jobs[event.job_id] = job
    state.queued[event.job_id] = None
    state.last_job_id = event.job_id
    held, job_id = state.held, event.job_id
    for d in event.device_blocks:
        held[d] = job_id
    req = _request(state, event.request_id)
    if req is not None:
        req.jobs[event.job_id] = None
    return job


def _end_job(state: State, job: Job, abandoned: bool) -> None:
    """A terminal job leaves the state: its holds end, its request forgets it (a job
    abandoned by a reset was already forgotten by its request)."""
    del state.jobs[job.job_id]
    state.queued.pop(job.job_id, None)
    held = state.held
    for d in job.device_blocks:
        del held[d]
    if job.request_id is not None and not abandoned:
        del state.requests[job.request_id].jobs[job.job_id]


def _quarantine(state: State, job: Job) -> None:
    """Fence the job's slots: none is handed out again while its copy may still run."""
    quarantine, jid = state.quarantine, job.job_id
    for s in dict.fromkeys(job.slots):  # a load may read one slot twice
        quarantine[s] = quarantine.get(s, ()) + (jid,)


def _fence(state: State, job: Job) -> None:
    """The job's outcome is applied but its copy may still run (F15): its slots are
    quarantined and its device blocks stay held; its request forgets it."""
    _quarantine(state, job)
    if job.request_id is not None:
        del state.requests[job.request_id].jobs[job.job_id]


def _release_quarantine(state: State, job: Job) -> None:
    """The fence ends: each of the job's slots no other fence uses is free again, unless
    its entry still owns it (a fenced load's block may still be resident)."""
    quarantine = state.quarantine
    free, slot_of = state.free_slots, state.slot_of
    jid = job.job_id
    for h, s in reversed(dict.fromkeys(zip(job.hashes, job.slots))):
        users = tuple(j for j in quarantine[s] if j != jid)
        if users:
            quarantine[s] = users  # another fenced job still uses this slot
        else:
            del quarantine[s]
            if slot_of.get(h) != s:
                free.append(s)


def _pin(state: State, hashes: tuple[int, ...]) -> None:
    pins = state.pin_count
    for h in hashes:
        pins[h] = pins.get(h, 0) + 1


def _unpin(state: State, hashes: tuple[int, ...]) -> None:
    pins = state.pin_count
    for h in hashes:
        left = pins[h] - 1
        if left:
            pins[h] = left
        else:
            del pins[h]


# --- one function per event type ----------------------------------------------------------


def _store_queued(state: State, event: StoreQueued, check: bool) -> None:
    if check:
        lg.check_new_job(state, event)
        lg.check_absent(state, event)
        lg.check_free_slots(state, event, event.slots)
        req = state.requests.get(event.request_id) if event.request_id is not None else None
        if req is not None and req.finished:
            raise lg.illegal(state, event, "FINISHED", f"request {event.request_id} is finished")
    job = _add_job(state, event, STORE, "store_queued")
    _move(state, ABSENT, "store_queued", event.hashes, job)


def _load_queued(state: State, event: LoadQueued, check: bool) -> None:
    req = state.requests.get(event.request_id)
    n = len(event.hashes)
    if check:
        lg.check_new_job(state, event)
        if req is None or req.finished:
            raise lg.illegal(state, event, "NO_REQUEST", f"request {event.request_id} is not live")
        if req.offered[:n] != event.hashes:  # (offered hits are pinned, hence RESIDENT)
            raise lg.illegal(state, event, "PINS", "a load must take the request's offered hits, in order")
        if tuple(map(state.slot_of.__getitem__, event.hashes)) != event.slots:
            raise lg.illegal(state, event, "RESIDENT", "the load's slots are not where its blocks live")
    if req is None:
        raise lg.illegal(state, event, "NO_REQUEST", f"request {event.request_id} is not live")
    # the request's pins move from "offered" to the job (counts are unchanged)
    req.offered = req.offered[n:]
    req.loading[event.job_id] = event.hashes
    job = _add_job(state, event, LOAD, "load_queued")
    _move(state, RESIDENT, "load_queued", event.hashes, job)


def _jobs_submitted(state: State, event: JobsSubmitted, check: bool) -> None:
    jobs, queued = state.jobs, state.queued
    if check:
        for jid in event.job_ids:
            job = lg.check_job(state, event, "jobs_submitted", jid)
            if jid not in queued:
                raise lg.illegal(state, event, job.state.name, f"job {jid} is not queued")
        if len(set(event.job_ids)) != len(event.job_ids):
            raise lg.illegal(state, event, "IN_FLIGHT", "a job is submitted twice in one event")
    deadline = event.deadline_ms
    for jid in event.job_ids:
        job = jobs[jid]
        job.state = JOB_TRANSITIONS[job.state]["jobs_submitted"]
        job.deadline_ms = deadline
        del queued[jid]
        # a store's entries follow their job: STORE_QUEUED -> STORING
        _move(state, STORE_QUEUED if job.direction == STORE else RESIDENT, "jobs_submitted", (), job)


def _check_terminal(state: State, event: JobCompleted | JobFailed | JobTimedOut, tag: str) -> Job:
    job = lg.check_job(state, event, tag, event.job_id)
    if type(event) is JobFailed and event.fenced:
        if not 0 <= event.rank < state.config.world_size:
            raise lg.illegal(state, event, job.state.name, f"rank {event.rank} out of range")
        if job.reported | (1 << event.rank) == (1 << state.config.world_size) - 1:
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
    if type(event) is JobCompleted:
        world = state.config.world_size
        if not 0 <= event.rank < world:
            raise lg.illegal(state, event, job.state.name, f"rank {event.rank} out of range")
        if job.acks | (1 << event.rank) != (1 << world) - 1:
            raise lg.illegal(state, event, job.state.name, f"job {job.job_id} lacks rank results")
    return job


def _terminal(state: State, event: JobCompleted | JobFailed | JobTimedOut, check: bool) -> None:
    tag = event_name(event)
    fenced = type(event) is not JobCompleted and event.fenced  # type: ignore[union-attr]
    job_tag = tag + ":fenced" if fenced else tag
    job = _check_terminal(state, event, job_tag) if check else state.jobs[event.job_id]
    was = job.state
    job.state = JOB_TRANSITIONS[was][job_tag]
    if job.state not in OUTCOME_JOB_STATES:
        raise IllegalTransition(was.name, f"{tag}#{event.seq}", "the job table must end or fence the job here")
    abandoned = was is JobState.ABANDONED
    if fenced:
        if type(event) is JobFailed:
            job.reported |= 1 << event.rank
        if abandoned:
            return  # already fenced by the reset (its entries left the tier then)
        _fence(state, job)  # memory stays fenced; the outcome below applies now
    else:
        _end_job(state, job, abandoned)
        if abandoned:
            # its entries left the tier at the reset; only its quarantined slots come back now
            _release_quarantine(state, job)
            return
    if job.direction == STORE:
        _move(state, STORE_QUEUED if was is JobState.QUEUED else STORING, tag, job.hashes, job)
    else:
        _move(state, RESIDENT, tag, job.hashes, job)
        del state.requests[job.request_id].loading[job.job_id]  # type: ignore[index]
        _unpin(state, job.hashes)


def _rank_succeeded(state: State, event: RankSucceeded, check: bool) -> None:
    job = lg.check_job(state, event, "rank_succeeded", event.job_id)
    world = state.config.world_size
    if not 0 <= event.rank < world:  # (before the shift: a negative rank cannot shift)
        raise lg.illegal(state, event, job.state.name, f"rank {event.rank} out of range")
    bit = 1 << event.rank
    if job.acks & bit:
        raise lg.illegal(state, event, job.state.name, f"rank {event.rank} cannot report again")
    if job.acks | bit == (1 << world) - 1:
        raise lg.illegal(state, event, job.state.name, "the last rank's success is JobCompleted")
    job.state = JOB_TRANSITIONS[job.state]["rank_succeeded"]
    job.acks |= bit
    job.reported |= bit


def _late(state: State, event: LateResultIgnored, check: bool) -> None:
    job = state.jobs.get(event.job_id)
    if job is not None and job.state is JobState.FENCED:
        # a fenced job's rank reports: that rank's copy is over
        if not 0 <= event.rank < state.config.world_size:
            raise lg.illegal(state, event, job.state.name, f"rank {event.rank} out of range")
        job.state = lg.job_next(state, event, "late_result_ignored", job)
        job.reported |= 1 << event.rank
    elif job is not None:
        # legal for a live job only as a repeat of a rank that already reported success
        if not (0 <= event.rank < 64 and job.acks & (1 << event.rank)):
            raise lg.illegal(state, event, job.state.name, f"job {event.job_id} is live")
        job.state = lg.job_next(state, event, "late_result_ignored", job)
    elif not 0 < event.job_id <= state.last_job_id:
        raise lg.illegal(state, event, "NEW", f"job {event.job_id} was never queued")


def _fence_lifted(state: State, event: FenceLifted, check: bool) -> None:
    job = lg.check_job(state, event, "fence_lifted", event.job_id)
    if job.device_blocks != event.device_blocks or job.slots != event.slots:
        raise lg.illegal(state, event, job.state.name, f"event does not describe job {job.job_id}")
    if event.reason == "copy over" and job.reported != (1 << state.config.world_size) - 1:
        raise lg.illegal(state, event, job.state.name, f"job {job.job_id}: not every rank has reported")
    job.state = lg.job_next(state, event, "fence_lifted", job)
    _end_job(state, job, abandoned=True)  # its request forgot it when it was fenced
    _release_quarantine(state, job)


def _evicted(state: State, event: BlocksEvicted, check: bool) -> None:
    if check:
        if len(event.hashes) != len(event.slots):
            raise lg.illegal(state, event, "RESIDENT", "hashes and slots differ in length")
        lg.check_resident(state, event, "blocks_evicted", event.hashes)
        if not state.pin_count.keys().isdisjoint(event.hashes):
            raise lg.illegal(state, event, "RESIDENT", "a pinned block cannot be evicted")
        if tuple(map(state.slot_of.__getitem__, event.hashes)) != event.slots:
            raise lg.illegal(state, event, "RESIDENT", "the evicted slots are not where the blocks live")
        if len(set(event.hashes)) != len(event.hashes):
            raise lg.illegal(state, event, "RESIDENT", "a block is evicted twice in one event")
    _move(state, RESIDENT, "blocks_evicted", event.hashes, None)


def _touched(state: State, event: BlocksTouched, check: bool) -> None:
    hashes, pending = event.hashes, state.pending
    if pending and not pending.keys().isdisjoint(hashes):
        # F14: entries still being stored keep the touch on their job until they land
        if check:
            for h in hashes:
                lg.check_block(state, event, "blocks_touched", h)
        jobs = dict.fromkeys(pending[h] for h in hashes if h in pending)
        for job_id in jobs:
            state.deferred_touches[job_id] = (hashes, event.reuse)
        hashes = tuple(h for h in hashes if h not in pending)
    elif check:
        lg.check_resident(state, event, "blocks_touched", hashes)
    _move(state, RESIDENT, "blocks_touched", hashes, None)
    if event.reuse:
        state.policy.touch_many(hashes)
    else:
        state.policy.refresh_many(hashes)


def _corrupt(state: State, event: BlocksCorrupt, check: bool) -> None:
    if not event.hashes:
        raise lg.illegal(state, event, "RESIDENT", "names no block")
    lg.check_resident(state, event, "blocks_corrupt", event.hashes)
    _move(state, RESIDENT, "blocks_corrupt", event.hashes, None)
    for h in event.hashes:
        state.bad[h] = None


def _rejected(state: State, event: StoreRejected, check: bool) -> None:
    if not event.hashes:
        raise lg.illegal(state, event, "RESIDENT", "a rejection names at least one block")
    _request(state, event.request_id)


def _pins_acquired(state: State, event: PinsAcquired, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if check:
        if req is not None and (req.finished or req.offered):
            raise lg.illegal(state, event, "PINS", f"request {event.request_id} has offered pins or is finished")
        if event.hashes:
            lg.check_resident(state, event, "pins_acquired", event.hashes)
    if req is None:
        req = state.requests[event.request_id] = Request(event.request_id)
    _move(state, RESIDENT, "pins_acquired", event.hashes, None)
    _pin(state, event.hashes)
    req.offered = event.hashes


def _pins_released(state: State, event: PinsReleased, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if req is None:
        raise lg.illegal(state, event, "NO_REQUEST", f"request {event.request_id}")
    n = len(event.hashes)
    offered = req.offered
    # Only pins offered by a lookup and not taken by a load job can be released directly;
    # a load job's pins are released by its terminal event.
    if offered[len(offered) - n :] != event.hashes or n == 0:
        raise lg.illegal(state, event, "PINS", f"request {event.request_id} does not hold these offered pins")
    _move(state, RESIDENT, "pins_released", event.hashes, None)
    req.offered = offered[: len(offered) - n]
    _unpin(state, event.hashes)


def _finished(state: State, event: RequestFinished, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if req is None or req.finished:
        raise lg.illegal(state, event, "NO_REQUEST" if req is None else "FINISHED", f"request {event.request_id}")
    if req.offered:
        raise lg.illegal(state, event, "PINS", "release offered pins before finishing")
    req.finished = True
    req.preempted = event.preempted


def _opened(state: State, event: RequestOpened, check: bool) -> None:
    if event.request_id in state.requests:
        raise lg.illegal(state, event, "LIVE", f"request {event.request_id} is known already")
    _request(state, event.request_id)


def _resumed(state: State, event: RequestResumed, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if req is None or not req.finished or not req.preempted:
        raise lg.illegal(state, event, "LIVE", f"request {event.request_id} is not a preempted one")
    req.finished = req.preempted = False


def _closed(state: State, event: RequestClosed, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if req is None or not req.finished or req.jobs or req.holds_pins():
        raise lg.illegal(state, event, "LIVE", f"request {event.request_id} cannot close yet")
    del state.requests[event.request_id]


def _reset(state: State, event: Reset, check: bool) -> None:
    abandoned = event.abandoned_job_ids
    if state.queued:
        raise lg.illegal(state, event, "QUEUED", "queued jobs must be cancelled before a reset")
    if list(abandoned) != [jid for jid, j in state.jobs.items() if j.state is not JobState.FENCED]:
        raise lg.illegal(state, event, "IN_FLIGHT", "the reset must abandon exactly the in-flight jobs")
    # every entry goes where the table sends it under "reset" (the bulk writer below is the
    # one for ABSENT; a table that said otherwise is refused before anything changes)
    present = ([RESIDENT] if len(state.pending) < len(state.slot_of) else []) + ([STORING] if state.pending else [])
    for current in present:
        if BLOCK_TRANSITIONS[current].get("reset") is not ABSENT:
            raise lg.illegal(state, event, current.name, "reset must take every entry off the tier")
    jobs = state.jobs
    nxt = {jid: lg.job_next(state, event, "reset", jobs[jid]) for jid in abandoned}
    # apply: in-flight jobs keep their slots (quarantined) and device blocks until they report
    quarantine = state.quarantine
    for jid, job_state in nxt.items():
        job = jobs[jid]
        if job.state is not job_state:  # a second reset finds them already abandoned
            job.state = job_state
            for s in dict.fromkeys(job.slots):
                quarantine[s] = quarantine.get(s, ()) + (jid,)
    state.free_slots.extend(s for s in state.slot_of.values() if s not in quarantine)
    state.slot_of.clear()
    state.pending.clear()
    state.pin_count.clear()
    state.deferred_touches.clear()
    state.bad.clear()
    if event.keeps_requests:  # F18: live requests stay known, with nothing on the tier
        for rid, req in list(state.requests.items()):
            if req.finished:
                del state.requests[rid]
            else:
                req.offered, req.loading, req.jobs = (), {}, {}
    else:
        state.requests.clear()
    state.policy.clear()


_EVOLVERS: dict[type, Callable[[State, object, bool], None]] = {
    StoreQueued: _store_queued,  # type: ignore[dict-item]
    LoadQueued: _load_queued,  # type: ignore[dict-item]
    JobsSubmitted: _jobs_submitted,  # type: ignore[dict-item]
    RankSucceeded: _rank_succeeded,  # type: ignore[dict-item]
    JobCompleted: _terminal,  # type: ignore[dict-item]
    JobFailed: _terminal,  # type: ignore[dict-item]
    JobTimedOut: _terminal,  # type: ignore[dict-item]
    LateResultIgnored: _late,  # type: ignore[dict-item]
    FenceLifted: _fence_lifted,  # type: ignore[dict-item]
    BlocksEvicted: _evicted,  # type: ignore[dict-item]
    BlocksTouched: _touched,  # type: ignore[dict-item]
    BlocksCorrupt: _corrupt,  # type: ignore[dict-item]
    StoreRejected: _rejected,  # type: ignore[dict-item]
    PinsAcquired: _pins_acquired,  # type: ignore[dict-item]
    PinsReleased: _pins_released,  # type: ignore[dict-item]
    RequestFinished: _finished,  # type: ignore[dict-item]
    RequestOpened: _opened,  # type: ignore[dict-item]
    RequestResumed: _resumed,  # type: ignore[dict-item]
    RequestClosed: _closed,  # type: ignore[dict-item]
    Reset: _reset,  # type: ignore[dict-item]
}


def evolve(state: State, event: Event, check: bool = True) -> State:
    """Apply one event (in place) and return the state; illegal → IllegalTransition, no change.

    ``check=False`` skips the per-block legality checks. Only the live path uses it, for
    events its own ``decide`` just produced from this very state (the decider validated
    them); folds and replays of recorded logs always check.
    """
    if event.seq != state.next_seq:
        raise IllegalTransition(f"SEQ {state.next_seq}", f"{event_name(event)}#{event.seq}", "events must be gapless")
    _EVOLVERS[type(event)](state, event, check)
    state.next_seq += 1
    return state


def fold(state: State, events: Iterable[Event]) -> State:
    """Replay: apply every event in order."""
    for event in events:
        evolve(state, event)
    return state
