"""What the engine is told of outcomes that arrive later: notices (loads finished or failed,
stores finished or failed, device blocks released, a reset), kept until taken (F4), and the
fences it can ask about (F15). Built from the applied events alone."""

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
from kvflow.core.jobs import LOAD, STORE

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

    # A msgspec Struct, not a dataclass: a new one is built each time notices are taken, and
    # this builds in a fraction of the time. Each gets its own empty lists (msgspec copies ``[]``).
    loads_finished: list[tuple[str, int]] = []  # (request, job)
    loads_failed: list[LoadFailure] = []
    stores_finished: list[int] = []  # job ids
    stores_failed: list[tuple[int, str]] = []  # (job, error)
    released_device_blocks: list[int] = []  # holds that ended
    rejected_store_blocks: int = 0
    all_blocks_cleared: bool = False

    def __bool__(self) -> bool:
        return self != NO_NOTICES  # (msgspec compares every field, at C level)


NOTICE_FIELDS: tuple[str, ...] = Notices.__struct_fields__
"""The notices' names, in order: a ``StepReport`` carries each one under the same name."""

# nothing to tell: what ``Notices()`` holds; never handed out nor changed. ``manager.has_notices``
# compares with it directly, without a call of ``__bool__``.
NO_NOTICES = Notices()

NOTICE_TYPES = frozenset({JobCompleted, JobFailed, JobTimedOut, FenceLifted, StoreRejected, Reset})


class NoticeBook:
    """Where the notices accumulate as the events are applied: ``observe`` is subscribed once
    (a bound method that stays valid). ``notices`` is None until something is observed (a
    step tells "nothing happened" by that, without comparing), and whoever takes the notices
    puts None back."""

    __slots__ = ("notices",)

    def __init__(self) -> None:
        self.notices: Notices | None = None

    def current(self) -> Notices:
        """The notices being accumulated (started now if none are)."""
        notices = self.notices
        if notices is None:
            notices = self.notices = Notices()
        return notices

    def observe(self, event: Event) -> None:
        notices = self.notices
        if notices is None:
            notices = self.notices = Notices()
        kind = type(event)
        if kind is JobCompleted:  # (the common notice, first)
            notices.released_device_blocks.extend(event.device_blocks)  # type: ignore[union-attr]
            if event.abandoned:  # type: ignore[union-attr]
                return  # a reset already told the engine; only the holds end now
            if event.direction == LOAD:  # type: ignore[union-attr]
                if event.request_id is not None:  # type: ignore[union-attr]
                    notices.loads_finished.append((event.request_id, event.job_id))  # type: ignore[union-attr]
            elif event.direction == STORE:  # type: ignore[union-attr]
                notices.stores_finished.append(event.job_id)  # type: ignore[union-attr]
        elif kind is JobFailed or kind is JobTimedOut:
            fenced = event.fenced  # type: ignore[union-attr]
            if not fenced:  # (a fenced job's device blocks come back at its FenceLifted)
                notices.released_device_blocks.extend(event.device_blocks)  # type: ignore[union-attr]
            if event.abandoned:  # type: ignore[union-attr]
                return  # a reset already told the engine; only the holds end now
            if kind is JobFailed:
                error = event.error  # type: ignore[union-attr]
            else:
                error = f"timed out at {event.now_ms} ms (deadline {event.deadline_ms} ms)"  # type: ignore[union-attr]
            if event.direction == LOAD and event.request_id is not None:  # type: ignore[union-attr]
                notices.loads_failed.append(
                    LoadFailure(event.request_id, event.job_id, event.device_blocks, error, fenced)  # type: ignore[union-attr,arg-type]
                )
            elif event.direction == STORE:  # type: ignore[union-attr]
                notices.stores_failed.append((event.job_id, error))  # type: ignore[union-attr]
        elif kind is FenceLifted:
            notices.released_device_blocks.extend(event.device_blocks)  # type: ignore[union-attr]
        elif kind is StoreRejected:
            notices.rejected_store_blocks += len(event.hashes)  # type: ignore[union-attr]
        elif kind is Reset:
            notices.all_blocks_cleared = True
