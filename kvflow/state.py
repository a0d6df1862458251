"""The state machine: every transition of a CPU-tier entry and of a transfer job lives here.

This module does no I/O, reads no clock, draws no random numbers and logs nothing.

``evolve(state, event)`` applies one event. It *validates the whole event first* and only then
mutates, so an illegal event raises :class:`IllegalTransition` and leaves the state exactly as
it was. (The state is mutated in place for speed: folding a log must run at millions of block
changes per second; ``State.copy()`` gives an independent snapshot when one is needed.)

Legality is read from two tables, ``BLOCK_TRANSITIONS`` and ``JOB_TRANSITIONS``; the CLI prints
the lifecycle diagram from them (``kvflow diagram``), so the docs cannot drift from the code.
"""

from __future__ import annotations

import copy
import hashlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from enum import IntEnum
from itertools import repeat
from typing import Any

import msgspec

from kvflow.config import Config
from kvflow.errors import IllegalTransition
from kvflow.events import (
    LOAD,
    STORE,
    BlocksEvicted,
    BlocksTouched,
    Event,
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
    Reset,
    StoreQueued,
    StoreRejected,
    event_name,
)
from kvflow.policies import make_policy
from kvflow.policies.base import Policy


class BlockState(IntEnum):
    ABSENT = 0
    STORE_QUEUED = 1
    STORING = 2
    RESIDENT = 3


class JobState(IntEnum):
    NEW = 0
    QUEUED = 1
    IN_FLIGHT = 2
    COMPLETED = 3
    FAILED = 4
    TIMED_OUT = 5
    # In flight when a reset came: the copy may still be running, so its slots stay
    # quarantined and its device blocks held until it reports (or times out).
    ABANDONED = 6


ABSENT, STORE_QUEUED, STORING, RESIDENT = (
    BlockState.ABSENT,
    BlockState.STORE_QUEUED,
    BlockState.STORING,
    BlockState.RESIDENT,
)

# (state, event tag) -> next state, for one CPU-tier entry named by the event.
# Pins are a counter on a RESIDENT entry (see PIN rules in evolve), not a separate state.
BLOCK_TRANSITIONS: dict[BlockState, dict[str, BlockState]] = {
    ABSENT: {"store_queued": STORE_QUEUED, "reset": ABSENT},
    STORE_QUEUED: {
        "jobs_submitted": STORING,
        "job_failed": ABSENT,  # cancelled before submission (reset)
    },
    STORING: {
        "job_completed": RESIDENT,
        "job_failed": ABSENT,
        "job_timed_out": ABSENT,
        "reset": ABSENT,  # dropped; its slot stays quarantined until the job reports
    },
    RESIDENT: {
        "load_queued": RESIDENT,
        "jobs_submitted": RESIDENT,  # its load job was handed to the executor
        "job_completed": RESIDENT,  # a load finished: its pin is released
        "job_failed": RESIDENT,  # a load failed: entry stays, pin released (F1)
        "job_timed_out": RESIDENT,
        "pins_acquired": RESIDENT,
        "pins_released": RESIDENT,
        "blocks_touched": RESIDENT,
        "blocks_evicted": ABSENT,  # only when unpinned
        "reset": ABSENT,
    },
}

JOB_TRANSITIONS: dict[JobState, dict[str, JobState]] = {
    JobState.NEW: {"store_queued": JobState.QUEUED, "load_queued": JobState.QUEUED},
    JobState.QUEUED: {
        "jobs_submitted": JobState.IN_FLIGHT,
        "job_failed": JobState.FAILED,  # cancelled by reset before submission
    },
    JobState.IN_FLIGHT: {
        "rank_succeeded": JobState.IN_FLIGHT,
        "job_completed": JobState.COMPLETED,
        "job_failed": JobState.FAILED,
        "job_timed_out": JobState.TIMED_OUT,
        "reset": JobState.ABANDONED,
        "late_result_ignored": JobState.IN_FLIGHT,  # a rank repeated its success
    },
    # Its end frees the quarantined slots and held device blocks; nothing becomes visible.
    JobState.ABANDONED: {
        "rank_succeeded": JobState.ABANDONED,
        "job_completed": JobState.COMPLETED,
        "job_failed": JobState.FAILED,
        "job_timed_out": JobState.TIMED_OUT,
        "late_result_ignored": JobState.ABANDONED,
        "reset": JobState.ABANDONED,
    },
    JobState.COMPLETED: {"late_result_ignored": JobState.COMPLETED},
    JobState.FAILED: {"late_result_ignored": JobState.FAILED},
    JobState.TIMED_OUT: {"late_result_ignored": JobState.TIMED_OUT},
}
TERMINAL_JOB_STATES = (JobState.COMPLETED, JobState.FAILED, JobState.TIMED_OUT)

