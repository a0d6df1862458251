"""The writers of the state: each entry move of ``BLOCK_TRANSITIONS`` (one writer for each
(from, to) pair), pins, and the requests ``evolve`` creates. Used by ``kvflow.core.state.apply``
and ``kvflow.core.state.job_events`` once an event is known legal. Pure."""

from __future__ import annotations

from collections.abc import Callable

from kvflow.core.state.digest import INSERT, REFRESH, REMOVE, TOUCH, pair_sum
from kvflow.core.state.model import Job, Request, State
from kvflow.core.state.tables import (
    ABSENT,
    BLOCK_TRANSITIONS,
    RESIDENT,
    STORE_QUEUED,
    STORING,
    BlockState,
)

# --- entry moves: the one writer for each (from, to) pair of BLOCK_TRANSITIONS ----------
# The entries are stored column-wise (slot_of, pending, pin_count; the policy orders the
# RESIDENT ones), so a move is a few dict operations per hash. Each keeps its part of the
# digest as it goes (State.tally: kvflow.core.state.digest).


def _admit(state: State, hashes: tuple[int, ...], job: Job) -> None:
    """ABSENT -> STORE_QUEUED: the store job's slots are taken (``State.next_slots``: the
    top of the free stack), its hashes pending on it."""
    state.free_slots.take(len(job.slots))
    state.slot_of.update(zip(hashes, job.slots))
    state.tally.entries += pair_sum(hashes, job.slots)
    pending = state._pending
    if pending is not None:
        if len(state.jobs) == 1:  # the only live job: no index is kept (see State.pending)
            state._pending = None
        else:
            job_id = job.job_id
            for h in hashes:
                pending[h] = job_id


def _publish(state: State, hashes: tuple[int, ...], job: Job) -> None:
    """STORING -> RESIDENT: visible from now on, the most recent in the policy.

    F14: a touch that named these entries while they were being stored is applied now, so
    a chain's order is the engine's touch whatever order its stores land in."""
    state.policy.insert_many(hashes)  # (first: a policy that raises leaves the entries as they were)
    state.tally.ordered(INSERT, hashes)
    _unpend(state._pending, hashes)
    if state.deferred_touches:
        deferred = state.deferred_touches.pop(job.job_id, None)
        if deferred is not None:
            touched, reuse = deferred
            slot_of, pending = state.slot_of, state.pending
            touch(state, tuple(h for h in touched if h in slot_of and h not in pending), reuse)


def touch(state: State, hashes: tuple[int, ...], reuse: bool) -> None:
    """The policy orders resident ``hashes`` as used again (``reuse``) or only reordered."""
    if reuse:
        state.policy.touch_many(hashes)
    else:
        state.policy.refresh_many(hashes)
    state.tally.ordered(TOUCH if reuse else REFRESH, hashes)


def _unpend(pending: dict[int, int] | None, hashes: tuple[int, ...]) -> None:
    """The job's hashes (distinct, each pending on it) are pending no more."""
    if pending is None:
        return  # not kept (see State.pending)
    for h in hashes:
        del pending[h]


def _free(state: State, hashes: tuple[int, ...]) -> None:
    """The entries leave their slots; a slot a fenced copy may still use stays out of the
    free list until that fence is lifted (F15)."""
    state.departures += 1
    gone = hashes[::-1]
    slots = list(map(state.slot_of.pop, gone))
    state.tally.entries -= pair_sum(gone, slots)
    fenced_slots = state.fenced_slots
    if fenced_slots:
        state.free_slots.give_back([s for s in slots if s not in fenced_slots])
    else:
        state.free_slots.give_back(slots)


def _drop_pending(state: State, hashes: tuple[int, ...], job: Job) -> None:
    """STORE_QUEUED / STORING -> ABSENT: never visible; the slots are free again (or fenced,
    when the job's copy may still be writing them)."""
    if state.deferred_touches:
        state.deferred_touches.pop(job.job_id, None)
    _unpend(state._pending, hashes)
    _free(state, hashes)


def _evict(state: State, hashes: tuple[int, ...], job: Job | None) -> None:
    """RESIDENT -> ABSENT: the slots are free again; the policy forgets (or ghosts) them."""
    state.policy.remove_many(hashes)  # (first: a policy that raises leaves the entries as they were)
    state.tally.ordered(REMOVE, hashes)
    _free(state, hashes)
    if state.bad:
        for h in hashes:
            state.bad.pop(h, None)


_ENTRY_MOVES: dict[tuple[BlockState, BlockState], Callable[..., None] | None] = {
    (ABSENT, STORE_QUEUED): _admit,
    (STORE_QUEUED, STORING): None,  # nothing to write: the store job's own state tells them apart
    (STORING, RESIDENT): _publish,
    (STORE_QUEUED, ABSENT): _drop_pending,
    (STORING, ABSENT): _drop_pending,
    (RESIDENT, ABSENT): _evict,
}


# BLOCK_TRANSITIONS with each next state replaced by the writer of that move (None for a
# self-loop or a move with nothing to write): built from the table, so the table decides
WRITERS: dict[BlockState, dict[str, Callable[..., None] | None]] = {
    current: {tag: None if nxt is current else _ENTRY_MOVES[current, nxt] for tag, nxt in row.items()}
    for current, row in BLOCK_TRANSITIONS.items()
}


def entry_move(current: BlockState, tag: str) -> Callable[..., None] | None:
    """The writer that moves entries in ``current`` to where the table says ``tag`` takes
    them, called ``write(state, hashes, job)``; None where they stay as they are (the event's
    own effect does the rest). Each evolver reads the writers it needs once, at import: its
    ``current`` and ``tag`` never vary."""
    return WRITERS[current][tag]


# --- pins and requests --------------------------------------------------------------------


def ensure_request(state: State, request_id: str | None) -> Request | None:
    if request_id is None:
        return None
    req = state.requests.get(request_id)
    if req is None:
        req = state.requests[request_id] = Request(request_id)
    return req


def note_chain_whole(state: State, req: Request, stored: tuple[int, ...]) -> None:
    """The request's store of ``stored`` was queued: if they are its chain's tail and the
    rest of its chain is on the tier, the whole chain is (see Request.chain_whole_at)."""
    start, order, slot_of = req.chain_tail_start(stored), req.chain_order, state.slot_of
    if start == 0 or (start > 0 and order is not None and all(map(slot_of.__contains__, order[:start]))):
        req.chain_whole_at = state.departures


def pin(state: State, hashes: tuple[int, ...]) -> None:
    """One more pin on each of ``hashes`` (a hash named twice is pinned twice). Hashes named
    once and pinned by no one yet (a lookup's hits, nearly always) take their pin in one
    update (docs/performance.md)."""
    pins = state.pin_count
    ones = dict.fromkeys(hashes, 1)
    if len(ones) == len(hashes) and pins.keys().isdisjoint(ones):
        pins.update(ones)
        return
    for h in hashes:
        pins[h] = pins.get(h, 0) + 1


def unpin(state: State, hashes: tuple[int, ...]) -> None:
    """One pin less on each of ``hashes``; an entry without pins leaves ``pin_count``. When
    these hashes hold every pin, once each (the one load in flight), the table empties at once
    (docs/performance.md)."""
    pins = state.pin_count
    if len(pins) == len(hashes) and max(pins.values(), default=0) == 1:
        pins.clear()  # (the caller's pins are among them: they are all there are)
        return
    for h in hashes:
        left = pins[h] - 1
        if left:
            pins[h] = left
        else:
            del pins[h]
