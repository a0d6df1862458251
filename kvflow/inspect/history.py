"""The trace queries behind ``kvflow inspect``: the history of one followed thing (block,
job, request or slot) and/or the state at one seq.

Results are dataclasses with ``to_dict()``; nothing here prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvflow.core.commands import COMMAND_TYPES, JobResult
from kvflow.core.errors import KvflowError
from kvflow.core.events import (
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    LateResultIgnored,
    RankSucceeded,
    Reset,
    event_name,
)
from kvflow.core.state.model import State
from kvflow.inspect.render import describe, to_builtins
from kvflow.inspect.views import _slot_owner, _view, focus_dict, state_to_dict
from kvflow.inspect.walk import JobInfo, _Walk
from kvflow.log.format import Checkpoint


class InspectError(KvflowError):
    """A question the trace cannot answer (no such seq, state unknowable); one line."""


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
    cpu_blocks: int = 0  # the trace's CPU tier: the slots there are

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
        return selector.slot is not None and _slot_owner(walk.state, selector.slot, walk)[0] != "free"
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
        hashes: tuple[int, ...] = getattr(rec, "hashes", ()) or getattr(rec, "block_hashes", ())
        return selector.block in hashes
    return selector.slot in getattr(rec, "slots", ())


def inspect_trace(
    path: str | os.PathLike[str], selector: Selector | None = None, at: int | None = None
) -> Inspection:
    """The history of ``selector``'s thing and/or the state at seq ``at``.

    Raises :class:`InspectError` when ``at`` is beyond the last event or the state there
    cannot be computed, and :class:`~kvflow.core.errors.TraceError` for an unreadable trace.
    """
    selector = selector or Selector()
    if len(selector.given()) > 1:
        raise InspectError(f"follow one thing at a time, not {' and '.join(selector.given())}")
    following = bool(selector.given())
    if at is not None and at < 0:
        raise InspectError(f"--at must be a seq >= 0, got {at}")
    walk = _Walk(path, slots=selector.slot is not None, keep=lambda info: _job_matches(selector, info))
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
        before = _view(selector, state, walk) if matched and walk.folding else None
        walk.apply(line, rec)
        if matched:
            if not cause_shown and walk.command is not None:
                history.append(_entry(walk.command_line or line, walk.command, walk, None))
                cause_shown = True
            change = None
            if before is not None and walk.folding:
                after = _view(selector, state, walk)
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
            focus_out = focus_dict(selector, snapshot, walk)
        else:
            state_out = state_to_dict(snapshot)
    return Inspection(
        walk.path, selector, history, at, state_out, focus_out, walk.last_seq, walk.warnings,
        walk.reader.config.cpu_blocks,
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
