"""Events: the facts that happened, what a log and a trace are made of. (Commands, the
requests to decide, are in ``commands.py``; jobs and their directions in ``jobs.py``.)

Events are frozen msgspec Structs forming one tagged union (`type` field). Each carries a
gapless ``seq`` assigned by the state it is appended to; order is always ``seq``, never time.
Events are *batched*: one event per job or per request, listing its blocks, so that folding a
log costs one Python object per decision rather than one per block.

Schema evolution rules (msgspec's): a new field gets a default, a field's type never changes,
a tag is never reused. ``EVENT_VERSION`` is bumped when the meaning of a recorded event changes;
the trace reader upgrades older records (see ``log.py``).

This module is pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from typing import Literal, Union, get_args

import msgspec

from kvflow.core.jobs import Blocks, Direction, Hashes, SharedTier

EVENT_VERSION = 1


# gc=False: events, commands and jobs hold only scalars and tuples of them, so they can never
# be part of a reference cycle; untracked, the millions a log or a replay creates cost the
# garbage collector nothing (msgspec's documented setting for such structs).
class _Event(msgspec.Struct, frozen=True, tag_field="type", kw_only=True, gc=False):
    seq: int


# --- store / load jobs ---------------------------------------------------------------------


class StoreQueued(_Event, frozen=True, tag="store_queued"):
    """A store job was queued: each hash takes the listed slot (STORE_QUEUED).

    ``request_id`` is the request whose computed blocks these are (``None`` for lazy stores of
    blocks the device cache evicts). ``device_blocks`` become held until the job is terminal.
    """

    job_id: int
    request_id: str | None
    hashes: Hashes
    device_blocks: Blocks
    slots: Blocks


class LoadQueued(_Event, frozen=True, tag="load_queued"):
    """A load job was queued for resident, pinned entries into the engine's device blocks."""

    job_id: int
    request_id: str
    hashes: Hashes
    device_blocks: Blocks
    slots: Blocks


class RemoteLoadQueued(_Event, frozen=True, tag="remote_load_queued"):
    """A remote load was queued: blocks the remote tier holds and the CPU tier lacks each take
    the listed slot (STORE_QUEUED), filled from the remote tier; like a store's, they become
    visible only when the job completes. No device blocks: the engine loads them from the CPU
    tier once they are resident (a later lookup hits them)."""

    job_id: int
    hashes: Hashes
    slots: Blocks


class RemoteStoreQueued(_Event, frozen=True, tag="remote_store_queued"):
    """Resident entries are copied from their slots to the remote tier. The job pins them
    until it is terminal, so their slots are not reused while the copy reads them."""

    job_id: int
    hashes: Hashes
    slots: Blocks


class RemoteIndexed(_Event, frozen=True, tag="remote_indexed"):
    """The remote tier was found to hold these hashes (another instance stored them): a
    lookup that misses the CPU tier on them queues their remote load."""

    hashes: Hashes


class DiskLoadQueued(_Event, frozen=True, tag="disk_load_queued"):
    """A disk load was queued: blocks the disk tier holds (in ``disk_slots``) and the CPU tier
    lacks each take the listed host slot (STORE_QUEUED); like a store's, they become visible
    only when the job completes. The disk slots are read until the job ends."""

    job_id: int
    hashes: Hashes
    slots: Blocks
    disk_slots: Blocks


class DiskStoreQueued(_Event, frozen=True, tag="disk_store_queued"):
    """Resident entries are copied from their host slots to the listed free disk slots. The
    job pins them until it is terminal; the blocks join the disk index when it completes."""

    job_id: int
    hashes: Hashes
    slots: Blocks
    disk_slots: Blocks


class DiskEvicted(_Event, frozen=True, tag="disk_evicted"):
    """Entries left the disk tier's index to free their slots (the least recently used
    first), or because a load found them unusable (``reason``)."""

    hashes: Hashes
    disk_slots: Blocks
    reason: str = "capacity"


class DiskIndexed(_Event, frozen=True, tag="disk_indexed"):
    """At start, the disk tier's journal vouched for these entries (a previous run stored
    them): they join the disk index in these slots, and lookups can load them."""

    hashes: Hashes
    disk_slots: Blocks


