"""Trace analysis behind ``kvflow incidents`` and ``kvflow inspect`` (DESIGN §1.3, §6).

Everything here reads a trace in one streaming pass through :class:`~kvflow.log.TraceReader`
and folds its events with ``evolve`` alongside, so what it reports about recovery and state
is what the state machine computed, not a re-reading of the event fields. Nothing here
prints: results are dataclasses with ``to_dict()`` (JSON-ready); the CLI renders them.

If a trace stops folding (an illegal event: the trace and the code disagree), the analysis
goes on from the events alone, marks what it could not verify, and says so in ``warnings``;
``kvflow replay`` is the tool that explains such a trace.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvflow.decide import CANCELLED_BY_RESET
from kvflow.errors import IllegalTransition, KvflowError
from kvflow.events import (
    COMMAND_TYPES,
    LOAD,
    STORE,
    AcceptHits,
    BlocksComputed,
    BlocksEvicted,
    BlocksTouched,
    DeviceBlocksEvicting,
    Evict,
    FinishRequest,
    JobCompleted,
    JobFailed,
    JobResult,
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
    Reset,
    ResetAll,
    StoreQueued,
    StoreRejected,
    Tick,
    Touch,
    event_name,
)
from kvflow.log import Checkpoint, TraceReader
from kvflow.state import State, evolve

TERMINAL_FAILURES = (JobFailed, JobTimedOut)


class InspectError(KvflowError):
    """A question the trace cannot answer (no such seq, state unknowable); one line."""


# --- describing records --------------------------------------------------------------------


def few(values: Any, limit: int = 4) -> str:
    """``[1, 2, 3, 4, +5 more]``: a list short enough for one line."""
    values = list(values)
    shown = ", ".join(str(v) for v in values[:limit])
    if len(values) > limit:
        shown += f", +{len(values) - limit} more"
    return f"[{shown}]"


def _req(request_id: str | None) -> str:
    return "no request" if request_id is None else f"request {request_id}"


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def describe(record: Any) -> str:
    """One human-readable line for a command, event or checkpoint."""
    r = record
    kind = type(r)
    if kind is StoreQueued:
        return (
            f"store job {r.job_id} queued for {_req(r.request_id)}: {_blocks(len(r.hashes))} "
            f"{few(r.hashes)} from device blocks {few(r.device_blocks)} into slots {few(r.slots)}"
        )
    if kind is LoadQueued:
        return (
            f"load job {r.job_id} queued for {_req(r.request_id)}: {_blocks(len(r.hashes))} "
            f"{few(r.hashes)} from slots {few(r.slots)} into device blocks {few(r.device_blocks)}"
        )
    if kind is JobsSubmitted:
        return (
            f"jobs {few(r.job_ids, 8)} submitted at {r.now_ms:g} ms, deadline {r.deadline_ms:g} ms"
        )
    if kind is RankSucceeded:
        return f"job {r.job_id}: rank {r.rank} succeeded; waiting for the other ranks"
    if kind is JobCompleted:
        return f"{r.direction} job {r.job_id} completed ({_req(r.request_id)}, {_blocks(len(r.hashes))})"
    if kind is JobFailed:
        if r.rank < 0:
            return f"{r.direction} job {r.job_id} CANCELLED ({r.error}; {_req(r.request_id)})"
        return f"{r.direction} job {r.job_id} FAILED on rank {r.rank}: {r.error} ({_req(r.request_id)})"
    if kind is JobTimedOut:
        return (
            f"{r.direction} job {r.job_id} TIMED OUT at {r.now_ms:g} ms "
            f"(deadline {r.deadline_ms:g} ms; {_req(r.request_id)})"
        )
    if kind is LateResultIgnored:
        outcome = "ok" if r.ok else f"error: {r.error}"
        return f"late result for ended job {r.job_id} from rank {r.rank} ({outcome}): ignored"
    if kind is BlocksEvicted:
        return f"evicted ({r.reason}) {_blocks(len(r.hashes))} {few(r.hashes)} from slots {few(r.slots)}"
    if kind is BlocksTouched:
        return f"touched {_blocks(len(r.hashes))} {few(r.hashes)} (last = most recent)"
    if kind is StoreRejected:
        return f"store of {_blocks(len(r.hashes))} {few(r.hashes)} for {_req(r.request_id)} rejected: {r.reason}"
    if kind is PinsAcquired:
        if not r.hashes:
            return f"lookup miss for request {r.request_id} ({r.num_tokens} tokens)"
        return (
            f"lookup hit: request {r.request_id} pinned {_blocks(len(r.hashes))} "
            f"{few(r.hashes)} ({r.num_tokens} tokens)"
        )
    if kind is PinsReleased:
        return f"request {r.request_id} released its offered pins on {_blocks(len(r.hashes))} {few(r.hashes)}"
    if kind is RequestFinished:
        return f"request {r.request_id} {'preempted' if r.preempted else 'finished'}"
    if kind is RequestClosed:
        return f"request {r.request_id} closed (no pins, no live jobs)"
    if kind is Reset:
        return f"RESET: tier cleared; in-flight jobs abandoned: {few(r.abandoned_job_ids, 8)}"
    if kind is Lookup:
        return (
            f"lookup for request {r.request_id}: {_blocks(len(r.block_hashes))} "
            f"{few(r.block_hashes)}, {r.num_tokens} tokens, device hit {r.device_hit_blocks}"
        )
    if kind is AcceptHits:
        return f"request {r.request_id} accepts {len(r.device_blocks)} hits into device blocks {few(r.device_blocks)}"
    if kind is BlocksComputed:
        return (
            f"{_req(r.request_id)} computed {_blocks(len(r.block_hashes))} {few(r.block_hashes)} "
            f"in device blocks {few(r.device_blocks)}"
        )
    if kind is DeviceBlocksEvicting:
        return (
            f"device cache drops {_blocks(len(r.block_hashes))} {few(r.block_hashes)} "
            f"from device blocks {few(r.device_blocks)}"
        )
    if kind is Touch:
        return f"touch {_blocks(len(r.block_hashes))} {few(r.block_hashes)}"
    if kind is Evict:
        return f"evict {_blocks(r.num_blocks)} on request"
    if kind is PlanStep:
        return f"plan step at {r.now_ms:g} ms"
    if kind is JobResult:
        outcome = "ok" if r.ok else f"error: {r.error}"
        return f"executor result: job {r.job_id} rank {r.rank} {outcome}"
    if kind is Tick:
        return f"tick at {r.now_ms:g} ms"
    if kind is FinishRequest:
        return f"request {r.request_id} {'preempted' if r.preempted else 'finished'} by the engine"
    if kind is ResetAll:
        return "reset requested by the engine"
    if kind is Checkpoint:
        return f"checkpoint: digest {r.digest} at seq {r.seq}"
    return event_name(r)


def to_builtins(record: Any) -> Any:
    """A record as plain JSON data, its ``type`` tag included."""
    return msgspec.to_builtins(record)


# --- the shared pass -----------------------------------------------------------------------


@dataclass
class JobInfo:
    """What the trace says about one job, whether it is still live or not."""

    job_id: int
    direction: str
    request_id: str | None
    hashes: tuple[int, ...]
    device_blocks: tuple[int, ...]
    slots: tuple[int, ...]
    queued_seq: int
    submitted_seq: int | None = None
    submitted_ms: float | None = None
    deadline_ms: float | None = None
    ranks_succeeded: list[int] = field(default_factory=list)
    abandoned_at_seq: int | None = None
    ended: str | None = None  # "completed", "failed", "timed_out"


class _Walk:
    """Streams a trace's records and keeps the context every analysis needs: the folded
    state, the engine step and time, the current command, and every job's description."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.reader = TraceReader(path)
        self.state = State(self.reader.config)
        self.folding = True
        self.fold_error: str | None = None
        self.step = 0
        self.time_ms: float | None = None
        self.command: Any = None
        self.command_line: int | None = None
        self.command_before_seq = 0
        self.jobs: dict[int, JobInfo] = {}
        self.last_seq = 0
        self.warnings: list[str] = []

    def records(self) -> Iterator[tuple[int, Any]]:
        with self.reader:
            yield from self.reader.records()
        self.warnings.extend(self.reader.warnings)
        if self.fold_error is not None:
            self.warnings.append(
                f"{self.fold_error}; state-based details after it are not verified "
                f"(run: kvflow replay {self.path})"
            )

    def on_command(self, line: int, command: Any) -> None:
        self.command, self.command_line = command, line
        self.command_before_seq = self.last_seq
        kind = type(command)
        if kind is PlanStep:
            self.step += 1
            self.time_ms = command.now_ms
        elif kind is Tick:
            self.time_ms = command.now_ms

    def apply(self, line: int, event: Any) -> None:
        """Fold ``event`` (while the trace folds) and track its jobs."""
        self.last_seq = event.seq
        if self.folding:
            try:
                evolve(self.state, event)
            except IllegalTransition as exc:
                self.folding = False
                self.fold_error = f"{self.path}:{line}: seq {event.seq} does not fold ({exc})"
        kind = type(event)
        jobs = self.jobs
        if kind is StoreQueued or kind is LoadQueued:
            jobs[event.job_id] = JobInfo(
                event.job_id,
                STORE if kind is StoreQueued else LOAD,
                event.request_id,
                event.hashes,
                event.device_blocks,
                event.slots,
                event.seq,
            )
        elif kind is JobsSubmitted:
            for jid in event.job_ids:
                info = jobs.get(jid)
                if info is not None:
                    info.submitted_seq = event.seq
                    info.submitted_ms = event.now_ms
                    info.deadline_ms = event.deadline_ms
        elif kind is RankSucceeded:
            info = jobs.get(event.job_id)
            if info is not None:
                info.ranks_succeeded.append(event.rank)
        elif kind is Reset:
            for jid in event.abandoned_job_ids:
                info = jobs.get(jid)
                if info is not None:
                    info.abandoned_at_seq = event.seq
        elif kind is JobCompleted or kind is JobFailed or kind is JobTimedOut:
            info = jobs.get(event.job_id)
            if info is not None:
                info.ended = (
                    "completed"
                    if kind is JobCompleted
                    else "failed"
                    if kind is JobFailed
                    else "timed_out"
                )