# For the hot loops: per event tag, the (present) entry states in which it is legal.
_ALLOWED: dict[str, frozenset[BlockState]] = {}
for _st, _edges in BLOCK_TRANSITIONS.items():
    for _tag in _edges:
        if _st is not BlockState.ABSENT:
            _ALLOWED[_tag] = _ALLOWED.get(_tag, frozenset()) | {_st}


class Entry:
    """A read-only picture of one CPU-tier entry (``state.entries[hash]``).

    The state stores entries column-wise (``slot_of``, ``pending``, ``pin_count``) so that
    the hot paths are a few C-level dict operations per event rather than a Python object
    per block; this view assembles one entry for readers (inspect, tests, invariants).
    """

    __slots__ = ("state", "slot", "pins", "job_id")

    def __init__(self, state: BlockState, slot: int, pins: int, job_id: int) -> None:
        self.state = state
        self.slot = slot
        self.pins = pins
        self.job_id = job_id  # the live store job while STORE_QUEUED / STORING, else 0

    def __repr__(self) -> str:
        return f"Entry({self.state.name}, slot={self.slot}, pins={self.pins}, job={self.job_id})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return (self.state, self.slot, self.pins, self.job_id) == (
            other.state,
            other.slot,
            other.pins,
            other.job_id,
        )


class EntriesView(Mapping[int, Entry]):
    """``State.entries``: every hash on the tier -> its Entry (assembled on access)."""

    __slots__ = ("_state",)

    def __init__(self, state: State) -> None:
        self._state = state

    def __getitem__(self, block_hash: int) -> Entry:
        st = self._state
        slot = st.slot_of[block_hash]
        job_id = st.pending.get(block_hash, 0)
        return Entry(st.block_state(block_hash), slot, st.pin_count.get(block_hash, 0), job_id)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._state.slot_of

    def __iter__(self) -> Iterator[int]:
        return iter(self._state.slot_of)

    def __len__(self) -> int:
        return len(self._state.slot_of)


class Job:
    """A live transfer job (terminal jobs leave the state; their events stay in the log)."""

    __slots__ = (
        "job_id",
        "direction",
        "request_id",
        "hashes",
        "device_blocks",
        "slots",
        "state",
        "deadline_ms",
        "acks",
    )

    def __init__(
        self,
        job_id: int,
        direction: str,
        request_id: str | None,
        hashes: tuple[int, ...],
        device_blocks: tuple[int, ...],
        slots: tuple[int, ...],
    ) -> None:
        self.job_id = job_id
        self.direction = direction
        self.request_id = request_id
        self.hashes = hashes
        self.device_blocks = device_blocks
        self.slots = slots
        self.state = JobState.QUEUED
        self.deadline_ms = 0.0
        self.acks = 0  # bit mask of ranks that reported success

    @property
    def abandoned(self) -> bool:
        return self.state is JobState.ABANDONED

    def __repr__(self) -> str:
        return (
            f"Job({self.job_id}, {self.direction}, {self.state.name}, request={self.request_id},"
            f" blocks={len(self.hashes)})"
        )


class Request:
    """What kvflow remembers of a request: its pins and its live jobs."""

    __slots__ = ("request_id", "offered", "loading", "jobs", "finished", "preempted")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        # A request's pins are its offered hits plus the blocks of its live load jobs.
        self.offered: tuple[int, ...] = ()  # lookup hits not yet accepted into a load job
        self.loading: dict[int, tuple[int, ...]] = {}  # live load job -> its pinned hashes
        self.jobs: dict[int, None] = {}  # live job ids, in order
        self.finished = False
        self.preempted = False

    @property
    def pins(self) -> dict[int, int]:
        """hash -> pins this request holds on it (offered hits and live loads)."""
        counts: dict[int, int] = {}
        for hashes in (self.offered, *self.loading.values()):
            for h in hashes:
                counts[h] = counts.get(h, 0) + 1
        return counts

    def holds_pins(self) -> bool:
        return bool(self.offered or self.loading)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, pins={sum(self.pins.values())}, "
            f"jobs={list(self.jobs)}, finished={self.finished})"
        )


