"""The incident finder behind ``kvflow incidents``: every failed, timed-out or cancelled
job of a trace, and what recovery did about it (derived from the folded state); and every
entry a shared tier refused (``EntriesRefused``: forged, another tenant's, under a retired
key ...), with the failed load it belongs to when a load refused it.

If the trace stops folding, recovery is derived from the events alone and marked not
verified.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvflow.core.commands import COMMAND_TYPES
from kvflow.core.decide.jobs import CANCELLED_BY_RESET
from kvflow.core.events import (
    BlocksEvicted,
    EntriesRefused,
    FenceLifted,
    JobFailed,
    JobTimedOut,
    LateResultIgnored,
)
from kvflow.core.jobs import DISK_LOAD, FILLING, LOAD, REMOTE_LOAD
from kvflow.core.state.model import State
from kvflow.inspect.render import exact_ms
from kvflow.inspect.walk import JobInfo, _Walk
from kvflow.log.format import Checkpoint

TERMINAL_FAILURES = (JobFailed, JobTimedOut)


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
    # F15: the copy may still have been running, so its memory was fenced; the lift (when the
    # copy reported over, or the executor closed), or None while the trace ends fenced
    fenced: bool = False
    fence_lifted: dict[str, Any] | None = None

    @property
    def requests(self) -> list[str]:
        return [] if self.request_id is None else [self.request_id]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "job",
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
            "fenced": self.fenced,
            "fence_lifted": self.fence_lifted,
        }


@dataclass
class RefusedEntry:
    """One value a shared tier refused (one block of an ``EntriesRefused`` event): never
    served. ``job_id``: the load that read it and failed (None: a probe refused it by its head,
    nothing was loaded); ``job_seq`` / ``job_line``: that load's failure in the trace."""

    seq: int
    line: int
    step: int
    time_ms: float | None
    tier: str
    reason: str
    block: int
    job_id: int | None
    dropped: bool  # this event took it out of the tier's index (else it was not there)
    job_seq: int | None = None
    job_line: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "refused_entry",
            "seq": self.seq,
            "line": self.line,
            "step": self.step,
            "time_ms": self.time_ms,
            "tier": self.tier,
            "reason": self.reason,
            "block": self.block,
            "job_id": self.job_id,
            "job_seq": self.job_seq,
            "job_line": self.job_line,
            "dropped_from_index": self.dropped,
        }


@dataclass
class IncidentReport:
    path: str
    incidents: list[Incident]
    jobs: int
    last_seq: int
    warnings: list[str]
    refused: list[RefusedEntry] = field(default_factory=list)

    def found(self) -> list[Incident | RefusedEntry]:
        """The job incidents and the refused entries together, in seq order."""
        return sorted([*self.incidents, *self.refused], key=lambda found: found.seq)

    def to_list(self) -> list[dict[str, Any]]:
        return [found.to_dict() for found in self.found()]


def _recovery_from_state(
    state: State, event: JobFailed | JobTimedOut, info: JobInfo | None, before: dict[str, Any]
) -> dict[str, Any]:
    free_after = state.free_slots  # (``in`` at once: asked of the event's slots only)
    held_after = state.held
    released = [d for d in event.device_blocks if d not in held_after]
    abandoned = info is not None and info.abandoned_at_seq is not None
    recovery: dict[str, Any] = {}
    if abandoned:
        recovery["fenced_slots_released"] = [
            s for s in event.slots if s in before["fenced_slots"] and s in free_after
        ]
        recovery["note"] = (
            f"abandoned by the reset at seq {info.abandoned_at_seq}: its slots stayed "  # type: ignore[union-attr]
            "fenced until this result; nothing became visible"
        )
    elif event.direction in FILLING:  # a store, or a remote load into host slots
        recovery["slots_freed"] = [
            s for s in event.slots if s not in before["free"] and s in free_after
        ]
        recovery["hashes_never_visible"] = [h for h in event.hashes if h not in state.entries]
        if event.direction == REMOTE_LOAD:
            recovery["dropped_from_remote_index"] = [h for h in event.hashes if h not in state.remote]
        elif event.direction == DISK_LOAD and state.disk is not None:
            recovery["dropped_from_disk_index"] = [h for h in event.hashes if h not in state.disk.slot_of]
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
    if event.fenced:
        recovery["slots_fenced"] = [s for s in event.slots if s in state.fenced_slots]
        recovery["device_blocks_fenced"] = [d for d in event.device_blocks if d in held_after]
    return recovery


def _recovery_from_event(event: JobFailed | JobTimedOut, info: JobInfo | None) -> dict[str, Any]:
    """What the lifecycle rules say recovery does, for a trace that no longer folds."""
    recovery: dict[str, Any] = {}
    if info is not None and info.abandoned_at_seq is not None:
        recovery["fenced_slots_released"] = list(event.slots)
    elif event.direction in FILLING:
        recovery["slots_freed"] = list(event.slots)
        recovery["hashes_never_visible"] = list(event.hashes)
        if event.direction == REMOTE_LOAD:
            recovery["dropped_from_remote_index"] = list(event.hashes)
        elif event.direction == DISK_LOAD:
            recovery["dropped_from_disk_index"] = list(event.hashes)
    else:
        recovery["entries_kept_resident"] = list(event.hashes)
        recovery["pins_released"] = len(event.hashes)
    if event.direction == LOAD:
        recovery["recompute_device_blocks"] = list(event.device_blocks)
    if event.fenced:
        recovery["device_blocks_released"] = []
        recovery["slots_fenced"] = list(event.slots)
        recovery["device_blocks_fenced"] = list(event.device_blocks)
        if event.direction in FILLING:
            recovery["slots_freed"] = []
    else:
        recovery["device_blocks_released"] = list(event.device_blocks)
    return recovery