# --- incidents -----------------------------------------------------------------------------


@dataclass
class LateResult:
    seq: int
    line: int
    rank: int
    ok: bool
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "line": self.line,
            "rank": self.rank,
            "ok": self.ok,
            "error": self.error,
        }


@dataclass
class Incident:
    """One failed, timed-out or cancelled job, and what recovery did about it."""

    seq: int
    line: int
    step: int
    time_ms: float | None
    job_id: int
    direction: str
    outcome: str  # "failed", "timed_out", "cancelled"
    rank: int | None
    error: str
    request_id: str | None
    hashes: tuple[int, ...]
    device_blocks: tuple[int, ...]
    slots: tuple[int, ...]
    queued_seq: int | None
    submitted_seq: int | None
    submitted_ms: float | None
    deadline_ms: float | None
    ranks_succeeded: list[int]
    abandoned_at_seq: int | None
    recovery: dict[str, Any]
    verified: bool
    late_results: list[LateResult] = field(default_factory=list)

    @property
    def requests(self) -> list[str]:
        return [] if self.request_id is None else [self.request_id]

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "line": self.line,
            "step": self.step,
            "time_ms": self.time_ms,
            "job_id": self.job_id,
            "direction": self.direction,
            "outcome": self.outcome,
            "rank": self.rank,
            "error": self.error,
            "requests": self.requests,
            "blocks": len(self.hashes),
            "hashes": list(self.hashes),
            "device_blocks": list(self.device_blocks),
            "slots": list(self.slots),
            "queued_seq": self.queued_seq,
            "submitted_seq": self.submitted_seq,
            "submitted_ms": self.submitted_ms,
            "deadline_ms": self.deadline_ms,
            "ranks_succeeded": list(self.ranks_succeeded),
            "abandoned": self.abandoned_at_seq is not None,
            "abandoned_at_seq": self.abandoned_at_seq,
            "cancelled_by_reset": self.outcome == "cancelled",
            "recovery": self.recovery,
            "verified": self.verified,
            "late_results": [late.to_dict() for late in self.late_results],
        }


