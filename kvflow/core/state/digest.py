"""The state digest: a hash of a deterministic, order-independent encoding of the state.

Two runs (a live engine and a replay, two seeds, two ``PYTHONHASHSEED``s) are in the same
state exactly when their digests are equal; trace checkpoints carry the digest at their
``seq``. Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from itertools import repeat
from typing import TYPE_CHECKING, Any

import msgspec

from kvflow.core.state.tables import QUEUED

if TYPE_CHECKING:
    from kvflow.core.state.model import State

class Entry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One entry of the tier in ``canonical``: encoded as the array of its fields, the bytes
    of the tuple ``(hash, state, slot, pins, job)`` (the digest of traces recorded with
    tuples is unchanged). A struct without gc rather than a tuple: a digest makes one per
    entry of the tier, and tuples would each be tracked by the garbage collector, whose
    collections they would set off."""

    hash: int
    state: int  # 1: STORE_QUEUED, 2: STORING, 3: RESIDENT
    slot: int
    pins: int
    job: int  # the pending job filling it (0: none)


def canonical(state: State) -> tuple[Any, ...]:
    """Everything that drives decisions, as sorted plain values and ``Entry`` rows (the
    digest's input)."""
    # entries: (hash, BlockState, slot, pins, pending job) sorted by hash, built column by
    # column as the state keeps them (hashes are unique, so sorting them sorts the rows)
    pending, pins, live, slot_of = state.pending, state.pin_count, state.jobs, state.slot_of
    hashes = sorted(slot_of)
    n = len(hashes)
    # (no pending or pinned entry: those columns are zeros)
    job_of: Iterable[int] = repeat(0, n)
    states: Iterable[int] = repeat(3, n)
    if pending:
        job_of = list(map(pending.get, hashes, job_of))
        states = [3 if j == 0 else (1 if live[j].state is QUEUED else 2) for j in job_of]
    pinned = map(pins.get, hashes, repeat(0, n)) if pins else repeat(0, n)
    entries = list(map(Entry, hashes, states, state.slots_of(hashes), pinned, job_of))
    # (a job's ``reported`` ranks differ from its ``acks`` only while it is fenced: added
    # then only, so the digests of traces recorded before fences are unchanged)
    jobs = [
        (
            j.job_id,
            j.direction,
            j.request_id,
            list(j.hashes),
            list(j.device_blocks),
            list(j.slots),
            int(j.state),
            j.deadline_ms,
            j.acks,
            j.abandoned,
        )
        + ((j.reported,) if j.reported != j.acks else ())
        + ((list(j.disk_slots),) if j.disk_slots else ())
        for j in sorted(state.jobs.values(), key=lambda j: j.job_id)
    ]
    requests = [
        (
            r.request_id,
            sorted(r.pins.items()),
            list(r.offered),
            sorted(r.jobs),
            r.finished,
            r.preempted,
        )
        # (the chain only when kept: the digests of traces recorded before it are unchanged)
        + ((list(r.chain_hashes()),) if r.chain_hashes() else ())
        for r in sorted(state.requests.values(), key=lambda r: r.request_id)
    ]
    return (
        state.next_seq,
        state.last_job_id,
        entries,
        list(state.free_slots),
        sorted((s, list(j)) for s, j in state.fenced_slots.items()),
        jobs,
        sorted(state.queued),
        sorted(state.held.items()),
        requests,
        state.policy.snapshot(),
    ) + (
        # (added only when present, so states without one digest as before F14)
        (sorted((j, list(h), r) for j, (h, r) in state.deferred_touches.items()),)
        if state.deferred_touches
        else ()
    ) + ((sorted(state.bad),) if state.bad else ()) + (
        # the remote index in its order (the oldest is forgotten first): only when present
        (("remote", list(state.remote)),) if state.remote else ()
    ) + ((("disk", state.disk.canonical()),) if state.disk is not None else ())


def digest(state: State) -> str:
    """A short hash of ``canonical(state)``: equal digests mean equal states."""
    blob = msgspec.msgpack.encode(canonical(state))
    return hashlib.blake2b(blob, digest_size=16).hexdigest()
