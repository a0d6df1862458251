"""The shared streaming pass over a trace: folds its events and tracks every job.

Both analyses (``incidents`` and ``history``) read a trace through :class:`_Walk`, so what
they report about state is what ``evolve`` computed, not a re-reading of the event fields.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvflow.core.commands import COMMAND_TYPES, PlanStep, Tick
from kvflow.core.errors import IllegalTransition
from kvflow.core.events import (
    DiskLoadQueued,
    DiskStoreQueued,
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    LoadQueued,
    RankSucceeded,
    RemoteLoadQueued,
    RemoteStoreQueued,
    Reset,
    StoreQueued,
)
from kvflow.core.jobs import DISK_LOAD, DISK_STORE, LOAD, REMOTE_LOAD, REMOTE_STORE, STORE
from kvflow.core.state.apply import evolve
from kvflow.log.format import Checkpoint
from kvflow.log.reader import TraceReader


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
    ended: str | None = None  # "completed", "failed", "timed_out"; "lifted" once a fence ends


class _Walk:
    """Streams a trace's records and keeps the context every analysis needs: the folded
    state, the engine step and time, the current command, and every job's description."""

    def __init__(
        self, path: str | os.PathLike[str], slots: bool = False, keep: Callable[[JobInfo], bool] | None = None
    ) -> None:
        """``slots``: keep ``filled``, for an analysis that asks who owns a slot. ``jobs``
        holds the live jobs, and the ended ones ``keep`` asks for: a trace streams, so what
        it holds must not grow with the trace (``job_count`` counts them all)."""
        self.reader = TraceReader(path)
        self.path = self.reader.path
        self.state = self.reader.new_state()
        self.folding = True
        self.fold_error: str | None = None
        self.step = 0
        self.time_ms: float | None = None
        self.command: Any = None
        self.command_line: int | None = None
        self.command_before_seq = 0
        self.jobs: dict[int, JobInfo] = {}
        self.job_count = 0
        self.keep = keep
        self.last_seq = 0
        self.warnings: list[str] = []
        # slot -> the blocks the trace admitted into it, in order (with ``slots``): the state
        # keeps no owner per slot, and a scan of its entries would cost the tier's size
        self.filled: dict[int, list[int]] | None = {} if slots else None

    def records(self) -> Iterator[tuple[int, Any]]:
        with self.reader:
            yield from self.reader.records()
        self.warnings.extend(self.reader.findings())  # a torn line, a record digest that differs
        if self.fold_error is not None:
            self.warnings.append(
                f"{self.fold_error}; state-based details after it are not verified "
                f"(run: kvflow replay {self.path})"
            )

    def feed(self, line: int, rec: Any) -> None:
        """Take one record: a command is noted, an event folded, a checkpoint passed by."""
        kind = type(rec)
        if kind in COMMAND_TYPES:
            self.on_command(line, rec)
        elif kind is not Checkpoint:
            self.apply(line, rec)

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
        if self.filled is not None and (kind is StoreQueued or kind is RemoteLoadQueued):
            slot_of = self.state.slot_of
            for s, h in zip(event.slots, event.hashes):
                # a block that left the slot owns it again only when admitted again (and
                # listed again then): while the state folds, only the current ones are kept
                kept = self.filled.get(s, [])
                if self.folding:
                    kept = [x for x in kept if slot_of.get(x) == s]
                kept.append(h)
                self.filled[s] = kept
        if kind is StoreQueued or kind is LoadQueued:
            self.job_count += 1
            jobs[event.job_id] = JobInfo(
                event.job_id,
                STORE if kind is StoreQueued else LOAD,
                event.request_id,
                event.hashes,
                event.device_blocks,
                event.slots,
                event.seq,
            )
        elif kind is RemoteLoadQueued or kind is RemoteStoreQueued:
            self.job_count += 1
            direction = REMOTE_LOAD if kind is RemoteLoadQueued else REMOTE_STORE
            jobs[event.job_id] = JobInfo(event.job_id, direction, None, event.hashes, (), event.slots, event.seq)
        elif kind is DiskLoadQueued or kind is DiskStoreQueued:
            self.job_count += 1
            direction = DISK_LOAD if kind is DiskLoadQueued else DISK_STORE
            jobs[event.job_id] = JobInfo(event.job_id, direction, None, event.hashes, (), event.slots, event.seq)
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
        elif kind is FenceLifted:
            info = jobs.get(event.job_id)
            if info is not None:
                info.ended = "lifted"
                self._drop(info)
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
                if not getattr(event, "fenced", False):  # (a fenced one ends when its fence lifts)
                    self._drop(info)

    def _drop(self, info: JobInfo) -> None:
        """An ended job leaves ``jobs`` unless ``keep`` asks for it."""
        if self.keep is None or not self.keep(info):
            del self.jobs[info.job_id]