class State:
    """The whole CPU-tier state. Built empty from a Config, changed only by ``evolve``."""

    __slots__ = (
        "config",
        "next_seq",
        "last_job_id",
        "slot_of",
        "pending",
        "pin_count",
        "free_slots",
        "quarantine",
        "jobs",
        "queued",
        "held",
        "requests",
        "policy",
    )

    def __init__(self, config: Config) -> None:
        self.config = config
        self.next_seq = 1
        self.last_job_id = 0
        # Entries, column-wise: every hash on the tier -> its slot; the hashes of live store
        # jobs (STORE_QUEUED / STORING, which one follows the job) -> that job; pinned hashes
        # -> their pin count (absent means 0). RESIDENT = on the tier and not pending.
        self.slot_of: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        self.pin_count: dict[int, int] = {}
        # Free slots as a stack: allocation takes from the end, so a fresh tier hands out
        # 0, 1, 2... (contiguous host runs keep the executor's copies at full speed).
        self.free_slots: list[int] = list(range(config.cpu_blocks - 1, -1, -1))
        # slot -> abandoned jobs still using it (two abandoned loads can read one slot)
        self.quarantine: dict[int, tuple[int, ...]] = {}
        self.jobs: dict[int, Job] = {}  # live jobs by id (queued or in flight)
        self.queued: dict[int, None] = {}  # queued, not yet submitted, in id order
        self.held: dict[int, int] = {}  # device block -> live job holding it
        self.requests: dict[str, Request] = {}
        self.policy: Policy = make_policy(config.policy, config.cpu_blocks)

    # -- queries -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.config.cpu_blocks

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    @property
    def entries(self) -> EntriesView:
        return EntriesView(self)

    def block_state(self, block_hash: int) -> BlockState:
        if block_hash not in self.slot_of:
            return ABSENT
        job_id = self.pending.get(block_hash)
        if job_id is None:
            return RESIDENT
        return STORE_QUEUED if self.jobs[job_id].state is JobState.QUEUED else STORING

    def is_resident(self, block_hash: int) -> bool:
        return block_hash in self.slot_of and block_hash not in self.pending

    def evictable(self, block_hash: int) -> bool:
        return (
            block_hash not in self.pin_count
            and block_hash not in self.pending
            and block_hash in self.slot_of
        )

    def num_resident(self) -> int:
        return len(self.policy)

    def copy(self) -> State:
        """An independent deep copy (used by tests and by ``inspect --at``)."""
        clone = State.__new__(State)
        clone.config = self.config
        clone.next_seq = self.next_seq
        clone.last_job_id = self.last_job_id
        clone.slot_of = dict(self.slot_of)
        clone.pending = dict(self.pending)
        clone.pin_count = dict(self.pin_count)
        clone.free_slots = list(self.free_slots)
        clone.quarantine = dict(self.quarantine)
        clone.jobs = {}
        for jid, j in self.jobs.items():
            nj = Job(j.job_id, j.direction, j.request_id, j.hashes, j.device_blocks, j.slots)
            nj.state, nj.deadline_ms, nj.acks = j.state, j.deadline_ms, j.acks
            clone.jobs[jid] = nj
        clone.queued = dict(self.queued)
        clone.held = dict(self.held)
        clone.requests = {}
        for rid, r in self.requests.items():
            nr = Request(rid)
            nr.loading = dict(r.loading)
            nr.offered = r.offered
            nr.jobs = dict(r.jobs)
            nr.finished, nr.preempted = r.finished, r.preempted
            clone.requests[rid] = nr
        clone.policy = copy.deepcopy(self.policy)
        return clone

    # -- determinism ---------------------------------------------------------------------

    def canonical(self) -> tuple[Any, ...]:
        """A deterministic, order-independent picture of the state (digest input)."""
        # entries: (hash, BlockState, slot, pins, pending job) sorted by hash, built column
        # by column with C-level maps (hashes are unique, so sorting them sorts the rows)
        pending, pins, live, slot_of = self.pending, self.pin_count, self.jobs, self.slot_of
        hashes = sorted(slot_of)
        n = len(hashes)
        if pending:
            states = [
                3 if j == 0 else (1 if live[j].state is JobState.QUEUED else 2)
                for j in map(pending.get, hashes, repeat(0, n))
            ]
        else:
            states = [3] * n
        entries = list(
            zip(
                hashes,
                states,
                map(slot_of.__getitem__, hashes),
                map(pins.get, hashes, repeat(0, n)),
                map(pending.get, hashes, repeat(0, n)),
            )
        )
        jobs = [
            (
                j.job_id,
                j.direction,
                j.request_id,
                list(j.hashes),
                list(j.device_blocks),
                list(j.slots),
                int(j.state),
                j.deadline_ms,
                j.acks,
                j.abandoned,
            )
            for j in sorted(self.jobs.values(), key=lambda j: j.job_id)
        ]
        requests = [
            (
                r.request_id,
                sorted(r.pins.items()),
                list(r.offered),
                sorted(r.jobs),
                r.finished,
                r.preempted,
            )
            for r in sorted(self.requests.values(), key=lambda r: r.request_id)
        ]
        return (
            self.next_seq,
            self.last_job_id,
            entries,
            list(self.free_slots),
            sorted((s, list(j)) for s, j in self.quarantine.items()),
            jobs,
            sorted(self.queued),
            sorted(self.held.items()),
            requests,
            self.policy.snapshot(),
        )

    def digest(self) -> str:
        """A short hash of ``canonical()``: equal digests mean equal states."""
        blob = msgspec.msgpack.encode(self.canonical())
        return hashlib.blake2b(blob, digest_size=16).hexdigest()