@dataclass
class IncidentReport:
    path: str
    incidents: list[Incident]
    jobs: int
    last_seq: int
    warnings: list[str]

    def to_list(self) -> list[dict[str, Any]]:
        return [incident.to_dict() for incident in self.incidents]


def _recovery_from_state(
    state: State, event: JobFailed | JobTimedOut, info: JobInfo | None, before: dict[str, Any]
) -> dict[str, Any]:
    free_after = set(state.free_slots)
    held_after = state.held
    released = [d for d in event.device_blocks if d not in held_after]
    abandoned = info is not None and info.abandoned_at_seq is not None
    recovery: dict[str, Any] = {}
    if abandoned:
        recovery["quarantined_slots_released"] = [
            s for s in event.slots if s in before["quarantine"] and s in free_after
        ]
        recovery["note"] = (
            f"abandoned by the reset at seq {info.abandoned_at_seq}: its slots stayed "  # type: ignore[union-attr]
            "quarantined until this result; nothing became visible"
        )
    elif event.direction == STORE:
        recovery["slots_freed"] = [
            s for s in event.slots if s not in before["free"] and s in free_after
        ]
        recovery["hashes_never_visible"] = [h for h in event.hashes if h not in state.entries]
    else:
        recovery["entries_kept_resident"] = [h for h in event.hashes if state.is_resident(h)]
        pins_before = before["pins"]
        recovery["pins_released"] = sum(
            pins_before.get(h, 0) - (state.entries[h].pins if h in state.entries else 0)
            for h in dict.fromkeys(event.hashes)
        )
    if event.direction == LOAD:
        recovery["recompute_device_blocks"] = list(event.device_blocks)
    recovery["device_blocks_released"] = released
    return recovery


