"""``evolve(state, event)``: apply one event. Every next state is read from the tables.

An event names a job, some entries, or both. ``evolve`` first checks the whole event
(kvflow.core.state.legality), then reads each next state from ``JOB_TRANSITIONS`` /
``BLOCK_TRANSITIONS`` and applies it: a job's state is the table's value; an entry's move
from one state to another is done by the one writer for that pair (``kvflow.core.state.moves``). So the
diagram ``kvflow diagram`` prints, the table tests and this code cannot disagree. An illegal
event raises :class:`~kvflow.core.errors.IllegalTransition` and leaves the state as it was.

The state is mutated in place (an event changes a few entries of a tier that may hold
millions: a copy per event would cost the whole tier each time); ``State.copy()`` gives an
independent snapshot. Pure: no I/O, no clock, no randomness, no logging.

The job events are applied in ``kvflow.core.state.job_events``; the entry, pin and request events
here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvflow.core.errors import IllegalTransition
from kvflow.core.events import (
    BlocksCorrupt,
    BlocksEvicted,
    BlocksTouched,
    ChainExtended,
    Event,
    PinsAcquired,
    PinsReleased,
    RequestClosed,
    RequestFinished,
    RequestOpened,
    RequestResumed,
    Reset,
    StoreRejected,
    event_name,
)
from kvflow.core.state import legality as lg
from kvflow.core.state.digest import CLEAR
from kvflow.core.state.job_events import JOB_EVOLVERS
from kvflow.core.state.model import Request, State
from kvflow.core.state.moves import ensure_request, entry_move, pin, touch, unpin
from kvflow.core.state.tables import (
    ABSENT,
    BLOCK_TRANSITIONS,
    FENCED,
    RESIDENT,
    STORING,
)

# --- one function per entry, pin and request event -------------------------------------------

# What each event does to the entries it names, read from BLOCK_TRANSITIONS once (see
# moves.entry_move; None: they stay RESIDENT, the event's own effect does the rest)
_EVICT = entry_move(RESIDENT, "blocks_evicted")
_TOUCH = entry_move(RESIDENT, "blocks_touched")
_MARK_CORRUPT = entry_move(RESIDENT, "blocks_corrupt")
_PIN = entry_move(RESIDENT, "pins_acquired")
_UNPIN = entry_move(RESIDENT, "pins_released")


def _evicted(state: State, event: BlocksEvicted, check: bool) -> None:
    if check:
        if len(event.hashes) != len(event.slots):
            raise lg.illegal(state, event, "RESIDENT", "hashes and slots differ in length")
        lg.check_resident(state, event, "blocks_evicted", event.hashes)
        if not state.pin_count.keys().isdisjoint(event.hashes):
            raise lg.illegal(state, event, "RESIDENT", "a pinned block cannot be evicted")
        if state.slots_of(event.hashes) != event.slots:
            raise lg.illegal(state, event, "RESIDENT", "the evicted slots are not where the blocks live")
        if len(set(event.hashes)) != len(event.hashes):
            raise lg.illegal(state, event, "RESIDENT", "a block is evicted twice in one event")
    if _EVICT is not None:
        _EVICT(state, event.hashes, None)


def _touched(state: State, event: BlocksTouched, check: bool) -> None:
    hashes, pending = event.hashes, state.pending
    if pending and not pending.keys().isdisjoint(hashes):
        # F14: entries still being stored keep the touch on their job until they land
        if check:
            for h in hashes:
                lg.check_block(state, event, "blocks_touched", h)
        jobs = dict.fromkeys(pending[h] for h in hashes if h in pending)
        for job_id in jobs:
            state.deferred_touches[job_id] = (hashes, event.reuse)
        hashes = tuple(h for h in hashes if h not in pending)
    elif check:
        lg.check_resident(state, event, "blocks_touched", hashes)
    if _TOUCH is not None:
        _TOUCH(state, hashes, None)
    touch(state, hashes, event.reuse)


def _corrupt(state: State, event: BlocksCorrupt, check: bool) -> None:
    if not event.hashes:
        raise lg.illegal(state, event, "RESIDENT", "names no block")
    lg.check_resident(state, event, "blocks_corrupt", event.hashes)
    if _MARK_CORRUPT is not None:
        _MARK_CORRUPT(state, event.hashes, None)
    for h in event.hashes:
        state.bad[h] = None


def _rejected(state: State, event: StoreRejected, check: bool) -> None:
    if not event.hashes:
        raise lg.illegal(state, event, "RESIDENT", "a rejection names at least one block")
    ensure_request(state, event.request_id)


def _pins_acquired(state: State, event: PinsAcquired, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if check:
        if req is not None and (req.finished or req.offered):
            raise lg.illegal(state, event, "PINS", f"request {event.request_id} has offered pins or is finished")
        if event.hashes:
            lg.check_resident(state, event, "pins_acquired", event.hashes)
    if req is None:
        req = state.requests[event.request_id] = Request(event.request_id)
    if event.hashes:  # (a lookup that missed pins nothing: most of them)
        if _PIN is not None:
            _PIN(state, event.hashes, None)
        pin(state, event.hashes)
    req.offered = event.hashes


def _pins_released(state: State, event: PinsReleased, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if req is None:
        raise lg.illegal(state, event, "NO_REQUEST", f"request {event.request_id}")
    n = len(event.hashes)
    offered = req.offered
    # Only pins offered by a lookup and not taken by a load job can be released directly;
    # a load job's pins are released by its terminal event.
    if offered[len(offered) - n :] != event.hashes or n == 0:
        raise lg.illegal(state, event, "PINS", f"request {event.request_id} does not hold these offered pins")
    if _UNPIN is not None:
        _UNPIN(state, event.hashes, None)
    req.offered = offered[: len(offered) - n]
    unpin(state, event.hashes)


def _finished(state: State, event: RequestFinished, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if req is None or req.finished:
        raise lg.illegal(state, event, "NO_REQUEST" if req is None else "FINISHED", f"request {event.request_id}")
    if req.offered:
        raise lg.illegal(state, event, "PINS", "release offered pins before finishing")
    req.finished = True
    req.preempted = event.preempted


def _chain_extended(state: State, event: ChainExtended, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if req is None:
        req = state.requests[event.request_id] = Request(event.request_id)
    elif req.finished:
        raise lg.illegal(state, event, "FINISHED", f"request {event.request_id}")
    order = req.chain_order
    if order is not None and not order:  # (its first hashes, usually its lookup's)
        if check and not event.hashes:
            raise lg.illegal(state, event, "CHAIN", f"request {event.request_id}: names no hash new to its chain")
        req.start_chain(event.hashes)
        return
    if check and all(map(req.chain.__contains__, event.hashes)):  # (stops at the first new hash)
        raise lg.illegal(state, event, "CHAIN", f"request {event.request_id}: names no hash new to its chain")
    req.extend_chain(event.hashes)


def _opened(state: State, event: RequestOpened, check: bool) -> None:
    if event.request_id in state.requests:
        raise lg.illegal(state, event, "LIVE", f"request {event.request_id} is known already")
    ensure_request(state, event.request_id)


def _resumed(state: State, event: RequestResumed, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if req is None or not req.finished or not req.preempted:
        raise lg.illegal(state, event, "LIVE", f"request {event.request_id} is not a preempted one")
    req.finished = req.preempted = False


def _closed(state: State, event: RequestClosed, check: bool) -> None:
    req = state.requests.get(event.request_id)
    if req is None or not req.finished or req.jobs or req.holds_pins():
        raise lg.illegal(state, event, "LIVE", f"request {event.request_id} cannot close yet")
    del state.requests[event.request_id]


def _reset(state: State, event: Reset, check: bool) -> None:
    abandoned = event.abandoned_job_ids
    if state.queued:
        raise lg.illegal(state, event, "QUEUED", "queued jobs must be cancelled before a reset")
    if list(abandoned) != [jid for jid, j in state.jobs.items() if j.state is not FENCED]:
        raise lg.illegal(state, event, "IN_FLIGHT", "the reset must abandon exactly the in-flight jobs")
    # every entry goes where the table sends it under "reset" (the bulk writer below is the
    # one for ABSENT; a table that said otherwise is refused before anything changes)
    present = ([RESIDENT] if len(state.pending) < len(state.slot_of) else []) + ([STORING] if state.pending else [])
    for current in present:
        if BLOCK_TRANSITIONS[current].get("reset") is not ABSENT:
            raise lg.illegal(state, event, current.name, "reset must take every entry off the tier")
    jobs = state.jobs
    nxt = {jid: lg.job_next(state, event, "reset", jobs[jid]) for jid in abandoned}
    # apply: in-flight jobs keep their slots and device blocks fenced until they report
    fenced_slots = state.fenced_slots
    for jid, job_state in nxt.items():
        job = jobs[jid]
        if job.state is not job_state:  # a second reset finds them already abandoned
            job.state = job_state
            for s in dict.fromkeys(job.slots):
                fenced_slots[s] = fenced_slots.get(s, ()) + (jid,)
    state.free_slots.give_back(s for s in state.slot_of.values() if s not in fenced_slots)
    state.slot_of.clear()
    state.tally.entries = 0
    state.departures += 1
    state._pending = None  # (every store's entries left: built empty when next read)
    state.pin_count.clear()
    state.deferred_touches.clear()
    state.bad.clear()
    if event.keeps_requests:  # F18: live requests stay known, with nothing on the tier
        for rid, req in list(state.requests.items()):
            if req.finished:
                del state.requests[rid]
            else:
                req.offered, req.loading, req.jobs = (), {}, {}
    else:
        state.requests.clear()
    state.policy.clear()
    state.tally.ordered(CLEAR, ())


Evolver = Callable[[State, Any, bool], None]
"""How one event type is applied: ``evolver(state, event, check)``; ``check`` runs the
event's legality checks first (see ``evolve``)."""