# --- evolve ------------------------------------------------------------------------------


def _illegal(state: State, event: Event, what: str, detail: str) -> IllegalTransition:
    return IllegalTransition(what, f"{event_name(event)}#{event.seq}", detail)


def _check_block(state: State, event: Event, tag: str, block_hash: int) -> None:
    current = state.block_state(block_hash)
    if tag not in BLOCK_TRANSITIONS.get(current, {}):
        raise _illegal(state, event, current.name, f"block {block_hash}")


def _check_job(state: State, event: Event, tag: str, job_id: int) -> Job:
    job = state.jobs.get(job_id)
    if job is None:
        if 0 < job_id <= state.last_job_id:
            raise _illegal(state, event, "TERMINAL", f"job {job_id} is already terminal")
        raise _illegal(state, event, "NEW", f"job {job_id} was never queued")
    if tag not in JOB_TRANSITIONS[job.state]:
        raise _illegal(state, event, job.state.name, f"job {job_id}")
    return job


def _policy_many(policy: Policy, op: str, hashes: tuple[int, ...]) -> None:
    """Apply ``op`` to every hash in order, through the policy's bulk method if it has one."""
    bulk = getattr(policy, op + "_many", None)
    if bulk is not None:
        bulk(hashes)
    else:
        method = getattr(policy, op)
        for h in hashes:
            method(h)


_RESIDENT_TAGS = frozenset(tag for tag, states in _ALLOWED.items() if RESIDENT in states)


def _check_resident(state: State, event: Event, tag: str, hashes: tuple[int, ...]) -> None:
    """Every hash must be RESIDENT and ``tag`` legal there (set operations in C; the slow
    path only runs to name the offending block)."""
    if tag in _RESIDENT_TAGS and state.pending.keys().isdisjoint(hashes):
        if all(map(state.slot_of.__contains__, hashes)):
            return
    for h in hashes:
        _check_block(state, event, tag, h)
    raise _illegal(state, event, "RESIDENT", f"event {tag} does not apply to resident blocks")


def _check_pending(state: State, event: Event, tag: str, job: Job) -> None:
    """Every hash of a live store job must still be pending on that job."""
    if set(map(state.pending.get, job.hashes)) == {job.job_id}:
        return
    for h in job.hashes:
        _check_block(state, event, tag, h)
    raise _illegal(state, event, "PENDING", f"blocks of job {job.job_id} are not pending on it")


def _check_free_slots(state: State, event: Event, slots: tuple[int, ...]) -> None:
    n = len(slots)
    free = state.free_slots
    if n > len(free) or tuple(free[len(free) - n :][::-1]) != slots:
        raise _illegal(
            state, event, "SLOTS", f"slots {list(slots)[:8]} are not the next free slots"
        )


def _check_device_blocks_free(state: State, event: Event, device_blocks: tuple[int, ...]) -> None:
    held = state.held
    if held.keys().isdisjoint(device_blocks) and len(set(device_blocks)) == len(device_blocks):
        return
    for d in device_blocks:
        if d in held:
            raise _illegal(state, event, "HELD", f"device block {d} is held by job {held[d]}")
    if len(set(device_blocks)) != len(device_blocks):
        raise _illegal(state, event, "HELD", "device blocks repeat within one job")


def _new_job_checks(state: State, event: StoreQueued | LoadQueued) -> None:
    if event.job_id != state.last_job_id + 1:
        raise _illegal(state, event, "NEW", f"job id {event.job_id} is not {state.last_job_id + 1}")
    if not (len(event.hashes) == len(event.device_blocks) == len(event.slots)) or not event.hashes:
        raise _illegal(state, event, "NEW", "hashes, device_blocks and slots must match, non-empty")
    _check_device_blocks_free(state, event, event.device_blocks)


def _request(state: State, request_id: str | None) -> Request | None:
    if request_id is None:
        return None
    req = state.requests.get(request_id)
    if req is None:
        req = Request(request_id)
        state.requests[request_id] = req
    return req


def _add_job(state: State, event: StoreQueued | LoadQueued, direction: str) -> Job:
    job = Job(
        event.job_id, direction, event.request_id, event.hashes, event.device_blocks, event.slots
    )
    state.jobs[event.job_id] = job
    state.queued[event.job_id] = None
    state.last_job_id = event.job_id
    state.held.update(dict.fromkeys(event.device_blocks, event.job_id))
    req = _request(state, event.request_id)
    if req is not None:
        req.jobs[event.job_id] = None
    return job