def _recovery_from_event(event: JobFailed | JobTimedOut, info: JobInfo | None) -> dict[str, Any]:
    """What the lifecycle rules say recovery does, for a trace that no longer folds."""
    recovery: dict[str, Any] = {}
    if info is not None and info.abandoned_at_seq is not None:
        recovery["quarantined_slots_released"] = list(event.slots)
    elif event.direction == STORE:
        recovery["slots_freed"] = list(event.slots)
        recovery["hashes_never_visible"] = list(event.hashes)
    else:
        recovery["entries_kept_resident"] = list(event.hashes)
        recovery["pins_released"] = len(event.hashes)
    if event.direction == LOAD:
        recovery["recompute_device_blocks"] = list(event.device_blocks)
    recovery["device_blocks_released"] = list(event.device_blocks)
    return recovery


def find_incidents(path: str | os.PathLike[str]) -> IncidentReport:
    """Every failed, timed-out or cancelled job of the trace, in seq order.

    Raises :class:`~kvflow.errors.TraceError` for an unreadable trace.
    """
    walk = _Walk(path)
    incidents: list[Incident] = []
    by_job: dict[int, Incident] = {}
    state = walk.state
    for line, rec in walk.records():
        kind = type(rec)
        if kind is Checkpoint:
            continue
        if kind in COMMAND_TYPES:
            walk.on_command(line, rec)
            continue
        if kind is JobFailed or kind is JobTimedOut:
            before: dict[str, Any] = {}
            folding = walk.folding
            if folding:
                entries = state.entries
                before = {
                    "free": set(state.free_slots),
                    "quarantine": dict(state.quarantine),
                    "pins": {h: entries[h].pins for h in rec.hashes if h in entries},
                }
            walk.apply(line, rec)
            info = walk.jobs.get(rec.job_id)
            verified = folding and walk.folding
            if verified:
                recovery = _recovery_from_state(state, rec, info, before)
            else:
                recovery = _recovery_from_event(rec, info)
            if kind is JobTimedOut:
                outcome, rank, error = (
                    "timed_out",
                    None,
                    (f"timed out at {rec.now_ms:g} ms (deadline {rec.deadline_ms:g} ms)"),
                )
                time_ms: float | None = rec.now_ms
            else:
                cancelled = rec.rank < 0 and rec.error == CANCELLED_BY_RESET
                outcome = "cancelled" if cancelled else "failed"
                rank, error, time_ms = (None if rec.rank < 0 else rec.rank), rec.error, walk.time_ms
            incident = Incident(
                seq=rec.seq,
                line=line,
                step=walk.step,
                time_ms=time_ms,
                job_id=rec.job_id,
                direction=rec.direction,
                outcome=outcome,
                rank=rank,
                error=error,
                request_id=rec.request_id,
                hashes=rec.hashes,
                device_blocks=rec.device_blocks,
                slots=rec.slots,
                queued_seq=None if info is None else info.queued_seq,
                submitted_seq=None if info is None else info.submitted_seq,
                submitted_ms=None if info is None else info.submitted_ms,
                deadline_ms=None if info is None else info.deadline_ms,
                ranks_succeeded=[] if info is None else list(info.ranks_succeeded),
                abandoned_at_seq=None if info is None else info.abandoned_at_seq,
                recovery=recovery,
                verified=verified,
            )
            incidents.append(incident)
            by_job[rec.job_id] = incident
            continue
        walk.apply(line, rec)
        if kind is LateResultIgnored:
            ended = by_job.get(rec.job_id)
            if ended is not None:
                ended.late_results.append(LateResult(rec.seq, line, rec.rank, rec.ok, rec.error))
    return IncidentReport(walk.path, incidents, len(walk.jobs), walk.last_seq, walk.warnings)