EVOLVERS: dict[type, Evolver] = {
    **JOB_EVOLVERS,
    BlocksEvicted: _evicted,
    BlocksTouched: _touched,
    BlocksCorrupt: _corrupt,
    StoreRejected: _rejected,
    PinsAcquired: _pins_acquired,
    PinsReleased: _pins_released,
    RequestFinished: _finished,
    RequestOpened: _opened,
    RequestResumed: _resumed,
    RequestClosed: _closed,
    ChainExtended: _chain_extended,
    Reset: _reset,
}


def evolve(state: State, event: Event, check: bool = True) -> State:
    """Apply one event (in place) and return the state; illegal → IllegalTransition, no change.

    Every event is applied here, whoever applies it: a fold, a replay, the live engine.
    ``check=False`` skips the per-block legality checks, for the events a decider has just
    built from this very state (the live path: the decider validated its command first, and
    the Hypothesis machines fold every log they make with the checks on, so a decider that
    emitted an illegal event is found there); a recorded log is always applied checked.
    """
    if event.seq != state.next_seq:
        raise IllegalTransition(f"SEQ {state.next_seq}", f"{event_name(event)}#{event.seq}", "events must be gapless")
    EVOLVERS[type(event)](state, event, check)
    state.next_seq += 1
    return state


def fold(state: State, events: Iterable[Event]) -> State:
    """Replay: ``evolve`` every event in order, with every check."""
    for event in events:
        evolve(state, event)
    return state


Observers = Mapping[type, Sequence[Callable[[Any], Any]]]


def live_applier(
    state: State, observers: Observers, applied: list[Event] | None, check: bool = False
) -> Callable[[Event], None]:
    """The live path's ``emit`` (see kvflow.core.decide.dispatch): ``evolve`` one event a
    decider has just decided from this very state (``check``: with the legality checks, a
    paranoid manager's), append it to ``applied`` (None: keep none), then hand it to the
    callables ``observers`` names for its type, in order."""

    def emit(event: Event) -> None:
        evolve(state, event, check)
        if applied is not None:
            applied.append(event)
        for callback in observers.get(type(event), ()):
            callback(event)

    return emit