def _evolve_store_queued(state: State, event: StoreQueued, check: bool) -> None:
    slot_of = state.slot_of
    if check:
        _new_job_checks(state, event)
        if not slot_of.keys().isdisjoint(event.hashes) or len(set(event.hashes)) != len(event.hashes):
            h = next((h for h in event.hashes if h in slot_of), event.hashes[0])
            raise _illegal(state, event, state.block_state(h).name, f"block {h} is already on the tier")
        _check_free_slots(state, event, event.slots)
        req = state.requests.get(event.request_id) if event.request_id is not None else None
        if req is not None and req.finished:
            raise _illegal(state, event, "FINISHED", f"request {event.request_id} is finished")
    # apply
    free = state.free_slots
    del free[len(free) - len(event.slots) :]
    slot_of.update(zip(event.hashes, event.slots))
    state.pending.update(dict.fromkeys(event.hashes, event.job_id))
    _add_job(state, event, STORE)


def _evolve_load_queued(state: State, event: LoadQueued, check: bool) -> None:
    req = state.requests.get(event.request_id)
    n = len(event.hashes)
    if check:
        _new_job_checks(state, event)
        if req is None or req.finished:
            raise _illegal(state, event, "NO_REQUEST", f"request {event.request_id} is not live")
        if req.offered[:n] != event.hashes:
            raise _illegal(state, event, "PINS", "a load must take the request's offered hits, in order")
        _check_resident(state, event, "load_queued", event.hashes)
        if tuple(map(state.slot_of.__getitem__, event.hashes)) != event.slots:
            raise _illegal(state, event, "RESIDENT", "the load's slots are not where its blocks live")
    assert req is not None
    # apply: the request's pins move from "offered" to the job (counts are unchanged)
    req.offered = req.offered[n:]
    req.loading[event.job_id] = event.hashes
    _add_job(state, event, LOAD)


def _evolve_jobs_submitted(state: State, event: JobsSubmitted, check: bool) -> None:
    jobs = state.jobs
    if check:
        for jid in event.job_ids:
            job = _check_job(state, event, "jobs_submitted", jid)
            if jid not in state.queued:
                raise _illegal(state, event, job.state.name, f"job {jid} is not queued")
        if len(set(event.job_ids)) != len(event.job_ids):
            raise _illegal(state, event, "IN_FLIGHT", "a job is submitted twice in one event")
    queued = state.queued
    deadline = event.deadline_ms
    for jid in event.job_ids:
        job = jobs[jid]
        job.state = JobState.IN_FLIGHT  # its pending blocks are STORING from now on
        job.deadline_ms = deadline
        del queued[jid]


def _finish_job(state: State, job: Job) -> None:
    del state.jobs[job.job_id]
    state.queued.pop(job.job_id, None)
    held = state.held
    for d in job.device_blocks:
        del held[d]
    if job.request_id is not None and not job.abandoned:
        req = state.requests[job.request_id]
        del req.jobs[job.job_id]


def _release_quarantine(state: State, job: Job) -> None:
    quarantine = state.quarantine
    free = state.free_slots
    jid = job.job_id
    for s in reversed(dict.fromkeys(job.slots)):  # a load may read one slot twice
        users = tuple(j for j in quarantine[s] if j != jid)
        if users:
            quarantine[s] = users  # another abandoned job still reads this slot
        else:
            del quarantine[s]
            free.append(s)


def _unpin(state: State, hashes: tuple[int, ...]) -> None:
    pins = state.pin_count
    for h in hashes:
        left = pins[h] - 1
        if left:
            pins[h] = left
        else:
            del pins[h]


def _check_terminal(state: State, event: JobCompleted | JobFailed | JobTimedOut, tag: str) -> Job:
    job = _check_job(state, event, tag, event.job_id)
    if (
        job.hashes != event.hashes
        or job.direction != event.direction
        or job.device_blocks != event.device_blocks
    ):
        raise _illegal(state, event, job.state.name, f"event does not describe job {job.job_id}")
    if not job.abandoned:
        if job.direction == STORE:
            _check_pending(state, event, tag, job)
        else:
            _check_resident(state, event, tag, job.hashes)
    return job


