"""The state's data: CPU-tier entries, live jobs, requests, and the policy's order.

``State`` is built empty from a Config and changed only by ``evolve`` (kvflow.core.state.apply).
Its queries here read; they never change anything. Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from operator import itemgetter

import msgspec

from kvflow.core.config import Config
from kvflow.core.jobs import FILLING, Direction
from kvflow.core.policies.base import Policy
from kvflow.core.policies.registry import make_policy
from kvflow.core.state.digest import Tally, canonical, digest
from kvflow.core.state.disk import DiskIndex
from kvflow.core.state.slots import FreeSlots
from kvflow.core.state.tables import (
    ABANDONED,
    ABSENT,
    FENCED,
    QUEUED,
    RESIDENT,
    STORE_QUEUED,
    STORING,
    BlockState,
    JobState,
)


class Entry:
    """A read-only picture of one CPU-tier entry (``state.entries[hash]``).

    The state stores entries column-wise (``slot_of``, ``pending``, ``pin_count``): an event
    changes a few columns for all its blocks, and a tier of millions of blocks holds no object
    per block; this view assembles one entry for readers (inspect, tests, invariants).
    """

    __slots__ = ("state", "slot", "pins", "job_id")

    def __init__(self, state: BlockState, slot: int, pins: int, job_id: int) -> None:
        self.state = state
        self.slot = slot
        self.pins = pins
        self.job_id = job_id  # the live store job while STORE_QUEUED / STORING, else 0

    def __repr__(self) -> str:
        return f"Entry({self.state.name}, slot={self.slot}, pins={self.pins}, job={self.job_id})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return (self.state, self.slot, self.pins, self.job_id) == (
            other.state,
            other.slot,
            other.pins,
            other.job_id,
        )


class EntriesView(Mapping[int, Entry]):
    """``State.entries``: every hash on the tier -> its Entry (assembled on access)."""

    __slots__ = ("_state",)

    def __init__(self, state: State) -> None:
        self._state = state

    def __getitem__(self, block_hash: int) -> Entry:
        st = self._state
        slot = st.slot_of[block_hash]
        job_id = st.pending.get(block_hash, 0)
        return Entry(st.block_state(block_hash), slot, st.pin_count.get(block_hash, 0), job_id)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._state.slot_of

    def __iter__(self) -> Iterator[int]:
        return iter(self._state.slot_of)

    def __len__(self) -> int:
        return len(self._state.slot_of)


class Job(msgspec.Struct, eq=False, gc=False):
    """A live transfer job (terminal jobs leave the state; their events stay in the log).

    ``eq=False``: jobs compare (and hash) by identity; ``gc=False``: a job holds only scalars
    and tuples of them, so it is never part of a reference cycle.
    """

    job_id: int
    direction: Direction
    request_id: str | None
    hashes: tuple[int, ...]
    device_blocks: tuple[int, ...]
    slots: tuple[int, ...]
    state: JobState = QUEUED
    deadline_ms: float = 0.0
    acks: int = 0  # bit mask of ranks that reported success
    reported: int = 0  # bit mask of ranks that reported at all: their copy is over
    disk_slots: tuple[int, ...] = ()  # a disk job's slots on the disk tier

    @property
    def abandoned(self) -> bool:
        """A reset came while it was in flight (its memory is fenced: see ``fenced``)."""
        return self.state is ABANDONED

    @property
    def fenced(self) -> bool:
        """Its outcome is known but its copy may still run: its memory is fenced (F15)."""
        return self.state is FENCED or self.state is ABANDONED

    def __repr__(self) -> str:
        return (
            f"Job({self.job_id}, {self.direction}, {self.state.name}, request={self.request_id},"
            f" blocks={len(self.hashes)})"
        )


class Request:
    """What kvflow remembers of a request: its pins, its live jobs and its chain."""

    __slots__ = (
        "request_id", "offered", "loading", "jobs", "finished", "preempted", "_chain", "chain_order", "chain_whole_at",
    )  # fmt: skip

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        # A request's pins are its offered hits plus the blocks of its live load jobs.
        self.offered: tuple[int, ...] = ()  # lookup hits not yet accepted into a load job
        self.loading: dict[int, tuple[int, ...]] = {}  # live load job -> its pinned hashes
        self.jobs: dict[int, None] = {}  # live job ids, in order
        self.finished = False
        self.preempted = False
        # its chain (see ``chain``), or None while ``chain_order`` alone holds it
        self._chain: dict[int, None] | None = {}
        # the chain's hashes as one tuple, ``tuple(chain)``, while a single event has named
        # them (usually the event's own tuple: a lookup's hashes); None once a later event
        # extends the chain (then only the dict is kept): a store of the chain's tail and the
        # request's finish compare with it, and most chains are never extended.
        self.chain_order: tuple[int, ...] | None = ()
        # ``State.departures`` when every hash of ``chain_order`` was last known on the tier
        # (a store of the chain's tail queued, the rest there), else -1: while no entry has
        # left the tier since, its finish touches the chain without asking the tier of each
        self.chain_whole_at = -1

    @property
    def chain(self) -> dict[int, None]:
        """Its full blocks' hashes in prefix order, each once, as its lookups and stores
        named them (ChainExtended; empty unless Config.chain_recency): its finish touches
        them (F14). Built from ``chain_order`` when first read."""
        chain = self._chain
        if chain is None:
            chain = self._chain = dict.fromkeys(self.chain_order or ())
        return chain

    def chain_hashes(self) -> Sequence[int]:
        """The chain's hashes in order, read without building its dict."""
        return self.chain_order if self.chain_order is not None else tuple(self._chain or ())

    def start_chain(self, hashes: tuple[int, ...]) -> None:
        """The chain's first hashes (usually a lookup's), kept as the tuple itself when it
        names each hash once."""
        if len(set(hashes)) == len(hashes):
            self.chain_order, self._chain = hashes, None
        else:
            chain = self._chain = dict.fromkeys(hashes)
            self.chain_order = tuple(chain)

    def chain_tail_start(self, hashes: Sequence[int]) -> int:
        """Where ``hashes`` begin in the chain if they are its last blocks, in order (the
        usual store: the blocks after its lookup's hits), else -1 (also once the chain is kept
        as a dict only). They are then in the chain, each named once."""
        order = self.chain_order
        if not order:
            return -1
        start = len(order) - len(hashes)
        return start if start >= 0 and order[start:] == hashes else -1

    def extend_chain(self, hashes: tuple[int, ...]) -> None:
        """The new ones of ``hashes`` go to the chain's end, in order."""
        chain = self.chain
        self.chain_order = None  # (from now on the dict alone holds the chain)
        self.chain_whole_at = -1  # (the new ones are not known on the tier)
        for h in hashes:
            chain[h] = None

    @property
    def pins(self) -> dict[int, int]:
        """hash -> pins this request holds on it (offered hits and live loads)."""
        counts: dict[int, int] = {}
        for hashes in (self.offered, *self.loading.values()):
            for h in hashes:
                counts[h] = counts.get(h, 0) + 1
        return counts

    def holds_pins(self) -> bool:
        return bool(self.offered or self.loading)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, pins={sum(self.pins.values())}, "
            f"jobs={list(self.jobs)}, finished={self.finished})"
        )