class EntriesRefused(_Event, frozen=True, tag="entries_refused"):
    """A shared tier (``tier``) refused the values under these hashes, each value once and
    for ``reasons[i]`` (``kvflow.tiers.entry.REJECTED``): never served. ``job_ids[i]``: the
    load that read the value and failed (0: a probe refused it by its head, nothing was
    loaded). Those of the hashes its index holds leave it (``dropped``): the remote index
    forgets them; the disk index drops those whose disk slot no job is using (a load still
    reading one drops it when it fails). The rest are recorded only."""

    tier: SharedTier
    hashes: Hashes
    reasons: tuple[str, ...]
    job_ids: Blocks
    dropped: Hashes = ()


class JobsSubmitted(_Event, frozen=True, tag="jobs_submitted"):
    """Queued jobs were handed to the executor (queued -> in_flight), once each (F5).

    Every job gets the same deadline, ``now_ms + config.job_deadline_ms``.
    """

    job_ids: tuple[int, ...]
    now_ms: float
    deadline_ms: float


class RankSucceeded(_Event, frozen=True, tag="rank_succeeded"):
    """One rank reported success for a job that still waits for other ranks."""

    job_id: int
    rank: int


class _Terminal(_Event, frozen=True, kw_only=True):
    # Carried so that consumers (notices, incidents, KV events) need no state lookup.
    job_id: int
    direction: Direction
    request_id: str | None
    hashes: Hashes
    device_blocks: Blocks
    slots: Blocks
    # True for a job a reset abandoned: its end only frees its fenced slots and device
    # blocks; nothing becomes visible and no request is told.
    abandoned: bool = False


class JobCompleted(_Terminal, frozen=True, tag="job_completed"):
    """Every rank succeeded. Store: entries become RESIDENT (visible). Load: pins released."""

    rank: int


class JobFailed(_Terminal, frozen=True, tag="job_failed"):
    """A rank failed (or the job was cancelled). Recovery by direction (F1).

    Store: entries removed, slots freed, hashes never visible. Load: entries stay resident,
    the job's pins are released and ``device_blocks`` must be recomputed by the engine.

    ``fenced`` (F15): other ranks had not reported yet, so their copies may still run: the
    outcome applies at once, but the job's slots and device blocks stay fenced
    until every rank has reported (``FenceLifted``). Traces from before it read as False.
    """

    rank: int
    error: str
    fenced: bool = False


class JobTimedOut(_Terminal, frozen=True, tag="job_timed_out"):
    """The job passed its deadline; recovery as for a failure."""

    now_ms: float
    deadline_ms: float
    # F15: the copy may still be running (see JobFailed.fenced); traces from before read False
    fenced: bool = False


class LateResultIgnored(_Event, frozen=True, tag="late_result_ignored"):
    """A result for a job that is already terminal, or a rank repeating its success: its
    outcome changes nothing. For a fenced job it records that this rank's copy is over."""

    job_id: int
    rank: int
    ok: bool
    error: str | None = None


FenceReason = Literal["copy over", "executor closed"]


class FenceLifted(_Event, frozen=True, tag="fence_lifted"):
    """The copy of a fenced job (timed out, failed on one rank, or abandoned by a reset) is
    over (F15): every rank reported, or the executor was closed and its copies stopped. Its
    fenced ``slots`` are free again unless an entry still owns them, and its
    ``device_blocks`` are released to the engine."""

    job_id: int
    device_blocks: Blocks
    slots: Blocks
    reason: FenceReason


# --- tier contents ---------------------------------------------------------------------------

# capacity: a store needed the slot; explicit: Evict; corrupt: a load found the host copy bad
# (F17); invalidated: the engine said the data is bad (OffloadManager.invalidate).
EvictReason = Literal["capacity", "explicit", "corrupt", "invalidated"]


class BlocksEvicted(_Event, frozen=True, tag="blocks_evicted"):
    """RESIDENT, unpinned entries removed (all-or-nothing, F8); their slots are freed."""

    hashes: Hashes
    slots: Blocks
    reason: EvictReason


class BlocksCorrupt(_Event, frozen=True, tag="blocks_corrupt"):
    """A load found these resident blocks' host copies bad while another request still pins
    them (F17): they stay until their last pin goes, then they are evicted (reason
    ``corrupt``), whatever way the pin goes."""

    hashes: Hashes