def _evolve_terminal(state: State, event: JobCompleted | JobFailed | JobTimedOut, check: bool) -> None:
    if check:
        job = _check_terminal(state, event, event_name(event))
        if event.abandoned != job.abandoned:
            raise _illegal(state, event, job.state.name, f"job {job.job_id} abandoned is {job.abandoned}")
        if isinstance(event, JobCompleted):
            if job.acks | (1 << event.rank) != (1 << state.config.world_size) - 1:
                raise _illegal(state, event, job.state.name, f"job {job.job_id} lacks rank results")
            if not 0 <= event.rank < state.config.world_size:
                raise _illegal(state, event, job.state.name, f"rank {event.rank} out of range")
    else:
        job = state.jobs[event.job_id]
    # apply
    _finish_job(state, job)
    if job.abandoned:
        _release_quarantine(state, job)
        return
    if job.direction == STORE:
        deque(map(state.pending.__delitem__, job.hashes), 0)
        if type(event) is JobCompleted:
            _policy_many(state.policy, "insert", job.hashes)  # RESIDENT: visible from now on
        else:
            state.free_slots.extend(map(state.slot_of.pop, reversed(job.hashes)))
    else:
        del state.requests[job.request_id].loading[job.job_id]  # type: ignore[index]
        _unpin(state, job.hashes)


def _evolve_rank_succeeded(state: State, event: RankSucceeded, check: bool = True) -> None:
    job = _check_job(state, event, "rank_succeeded", event.job_id)
    bit = 1 << event.rank
    if not 0 <= event.rank < state.config.world_size or job.acks & bit:
        raise _illegal(state, event, job.state.name, f"rank {event.rank} cannot report again")
    if job.acks | bit == (1 << state.config.world_size) - 1:
        raise _illegal(state, event, job.state.name, "the last rank's success is JobCompleted")
    job.acks |= bit


def _evolve_late(state: State, event: LateResultIgnored, check: bool = True) -> None:
    job = state.jobs.get(event.job_id)
    if job is not None:
        # legal for a live job only as a repeat of a rank that already reported success
        if not (0 <= event.rank < 64 and job.acks & (1 << event.rank)):
            raise _illegal(state, event, job.state.name, f"job {event.job_id} is live")
    elif not 0 < event.job_id <= state.last_job_id:
        raise _illegal(state, event, "NEW", f"job {event.job_id} was never queued")


def _evolve_evicted(state: State, event: BlocksEvicted, check: bool) -> None:
    slot_of = state.slot_of
    if check:
        if len(event.hashes) != len(event.slots):
            raise _illegal(state, event, "RESIDENT", "hashes and slots differ in length")
        _check_resident(state, event, "blocks_evicted", event.hashes)
        if not state.pin_count.keys().isdisjoint(event.hashes):
            raise _illegal(state, event, "RESIDENT", "a pinned block cannot be evicted")
        if tuple(map(slot_of.__getitem__, event.hashes)) != event.slots:
            raise _illegal(state, event, "RESIDENT", "the evicted slots are not where the blocks live")
        if len(set(event.hashes)) != len(event.hashes):
            raise _illegal(state, event, "RESIDENT", "a block is evicted twice in one event")
    state.free_slots.extend(map(slot_of.pop, reversed(event.hashes)))
    _policy_many(state.policy, "remove", event.hashes)


def _evolve_touched(state: State, event: BlocksTouched, check: bool) -> None:
    if check:
        _check_resident(state, event, "blocks_touched", event.hashes)
    _policy_many(state.policy, "touch" if event.reuse else "refresh", event.hashes)


def _evolve_rejected(state: State, event: StoreRejected, check: bool = True) -> None:
    if not event.hashes:
        raise _illegal(state, event, "RESIDENT", "a rejection names at least one block")
    _request(state, event.request_id)


def _evolve_pins_acquired(state: State, event: PinsAcquired, check: bool) -> None:
    if check:
        req = state.requests.get(event.request_id)
        if req is not None and (req.finished or req.offered):
            raise _illegal(state, event, "PINS", f"request {event.request_id} has offered pins or is finished")
        if event.hashes:
            _check_resident(state, event, "pins_acquired", event.hashes)
    req = _request(state, event.request_id)
    assert req is not None
    pins = state.pin_count
    for h in event.hashes:
        pins[h] = pins.get(h, 0) + 1
    req.offered = event.hashes


def _evolve_pins_released(state: State, event: PinsReleased, check: bool = True) -> None:
    req = state.requests.get(event.request_id)
    if req is None:
        raise _illegal(state, event, "NO_REQUEST", f"request {event.request_id}")
    n = len(event.hashes)
    offered = req.offered
    # Only pins offered by a lookup and not taken by a load job can be released directly;
    # a load job's pins are released by its terminal event.
    if offered[len(offered) - n :] != event.hashes or n == 0:
        raise _illegal(state, event, "PINS", f"request {event.request_id} does not hold these offered pins")
    req.offered = offered[: len(offered) - n]
    _unpin(state, event.hashes)


