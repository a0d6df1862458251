"""Decisions of stores and eviction: admission of a store's blocks (F3, F16), touches (F14),
explicit eviction, and the eviction of blocks found bad (F17). Pure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain, filterfalse
from typing import Any

from kvflow.core.commands import BlocksComputed, DeviceBlocksEvicting, Evict, Invalidate, Touch
from kvflow.core.decide.checks import Emit, check_device_blocks, check_not_finished
from kvflow.core.decide.victims import checked_victims
from kvflow.core.errors import Rejected
from kvflow.core.events import (
    BlocksCorrupt,
    BlocksEvicted,
    BlocksTouched,
    ChainExtended,
    EvictReason,
    RequestOpened,
    RequestResumed,
    StoreQueued,
    StoreRejected,
)
from kvflow.core.jobs import COPYING_DOWN, LOAD
from kvflow.core.state.model import Request, State
from kvflow.core.values import is_int


def _fenced_slot_owners(state: State) -> list[int]:
    """Resident entries whose slot a fenced load (or a copy to a lower tier) may still read (F15):
    evicting one would free no slot until the fence is lifted, so eviction for space passes
    them over."""
    if not state.fenced_slots:
        return []
    slot_of = state.slot_of
    return [
        h
        for job in state.jobs.values()
        if job.fenced and (job.direction == LOAD or job.direction in COPYING_DOWN)
        for h, s in zip(job.hashes, job.slots)
        if slot_of.get(h) == s
    ]


def _kept_from_eviction(state: State, protected: Sequence[int] = ()) -> dict[int, Any]:
    """The resident entries eviction passes over: the pinned ones, ``protected`` (F16: a
    store's own chain) and those whose slot a fence keeps (F15)."""
    if state.fenced_slots or not state.slot_of.keys().isdisjoint(protected):
        return dict.fromkeys(chain(state.pin_count, protected, _fenced_slot_owners(state)))
    # the policy orders exactly the RESIDENT entries: only pins block them
    return state.pin_count


def _victims_up_to(state: State, wanted: int, protected: Sequence[int] = ()) -> list[int]:
    """As many victims as the policy can give, up to ``wanted``, in eviction order, never a
    pinned block nor one of ``protected`` (F16: a store's own chain)."""
    if wanted <= 0:
        return []
    kept = _kept_from_eviction(state, protected)
    victims = checked_victims(state, wanted, kept)
    if victims is not None:
        return victims
    evictable = sum(1 for h in state.policy.resident() if h not in kept)
    if evictable <= 0:
        return []
    return checked_victims(state, evictable, kept) or []


def extend_chain(
    state: State,
    request_id: str,
    req: Request | None,
    hashes: Sequence[int],
    distinct: AbstractSet[int] | None = None,
) -> ChainExtended | None:
    """With ``chain_recency``: the request's chain grows by those of ``hashes`` new to it,
    or None when it has them all already (a store of blocks its lookup named).
    ``distinct``: the set of ``hashes``, when the caller has built it."""
    if not state.config.chain_recency or not hashes:
        return None
    if req is not None:
        if req.chain_tail_start(hashes) >= 0:  # (its chain's last blocks, or all of them: a lookup repeated)
            return None
        chain = req.chain
        if chain and chain.keys() >= (distinct if distinct is not None else set(hashes)):
            return None
    return ChainExtended(seq=state.next_seq, request_id=request_id, hashes=tuple(hashes))


def chain_touch(state: State, req: Request) -> BlocksTouched | None:
    """The simulation's rule 4 (docs/simulate.md), at a request's finish: its chain's blocks on the tier, deepest
    first, touched for order only (``reuse=False``), so that eviction takes a chain's tail
    before its head (F14); blocks still being stored keep the touch until they land."""
    if not state.config.chain_recency:
        return None
    slot_of, order = state.slot_of, req.chain_order
    if order is not None:  # (the chain kept as one tuple)
        if not order:
            return None
        if req.chain_whole_at == state.departures:
            # its store put the chain's tail on the tier, and nothing has left the tier since
            touched = order[::-1]
        else:
            touched = tuple(filter(slot_of.__contains__, reversed(order)))
    else:
        touched = tuple(filter(slot_of.__contains__, reversed(req.chain)))
    if not touched:
        return None
    return BlocksTouched(seq=state.next_seq, hashes=touched, reuse=False)


def on_tier(state: State, hashes: tuple[int, ...]) -> tuple[int, ...]:
    """Those of ``hashes`` that are on the tier (resident, or being stored), in order."""
    return tuple(filter(state.slot_of.__contains__, hashes))


# hashes admitted, their device blocks, victims, and the blocks rejected (hashes, device blocks)
Admission = tuple[Sequence[int], Sequence[int], list[int], Sequence[int], Sequence[int]]


def _admission(
    state: State,
    block_hashes: Sequence[int],
    device_blocks: Sequence[int],
    unique: bool = False,
) -> Admission:
    """The simulation's rule 3 (docs/simulate.md): every block of the store not on the tier (resident, queued or in
    flight; F3), each hash once, in prefix order, takes a free slot, else evicts the policy's
    next victim, never a block of this store's own chain (F16); when nothing else can be
    evicted, it and every later block are rejected. ``unique``: the caller knows that
    ``block_hashes`` name each hash once."""
    # the blocks eviction must spare (F16): those of the store already on the tier
    protected: Sequence[int] = ()
    new_hashes: Sequence[int]
    new_blocks: Sequence[int]
    slot_of = state.slot_of
    if slot_of.keys().isdisjoint(block_hashes):  # none of them is on the tier: all are new
        new_hashes, new_blocks = block_hashes, device_blocks
    else:
        protected = block_hashes
        new = [(h, d) for h, d in zip(block_hashes, device_blocks) if h not in slot_of]
        new_hashes, new_blocks = [h for h, _ in new], [d for _, d in new]
    if not unique and len(set(new_hashes)) != len(new_hashes):  # a hash named twice is stored once
        firsts: dict[int, int] = {}
        for h, d in zip(new_hashes, new_blocks):
            firsts.setdefault(h, d)
        new_hashes, new_blocks = list(firsts), list(firsts.values())
    need = len(new_hashes) - len(state.free_slots)
    victims = _victims_up_to(state, need, protected) if need > 0 else []
    admitted = len(new_hashes) - max(0, need - len(victims))
    return new_hashes[:admitted], new_blocks[:admitted], victims, new_hashes[admitted:], new_blocks[admitted:]


def _decide_store(
    state: State,
    request_id: str | None,
    block_hashes: Sequence[int],
    device_blocks: Sequence[int],
    emit: Emit,
) -> int | None:
    if len(block_hashes) != len(device_blocks):
        raise Rejected(
            f"store: {len(block_hashes)} hashes but {len(device_blocks)} device blocks"
        )
    req = state.requests.get(request_id) if request_id is not None else None
    if req is not None:
        check_not_finished(req, request_id, "store: request")
    held = state.held
    same = dict(zip(device_blocks, block_hashes)) if held and not held.keys().isdisjoint(device_blocks) else {}
    check_device_blocks(state, device_blocks, same)
    if not state.config.enabled:
        return None
    distinct: set[int] | None = None
    if req is not None and req.chain_tail_start(block_hashes) >= 0:
        unique = True  # (and the chain has them all: nothing to extend)
    else:
        # the store's hashes as a set, built once: its chain (F14) and its duplicates (F3)
        # are both asked of it
        distinct = set(block_hashes)
        unique = len(distinct) == len(block_hashes)
    # decided before the first emit, so that a wrong answer of the policy's changes nothing
    # (the request's resumption and chain, emitted next, change nothing admission reads)
    admit_hashes, admit_blocks, victims, rejected_hashes, rejected_blocks = _admission(
        state, block_hashes, device_blocks, unique
    )
    if req is not None and req.finished:
        emit(RequestResumed(seq=state.next_seq, request_id=req.request_id))  # F18
    if distinct is not None and request_id is not None:
        extension = extend_chain(state, request_id, req, block_hashes, distinct)
        if extension is not None:
            emit(extension)
            req = state.requests[request_id]  # (known from now on)
    if victims:
        emit(eviction(state, victims, "capacity"))
    job_id = None
    admitted = len(admit_hashes)
    if admitted:
        job_id = state.next_job_id
        emit(
            StoreQueued(
                seq=state.next_seq,
                job_id=job_id,
                request_id=request_id,
                hashes=tuple(admit_hashes),  # (a tuple already: returned as it is)
                device_blocks=tuple(admit_blocks),
                slots=state.next_slots(admitted),
            )
        )
    elif request_id is not None and req is None and not rejected_hashes:
        emit(RequestOpened(seq=state.next_seq, request_id=request_id))  # F18: known from now on
    if rejected_hashes:
        emit(
            StoreRejected(
                seq=state.next_seq,
                request_id=request_id,
                hashes=tuple(rejected_hashes),
                device_blocks=tuple(rejected_blocks),
                reason=f"tier full: {state.capacity} slots held by pinned, in-flight or own-chain entries",
            )
        )
    return job_id


def decide_blocks_computed(state: State, cmd: BlocksComputed, emit: Emit) -> int | None:
    if state.config.store_mode != "eager":
        _computed_lazy(state, cmd, emit)
        return None
    return _decide_store(state, cmd.request_id, cmd.block_hashes, cmd.device_blocks, emit)


def _computed_lazy(state: State, cmd: BlocksComputed, emit: Emit) -> None:
    """Lazy mode: nothing is stored now, but the request is known (and back, if preempted)
    (F18)."""
    req = state.requests.get(cmd.request_id) if cmd.request_id is not None else None
    check_not_finished(req, cmd.request_id, "blocks_computed: request")
    check_device_blocks(state, cmd.device_blocks, dict(zip(cmd.device_blocks, cmd.block_hashes)))
    if cmd.request_id is not None and state.config.enabled:
        if req is not None and req.finished:
            emit(RequestResumed(seq=state.next_seq, request_id=cmd.request_id))
        extension = extend_chain(state, cmd.request_id, req, cmd.block_hashes)
        if extension is not None:
            emit(extension)
        elif req is None:
            emit(RequestOpened(seq=state.next_seq, request_id=cmd.request_id))
    return None


def decide_device_evicting(state: State, cmd: DeviceBlocksEvicting, emit: Emit) -> int | None:
    if state.config.store_mode != "lazy":
        return None
    return _decide_store(state, None, cmd.block_hashes, cmd.device_blocks, emit)


def decide_touch(state: State, cmd: Touch, emit: Emit) -> int:
    """Recency for the blocks on the tier, in the given order. A block still being stored
    keeps the touch until it lands (F14: a touch is never lost to completion order)."""
    slot_of, pending, hashes = state.slot_of, state.pending, cmd.block_hashes
    if cmd.keep_pending or not pending or pending.keys().isdisjoint(hashes):
        touched = on_tier(state, hashes)
    else:  # (a version-1 trace's touch: blocks still being stored were skipped)
        touched = tuple(filterfalse(pending.__contains__, filter(slot_of.__contains__, hashes)))
    if touched:
        emit(BlocksTouched(seq=state.next_seq, hashes=touched, reuse=cmd.reuse))
    return len(touched)


def decide_evict(state: State, cmd: Evict, emit: Emit) -> int:
    if not is_int(cmd.num_blocks) or cmd.num_blocks < 0:
        raise Rejected(f"evict: num_blocks must be >= 0, got {cmd.num_blocks!r}")
    if cmd.num_blocks == 0:
        return 0
    # (an entry whose slot stays fenced would free nothing)
    victims = checked_victims(state, cmd.num_blocks, _kept_from_eviction(state))
    if victims is None:
        raise Rejected(f"evict: fewer than {cmd.num_blocks} unpinned resident blocks (all-or-nothing)")
    emit(eviction(state, victims, "explicit"))
    return len(victims)


def _evict_resident(state: State, hashes: Sequence[int], reason: EvictReason) -> BlocksEvicted | None:
    """The eviction of those of ``hashes`` that are RESIDENT and unpinned (each once), or None."""
    slot_of, pending, pinned = state.slot_of, state.pending, state.pin_count
    chosen = [h for h in dict.fromkeys(hashes) if h in slot_of and h not in pending and h not in pinned]
    if not chosen:
        return None
    return eviction(state, chosen, reason)


def eviction(state: State, victims: Sequence[int], reason: EvictReason) -> BlocksEvicted:
    """The eviction of ``victims`` (RESIDENT, unpinned, distinct), with their slots."""
    return BlocksEvicted(
        seq=state.next_seq,
        hashes=tuple(victims),
        slots=state.slots_of(victims),
        reason=reason,
    )


def drop_corrupt(state: State, hashes: Sequence[int], emit: Emit) -> None:
    """F17: the resident, unpinned ones of ``hashes`` are evicted now; the ones another
    request still pins are remembered and evicted when their last pin goes."""
    eviction = _evict_resident(state, hashes, "corrupt")
    if eviction is not None:
        emit(eviction)
    pinned = [h for h in dict.fromkeys(hashes) if h in state.pin_count and h not in state.bad and state.is_resident(h)]
    if pinned:
        emit(BlocksCorrupt(seq=state.next_seq, hashes=tuple(pinned)))


def evict_unpinned_bad(state: State, emit: Emit) -> None:
    """After a decision that can release pins: remembered bad blocks whose last pin went
    are evicted (F17; see ``kvflow.core.decide.dispatch.after_decision``)."""
    gone = [h for h in state.bad if h not in state.pin_count]
    if gone:
        eviction = _evict_resident(state, gone, "corrupt")
        if eviction is not None:
            emit(eviction)


# a decider: decides ``cmd`` against ``state``, hands each event to ``emit``, returns the answer
Decider = Callable[[State, Any, Emit], Any]


def decide_invalidate(state: State, cmd: Invalidate, emit: Emit) -> int:
    eviction = _evict_resident(state, cmd.block_hashes, "invalidated")
    if eviction is None:
        return 0
    emit(eviction)
    return len(eviction.hashes)
