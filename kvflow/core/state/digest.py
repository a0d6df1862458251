"""The state digest that trace checkpoints carry: equal digests mean equal states.

Two runs (a live engine and a replay, two seeds, two ``PYTHONHASHSEED``s) that applied the same
events reach the same digest; trace checkpoints carry it at their ``seq``. Its work at a
checkpoint grows with the live work (jobs, requests, pins, fences), not with the tier: the tier's
parts are kept as the state changes, a few operations per entry an event changes (``Tally``):

- the entries: the sum of ``pair_sum(hash, slot)`` over the tier, added as entries come, taken
  away as they go (an entry's state, job and pins follow from the live jobs and the pin counts,
  hashed whole);
- the free slots: the sum of ``pair_sum(position, slot)`` over the slots given back, as a stack
  (``kvflow.core.state.slots``), and where the never-used ones start;
- the policy's order and the remote index's: a running hash of the operations applied to them, in
  order (insert, touch, refresh, remove, clear; remember, forget); the disk tier's index, free
  slots and slots in use, likewise (taken, stored, loaded, dropped, released, evicted, indexed). A policy is deterministic, so
  its order, ghosts and counts are a function of those operations: two states whose policies
  would choose differently had different operations applied.

Traces before version 4 carry the digest of ``canonical(state)``, the whole state as sorted plain
values (``State.full_digest``): their replay computes that one. Pure: no I/O, no clock, no
randomness.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from itertools import repeat
from typing import TYPE_CHECKING, Any

import msgspec

from kvflow.core.state.tables import QUEUED

if TYPE_CHECKING:
    from kvflow.core.state.model import State

_MASK = (1 << 64) - 1
_encode = msgspec.msgpack.Encoder().encode


def pair_sum(xs: Iterable[int], ys: Iterable[int]) -> int:
    """The sum of ``hash((x, y))`` over the pairs: one term per pair, in C. An int's hash is
    fixed by the language (the value mod 2**61 - 1) and a tuple's mixes its items' (CPython's
    xxHash-based mix since 3.8; ``tests/core/test_digest.py`` pins its values), so the terms
    do not depend on ``PYTHONHASHSEED``; a sum of them does not depend on the order."""
    return sum(map(hash, zip(xs, ys)))


# the operations a running record folds in (their codes, as the digest hashes them)
INSERT, TOUCH, REFRESH, REMOVE, CLEAR, REMEMBER, FORGET = range(7)


class Tally:
    """The parts of the digest kept as the state changes (see the module docstring)."""

    __slots__ = ("disk", "entries", "order", "remote")

    def __init__(self) -> None:
        self.entries = 0  # sum of pair_sum(hash, slot) over the tier's entries
        self.order = hashlib.blake2b(digest_size=16)  # the policy's operations, in order
        self.remote = hashlib.blake2b(digest_size=16)  # the remote index's, in order
        self.disk = hashlib.blake2b(digest_size=16)  # what was done to the disk tier, in order

    def ordered(self, op: int, hashes: tuple[int, ...]) -> None:
        """The policy applied ``op`` to ``hashes``."""
        self.order.update(_encode((op, hashes)))

    def indexed(self, op: int, hashes: Iterable[int]) -> None:
        """The remote index applied ``op`` (REMEMBER or FORGET) to ``hashes``."""
        self.remote.update(_encode((op, tuple(hashes))))

    def disked(self, what: int, hashes: tuple[int, ...], slots: tuple[int, ...]) -> None:
        """The disk tier's index, free slots or slots in use changed (``kvflow.core.state.disk``)."""
        self.disk.update(_encode((what, hashes, slots)))

    def copy(self) -> Tally:
        clone = Tally()
        clone.entries, clone.order, clone.remote = self.entries, self.order.copy(), self.remote.copy()
        clone.disk = self.disk.copy()
        return clone


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
    return (
        state.next_seq,
        state.last_job_id,
        entries,
        list(state.free_slots),
        *_live(state),
        state.policy.snapshot(),
    ) + _kept(state) + (
        # the remote index in its order (the oldest is forgotten first): only when present
        (("remote", list(state.remote)),) if state.remote else ()
    ) + ((("disk", state.disk.canonical()),) if state.disk is not None else ())


def _live(state: State) -> Iterator[Any]:
    """The fenced slots, live jobs, queued jobs, held device blocks and requests, as sorted
    plain values (both forms of the digest hash them whole: they are the live work)."""
    yield sorted((s, list(j)) for s, j in state.fenced_slots.items())
    # (a job's ``reported`` ranks differ from its ``acks`` only while it is fenced: added
    # then only, so the digests of traces recorded before fences are unchanged)
    yield [
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
    yield sorted(state.queued)
    yield sorted(state.held.items())
    yield [
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


def _kept(state: State) -> tuple[Any, ...]:
    """The touches kept for stores in flight (F14) and the blocks found corrupt (F17), each
    only when present (so states without them digest as before either existed)."""
    return (
        (sorted((j, list(h), r) for j, (h, r) in state.deferred_touches.items()),)
        if state.deferred_touches
        else ()
    ) + ((sorted(state.bad),) if state.bad else ())


def digest(state: State) -> str:
    """A short hash of the state: equal digests mean equal states (see the module docstring;
    a state folded from a trace before version 4 gives the hash of ``canonical(state)``)."""
    if state.full_digest:
        parts: tuple[Any, ...] = canonical(state)
    else:
        tally, free = state.tally, state.free_slots
        parts = (
            state.next_seq,
            state.last_job_id,
            len(state.slot_of),
            tally.entries & _MASK,
            free.fresh,
            len(free.freed),
            free.tally & _MASK,
            tally.order.digest(),
            tally.remote.digest(),
            sorted(state.pin_count.items()),
            *_live(state),
        ) + _kept(state) + ((tally.disk.digest(),) if state.disk is not None else ())
    return hashlib.blake2b(_encode(parts), digest_size=16).hexdigest()
