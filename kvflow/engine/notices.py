"""What the engine is told of outcomes that arrive later: notices (loads finished or failed,
stores finished or failed, device blocks released, a reset), kept until taken (F4), the report
of one step (the notices with what the step itself did), and the fences the engine can ask
about (F15). Built from the applied events alone."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvflow.core.events import (
    Event,
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobTimedOut,
    Reset,
    StoreRejected,
)
from kvflow.core.jobs import LOAD, STORE, TransferJob

ABANDONED_BY_RESET = "abandoned by a reset: recompute these device blocks once they are released"


@dataclass
class LoadFailure:
    """A load that did not land: ``device_blocks`` hold garbage and must be recomputed.

    ``fenced`` (F15): the load's copy may still be writing those device blocks (it timed out,
    failed on one rank, or was abandoned by a reset). Recompute into other blocks; these
    come back in a later ``released_device_blocks``, once the copy is over."""

    request_id: str
    job_id: int
    device_blocks: tuple[int, ...]
    error: str
    fenced: bool = False


@dataclass(frozen=True)
class Fence:
    """A job whose outcome is known but whose copy may still run (F15): its slots and device
    blocks are not reused until the executor reports every rank's copy over."""

    job_id: int
    direction: str
    request_id: str | None
    device_blocks: tuple[int, ...]
    slots: tuple[int, ...]
    deadline_ms: float
    ranks_pending: tuple[int, ...]  # ranks that have not reported yet
    abandoned: bool  # fenced by a reset (else: timed out, or failed on another rank)


class Notices(msgspec.Struct):
    """What happened since the engine last asked (F4: kept until taken)."""

    # (msgspec Structs: each gets its own empty lists, msgspec copies ``[]``)
    loads_finished: list[tuple[str, int]] = []  # (request, job)
    loads_failed: list[LoadFailure] = []
    stores_finished: list[int] = []  # job ids
    stores_failed: list[tuple[int, str]] = []  # (job, error)
    released_device_blocks: list[int] = []  # holds that ended
    rejected_store_blocks: int = 0  # blocks a store could not take (tier full of pinned / in-flight)
    all_blocks_cleared: bool = False  # a reset cleared the tier (vLLM's AllBlocksCleared)

    def __bool__(self) -> bool:
        """Whether there is anything to tell (a step report's own fields aside)."""
        return any(getattr(self, name) for name in Notices.__struct_fields__)


NO_NOTICES = Notices()
"""Nothing to tell: what a fresh ``Notices()`` holds (never handed out nor changed)."""

NOTICE_FIELDS: tuple[str, ...] = Notices.__struct_fields__
"""The notices' names, in order: a ``StepReport`` carries each one under the same name."""


class StepReport(Notices, kw_only=True):
    """What one step did and what the engine must act on: the notices taken at its end, and
    the jobs it handed to the executor."""

    now_ms: float
    submitted: list[TransferJob] = []
    timed_out: int = 0  # jobs past their deadline (their failures are in the notices)
    refused_results: int = 0  # executor results the decisions refused (logged, never raised: F2)


def merge_reports(into: StepReport, more: Notices) -> None:
    """Add ``more`` (a later step's report, or notices taken after a step) to ``into``: lists
    are joined, counts added, flags or-ed."""
    for name in NOTICE_FIELDS:
        mine, theirs = getattr(into, name), getattr(more, name)
        if isinstance(mine, list):
            mine.extend(theirs)
        elif isinstance(mine, bool):
            setattr(into, name, mine or theirs)
        else:
            setattr(into, name, mine + theirs)
    if isinstance(more, StepReport):
        into.submitted.extend(more.submitted)
        into.timed_out += more.timed_out
        into.refused_results += more.refused_results


NOTICE_TYPES = frozenset({JobCompleted, JobFailed, JobTimedOut, FenceLifted, StoreRejected, Reset})


class NoticeBook:
    """Where the notices accumulate as the events are applied (``observe`` is subscribed
    once), until they are taken."""

    __slots__ = ("notices",)

    def __init__(self) -> None:
        self.notices = Notices()

    def take(self) -> Notices:
        """The notices so far; the book starts anew."""
        notices, self.notices = self.notices, Notices()
        return notices

    def observe(self, event: Event) -> None:
        notices = self.notices
        if isinstance(event, JobCompleted):
            notices.released_device_blocks.extend(event.device_blocks)
            if event.abandoned:
                return  # a reset already told the engine; only the holds end now
            if event.direction == LOAD:
                if event.request_id is not None:
                    notices.loads_finished.append((event.request_id, event.job_id))
            elif event.direction == STORE:
                notices.stores_finished.append(event.job_id)
        elif isinstance(event, (JobFailed, JobTimedOut)):
            if not event.fenced:  # (a fenced job's device blocks come back at its FenceLifted)
                notices.released_device_blocks.extend(event.device_blocks)
            if event.abandoned:
                return  # a reset already told the engine; only the holds end now
            if isinstance(event, JobFailed):
                error = event.error
            else:
                error = f"timed out at {event.now_ms} ms (deadline {event.deadline_ms} ms)"
            if event.direction == LOAD and event.request_id is not None:
                notices.loads_failed.append(
                    LoadFailure(event.request_id, event.job_id, event.device_blocks, error, event.fenced)
                )
            elif event.direction == STORE:
                notices.stores_failed.append((event.job_id, error))
        elif isinstance(event, FenceLifted):
            notices.released_device_blocks.extend(event.device_blocks)
        elif isinstance(event, StoreRejected):
            notices.rejected_store_blocks += len(event.hashes)
        elif isinstance(event, Reset):
            notices.all_blocks_cleared = True
