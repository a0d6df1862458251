"""Decisions of jobs: handing queued jobs to the executor, applying results (with fences,
F15, and corrupt loads, F17), deadlines (F2), a request's finish (F18), a reset, and the end of
fences once the executor is closed. Pure."""

from __future__ import annotations

from typing import Any

from kvflow.core.commands import (
    EndFences,
    FinishRequest,
    JobResult,
    JobResults,
    PlanStep,
    ResetAll,
    Tick,
)
from kvflow.core.decide.checks import Emit
from kvflow.core.decide.disk import disk_write_through, spill_ahead_of_eviction
from kvflow.core.decide.remote import push_ahead_of_eviction, write_through
from kvflow.core.decide.store import chain_touch, drop_corrupt
from kvflow.core.errors import Rejected, UnknownJob
from kvflow.core.events import (
    FenceLifted,
    FenceReason,
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    LateResultIgnored,
    PinsReleased,
    RankSucceeded,
    RequestClosed,
    RequestFinished,
    Reset,
)
from kvflow.core.jobs import LOAD, STORE, TransferJob, every_rank, has_rank, is_rank, with_rank
from kvflow.core.state.model import Job, State
from kvflow.core.state.tables import ABANDONED, FENCED, IN_FLIGHT, QUEUED
from kvflow.core.values import is_int

CANCELLED_BY_RESET = "cancelled by reset before submission"

def decide_plan_step(state: State, cmd: PlanStep, emit: Emit) -> list[TransferJob]:
    config = state.config
    if config.remote_store_mode == "ahead_of_eviction" and config.remote:
        push_ahead_of_eviction(state, emit)
    if state.disk is not None:
        spill_ahead_of_eviction(state, emit)
    if not state.queued:
        return []
    job_ids = tuple(state.queued)
    jobs = []
    for jid in job_ids:
        job = state.jobs[jid]
        jobs.append(
            TransferJob(
                job_id=jid,
                direction=job.direction,
                device_blocks=job.device_blocks,
                slots=job.slots,
                hashes=job.hashes,
                request_id=job.request_id,
                disk_slots=job.disk_slots,
            )
        )
    emit(
        JobsSubmitted(
            seq=state.next_seq,
            job_ids=job_ids,
            now_ms=float(cmd.now_ms),
            deadline_ms=float(cmd.now_ms + config.job_deadline_ms),
        )
    )
    return jobs