class IncidentFinder:
    """The incident finder, fed one record at a time (it applies each to ``walk``), so that
    another analysis can share its pass over a trace (``kvflow report``)."""

    def __init__(self, walk: _Walk) -> None:
        self.walk = walk
        self.incidents: list[Incident] = []
        self.refused: list[RefusedEntry] = []
        self.by_job: dict[int, Incident] = {}

    def feed(self, line: int, rec: Any) -> None:
        """Apply one record of the walk's trace, noting what it tells of incidents."""
        walk, state, incidents, refused, by_job = (
            self.walk, self.walk.state, self.incidents, self.refused, self.by_job
        )
        kind = type(rec)
        if kind is Checkpoint:
            return
        if kind in COMMAND_TYPES:
            walk.on_command(line, rec)
            return
        if kind is JobFailed or kind is JobTimedOut:
            before: dict[str, Any] = {}
            folding = walk.folding
            if folding:
                entries = state.entries
                before = {
                    "free": {s for s in rec.slots if s in state.free_slots},
                    "fenced_slots": dict(state.fenced_slots),
                    "pins": {h: entries[h].pins for h in rec.hashes if h in entries},
                }
            info = walk.jobs.get(rec.job_id)  # (before the job ends and leaves walk.jobs)
            walk.apply(line, rec)
            verified = folding and walk.folding
            if verified:
                recovery = _recovery_from_state(state, rec, info, before)
            else:
                recovery = _recovery_from_event(rec, info)
            if kind is JobTimedOut:
                outcome, rank, error = (
                    "timed_out",
                    None,
                    (f"timed out at {exact_ms(rec.now_ms)} ms (deadline {exact_ms(rec.deadline_ms)} ms)"),
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
                fenced=rec.fenced,
            )
            incidents.append(incident)
            by_job[rec.job_id] = incident
            return
        if kind is FenceLifted:
            free_before = {s for s in rec.slots if s in state.free_slots}
            walk.apply(line, rec)
            fenced = by_job.get(rec.job_id)
            if fenced is not None:
                fenced.fence_lifted = {
                    "seq": rec.seq,
                    "line": line,
                    "reason": rec.reason,
                    "slots_freed": [s for s in rec.slots if s not in free_before and s in state.free_slots]
                    if walk.folding
                    else list(rec.slots),
                    "device_blocks_released": list(rec.device_blocks),
                }
            return
        walk.apply(line, rec)
        if kind is EntriesRefused:
            dropped = set(rec.dropped)
            refused.extend(
                RefusedEntry(
                    seq=rec.seq, line=line, step=walk.step, time_ms=walk.time_ms, tier=rec.tier, reason=reason,
                    block=h, job_id=job_id or None, dropped=h in dropped,
                )
                for h, reason, job_id in zip(rec.hashes, rec.reasons, rec.job_ids)
            )  # fmt: skip
            return
        if kind is BlocksEvicted and rec.reason == "corrupt" and incidents and incidents[-1].seq == rec.seq - 1:
            # F17: the failed load found these host copies bad; they left the tier with it
            recovery = incidents[-1].recovery
            gone = set(rec.hashes)
            recovery["evicted_as_corrupt"] = list(rec.hashes)
            if "entries_kept_resident" in recovery:
                recovery["entries_kept_resident"] = [h for h in recovery["entries_kept_resident"] if h not in gone]
        if kind is LateResultIgnored:
            ended = by_job.get(rec.job_id)
            if ended is not None:
                ended.late_results.append(LateResult(rec.seq, line, rec.rank, rec.ok, rec.error))

    def report(self) -> IncidentReport:
        """What was found, once every record was fed."""
        walk, incidents, refused, by_job = self.walk, self.incidents, self.refused, self.by_job
        for entry in refused:  # (a load's failure may be recorded before or after its refusals)
            failed = by_job.get(entry.job_id) if entry.job_id is not None else None
            if failed is not None:
                entry.job_seq, entry.job_line = failed.seq, failed.line
        held = [i.job_id for i in incidents if i.fenced and i.fence_lifted is None]
        if held:
            walk.warnings.append(
                f"{len(held)} fenced job{'s' if len(held) > 1 else ''} never reported the copy over "
                f"by the end of the trace (their slots and device blocks still fenced): jobs {held[:8]}"
            )
        return IncidentReport(walk.path, incidents, walk.job_count, walk.last_seq, walk.warnings, refused)


def find_incidents(path: str | os.PathLike[str]) -> IncidentReport:
    """Every failed, timed-out or cancelled job of the trace, in seq order, and every entry a
    shared tier refused.

    Raises :class:`~kvflow.core.errors.TraceError` for an unreadable trace.
    """
    walk = _Walk(path)
    finder = IncidentFinder(walk)
    for line, rec in walk.records():
        finder.feed(line, rec)
    return finder.report()
