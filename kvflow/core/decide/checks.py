"""The checks every decider shares: a call is refused (F12) before its first event."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvflow.core.errors import BlockHeld, Rejected
from kvflow.core.events import Event
from kvflow.core.jobs import STORE
from kvflow.core.state.model import Request, State

# how a decider hands over each event it decides: applied (and recorded, observed) at once,
# so the decider's next line reads the state that event produced (see kvflow.core.decide.dispatch)
Emit = Callable[[Event], None]


def check_not_finished(req: Request | None, request_id: str | None, what: str) -> None:
    """A finished request takes no new work; a preempted one whose earlier jobs are still
    live comes back under its id (F18: ``RequestResumed``)."""
    if req is not None and req.finished and not req.preempted:
        raise Rejected(f"{what} {request_id}: the request is finished")


def check_device_blocks(
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
        lowest = min(device_blocks)
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