def _terminal_event(kind: type[Any], state: State, job: Job, **outcome: Any) -> Any:
    """A JobFailed / JobTimedOut describing ``job``, with its outcome fields. (A JobCompleted,
    the end of nearly every job, is built where it is decided, in ``_apply_result``: msgspec
    builds a struct from plain keywords faster than from a mapping, docs/performance.md.)"""
    return kind(
        seq=state.next_seq,
        abandoned=job.state is ABANDONED,
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


def _check_result(state: State, result: JobResult) -> Job | None:
    """A result must name a job issued and submitted, and a rank of the world (F12).
    Returns the job (None: it has ended)."""
    job_id, rank = result.job_id, result.rank
    if not is_int(job_id) or not 0 < job_id <= state.last_job_id:
        raise UnknownJob(f"result for unknown job {job_id!r} (last issued: {state.last_job_id})")
    world = state.config.world_size
    if not is_int(rank) or not is_rank(rank, world):
        raise Rejected(f"result for job {result.job_id}: rank {result.rank!r} outside world size {world}")
    job = state.jobs.get(job_id)
    if job is not None and job.state is QUEUED:
        raise Rejected(f"result for job {job_id}, which was never submitted")
    return job


def _fence_lifted(state: State, job: Job, reason: FenceReason) -> FenceLifted:
    return FenceLifted(
        seq=state.next_seq, job_id=job.job_id, device_blocks=job.device_blocks, slots=job.slots, reason=reason
    )


def _apply_result(state: State, cmd: JobResult, emit: Emit, check: bool = False) -> None:
    """The events of one result: the job's end, a rank's success, or a late result (which,
    for a fenced job, says that rank's copy is over: the last one lifts the fence). ``check``:
    the result is checked first (before any event); else the caller checked it."""
    job = _check_result(state, cmd) if check else state.jobs.get(cmd.job_id)
    rank, every = cmd.rank, every_rank(state.config.world_size)
    if job is None or has_rank(job.acks, rank) or job.state is FENCED:
        emit(LateResultIgnored(seq=state.next_seq, job_id=cmd.job_id, rank=cmd.rank, ok=cmd.ok, error=cmd.error))
        if job is not None and job.state is FENCED:
            if cmd.corrupt and job.direction == LOAD and not cmd.ok:
                # F17 also when the report comes after the outcome (a timeout, another rank's
                # failure): the host copies it found bad leave the tier
                drop_corrupt(state, [h for h in job.hashes if h in set(cmd.corrupt)], emit)
            if job.reported == every:
                emit(_fence_lifted(state, job, "copy over"))
        return
    request_id = None if job.state is ABANDONED else job.request_id
    if not cmd.ok:
        # F15: while another rank has not reported, its copy may still run: fence the memory
        fenced = with_rank(job.reported, rank) != every
        emit(_terminal_event(JobFailed, state, job, rank=cmd.rank, error=cmd.error or "unknown error", fenced=fenced))
        if cmd.corrupt and job.direction == LOAD and job.state is not ABANDONED:
            # F17: bad bytes are never offered twice: the entries the load found corrupt
            # leave the tier now that its pins are released (those another request still
            # pins go when that load fails on them too)
            named = set(cmd.corrupt)
            bad = [h for h in job.hashes if h in named]
            drop_corrupt(state, bad, emit)
    elif with_rank(job.acks, rank) == every:
        landed = job.direction == STORE and job.state is not ABANDONED
        emit(
            JobCompleted(
                seq=state.next_seq,
                abandoned=job.state is ABANDONED,
                job_id=job.job_id,
                direction=job.direction,
                request_id=job.request_id,
                hashes=job.hashes,
                device_blocks=job.device_blocks,
                slots=job.slots,
                rank=rank,
            )
        )
        if landed and state.config.remote:
            write_through(state, job.hashes, emit)
        if landed and state.disk is not None:
            disk_write_through(state, job.hashes, emit)
    else:
        emit(RankSucceeded(seq=state.next_seq, job_id=job.job_id, rank=cmd.rank))
        return
    closing = _closing(state, request_id)
    if closing is not None:
        emit(closing)


def decide_job_result(state: State, cmd: JobResult, emit: Emit) -> None:
    _apply_result(state, cmd, emit, check=True)


def decide_job_results(state: State, cmd: JobResults, emit: Emit) -> None:
    """Many executor outcomes at once (one command per engine step instead of one per job).
    All are checked before anything is applied, so a bad one refuses the whole batch."""
    results = cmd.results
    if len(results) == 1:  # (the usual step's: checked as it is applied)
        _apply_result(state, results[0], emit, check=True)
        return
    for r in results:
        _check_result(state, r)
    for r in results:
        _apply_result(state, r, emit)


def expired_jobs(state: State, now_ms: float) -> list[Job]:
    """The in-flight jobs whose deadline has come by ``now_ms`` (F2), in job order. (A fenced
    job's outcome is already known: its deadline has nothing left to decide.)"""
    expired = []
    for job in state.jobs.values():
        if job.deadline_ms <= now_ms and job.state is IN_FLIGHT:
            expired.append(job)
    return expired


def decide_tick(state: State, cmd: Tick, emit: Emit) -> int:
    expired = expired_jobs(state, cmd.now_ms)
    for job in expired:
        request_id = job.request_id
        # F15: the engine learns of the timeout now; the copy may still run, so the job's
        # memory stays fenced until the executor reports it over
        emit(
            _terminal_event(
                JobTimedOut, state, job, now_ms=float(cmd.now_ms), deadline_ms=float(job.deadline_ms), fenced=True
            )
        )
        closing = _closing(state, request_id)
        if closing is not None:
            emit(closing)
    return len(expired)


def decide_finish(state: State, cmd: FinishRequest, emit: Emit) -> bool:
    req = state.requests.get(cmd.request_id)
    if req is None:
        # F18: routine for an engine (a request kvflow never saw, or one already closed)
        return False
    if req.finished:
        raise Rejected(f"finish: request {cmd.request_id!r} is already finished")
    if not cmd.preempted:  # (a preempted request is not over: it may come back, F18)
        touch = chain_touch(state, req)
        if touch is not None:
            emit(touch)
    if req.offered:
        emit(PinsReleased(seq=state.next_seq, request_id=cmd.request_id, hashes=req.offered))
    emit(RequestFinished(seq=state.next_seq, request_id=cmd.request_id, preempted=cmd.preempted))
    closing = _closing(state, cmd.request_id)
    if closing is not None:
        emit(closing)
    return True


def decide_reset(state: State, cmd: ResetAll, emit: Emit) -> None:
    for jid in list(state.queued):
        job = state.jobs[jid]
        emit(_terminal_event(JobFailed, state, job, rank=-1, error=CANCELLED_BY_RESET))
    live = tuple(jid for jid, job in state.jobs.items() if job.state is not FENCED)
    emit(Reset(seq=state.next_seq, abandoned_job_ids=live, keeps_requests=True))


def decide_end_fences(state: State, cmd: EndFences, emit: Emit) -> int:
    """The executor is closed, its copies stopped: every fenced job's memory comes back."""
    fenced = [job for job in state.jobs.values() if job.fenced]
    for job in fenced:
        emit(_fence_lifted(state, job, "executor closed"))
    return len(fenced)