def recovery_summary(incident: Incident) -> str:
    """The recovery of one incident in one line."""
    rec = incident.recovery
    parts = []
    if "quarantined_slots_released" in rec:
        parts.append(f"quarantined slots released {few(rec['quarantined_slots_released'], 6)}")
    if "slots_freed" in rec:
        parts.append(f"slots freed {few(rec['slots_freed'], 6)}")
    if "hashes_never_visible" in rec:
        parts.append(f"{len(rec['hashes_never_visible'])} hashes never visible")
    if "entries_kept_resident" in rec:
        parts.append(f"{len(rec['entries_kept_resident'])} entries kept resident")
    if "pins_released" in rec:
        parts.append(f"{rec['pins_released']} pins released")
    if "recompute_device_blocks" in rec:
        parts.append(f"recompute device blocks {few(rec['recompute_device_blocks'], 6)}")
    if incident.abandoned_at_seq is not None:
        parts.append(f"abandoned by reset at seq {incident.abandoned_at_seq}")
    if not incident.verified:
        parts.append("(not verified: the trace stopped folding)")
    return "; ".join(parts)


# --- history and state at a seq ------------------------------------------------------------


@dataclass(frozen=True)
class Selector:
    """What ``kvflow inspect`` follows: exactly one of the four, or none (state only)."""

    block: int | None = None
    job: int | None = None
    request: str | None = None
    slot: int | None = None

    def given(self) -> list[str]:
        return [k for k in ("block", "job", "request", "slot") if getattr(self, k) is not None]

    def __str__(self) -> str:
        (name,) = self.given()
        return f"{name} {getattr(self, name)}"