class State:
    """The whole CPU-tier state. Built empty from a Config, changed only by ``evolve``."""

    __slots__ = (
        "config",
        "next_seq",
        "last_job_id",
        "slot_of",
        "_pending",
        "pin_count",
        "free_slots",
        "fenced_slots",
        "jobs",
        "queued",
        "_held",
        "requests",
        "policy",
        "deferred_touches",
        "bad",
        "remote",
        "disk",
        "departures",
        "tally",
        "full_digest",
        "pushes_settled",
    )

    def __init__(self, config: Config, full_digest: bool = False) -> None:
        self.config = config
        self.next_seq = 1
        self.last_job_id = 0
        # Entries, column-wise: every hash on the tier -> its slot; the hashes of live store
        # jobs (STORE_QUEUED / STORING, which one follows the job) -> that job; pinned hashes
        # -> their pin count (absent means 0). RESIDENT = on the tier and not pending.
        self.slot_of: dict[int, int] = {}
        self._pending: dict[int, int] | None = None  # (see ``pending``)
        self.pin_count: dict[int, int] = {}
        # Free slots as a stack: allocation takes from its top, so a fresh tier hands out
        # 0, 1, 2... (contiguous host runs keep the executor's copies at full speed).
        self.free_slots = FreeSlots(config.cpu_blocks)
        # slot -> fenced jobs whose copy may still use it (two fenced loads can read one
        # slot; a fenced load's slot may still belong to its resident entry)
        self.fenced_slots: dict[int, tuple[int, ...]] = {}
        self.jobs: dict[int, Job] = {}  # live jobs by id (queued or in flight)
        self.queued: dict[int, None] = {}  # queued, not yet submitted, in id order
        self._held: dict[int, int] | None = None  # (see ``held``)
        self.requests: dict[str, Request] = {}
        self.policy: Policy = make_policy(config.policy, config.cpu_blocks)
        # F14: a touch that named entries still being stored, kept on their store job (the
        # latest one) and applied again when the job lands: (hashes in order, reuse)
        self.deferred_touches: dict[int, tuple[tuple[int, ...], bool]] = {}
        # F17: resident blocks reported corrupt while pinned, evicted once unpinned
        self.bad: dict[int, None] = {}
        # the remote tier's index: hashes known to be there, oldest first (capped at
        # config.remote_blocks); a remote load that fails drops its hashes at once
        self.remote: dict[int, None] = {}
        # the disk tier's index, free slots and slots in use (None without a disk tier)
        self.disk: DiskIndex | None = DiskIndex(config.disk_blocks) if config.disk_blocks else None
        # how many times entries have left the tier (an eviction, a dropped store, a reset):
        # what was known on the tier at one count is there still while the count is the same
        # (see Request.chain_whole_at). Not part of the digest: it only spares a lookup
        self.departures = 0
        # the digest's parts kept as the state changes (kvflow.core.state.digest); a state
        # folded from a trace before version 4 digests the whole state instead (``full_digest``)
        self.tally = Tally()
        self.full_digest = full_digest
        # by direction (remote_store, disk_store): what a copy ahead of eviction last found
        # nothing to copy at (kvflow.core.decide.remote: pushes_key). Not part of the digest:
        # it only spares a question to the policy
        self.pushes_settled: dict[str, object] = {}

    # -- indexes of the live jobs ----------------------------------------------------------
    #
    # ``pending`` and ``held`` follow from ``jobs`` alone. They are kept up to date by the
    # evolvers only once something has read them while other jobs were live; a job that
    # is the only live one does not write itself into them (``None``: built from ``jobs``
    # when next read). An engine that waits for each job before the next writes no
    # per-block index at all; one with many jobs in flight keeps both, as before.
    # (check_invariants compares a kept index with the one built from ``jobs``.)

    @property
    def pending(self) -> dict[int, int]:
        """Hash -> the live store (or remote load) job filling it: STORE_QUEUED / STORING
        entries; a fenced job's entries have left the tier. Read-only for callers."""
        index = self._pending
        if index is None:
            index = self._pending = pending_of(self.jobs) if self.jobs else {}
        return index

    @property
    def held(self) -> dict[int, int]:
        """Device block -> the live job holding it (fenced jobs too: their copy may still
        use it). Read-only for callers."""
        index = self._held
        if index is None:
            index = self._held = held_by(self.jobs) if self.jobs else {}
        return index

    # -- queries -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.config.cpu_blocks

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    @property
    def next_job_id(self) -> int:
        """The id the next queued job takes: job ids count 1, 2, 3... in the order jobs are
        queued, whatever their direction."""
        return self.last_job_id + 1

    def slots_of(self, hashes: Sequence[int]) -> tuple[int, ...]:
        """The slots of these entries on the tier, in order (KeyError: one is not there)."""
        if len(hashes) > 1:  # (one lookup loop in C; an itemgetter of one key gives the bare value)
            slots: tuple[int, ...] = itemgetter(*hashes)(self.slot_of)
            return slots
        return (self.slot_of[hashes[0]],) if hashes else ()

    def next_slots(self, n: int) -> tuple[int, ...]:
        """The slots the next ``n`` new entries take, in order: the top ``n`` of the free stack,
        the top first (a fresh tier hands out 0, 1, 2...: contiguous host runs). Fewer if
        fewer are free."""
        return self.free_slots.top(n)

    @property
    def entries(self) -> EntriesView:
        return EntriesView(self)

    def block_state(self, block_hash: int) -> BlockState:
        if block_hash not in self.slot_of:
            return ABSENT
        job_id = self.pending.get(block_hash)
        if job_id is None:
            return RESIDENT
        return STORE_QUEUED if self.jobs[job_id].state is QUEUED else STORING

    def is_resident(self, block_hash: int) -> bool:
        return block_hash in self.slot_of and block_hash not in self.pending

    def evictable(self, block_hash: int) -> bool:
        return (
            block_hash not in self.pin_count
            and block_hash not in self.pending
            and block_hash in self.slot_of
        )

    def num_resident(self) -> int:
        return len(self.policy)

    def copy(self) -> State:
        """An independent deep copy (used by tests and by ``inspect --at``)."""
        clone = State.__new__(State)
        clone.config = self.config
        clone.next_seq = self.next_seq
        clone.last_job_id = self.last_job_id
        clone.slot_of = dict(self.slot_of)
        clone._pending = None if self._pending is None else dict(self._pending)
        clone.pin_count = dict(self.pin_count)
        clone.free_slots = self.free_slots.copy()
        clone.fenced_slots = dict(self.fenced_slots)
        clone.jobs = {}
        for jid, j in self.jobs.items():
            clone.jobs[jid] = Job(
                j.job_id, j.direction, j.request_id, j.hashes, j.device_blocks, j.slots,
                j.state, j.deadline_ms, j.acks, j.reported, j.disk_slots,
            )  # fmt: skip
        clone.queued = dict(self.queued)
        clone._held = None if self._held is None else dict(self._held)
        clone.requests = {}
        for rid, r in self.requests.items():
            nr = Request(rid)
            nr.loading = dict(r.loading)
            nr.offered = r.offered
            nr.jobs = dict(r.jobs)
            nr.finished, nr.preempted = r.finished, r.preempted
            nr._chain = None if r._chain is None else dict(r._chain)
            nr.chain_order = r.chain_order
            nr.chain_whole_at = r.chain_whole_at
            clone.requests[rid] = nr
        clone.policy = copy.deepcopy(self.policy)
        clone.deferred_touches = dict(self.deferred_touches)
        clone.bad = dict(self.bad)
        clone.remote = dict(self.remote)
        clone.disk = None if self.disk is None else self.disk.copy()
        clone.departures = self.departures
        clone.tally = self.tally.copy()
        clone.full_digest = self.full_digest
        clone.pushes_settled = dict(self.pushes_settled)
        return clone

    # -- determinism ---------------------------------------------------------------------

    def canonical(self) -> tuple[object, ...]:
        """A deterministic, order-independent picture of the state (see state.digest)."""
        return canonical(self)

    def digest(self) -> str:
        """A short hash of ``canonical()``: equal digests mean equal states."""
        return digest(self)


def pending_of(jobs: Mapping[int, Job]) -> dict[int, int]:
    """``State.pending`` built from the live jobs, in job order (as the evolvers write it)."""
    return {
        h: jid
        for jid, job in jobs.items()
        if job.direction in FILLING and not job.fenced
        for h in job.hashes
    }


def held_by(jobs: Mapping[int, Job]) -> dict[int, int]:
    """``State.held`` built from the live jobs, in job order (as the evolvers write it)."""
    return {d: jid for jid, job in jobs.items() for d in job.device_blocks}
