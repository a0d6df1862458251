"""Commands: what the engine asks kvflow to decide. Recorded in traces beside the events
they produced, and re-run by ``replay --redecide``.

Commands are frozen msgspec Structs forming one tagged union (`type` field), under the same
schema evolution rules as the events (see ``events.py``).

This module is pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from typing import Union, get_args

import msgspec

from kvflow.core.jobs import Blocks, Hashes, SharedTier


# gc=False: commands hold only scalars and tuples of them (see events.py)
class _Command(msgspec.Struct, frozen=True, tag_field="type", kw_only=True, gc=False):
    pass


class Lookup(_Command, frozen=True, tag="lookup"):
    """How many blocks after ``device_hit_blocks`` can be loaded from the CPU tier?"""

    request_id: str
    block_hashes: Hashes
    num_tokens: int
    device_hit_blocks: int = 0


class AcceptHits(_Command, frozen=True, tag="accept_hits"):
    """The engine allocated ``device_blocks`` for the first ``len(device_blocks)`` hits."""

    request_id: str
    device_blocks: Blocks


class BlocksComputed(_Command, frozen=True, tag="blocks_computed"):
    """Eager mode: these full blocks were computed; store the ones not on the tier."""

    request_id: str | None
    block_hashes: Hashes
    device_blocks: Blocks


class DeviceBlocksEvicting(_Command, frozen=True, tag="device_blocks_evicting"):
    """Lazy mode: the device cache is about to drop these blocks; store the missing ones."""

    block_hashes: Hashes
    device_blocks: Blocks


class Touch(_Command, frozen=True, tag="touch"):
    """Recency for the hashes on the tier, in order (put the head of a chain last, F14).
    ``reuse=False``: ordering only, not a new use (see BlocksTouched). ``keep_pending``: a
    block still being stored keeps the touch until it lands (F14); traces of version 1,
    recorded before, read False (such blocks were skipped)."""

    block_hashes: Hashes
    reuse: bool = True
    keep_pending: bool = True


class Evict(_Command, frozen=True, tag="evict"):
    """Free ``num_blocks`` slots through the policy, all or nothing (F8)."""

    num_blocks: int


class PlanStep(_Command, frozen=True, tag="plan_step"):
    """Hand every queued job to the executor exactly once (F5)."""

    now_ms: float


# omit_defaults: a success is recorded as just its job (and rank); the common case stays short
class JobResult(_Command, frozen=True, tag="job_result", omit_defaults=True):
    """An executor outcome for one rank of one job. A failed load whose host copy failed its
    integrity check names the bad blocks in ``corrupt`` (F17: they are evicted, so the
    engine's recompute stores them again)."""

    job_id: int
    rank: int = 0
    ok: bool = True
    error: str | None = None
    corrupt: Hashes = ()


class JobResults(_Command, frozen=True, tag="job_results"):
    """Several executor outcomes, applied in order (what one engine step collected)."""

    results: tuple[JobResult, ...]


class Tick(_Command, frozen=True, tag="tick"):
    """Time passes: in-flight jobs past their deadline time out (F2)."""

    now_ms: float


class FinishRequest(_Command, frozen=True, tag="finish_request"):
    """The request finished or was preempted: release exactly its pins."""

    request_id: str
    preempted: bool = False


class ResetAll(_Command, frozen=True, tag="reset_all"):
    """Drop everything; abandon in-flight work safely."""


class Invalidate(_Command, frozen=True, tag="invalidate"):
    """The engine learned that these blocks' bytes are bad: evict the resident, unpinned
    ones (F17), so nothing offers them again."""

    block_hashes: Hashes


class EndFences(_Command, frozen=True, tag="end_fences"):
    """The executor is closed and its copies have stopped: every fence ends (F15)."""


class RemoteFound(_Command, frozen=True, tag="remote_found"):
    """A probe of the remote tier found these hashes there (remember them for lookups)."""

    block_hashes: Hashes


class DiskRestored(_Command, frozen=True, tag="disk_restored"):
    """The disk tier's journal vouches for these entries (``disk_slots[i]`` holds
    ``block_hashes[i]``), written by an earlier run: index them (a warm restart)."""

    block_hashes: Hashes
    disk_slots: Blocks


class TierRefused(_Command, frozen=True, tag="tier_refused"):
    """A shared tier refused the values it found under these keys, each value once:
    ``reasons[i]`` says why ``block_hashes[i]``'s was refused (another tenant's, forged, under
    a retired key ...: ``kvflow.tiers.entry.REJECTED``). ``job_ids[i]``: the load that read
    it and failed with it, or 0 when a probe refused it by its head alone (nothing was
    loaded). Whatever the tier's index still holds of them leaves it."""

    tier: SharedTier
    block_hashes: Hashes
    reasons: tuple[str, ...]
    job_ids: Blocks


Command = Union[
    Lookup,
    AcceptHits,
    BlocksComputed,
    DeviceBlocksEvicting,
    Touch,
    Evict,
    PlanStep,
    JobResult,
    JobResults,
    Tick,
    FinishRequest,
    ResetAll,
    Invalidate,
    EndFences,
    RemoteFound,
    DiskRestored,
    TierRefused,
]

COMMAND_TYPES: tuple[type, ...] = get_args(Command)