@dataclass
class HistoryEntry:
    line: int
    seq: int | None  # None for a command (it has no seq; see ``before_seq``)
    before_seq: int  # the last seq applied before this record
    kind: str  # "event" or "command"
    type: str
    text: str
    change: str | None  # the followed thing, before -> after (events)
    record: Any

    def to_dict(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "seq": self.seq,
            "before_seq": self.before_seq,
            "kind": self.kind,
            "type": self.type,
            "text": self.text,
            "change": self.change,
            "record": to_builtins(self.record),
        }


@dataclass
class Inspection:
    path: str
    selector: Selector
    history: list[HistoryEntry]
    at: int | None
    state: dict[str, Any] | None  # the whole state at ``at`` (no selector) ...
    focus: dict[str, Any] | None  # ... or the followed thing's state at ``at``
    last_seq: int
    warnings: list[str]

    def to_dict(self) -> dict[str, Any]:
        given = self.selector.given()
        return {
            "path": self.path,
            "selector": {k: getattr(self.selector, k) for k in given},
            "history": [entry.to_dict() for entry in self.history],
            "at": self.at,
            "state": self.state,
            "focus": self.focus,
            "last_seq": self.last_seq,
            "warnings": self.warnings,
        }


def entry_dict(block_hash: int, state: State) -> dict[str, Any]:
    entry = state.entries.get(block_hash)
    if entry is None:
        return {"hash": block_hash, "state": "ABSENT"}
    return {
        "hash": block_hash,
        "state": entry.state.name,
        "slot": entry.slot,
        "pins": entry.pins,
        "job": entry.job_id or None,
    }


def job_dict(job: Any) -> dict[str, Any]:
    return {
        "job": job.job_id,
        "direction": job.direction,
        "state": job.state.name,
        "request": job.request_id,
        "blocks": len(job.hashes),
        "hashes": list(job.hashes),
        "device_blocks": list(job.device_blocks),
        "slots": list(job.slots),
        "deadline_ms": job.deadline_ms if job.deadline_ms else None,
        "ranks_succeeded": [r for r in range(job.acks.bit_length()) if job.acks >> r & 1],
        "abandoned": job.abandoned,
    }


def request_dict(req: Any) -> dict[str, Any]:
    return {
        "request": req.request_id,
        "pins": {str(h): n for h, n in req.pins.items()},
        "offered": list(req.offered),
        "jobs": list(req.jobs),
        "finished": req.finished,
        "preempted": req.preempted,
    }


def state_to_dict(state: State) -> dict[str, Any]:
    """The whole state as JSON-ready data (entries by slot, jobs by id)."""
    entries = sorted(state.entries, key=lambda h: state.entries[h].slot)
    return {
        "seq": state.last_seq,
        "digest": state.digest(),
        "capacity": state.capacity,
        "policy": state.config.policy,
        "resident_blocks": state.num_resident(),
        "free_slots": len(state.free_slots),
        "entries": [entry_dict(h, state) for h in entries],
        "pins": {
            rid: {str(h): n for h, n in req.pins.items()}
            for rid, req in sorted(state.requests.items())
            if req.pins
        },
        "requests": [request_dict(state.requests[rid]) for rid in sorted(state.requests)],
        "jobs": [job_dict(state.jobs[jid]) for jid in sorted(state.jobs)],
        "quarantine": [{"slot": s, "job": list(j)} for s, j in sorted(state.quarantine.items())],
        "held_device_blocks": [
            {"device_block": d, "job": j} for d, j in sorted(state.held.items())
        ],
        "recency_coldest_first": state.policy.resident(),
    }


def _slot_owner(state: State, slot: int) -> tuple[str, Any]:
    """Who owns a slot: ("quarantine", [abandoned job ids]), ("block", hash) or ("free", None)."""
    if slot in state.quarantine:
        return "quarantine", list(state.quarantine[slot])
    for h, s in state.slot_of.items():
        if s == slot:
            return "block", h
    if slot in state.free_slots:
        return "free", None
    return "unknown", None


