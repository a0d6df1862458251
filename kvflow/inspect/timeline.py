"""A trace over time, from one streaming pass: what ``kvflow report --html`` draws and ``kvflow
export --chrome-trace`` writes.

Three things are kept while the records go by, each bounded whatever the trace's length:

* ``bins``: the trace cut into at most ``MAX_BINS`` runs of seqs (the runs double in length as
  the trace goes on): per run, the lookups' tokens and hit tokens, the jobs' busy time per track,
  and a sample of the tier at the run's last seq (what ``kvflow inspect --at SEQ`` says there);
* ``spans``: every job's life on every rank (``Span``), handed to ``on_span`` as each job ends
  and kept for drawing while there are at most ``MAX_DRAWN_JOBS`` jobs (beyond, the page draws
  the busy time per run instead);
* ``marks``: the failures, timeouts, cancellations and fences (``Mark``), handed to
  ``on_mark`` and kept up to ``MAX_MARKS``; and for each job that failed, timed out or was
  cancelled its records (``histories``), as ``kvflow inspect --job`` shows them.

A track is a direction and a rank (``track_name``). Positions are seqs (every trace has them);
times are the engine's milliseconds where the trace records them (a job's start is its
submission, its end the time of the step or tick that ended it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvflow.core.commands import JobResult, JobResults, Lookup
from kvflow.core.decide.jobs import CANCELLED_BY_RESET
from kvflow.core.events import (
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    PinsAcquired,
    RankSucceeded,
)
from kvflow.core.jobs import DISK_LOAD, DISK_STORE, LOAD, REMOTE_LOAD, REMOTE_STORE, STORE
from kvflow.inspect.incidents import IncidentFinder, IncidentReport
from kvflow.inspect.render import describe
from kvflow.inspect.walk import _Walk
from kvflow.log.format import Checkpoint

DIRECTIONS = (STORE, LOAD, DISK_STORE, DISK_LOAD, REMOTE_STORE, REMOTE_LOAD)
"""The order of the tracks: the CPU tier's jobs, then the disk's, then the remote tier's."""
MAX_BINS = 240
MAX_DRAWN_JOBS = 2_000
MAX_MARKS = 2_000
MAX_HISTORY_LINES = 60
TERMINAL = (JobCompleted, JobFailed, JobTimedOut)


def track_name(direction: str, rank: int) -> str:
    return f"{direction} rank {rank}"


@dataclass
class Span:
    """One job on one rank: from its submission (its queueing, if it was never submitted) to
    the rank's success or the job's end."""

    job_id: int
    direction: str
    rank: int
    request_id: str | None
    blocks: int
    start_seq: int
    end_seq: int
    start_ms: float | None
    end_ms: float | None
    outcome: str  # "completed", "failed", "timed_out", "cancelled"

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job_id,
            "direction": self.direction,
            "rank": self.rank,
            "request": self.request_id,
            "blocks": self.blocks,
            "start_seq": self.start_seq,
            "end_seq": self.end_seq,
            "start_ms": self.start_ms,
            "end_ms": self.end_ms,
            "outcome": self.outcome,
        }


@dataclass
class Mark:
    """A failure, timeout, cancellation, fence or fence lift of a job, on its rank's track
    (a timeout, a cancellation and a fence lift: on every rank of the job)."""

    kind: str  # "failed", "timed_out", "cancelled", "fenced", "fence_lifted"
    job_id: int
    direction: str
    rank: int
    seq: int
    ms: float | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "job": self.job_id,
            "direction": self.direction,
            "rank": self.rank,
            "seq": self.seq,
            "ms": self.ms,
            "text": self.text,
        }


@dataclass
class Bin:
    sums: dict[str, float] = field(default_factory=dict)
    sample: dict[str, int] | None = None  # the tier after the run's last seq


class Bins:
    """Runs of ``width`` seqs (run ``i``: seqs ``i * width`` to ``(i + 1) * width - 1``); when
    a seq falls beyond ``MAX_BINS`` runs, the width doubles and neighbours merge (sums add,
    the later sample stands)."""

    def __init__(self, limit: int = MAX_BINS) -> None:
        self.limit = limit
        self.width = 1
        self.bins: list[Bin] = []

    def index(self, seq: int) -> int:
        while seq // self.width >= self.limit:
            self._double()
        i = seq // self.width
        while len(self.bins) <= i:
            self.bins.append(Bin())
        return i

    def _double(self) -> None:
        merged = []
        for k in range(0, len(self.bins), 2):
            pair = self.bins[k : k + 2]
            out = Bin(dict(pair[0].sums), pair[0].sample)
            if len(pair) == 2:
                for key, value in pair[1].sums.items():
                    out.sums[key] = out.sums.get(key, 0.0) + value
                if pair[1].sample is not None:
                    out.sample = pair[1].sample
            merged.append(out)
        self.bins = merged
        self.width *= 2

    def add(self, seq: int, key: str, value: float) -> None:
        sums = self.bins[self.index(seq)].sums
        sums[key] = sums.get(key, 0.0) + value

    def add_span(self, key: str, start: int, end: int) -> None:
        """Add the seqs ``start``..``end`` cover, to each run they cross."""
        last = self.index(end)
        first = start // self.width
        w = self.width
        for i in range(first, last + 1):
            overlap = min(end + 1, (i + 1) * w) - max(start, i * w)
            sums = self.bins[i].sums
            sums[key] = sums.get(key, 0.0) + overlap

    def to_list(self) -> list[dict[str, Any]]:
        w = self.width
        return [
            {"first_seq": i * w, "last_seq": (i + 1) * w - 1, **b.sums, "sample": b.sample}
            for i, b in enumerate(self.bins)
        ]