class BlocksTouched(_Event, frozen=True, tag="blocks_touched"):
    """Recency: the resident hashes were used, in this order (the last is the most recent).

    ``reuse=False`` only reorders (the end-of-request pass that puts a chain's head last,
    F14): frequency-aware policies (ARC) do not count it as a second use."""

    hashes: Hashes
    reuse: bool = True


class StoreRejected(_Event, frozen=True, tag="store_rejected"):
    """Admission refused: no free slot and nothing evictable (pinned / in flight)."""

    request_id: str | None
    hashes: Hashes
    device_blocks: Blocks
    reason: str


# --- requests --------------------------------------------------------------------------------


class PinsAcquired(_Event, frozen=True, tag="pins_acquired"):
    """A lookup hit pinned these resident hashes for the request (F7). Empty at a miss."""

    request_id: str
    hashes: Hashes
    num_tokens: int


class PinsReleased(_Event, frozen=True, tag="pins_released"):
    """The request gave these pins back (hits not accepted, finish, preemption)."""

    request_id: str
    hashes: Hashes


class RequestFinished(_Event, frozen=True, tag="request_finished"):
    """The engine finished (or preempted) the request; cleanup waits for its live jobs."""

    request_id: str
    preempted: bool


class RequestOpened(_Event, frozen=True, tag="request_opened"):
    """kvflow first heard of a request through a call that decided nothing else (F18: a
    store whose blocks were all on the tier already): it is known from its first call."""

    request_id: str


class ChainExtended(_Event, frozen=True, tag="chain_extended"):
    """The request's chain (its full blocks' hashes, in prefix order) grows by those of these
    hashes, named by a lookup or a store, that are new to it (``Config.chain_recency``;
    at least one is). The request's
    own recency follows its chain: when it finishes, the chain's blocks on the tier are
    touched deepest first (F14; docs/simulate.md, rule 4). A request first heard of here is known
    from now on (F18)."""

    request_id: str
    hashes: Hashes


class RequestResumed(_Event, frozen=True, tag="request_resumed"):
    """A request preempted while its jobs were in flight came back under the same id (F18):
    it is live again; the jobs of its earlier run finish on their own (the engine tells them
    apart by job id)."""

    request_id: str


class RequestClosed(_Event, frozen=True, tag="request_closed"):
    """A finished request has no live jobs and no pins left: it is forgotten."""

    request_id: str


class Reset(_Event, frozen=True, tag="reset"):
    """Everything cleared (vLLM's AllBlocksCleared).

    Queued jobs are failed before this event. Jobs still in flight are *abandoned*: their
    slots and device blocks stay fenced until the executor reports them (or they time
    out), because a copy may still be writing there; then the slots are freed and nothing
    becomes visible.

    ``keeps_requests`` (F18): live requests stay known, without pins or jobs (their abandoned
    loads are reported failed); finished ones are forgotten. Traces recorded before it
    existed read as False: every request was forgotten.
    """

    abandoned_job_ids: tuple[int, ...]
    keeps_requests: bool = False


Event = Union[
    StoreQueued,
    LoadQueued,
    JobsSubmitted,
    RankSucceeded,
    JobCompleted,
    JobFailed,
    JobTimedOut,
    LateResultIgnored,
    FenceLifted,
    BlocksEvicted,
    BlocksCorrupt,
    BlocksTouched,
    StoreRejected,
    PinsAcquired,
    PinsReleased,
    RequestFinished,
    RequestOpened,
    RequestResumed,
    RequestClosed,
    Reset,
    RemoteLoadQueued,
    RemoteStoreQueued,
    RemoteIndexed,
    ChainExtended,
    DiskLoadQueued,
    DiskStoreQueued,
    DiskEvicted,
    DiskIndexed,
    EntriesRefused,
]

EVENT_TYPES: tuple[type, ...] = get_args(Event)
TERMINAL_TYPES = (JobCompleted, JobFailed, JobTimedOut)


def event_name(event: msgspec.Struct) -> str:
    """The stable tag of an event or command (``job_failed``, ``lookup``...)."""
    return str(event.__struct_config__.tag)