def focus_dict(selector: Selector, state: State, jobs: dict[int, JobInfo]) -> dict[str, Any]:
    """The followed thing's state (the state at one seq, narrowed)."""
    out: dict[str, Any] = {"seq": state.last_seq}
    if selector.block is not None:
        h = selector.block
        out.update(entry_dict(h, state))
        out["pins_by_request"] = {
            rid: req.pins[h] for rid, req in sorted(state.requests.items()) if h in req.pins
        }
        out["live_jobs"] = [job_dict(j) for jid, j in sorted(state.jobs.items()) if h in j.hashes]
    elif selector.job is not None:
        job = state.jobs.get(selector.job)
        if job is not None:
            out.update(job_dict(job))
        else:
            info = jobs.get(selector.job)
            ended = None if info is None else info.ended
            out.update(
                {
                    "job": selector.job,
                    "state": (ended or "not queued yet").upper().replace(" ", "_"),
                }
            )
    elif selector.request is not None:
        req = state.requests.get(selector.request)
        if req is not None:
            out.update(request_dict(req))
        else:
            out.update({"request": selector.request, "state": "UNKNOWN (not seen yet, or closed)"})
    elif selector.slot is not None:
        owner, who = _slot_owner(state, selector.slot)
        out.update({"slot": selector.slot, "owner": owner})
        if owner == "block":
            out["entry"] = entry_dict(who, state)  # type: ignore[arg-type]
        elif owner == "quarantine":
            out["jobs"] = who
    return out


def _view(selector: Selector, state: State, jobs: dict[int, JobInfo]) -> str:
    """The followed thing in a few words (for before -> after)."""
    if selector.block is not None:
        entry = state.entries.get(selector.block)
        if entry is None:
            return "ABSENT"
        pins = f" pins {entry.pins}" if entry.pins else ""
        return f"{entry.state.name} slot {entry.slot}{pins}"
    if selector.job is not None:
        job = state.jobs.get(selector.job)
        if job is not None:
            return job.state.name
        info = jobs.get(selector.job)
        return "NEW" if info is None or info.ended is None else info.ended.upper()
    if selector.request is not None:
        req = state.requests.get(selector.request)
        if req is None:
            return "not live"
        done = ", finished" if req.finished else ""
        return f"pins {sum(req.pins.values())}, live jobs {few(req.jobs)}{done}"
    owner, who = _slot_owner(state, selector.slot)  # type: ignore[arg-type]
    if owner == "block":
        return f"block {who} ({state.entries[who].state.name})"  # type: ignore[index]
    if owner == "quarantine":
        return f"quarantined by job{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}"
    return owner


def _job_matches(selector: Selector, info: JobInfo | None) -> bool:
    if info is None:
        return False
    if selector.block is not None:
        return selector.block in info.hashes
    if selector.job is not None:
        return info.job_id == selector.job
    if selector.request is not None:
        return info.request_id == selector.request
    return selector.slot in info.slots


def _names(selector: Selector, rec: Any, walk: _Walk) -> bool:
    """Does this record name the followed thing (directly or through one of its jobs)?"""
    kind = type(rec)
    jobs = walk.jobs
    if kind is JobsSubmitted:
        return any(_job_matches(selector, jobs.get(j)) for j in rec.job_ids)
    if kind is Reset:
        if selector.job is not None or selector.request is not None:
            return any(_job_matches(selector, jobs.get(j)) for j in rec.abandoned_job_ids) or (
                selector.request is not None and selector.request in walk.state.requests
            )
        if not walk.folding:
            return True  # cannot tell: a reset touches every block and slot
        if selector.block is not None:
            return selector.block in walk.state.entries
        return _slot_owner(walk.state, selector.slot)[0] != "free"  # type: ignore[arg-type]
    if kind in (RankSucceeded, LateResultIgnored, JobResult):
        return _job_matches(selector, jobs.get(rec.job_id))
    if selector.job is not None:
        return getattr(rec, "job_id", None) == selector.job
    if selector.request is not None:
        return getattr(rec, "request_id", None) == selector.request or (
            kind in (JobCompleted, JobFailed, JobTimedOut)
            and _job_matches(selector, jobs.get(rec.job_id))
        )
    if selector.block is not None:
        hashes = getattr(rec, "hashes", None)
        if hashes is None:
            hashes = getattr(rec, "block_hashes", ())
        return selector.block in hashes  # type: ignore[operator]
    return selector.slot in getattr(rec, "slots", ())


