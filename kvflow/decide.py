"""Decisions: the business rules. ``decide(state, command)`` yields the events to append.

Each decider is a generator. The caller (``OffloadManager``, or ``replay --redecide``) applies
every yielded event with ``evolve`` before resuming the generator, so a decision always reads
the state its earlier events produced (an eviction frees the slots the next store takes).
The generator's return value is the command's answer (hit count, job id, jobs to submit).

Rule: a decider validates everything *before its first yield* and raises a
:class:`~kvflow.errors.Rejected` subclass for a bad call (F12), so a refused command appends
nothing. Pure: no I/O, no clock, no randomness, no logging.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Generator, Sequence
from itertools import compress, filterfalse
from typing import Any

from kvflow.errors import BlockHeld, Rejected, UnknownJob, UnknownRequest
from kvflow.events import (
    LOAD,
    STORE,
    AcceptHits,
    BlocksComputed,
    BlocksCorrupt,
    BlocksEvicted,
    BlocksTouched,
    Command,
    DeviceBlocksEvicting,
    EndFences,
    Event,
    Evict,
    FenceLifted,
    FinishRequest,
    Invalidate,
    JobCompleted,
    JobFailed,
    JobResult,
    JobResults,
    JobsSubmitted,
    JobTimedOut,
    LateResultIgnored,
    LoadQueued,
    Lookup,
    PinsAcquired,
    PinsReleased,
    PlanStep,
    RankSucceeded,
    RequestClosed,
    RequestFinished,
    RequestOpened,
    RequestResumed,
    Reset,
    ResetAll,
    StoreQueued,
    StoreRejected,
    Tick,
    Touch,
    TransferJob,
)
from kvflow.state import Job, JobState, State

Decision = Generator[Event, None, Any]

CANCELLED_BY_RESET = "cancelled by reset before submission"


def _whole(value: object) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def hit_cap_blocks(num_tokens: int, block_tokens: int) -> int:
    """At most ``num_tokens - 1`` tokens may hit, rounded down to whole blocks (F13)."""
    return max(0, (num_tokens - 1) // block_tokens)


# --- lookup and loads ----------------------------------------------------------------------


def decide_lookup(state: State, cmd: Lookup) -> Decision:
    if not _whole(cmd.num_tokens) or cmd.num_tokens < 0:
        raise Rejected(f"lookup of request {cmd.request_id}: num_tokens must be >= 0")
    if not _whole(cmd.device_hit_blocks) or cmd.device_hit_blocks < 0:
        raise Rejected(f"lookup of request {cmd.request_id}: device_hit_blocks must be >= 0")
    if not state.config.enabled:
        return 0
    req = state.requests.get(cmd.request_id)
    _check_not_finished(req, cmd.request_id, "lookup of request")
    cap = hit_cap_blocks(cmd.num_tokens, state.config.block_tokens)
    if req is not None and req.finished:
        yield RequestResumed(seq=state.next_seq, request_id=cmd.request_id)  # F18
    if req is not None and req.offered:
        # A repeated lookup (the scheduler could not place the request last step) replaces the
        # hits it offered before, so pins never pile up.
        yield PinsReleased(seq=state.next_seq, request_id=cmd.request_id, hashes=req.offered)
    window = cmd.block_hashes[cmd.device_hit_blocks : cap]
    # only RESIDENT entries are visible: on the tier and not pending (scanned at C level)
    visible = list(map(state.slot_of.__contains__, window))
    if state.pending:
        visible = list(map(operator.gt, visible, map(state.pending.__contains__, window)))
    n = visible.index(False) if False in visible else len(window)
    yield PinsAcquired(seq=state.next_seq, request_id=cmd.request_id, hashes=window[:n], num_tokens=cmd.num_tokens)
    return n


def _check_not_finished(req: Any, request_id: str, what: str) -> None:
    """A finished request takes no new work; a preempted one whose earlier jobs are still
    live comes back under its id (F18: ``RequestResumed``)."""
    if req is not None and req.finished and not req.preempted:
        raise Rejected(f"{what} {request_id}: the request is finished")


def decide_accept_hits(state: State, cmd: AcceptHits) -> Decision:
    if not state.config.enabled:
        if cmd.device_blocks:
            raise Rejected(f"accept_hits: offload is disabled, request {cmd.request_id} was offered nothing")
        return None
    req = state.requests.get(cmd.request_id)
    if req is None or req.finished:
        raise UnknownRequest(f"accept_hits: request {cmd.request_id} has no live lookup")
    n = len(cmd.device_blocks)
    if n > len(req.offered):
        raise Rejected(
            f"accept_hits: request {cmd.request_id} was offered {len(req.offered)} blocks, "
            f"cannot accept {n}"
        )
    _check_device_blocks(state, cmd.device_blocks, allow_same_store={})
    job_id = None
    if n:
        hashes = req.offered[:n]
        job_id = state.last_job_id + 1
        yield LoadQueued(
            seq=state.next_seq,
            job_id=job_id,
            request_id=cmd.request_id,
            hashes=hashes,
            device_blocks=tuple(cmd.device_blocks),
            slots=tuple(map(state.slot_of.__getitem__, hashes)),
        )
    if req.offered:
        yield PinsReleased(seq=state.next_seq, request_id=cmd.request_id, hashes=req.offered)
    return job_id


# --- stores and eviction -------------------------------------------------------------------


def _check_device_blocks(
    state: State, device_blocks: Sequence[int], allow_same_store: dict[int, int]
) -> None:
    """Device blocks must not be held by a live job (F12), except a store of the same hash
    (that one is a duplicate, F3). ``allow_same_store`` maps device block -> hash asked.
    A fenced job (abandoned by a reset, timed out, failed on one rank) holds its device blocks
    until its copy is over, whatever the hash: its hashes left the tier, so a "duplicate"
    store would take the blocks it may still copy (F15)."""
    if not device_blocks:
        return
    unique = set(device_blocks)
    if len(unique) != len(device_blocks):
        raise Rejected("a device block is named twice in one call")
    try:
        lowest = min(unique)
    except TypeError:
        raise Rejected(f"device blocks must be integers, got {list(device_blocks)[:4]!r}") from None
    if lowest < 0:
        raise Rejected(f"device block {lowest} is not a block id")
    held = state.held
    if not held or held.keys().isdisjoint(unique):
        return
    for d in device_blocks:
        jid = held.get(d)
        if jid is None:
            continue
        job = state.jobs[jid]
        if job.direction == STORE and not job.fenced and d in allow_same_store:
            index = job.device_blocks.index(d)
            if job.hashes[index] == allow_same_store[d]:
                continue
        raise BlockHeld(
            f"device block {d} is held by live {job.direction} job {jid}; "
            "wait for the job to finish before reusing it"
        )


def _fenced_slot_owners(state: State) -> list[int]:
    """Resident entries whose slot a fenced load may still read (F15): evicting one would
    free no slot until the fence is lifted, so eviction for space passes them over."""
    if not state.quarantine:
        return []
    slot_of = state.slot_of
    return [
        h
        for job in state.jobs.values()
        if job.fenced and job.direction == LOAD
        for h, s in zip(job.hashes, job.slots)
        if slot_of.get(h) == s
    ]


def _victims_up_to(state: State, wanted: int, protected: Sequence[int] = ()) -> list[int]:
    """As many victims as the policy can give, up to ``wanted``, in eviction order, never a
    pinned block nor one of ``protected`` (F16: a store's own chain)."""
    if wanted <= 0:
        return []
    pin_count, slot_of = state.pin_count, state.slot_of
    if slot_of.keys().isdisjoint(protected) and not state.quarantine:
        blocked: Any = pin_count  # the policy orders exactly the RESIDENT entries
    else:
        blocked = set(pin_count)
        blocked.update(protected)
        blocked.update(_fenced_slot_owners(state))
    victims = state.policy.victims(wanted, blocked.__contains__)
    if victims is not None:
        return victims
    evictable = sum(1 for h in state.policy.resident() if h not in blocked)
    if evictable <= 0:
        return []
    return state.policy.victims(evictable, blocked.__contains__) or []


# hashes admitted, their device blocks, victims, and the blocks rejected (hashes, device blocks)
Admission = tuple[list[int], list[int], list[int], list[int], list[int]]


def _admission(state: State, block_hashes: Sequence[int], device_blocks: Sequence[int]) -> Admission:
    """DESIGN §7 step 3: every block of the store not on the tier (resident, queued or in
    flight; F3), each hash once, in prefix order, takes a free slot, else evicts the policy's
    next victim, never a block of this store's own chain (F16); when nothing else can be
    evicted, it and every later block are rejected."""
    absent = list(map(operator.not_, map(state.slot_of.__contains__, block_hashes)))
    new_hashes = list(compress(block_hashes, absent))
    new_blocks = list(compress(device_blocks, absent))
    if len(set(new_hashes)) != len(new_hashes):  # a hash named twice is stored once
        firsts: dict[int, int] = {}
        for h, d in zip(new_hashes, new_blocks):
            firsts.setdefault(h, d)
        new_hashes, new_blocks = list(firsts), list(firsts.values())
    need = len(new_hashes) - len(state.free_slots)
    victims = _victims_up_to(state, need, block_hashes) if need > 0 else []
    admitted = len(new_hashes) - max(0, need - len(victims))
    return new_hashes[:admitted], new_blocks[:admitted], victims, new_hashes[admitted:], new_blocks[admitted:]


def _decide_store(
    state: State,
    request_id: str | None,
    block_hashes: Sequence[int],
    device_blocks: Sequence[int],
) -> Decision:
    if len(block_hashes) != len(device_blocks):
        raise Rejected(
            f"store: {len(block_hashes)} hashes but {len(device_blocks)} device blocks"
        )
    req = state.requests.get(request_id) if request_id is not None else None
    _check_not_finished(req, request_id, "store: request")  # type: ignore[arg-type]
    held = state.held
    same = dict(zip(device_blocks, block_hashes)) if held and not held.keys().isdisjoint(device_blocks) else {}
    _check_device_blocks(state, device_blocks, same)
    if not state.config.enabled:
        return None
    if req is not None and req.finished:
        yield RequestResumed(seq=state.next_seq, request_id=req.request_id)  # F18
    entries = state.slot_of
    admit_hashes, admit_blocks, victims, rejected_hashes, rejected_blocks = _admission(
        state, block_hashes, device_blocks
    )
    if victims:
        yield BlocksEvicted(
            seq=state.next_seq,
            hashes=tuple(victims),
            slots=tuple(map(entries.__getitem__, victims)),
            reason="capacity",
        )
    job_id = None
    admitted = len(admit_hashes)
    if admitted:
        free = state.free_slots
        job_id = state.last_job_id + 1
        yield StoreQueued(
            seq=state.next_seq,
            job_id=job_id,
            request_id=request_id,
            hashes=tuple(admit_hashes),
            device_blocks=tuple(admit_blocks),
            slots=tuple(free[len(free) - admitted :][::-1]),
        )
    elif request_id is not None and req is None and not rejected_hashes:
        yield RequestOpened(seq=state.next_seq, request_id=request_id)  # F18: known from now on
    if rejected_hashes:
        yield StoreRejected(
            seq=state.next_seq,
            request_id=request_id,
            hashes=tuple(rejected_hashes),
            device_blocks=tuple(rejected_blocks),
            reason=f"tier full: {state.capacity} slots held by pinned, in-flight or own-chain entries",
        )
    return job_id


def decide_blocks_computed(state: State, cmd: BlocksComputed) -> Decision:
    if state.config.store_mode != "eager":
        # lazy: nothing is stored now, but the request is known (and back, if preempted) (F18)
        req = state.requests.get(cmd.request_id) if cmd.request_id is not None else None
        _check_not_finished(req, cmd.request_id, "blocks_computed: request")  # type: ignore[arg-type]
        _check_device_blocks(state, cmd.device_blocks, dict(zip(cmd.device_blocks, cmd.block_hashes)))
        if cmd.request_id is not None and state.config.enabled:
            if req is None:
                yield RequestOpened(seq=state.next_seq, request_id=cmd.request_id)
            elif req.finished:
                yield RequestResumed(seq=state.next_seq, request_id=cmd.request_id)
        return None
    return (yield from _decide_store(state, cmd.request_id, cmd.block_hashes, cmd.device_blocks))


def decide_device_evicting(state: State, cmd: DeviceBlocksEvicting) -> Decision:
    if state.config.store_mode != "lazy":
        return None
    return (yield from _decide_store(state, None, cmd.block_hashes, cmd.device_blocks))


def decide_touch(state: State, cmd: Touch) -> Decision:
    """Recency for the blocks on the tier, in the given order. A block still being stored
    keeps the touch until it lands (F14: a touch is never lost to completion order)."""
    slot_of, pending, hashes = state.slot_of, state.pending, cmd.block_hashes
    if all(map(slot_of.__contains__, hashes)) and (
        cmd.keep_pending or not pending or pending.keys().isdisjoint(hashes)
    ):
        touched = hashes  # the common case: every block is on the tier
    elif cmd.keep_pending:
        touched = tuple(filter(slot_of.__contains__, hashes))
    else:  # (a version-1 trace's touch: blocks still being stored were skipped)
        touched = tuple(filterfalse(pending.__contains__, filter(slot_of.__contains__, hashes)))
    if touched:
        yield BlocksTouched(seq=state.next_seq, hashes=touched, reuse=cmd.reuse)
    return len(touched)


def decide_evict(state: State, cmd: Evict) -> Decision:
    if not _whole(cmd.num_blocks) or cmd.num_blocks < 0:
        raise Rejected(f"evict: num_blocks must be >= 0, got {cmd.num_blocks!r}")
    if cmd.num_blocks == 0:
        return 0
    blocked: Any = state.pin_count
    if state.quarantine:  # (an entry whose slot stays fenced would free nothing)
        blocked = set(state.pin_count)
        blocked.update(_fenced_slot_owners(state))
    victims = state.policy.victims(cmd.num_blocks, blocked.__contains__)
    if victims is None:
        raise Rejected(f"evict: fewer than {cmd.num_blocks} unpinned resident blocks (all-or-nothing)")
    yield BlocksEvicted(
        seq=state.next_seq,
        hashes=tuple(victims),
        slots=tuple(map(state.slot_of.__getitem__, victims)),
        reason="explicit",
    )
    return len(victims)


def _evict_resident(state: State, hashes: Sequence[int], reason: str) -> BlocksEvicted | None:
    """The eviction of those of ``hashes`` that are RESIDENT and unpinned (each once), or None."""
    slot_of, pending, pinned = state.slot_of, state.pending, state.pin_count
    chosen = [h for h in dict.fromkeys(hashes) if h in slot_of and h not in pending and h not in pinned]
    if not chosen:
        return None
    return BlocksEvicted(
        seq=state.next_seq,
        hashes=tuple(chosen),
        slots=tuple(map(slot_of.__getitem__, chosen)),
        reason=reason,  # type: ignore[arg-type]
    )


def _drop_corrupt(state: State, hashes: Sequence[int]) -> Decision:
    """F17: the resident, unpinned ones of ``hashes`` are evicted now; the ones another
    request still pins are remembered and evicted when their last pin goes."""
    eviction = _evict_resident(state, hashes, "corrupt")
    if eviction is not None:
        yield eviction
    pinned = [h for h in dict.fromkeys(hashes) if h in state.pin_count and h not in state.bad and state.is_resident(h)]
    if pinned:
        yield BlocksCorrupt(seq=state.next_seq, hashes=tuple(pinned))


def _evict_unpinned_bad(state: State) -> Decision:
    """After any decision: remembered bad blocks whose last pin went are evicted (F17)."""
    gone = [h for h in state.bad if h not in state.pin_count]
    if gone:
        eviction = _evict_resident(state, gone, "corrupt")
        if eviction is not None:
            yield eviction


def _then_evict_bad(decider: Callable[[State, Any], Decision]) -> Callable[[State, Any], Decision]:
    def decide_then_evict(state: State, cmd: Any) -> Decision:
        answer = yield from decider(state, cmd)
        if state.bad:
            yield from _evict_unpinned_bad(state)
        return answer

    decide_then_evict.__name__ = decider.__name__
    return decide_then_evict


def decide_invalidate(state: State, cmd: Invalidate) -> Decision:
    eviction = _evict_resident(state, cmd.block_hashes, "invalidated")
    if eviction is None:
        return 0
    yield eviction
    return len(eviction.hashes)


# --- jobs ----------------------------------------------------------------------------------


def _transfer_job(job: Job) -> TransferJob:
    return TransferJob(
        job_id=job.job_id,
        direction=job.direction,  # type: ignore[arg-type]
        device_blocks=job.device_blocks,
        slots=job.slots,
        hashes=job.hashes,
        request_id=job.request_id,
    )


def decide_plan_step(state: State, cmd: PlanStep) -> Decision:
    if not state.queued:
        return []
    job_ids = tuple(state.queued)
    jobs = [_transfer_job(state.jobs[j]) for j in job_ids]
    yield JobsSubmitted(
        seq=state.next_seq,
        job_ids=job_ids,
        now_ms=float(cmd.now_ms),
        deadline_ms=float(cmd.now_ms + state.config.job_deadline_ms),
    )
    return jobs


def _terminal_event(kind: type[Any], state: State, job: Job, **outcome: Any) -> Any:
    """A JobCompleted / JobFailed / JobTimedOut describing ``job``, with its outcome fields."""
    return kind(
        seq=state.next_seq,
        abandoned=job.state is JobState.ABANDONED,
        job_id=job.job_id,
        direction=job.direction,
        request_id=job.request_id,
        hashes=job.hashes,
        device_blocks=job.device_blocks,
        slots=job.slots,
        **outcome,
    )


def _closing(state: State, request_id: str | None) -> RequestClosed | None:
    """The close of a finished request whose last job and pin are gone (it leaves the
    state), or None while it still has some."""
    if request_id is None:
        return None
    req = state.requests.get(request_id)
    if req is None or not req.finished or req.jobs or req.holds_pins():
        return None
    return RequestClosed(seq=state.next_seq, request_id=request_id)


def _check_result(state: State, result: JobResult) -> None:
    """A result must name a job issued and submitted, and a rank of the world (F12)."""
    if not _whole(result.job_id) or not 0 < result.job_id <= state.last_job_id:
        raise UnknownJob(f"result for unknown job {result.job_id!r} (last issued: {state.last_job_id})")
    world = state.config.world_size
    if not _whole(result.rank) or not 0 <= result.rank < world:
        raise Rejected(f"result for job {result.job_id}: rank {result.rank!r} outside world size {world}")
    job = state.jobs.get(result.job_id)
    if job is not None and job.state is JobState.QUEUED:
        raise Rejected(f"result for job {result.job_id}, which was never submitted")


def _fence_lifted(state: State, job: Job, reason: str) -> FenceLifted:
    return FenceLifted(
        seq=state.next_seq, job_id=job.job_id, device_blocks=job.device_blocks, slots=job.slots, reason=reason  # type: ignore[arg-type]
    )


def _apply_result(state: State, cmd: JobResult) -> Decision:
    """The events of one checked result: the job's end, a rank's success, or a late result
    (which, for a fenced job, says that rank's copy is over: the last one lifts the fence)."""
    job = state.jobs.get(cmd.job_id)
    bit = 1 << cmd.rank
    every_rank = (1 << state.config.world_size) - 1
    if job is None or job.acks & bit or job.state is JobState.FENCED:
        yield LateResultIgnored(seq=state.next_seq, job_id=cmd.job_id, rank=cmd.rank, ok=cmd.ok, error=cmd.error)
        if job is not None and job.state is JobState.FENCED:
            if cmd.corrupt and job.direction == LOAD and not cmd.ok:
                # F17 also when the report comes after the outcome (a timeout, another rank's
                # failure): the host copies it found bad leave the tier
                yield from _drop_corrupt(state, [h for h in job.hashes if h in set(cmd.corrupt)])
            if job.reported == every_rank:
                yield _fence_lifted(state, job, "copy over")
        return
    request_id = None if job.state is JobState.ABANDONED else job.request_id
    if not cmd.ok:
        # F15: while another rank has not reported, its copy may still run: fence the memory
        fenced = job.reported | bit != every_rank
        yield _terminal_event(
            JobFailed, state, job, rank=cmd.rank, error=cmd.error or "unknown error", fenced=fenced
        )
        if cmd.corrupt and job.direction == LOAD and job.state is not JobState.ABANDONED:
            # F17: bad bytes are never offered twice: the entries the load found corrupt
            # leave the tier now that its pins are released (those another request still
            # pins go when that load fails on them too)
            named = set(cmd.corrupt)
            bad = [h for h in job.hashes if h in named]
            yield from _drop_corrupt(state, bad)
    elif job.acks | bit == (1 << state.config.world_size) - 1:
        yield _terminal_event(JobCompleted, state, job, rank=cmd.rank)
    else:
        yield RankSucceeded(seq=state.next_seq, job_id=job.job_id, rank=cmd.rank)
        return
    closing = _closing(state, request_id)
    if closing is not None:
        yield closing


def decide_job_result(state: State, cmd: JobResult) -> Decision:
    _check_result(state, cmd)
    yield from _apply_result(state, cmd)
    return None


def decide_job_results(state: State, cmd: JobResults) -> Decision:
    """Many executor outcomes at once (one command per engine step instead of one per job).
    All are checked before anything is applied, so a bad one refuses the whole batch."""
    for r in cmd.results:
        _check_result(state, r)
    for r in cmd.results:
        yield from _apply_result(state, r)
    return None


def expired_jobs(state: State, now_ms: float) -> list[Job]:
    """The in-flight jobs whose deadline has come by ``now_ms`` (F2), in job order. (A fenced
    job's outcome is already known: its deadline has nothing left to decide.)"""
    in_flight = JobState.IN_FLIGHT
    return [job for job in state.jobs.values() if job.deadline_ms <= now_ms and job.state is in_flight]


def decide_tick(state: State, cmd: Tick) -> Decision:
    expired = expired_jobs(state, cmd.now_ms)
    for job in expired:
        request_id = job.request_id
        # F15: the engine learns of the timeout now; the copy may still run, so the job's
        # memory stays fenced until the executor reports it over
        yield _terminal_event(
            JobTimedOut, state, job, now_ms=float(cmd.now_ms), deadline_ms=float(job.deadline_ms), fenced=True
        )
        closing = _closing(state, request_id)
        if closing is not None:
            yield closing
    return len(expired)


def decide_finish(state: State, cmd: FinishRequest) -> Decision:
    req = state.requests.get(cmd.request_id)
    if req is None:
        # F18: routine for an engine (a request kvflow never saw, or one already closed)
        return False
    if req.finished:
        raise Rejected(f"finish: request {cmd.request_id!r} is already finished")
    if req.offered:
        yield PinsReleased(seq=state.next_seq, request_id=cmd.request_id, hashes=req.offered)
    yield RequestFinished(seq=state.next_seq, request_id=cmd.request_id, preempted=cmd.preempted)
    closing = _closing(state, cmd.request_id)
    if closing is not None:
        yield closing
    return True


def decide_reset(state: State, cmd: ResetAll) -> Decision:
    for jid in list(state.queued):
        job = state.jobs[jid]
        yield _terminal_event(JobFailed, state, job, rank=-1, error=CANCELLED_BY_RESET)
    live = tuple(jid for jid, job in state.jobs.items() if job.state is not JobState.FENCED)
    yield Reset(seq=state.next_seq, abandoned_job_ids=live, keeps_requests=True)
    return None


def decide_end_fences(state: State, cmd: EndFences) -> Decision:
    """The executor is closed, its copies stopped: every fenced job's memory comes back."""
    fenced = [job for job in state.jobs.values() if job.fenced]
    for job in fenced:
        yield _fence_lifted(state, job, "executor closed")
    return len(fenced)


DECIDERS: dict[type, Callable[[State, Any], Decision]] = {
    Lookup: decide_lookup,
    AcceptHits: decide_accept_hits,
    BlocksComputed: decide_blocks_computed,
    DeviceBlocksEvicting: decide_device_evicting,
    Touch: decide_touch,
    Evict: decide_evict,
    PlanStep: decide_plan_step,
    JobResult: decide_job_result,
    JobResults: decide_job_results,
    Tick: decide_tick,
    FinishRequest: decide_finish,
    ResetAll: decide_reset,
    Invalidate: decide_invalidate,
    EndFences: decide_end_fences,
}


# a decision that can release pins is followed by the eviction of bad blocks it unpinned
# (F17); the others (stores, touches, planning: the hot path) are left as they are
_UNPINNING = (Lookup, AcceptHits, JobResult, JobResults, Tick, FinishRequest)
DECIDERS.update({kind: _then_evict_bad(DECIDERS[kind]) for kind in _UNPINNING})


def decide(state: State, command: Command) -> Decision:
    """The decision generator for ``command`` (see the module docstring for the protocol)."""
    return DECIDERS[type(command)](state, command)


__all__ = ["decide", "DECIDERS", "expired_jobs", "hit_cap_blocks", "CANCELLED_BY_RESET", "LOAD", "STORE"]