def _evolve_finished(state: State, event: RequestFinished, check: bool = True) -> None:
    req = state.requests.get(event.request_id)
    if req is None or req.finished:
        raise _illegal(state, event, "NO_REQUEST" if req is None else "FINISHED", f"request {event.request_id}")
    if req.offered:
        raise _illegal(state, event, "PINS", "release offered pins before finishing")
    req.finished = True
    req.preempted = event.preempted


def _evolve_closed(state: State, event: RequestClosed, check: bool = True) -> None:
    req = state.requests.get(event.request_id)
    if req is None or not req.finished or req.jobs or req.holds_pins():
        raise _illegal(state, event, "LIVE", f"request {event.request_id} cannot close yet")
    del state.requests[event.request_id]


def _evolve_reset(state: State, event: Reset, check: bool = True) -> None:
    abandoned = event.abandoned_job_ids
    if state.queued:
        raise _illegal(state, event, "QUEUED", "queued jobs must be cancelled before a reset")
    if list(abandoned) != [j for j in state.jobs]:
        raise _illegal(state, event, "IN_FLIGHT", "the reset must abandon exactly the in-flight jobs")
    # apply: in-flight jobs keep their slots (quarantined) and device blocks until they report
    quarantine = state.quarantine
    for jid in abandoned:
        job = state.jobs[jid]
        if job.abandoned:
            continue  # a second reset: already abandoned
        job.state = JobState.ABANDONED
        for s in dict.fromkeys(job.slots):
            quarantine[s] = quarantine.get(s, ()) + (jid,)
    free = state.free_slots
    free.extend(s for s in state.slot_of.values() if s not in quarantine)
    state.slot_of.clear()
    state.pending.clear()
    state.pin_count.clear()
    state.requests.clear()
    state.policy.clear()


_EVOLVERS: dict[type, Callable[..., None]] = {
    StoreQueued: _evolve_store_queued,
    LoadQueued: _evolve_load_queued,
    JobsSubmitted: _evolve_jobs_submitted,
    RankSucceeded: _evolve_rank_succeeded,
    JobCompleted: _evolve_terminal,
    JobFailed: _evolve_terminal,
    JobTimedOut: _evolve_terminal,
    LateResultIgnored: _evolve_late,
    BlocksEvicted: _evolve_evicted,
    BlocksTouched: _evolve_touched,
    StoreRejected: _evolve_rejected,
    PinsAcquired: _evolve_pins_acquired,
    PinsReleased: _evolve_pins_released,
    RequestFinished: _evolve_finished,
    RequestClosed: _evolve_closed,
    Reset: _evolve_reset,
}


# The C mirror of ``evolve_python`` (kvflow._native, built from csrc/ when a compiler is
# present); bound by kvflow.native at import, None for the pure-Python core.
_native_evolve: Callable[[State, Event, bool], bool] | None = None


def evolve(state: State, event: Event, check: bool = True) -> State:
    """Apply one event (in place) and return the state; illegal → IllegalTransition, no change.

    ``check=False`` skips the per-block legality checks. Only the live path uses it, for
    events its own ``decide`` just produced from this very state (the decider validated
    them); folds and replays of recorded logs always check.

    With the C accelerator, the C mirror applies the event; whenever it declines (an illegal
    event, or one it does not handle) it has changed nothing and this Python implementation
    runs, so errors always come from one place.
    """
    native = _native_evolve
    if native is not None and native(state, event, check):
        return state
    return evolve_python(state, event, check)


def evolve_python(state: State, event: Event, check: bool = True) -> State:
    """The reference implementation of :func:`evolve` (pure Python)."""
    if event.seq != state.next_seq:
        raise IllegalTransition(
            f"SEQ {state.next_seq}", f"{event_name(event)}#{event.seq}", "events must be gapless"
        )
    _EVOLVERS[type(event)](state, event, check)
    state.next_seq += 1
    return state


def fold(state: State, events: Any) -> State:
    """Replay: apply every event in order."""
    for event in events:
        evolve(state, event)
    return state


# --- invariants ----------------------------------------------------------------------------