def inspect_trace(
    path: str | os.PathLike[str], selector: Selector | None = None, at: int | None = None
) -> Inspection:
    """The history of ``selector``'s thing and/or the state at seq ``at``.

    Raises :class:`InspectError` when ``at`` is beyond the last event or the state there
    cannot be computed, and :class:`~kvflow.errors.TraceError` for an unreadable trace.
    """
    selector = selector or Selector()
    if len(selector.given()) > 1:
        raise InspectError(f"follow one thing at a time, not {' and '.join(selector.given())}")
    following = bool(selector.given())
    if at is not None and at < 0:
        raise InspectError(f"--at must be a seq >= 0, got {at}")
    walk = _Walk(path)
    state = walk.state
    history: list[HistoryEntry] = []
    snapshot: State | None = state.copy() if at == 0 else None
    at_error: str | None = None
    cause_shown = False
    for line, rec in walk.records():
        kind = type(rec)
        if kind is Checkpoint:
            continue
        if kind in COMMAND_TYPES:
            walk.on_command(line, rec)
            cause_shown = False
            if following and _names(selector, rec, walk):
                history.append(_entry(line, rec, walk, None))
                cause_shown = True
            continue
        matched = following and _names(selector, rec, walk)
        before = _view(selector, state, walk.jobs) if matched and walk.folding else None
        walk.apply(line, rec)
        if matched:
            if not cause_shown and walk.command is not None:
                history.append(_entry(walk.command_line or line, walk.command, walk, None))
                cause_shown = True
            change = None
            if before is not None and walk.folding:
                after = _view(selector, state, walk.jobs)
                change = before if after == before else f"{before} -> {after}"
            history.append(_entry(line, rec, walk, change))
        if at is not None and snapshot is None and at_error is None and rec.seq >= at:
            if walk.folding and rec.seq == at:
                snapshot = state.copy()
            else:
                at_error = f"cannot compute the state at seq {at}: {walk.fold_error or 'seqs are not gapless'}"
            if not following:
                walk.reader.close()
                break
    state_out = focus_out = None
    if at is not None:
        if at_error is not None:
            raise InspectError(at_error)
        if snapshot is None:
            raise InspectError(
                f"--at {at} is beyond the last event of {walk.path} (last seq {walk.last_seq})"
            )
        if following:
            focus_out = focus_dict(selector, snapshot, walk.jobs)
        else:
            state_out = state_to_dict(snapshot)
    return Inspection(
        walk.path, selector, history, at, state_out, focus_out, walk.last_seq, walk.warnings
    )


def _entry(line: int, rec: Any, walk: _Walk, change: str | None) -> HistoryEntry:
    is_command = type(rec) in COMMAND_TYPES
    return HistoryEntry(
        line=line,
        seq=None if is_command else rec.seq,
        before_seq=walk.command_before_seq if is_command else rec.seq - 1,
        kind="command" if is_command else "event",
        type=event_name(rec),
        text=describe(rec),
        change=change,
        record=rec,
    )


__all__ = [
    "HistoryEntry",
    "Incident",
    "IncidentReport",
    "InspectError",
    "Inspection",
    "JobInfo",
    "LateResult",
    "Selector",
    "describe",
    "find_incidents",
    "focus_dict",
    "inspect_trace",
    "recovery_summary",
    "state_to_dict",
]