@dataclass
class _Live:
    """What the timeline keeps of a job until it ends."""

    rank_ends: dict[int, tuple[int, float | None]] = field(default_factory=dict)
    # (seq, line, record): described only if the job fails (most jobs do not)
    history: list[tuple[int | None, int, Any]] = field(default_factory=list)


class Timeline:
    """Fed every record of ``walk``'s trace (``before`` it is applied, ``after``), it keeps
    the bins, spans, marks and histories described above."""

    def __init__(
        self,
        walk: _Walk,
        on_span: Callable[[Span], None] | None = None,
        on_mark: Callable[[Mark], None] | None = None,
    ) -> None:
        self.walk = walk
        self.world = walk.reader.config.world_size
        self.block_tokens = walk.reader.config.block_tokens
        self.bins = Bins()
        self.spans: list[Span] = []
        self.drawn_jobs = 0
        self.too_many_jobs = False
        self.marks: list[Mark] = []
        self.mark_counts: dict[str, int] = {}
        self.tracks: set[str] = set()
        self.jobs_ended = 0
        self.histories: dict[int, list[tuple[int | None, int, str]]] = {}
        self._live: dict[int, _Live] = {}
        self._on_span = on_span
        self._on_mark = on_mark
        self._last_seq = 0
        self._pending_end: tuple[Any, Any] | None = None
        self._fenced: dict[int, str] = {}  # job -> direction, while its fence stands

    # -- the pass --------------------------------------------------------------------------

    def before(self, line: int, rec: Any) -> None:
        kind = type(rec)
        if kind is Checkpoint:
            return
        if kind is JobResult or kind is JobResults:
            for result in rec.results if kind is JobResults else (rec,):
                self._note(result.job_id, None, line, rec)
            return
        seq = getattr(rec, "seq", None)
        if seq is None:
            return
        bins = self.bins
        if bins.index(seq) != self._last_seq // bins.width:
            self._sample()  # (the state now is the one after the last seq of the run before)
        if kind in TERMINAL:
            # what the walk knows of the job, before the end takes it out of ``walk.jobs``
            self._pending_end = (rec, self.walk.jobs.get(rec.job_id))

    def after(self, line: int, rec: Any) -> None:
        kind = type(rec)
        seq = getattr(rec, "seq", None)
        if seq is None or kind is Checkpoint:
            return
        self._last_seq = seq
        walk = self.walk
        if kind is PinsAcquired:
            bins = self.bins
            bins.add(seq, "lookups", 1)
            bins.add(seq, "tokens", rec.num_tokens)
            bins.add(seq, "cpu_hit_tokens", len(rec.hashes) * self.block_tokens)
            command = walk.command
            if type(command) is Lookup and command.request_id == rec.request_id:
                bins.add(seq, "device_hit_tokens", command.device_hit_blocks * self.block_tokens)
            return
        job_id = getattr(rec, "job_id", None)
        if kind is JobsSubmitted:
            for jid in rec.job_ids:
                self._note(jid, seq, line, rec)
            return
        if job_id is None:
            return
        if job_id in walk.jobs and job_id not in self._live and kind is not FenceLifted:
            self._live[job_id] = _Live()
        self._note(job_id, seq, line, rec)
        if kind is RankSucceeded:
            live = self._live.get(job_id)
            if live is not None:
                live.rank_ends[rec.rank] = (seq, walk.time_ms)
        elif kind in TERMINAL and self._pending_end is not None:
            self._end(*self._pending_end)
            self._pending_end = None
        elif kind is FenceLifted:
            direction = self._fenced.pop(job_id, None)
            if direction is not None:
                for rank in range(self.world):
                    self._mark("fence_lifted", job_id, direction, rank, seq, walk.time_ms, f"fence lifted ({rec.reason})")

    def finish(self) -> None:
        """After the last record: the last run's sample."""
        self._sample()

    # -- helpers ---------------------------------------------------------------------------

    def _note(self, job_id: int, seq: int | None, line: int, rec: Any) -> None:
        """A record naming a job joins its history: while it lives, or after it failed."""
        ended = self.histories.get(job_id)
        if ended is not None:
            if len(ended) < MAX_HISTORY_LINES:
                ended.append((seq, line, describe(rec)))
            return
        live = self._live.get(job_id)
        if live is not None and len(live.history) < MAX_HISTORY_LINES:
            live.history.append((seq, line, rec))

    def _sample(self) -> None:
        walk = self.walk
        if not walk.folding or self._last_seq == 0:
            return
        state = walk.state
        i = self.bins.index(self._last_seq)
        resident = state.num_resident()
        sample = {
            "seq": self._last_seq,
            "resident": resident,
            "in_flight": len(state.entries) - resident,
            "free": len(state.free_slots),
            "fenced": len(state.fenced_slots),
            "live_jobs": len(state.jobs),
        }
        if state.disk is not None:
            sample["disk"] = len(state.disk.slot_of)
        if state.config.remote:
            sample["remote"] = len(state.remote)
        self.bins.bins[i].sample = sample

    def _end(self, rec: Any, info: Any) -> None:
        walk = self.walk
        kind = type(rec)
        live = self._live.pop(rec.job_id, None) or _Live()
        if info is not None:
            start_seq = info.submitted_seq if info.submitted_seq is not None else info.queued_seq
            start_ms = info.submitted_ms
        else:
            start_seq, start_ms = rec.seq, None
        end_ms = rec.now_ms if kind is JobTimedOut else walk.time_ms
        if start_ms is not None and end_ms is not None and end_ms < start_ms:
            end_ms = start_ms
        if kind is JobCompleted:
            outcome = "completed"
        elif kind is JobTimedOut:
            outcome = "timed_out"
        else:
            outcome = "cancelled" if rec.rank < 0 and rec.error == CANCELLED_BY_RESET else "failed"
        self.jobs_ended += 1
        draw = self.drawn_jobs < MAX_DRAWN_JOBS
        if draw:
            self.drawn_jobs += 1
        elif not self.too_many_jobs:
            self.too_many_jobs = True
            self.spans = []  # (the page draws the busy time per run instead)
        for rank in range(self.world):
            seq_end, ms_end = live.rank_ends.get(rank, (rec.seq, end_ms))
            span = Span(
                rec.job_id, rec.direction, rank, rec.request_id, len(rec.hashes),
                start_seq, seq_end, start_ms, ms_end if ms_end is not None else start_ms, outcome,
            )  # fmt: skip
            name = track_name(rec.direction, rank)
            self.tracks.add(name)
            self.bins.add_span(f"busy:{name}", start_seq, seq_end)
            if draw:
                self.spans.append(span)
            if self._on_span is not None:
                self._on_span(span)
        if getattr(rec, "fenced", False) or rec.abandoned:
            self._fenced[rec.job_id] = rec.direction
        if outcome == "completed":
            return
        self.histories[rec.job_id] = [(seq, line, describe(r)) for seq, line, r in live.history]
        if outcome == "failed" and rec.rank >= 0:
            ranks = [rec.rank]
            text = rec.error
        elif outcome == "timed_out":
            ranks = list(range(self.world))
            text = f"timed out at {rec.now_ms:g} ms (deadline {rec.deadline_ms:g} ms)"
        else:
            ranks = list(range(self.world))
            text = rec.error
        for rank in ranks:
            self._mark(outcome, rec.job_id, rec.direction, rank, rec.seq, end_ms, text)
        if getattr(rec, "fenced", False):
            for rank in range(self.world):
                self._mark("fenced", rec.job_id, rec.direction, rank, rec.seq, end_ms, "fenced: its copy may still run")

    def _mark(self, kind: str, job_id: int, direction: str, rank: int, seq: int, ms: float | None, text: str) -> None:
        mark = Mark(kind, job_id, direction, rank, seq, ms, text)
        self.mark_counts[kind] = self.mark_counts.get(kind, 0) + 1
        self.tracks.add(track_name(direction, rank))
        if len(self.marks) < MAX_MARKS:
            self.marks.append(mark)
        if self._on_mark is not None:
            self._on_mark(mark)

    def ordered_tracks(self) -> list[str]:
        """The tracks seen, by direction (``DIRECTIONS``) then rank."""
        return [
            track_name(d, r) for d in DIRECTIONS for r in range(self.world) if track_name(d, r) in self.tracks
        ]


def follow(
    path: str | os.PathLike[str],
    on_span: Callable[[Span], None] | None = None,
    on_mark: Callable[[Mark], None] | None = None,
    incidents: bool = False,
) -> tuple[Timeline, IncidentReport | None]:
    """One pass over the trace at ``path``: its timeline, and (``incidents``) what ``kvflow
    incidents`` finds in it, from the same pass.

    Raises :class:`~kvflow.core.errors.TraceError` for an unreadable trace.
    """
    walk = _Walk(path)
    timeline = Timeline(walk, on_span, on_mark)
    finder = IncidentFinder(walk) if incidents else None
    for line, rec in walk.records():
        timeline.before(line, rec)
        if finder is not None:
            finder.feed(line, rec)
        else:
            walk.feed(line, rec)
        timeline.after(line, rec)
    timeline.finish()
    return timeline, None if finder is None else finder.report()
