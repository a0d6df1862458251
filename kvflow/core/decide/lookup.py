"""Decisions of lookup and loads: the hits a lookup offers (pinned for the request, F7) and
the load of the hits the engine accepts. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile

from kvflow.core.commands import AcceptHits, Lookup
from kvflow.core.decide.checks import Emit, check_device_blocks, check_not_finished
from kvflow.core.decide.disk import disk_loads
from kvflow.core.decide.remote import remote_loads
from kvflow.core.decide.store import extend_chain
from kvflow.core.errors import Rejected, UnknownRequest
from kvflow.core.events import BlocksTouched, LoadQueued, PinsAcquired, PinsReleased, RequestResumed
from kvflow.core.jobs import STORE
from kvflow.core.state.model import State
from kvflow.core.values import is_int


def hit_cap_blocks(num_tokens: int, block_tokens: int) -> int:
    """At most ``num_tokens - 1`` tokens may hit, rounded down to whole blocks (F13)."""
    return max(0, (num_tokens - 1) // block_tokens)


def decide_lookup(state: State, cmd: Lookup, emit: Emit) -> int:
    request_id, num_tokens, skip = cmd.request_id, cmd.num_tokens, cmd.device_hit_blocks
    if not is_int(num_tokens) or num_tokens < 0:
        raise Rejected(f"lookup of request {request_id}: num_tokens must be >= 0")
    if not is_int(skip) or skip < 0:
        raise Rejected(f"lookup of request {request_id}: device_hit_blocks must be >= 0")
    if not state.config.enabled:
        return 0
    req = state.requests.get(request_id)
    if req is not None:
        check_not_finished(req, request_id, "lookup of request")
        if req.finished:
            emit(RequestResumed(seq=state.next_seq, request_id=request_id))  # F18
        if req.offered:
            # A repeated lookup (the scheduler could not place the request last step) replaces
            # the hits it offered before, so pins never pile up.
            emit(PinsReleased(seq=state.next_seq, request_id=request_id, hashes=req.offered))
    cap = hit_cap_blocks(num_tokens, state.config.block_tokens)
    extension = extend_chain(state, request_id, req, cmd.block_hashes)
    if extension is not None:
        emit(extension)
    window = cmd.block_hashes[skip:cap]
    # only a prefix hits, and only RESIDENT entries are visible (on the tier and not being
    # stored): the hits end at the first block that is on the tier no longer or not yet
    hits = tuple(takewhile(state.slot_of.__contains__, window))
    if hits:
        pending = state.pending
        if pending:
            hits = tuple(takewhile(lambda h: h not in pending, hits))
    n = len(hits)
    emit(PinsAcquired(seq=state.next_seq, request_id=request_id, hashes=hits, num_tokens=num_tokens))
    if n < len(window) and (state.disk is not None or state.remote):
        # what the lower tiers hold beyond the hits comes to the CPU tier (a later lookup
        # hits): the disk's run first, then the remote tier's from where the disk's ends
        if state.disk is not None:
            disk_loads(state, window[n:], emit)
        if state.remote:
            remote_loads(state, window[n:], emit)
    return n


def decide_accept_hits(state: State, cmd: AcceptHits, emit: Emit) -> int | None:
    if not state.config.enabled:
        if cmd.device_blocks:
            raise Rejected(f"accept_hits: offload is disabled, request {cmd.request_id} was offered nothing")
        return None
    req = state.requests.get(cmd.request_id)
    if req is None or req.finished:
        raise UnknownRequest(f"accept_hits: request {cmd.request_id} has no live lookup")
    n = len(cmd.device_blocks)
    if n > len(req.offered):
        raise Rejected(
            f"accept_hits: request {cmd.request_id} was offered {len(req.offered)} blocks, "
            f"cannot accept {n}"
        )
    check_device_blocks(state, cmd.device_blocks, allow_same_store={})
    job_id = None
    if n:
        hashes = req.offered[:n]
        job_id = state.next_job_id
        emit(LoadQueued(
            seq=state.next_seq,
            job_id=job_id,
            request_id=cmd.request_id,
            hashes=hashes,
            device_blocks=tuple(cmd.device_blocks),
            slots=state.slots_of(hashes),
        ))
    if req.offered:
        emit(PinsReleased(seq=state.next_seq, request_id=cmd.request_id, hashes=req.offered))
    if n and state.config.chain_recency:
        # the simulation's rule 2 (docs/simulate.md): the hits it loads are used again now, deepest first, so that
        # the request's own stores never evict the prefix they extend
        emit(BlocksTouched(seq=state.next_seq, hashes=hashes[::-1], reuse=True))
    return job_id


def arriving(state: State, window: Sequence[int]) -> int:
    """How many blocks right after the resident prefix of ``window`` (a lookup's blocks: its
    hits come first) a lower tier's load is bringing to the CPU tier now: an engine that waits
    for them hits them on the CPU tier once they land (or, if the load fails or times out,
    computes them)."""
    pending, jobs, slot_of = state.pending, state.jobs, state.slot_of
    n = 0
    for h in window:
        job_id = pending.get(h)
        if job_id is None:
            if n or h not in slot_of:
                break
            continue  # (resident: a hit)
        if jobs[job_id].direction == STORE:
            break
        n += 1
    return n