def check_invariants(state: State) -> list[str]:
    """Every structural rule of the state; returns the violations (empty when consistent).

    Each section first checks its rule in bulk (C-level set and dict operations, as exact as
    the per-item loop) and only walks item by item, to name the offenders, when that fails.
    """
    problems: list[str] = []
    cap = state.capacity
    slot_of, pending, pin_count, jobs = state.slot_of, state.pending, state.pin_count, state.jobs

    # slots: free + entries + quarantined is exactly 0..cap-1, each once
    used = list(state.free_slots)
    used.extend(slot_of.values())
    used.extend(state.quarantine)
    if not (len(used) == cap and len(set(used)) == cap and (not used or (min(used) >= 0 and max(used) < cap))):
        _slot_problems(state, problems)
    for s, jids in state.quarantine.items():
        for jid in jids:
            job = jobs.get(jid)
            if job is None or not job.abandoned or s not in job.slots:
                problems.append(f"slot {s} quarantined for job {jid}, which is not an abandoned job using it")

    # pins: every entry's count is what the requests hold; pinned entries are RESIDENT;
    # pending (STORE_QUEUED / STORING) entries belong to a live store job naming them
    pin_totals: dict[int, int] = {}
    for r in state.requests.values():
        for hashes in (r.offered, *r.loading.values()):
            for h in hashes:
                pin_totals[h] = pin_totals.get(h, 0) + 1
    entries_ok = (
        pin_count == pin_totals
        and slot_of.keys() >= pin_count.keys()
        and pending.keys().isdisjoint(pin_count)
        and slot_of.keys() >= pending.keys()
    )
    if entries_ok:
        for h, jid in pending.items():
            job = jobs.get(jid)
            if job is None or job.direction != STORE or h not in job.hashes:
                entries_ok = False
                break
    if not entries_ok:
        _entry_problems(state, pin_totals, problems)

    # policy tracks exactly the resident entries
    tracked = state.policy.resident()
    resident = [h for h in slot_of if h not in pending]
    if not (len(tracked) == len(resident) and set(tracked) == set(resident)):
        problems.append(f"policy tracks {len(tracked)} blocks, tier has {len(resident)} resident")

    # holds match live jobs; queued index matches job states
    expected_held: dict[int, int] = {}
    for jid, job in jobs.items():
        if job.state not in (JobState.QUEUED, JobState.IN_FLIGHT, JobState.ABANDONED):
            problems.append(f"job {jid} is live in state {job.state.name}")
        if (jid in state.queued) != (job.state is JobState.QUEUED):
            problems.append(f"job {jid} queued index disagrees with state {job.state.name}")
        for d in job.device_blocks:
            expected_held[d] = jid
        if not job.abandoned and job.request_id is not None:
            req = state.requests.get(job.request_id)
            if req is None or jid not in req.jobs:
                problems.append(f"job {jid} is not listed by request {job.request_id}")
    if expected_held != state.held:
        problems.append("device-block holds do not match the live jobs")
    for r in state.requests.values():
        for jid in r.jobs:
            if jid not in jobs:
                problems.append(f"request {r.request_id} lists job {jid} which is not live")
        if r.offered:
            pins = r.pins
            for h in r.offered:
                if pins.get(h, 0) <= 0:
                    problems.append(f"request {r.request_id} offers block {h} without a pin")
    return problems


def _slot_problems(state: State, problems: list[str]) -> None:
    """Name the slots that are out of range, owned twice or missing."""
    cap = state.capacity
    owner: dict[int, str] = {}
    found = len(problems)

    def own(slot: int, who: str) -> None:
        if not 0 <= slot < cap:
            problems.append(f"slot {slot} outside 0..{cap - 1} ({who})")
        elif slot in owner:
            problems.append(f"slot {slot} owned twice: {owner[slot]} and {who}")
        else:
            owner[slot] = who

    for s in state.free_slots:
        own(s, "free")
    for h, slot in state.slot_of.items():
        own(slot, f"block {h}")
    for s, jids in state.quarantine.items():
        own(s, f"quarantine of jobs {list(jids)}")
    if len(owner) != cap and len(problems) == found:
        problems.append(f"free + used + quarantined = {len(owner)} != capacity {cap}")


def _entry_problems(state: State, pin_totals: dict[int, int], problems: list[str]) -> None:
    """Name the entries whose pins or pending job are wrong."""
    for h in state.slot_of:
        pins = state.pin_count.get(h, 0)
        jid = state.pending.get(h)
        job = state.jobs.get(jid) if jid is not None else None
        if jid is None:
            name = "RESIDENT"
        else:
            name = "STORE_QUEUED" if job is not None and job.state is JobState.QUEUED else "STORING"
        if pins < 0:
            problems.append(f"block {h} has negative pins {pins}")
        if pins != pin_totals.get(h, 0):
            problems.append(f"block {h} has {pins} pins but requests hold {pin_totals.get(h, 0)}")
        if pins and jid is not None:
            problems.append(f"block {h} is pinned in state {name}")
        if jid is not None and (job is None or job.direction != STORE or h not in job.hashes):
            problems.append(f"block {h} ({name}) has no live store job")
    for h in pin_totals:
        if h not in state.slot_of:
            problems.append(f"pins on block {h} which is not on the tier")
    for h in state.pin_count:
        if h not in state.slot_of and h not in pin_totals:
            problems.append(f"pins on block {h} which is not on the tier")


# Bind the optional C accelerator now that every name it needs exists (see kvflow/native.py).
import kvflow.native as _native_binding  # noqa: E402

_native_binding.bind()
