"""Jobs: what moves where. A job's direction, the tuples of block hashes and block ids that
events and commands carry, and ``TransferJob``, what an executor is asked to copy.

This module is pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvflow.core.names import BlockName

# store / load: device <-> host slots. remote_load: the remote tier -> host slots (a CPU-tier
# entry filled like a store: visible when it completes); remote_store: host slots -> the remote
# tier (the entries stay resident, pinned by the job while it reads their slots).
# disk_load / disk_store: the same between host slots and the disk tier's slots (``disk_slots``).
Direction = Literal["store", "load", "remote_store", "remote_load", "disk_store", "disk_load"]
STORE: Direction = "store"
LOAD: Direction = "load"
REMOTE_STORE: Direction = "remote_store"
REMOTE_LOAD: Direction = "remote_load"
DISK_STORE: Direction = "disk_store"
DISK_LOAD: Direction = "disk_load"
# jobs whose entries are pending (STORE_QUEUED / STORING) until they complete
FILLING: tuple[str, ...] = (STORE, REMOTE_LOAD, DISK_LOAD)
# jobs that read resident entries' host slots for a lower tier, pinning them meanwhile
COPYING_DOWN: tuple[str, ...] = (REMOTE_STORE, DISK_STORE)

Hashes = tuple[int, ...]
Blocks = tuple[int, ...]

# the tiers shared with other deployments, whose entries a reader proves before it uses them
SharedTier = Literal["remote", "disk"]
SHARED_TIERS: tuple[SharedTier, ...] = ("remote", "disk")


# --- ranks ----------------------------------------------------------------------------------
# A job's copy runs on every rank of the world (tensor parallelism); which ranks have reported
# is a bit mask, one bit per rank (``Job.acks``, ``Job.reported``), that the state digest
# records as one 64-bit integer (hence ``MAX_WORLD_SIZE``).


def is_rank(rank: int, world_size: int) -> bool:
    """Is ``rank`` one of the world's ranks, ``0 .. world_size - 1``?"""
    return 0 <= rank < world_size


def every_rank(world_size: int) -> int:
    """The mask of a job every rank of the world has reported."""
    return (1 << world_size) - 1


def with_rank(mask: int, rank: int) -> int:
    """``mask`` with ``rank`` (a rank of the world) added."""
    return mask | 1 << rank


def has_rank(mask: int, rank: int) -> bool:
    """Is ``rank`` (a rank of the world) in ``mask``?"""
    return mask >> rank & 1 == 1


def ranks_in(mask: int) -> tuple[int, ...]:
    """The ranks of ``mask``, in order."""
    return tuple(r for r in range(mask.bit_length()) if mask >> r & 1)


def ranks_missing(mask: int, world_size: int) -> tuple[int, ...]:
    """The ranks of the world that ``mask`` lacks, in order."""
    return ranks_in(every_rank(world_size) & ~mask)


# gc=False: a job holds only scalars and tuples of them (see events.py)
class TransferJob(msgspec.Struct, frozen=True, gc=False):
    """What an executor is asked to do: copy ``device_blocks[i]`` <-> host ``slots[i]``, or
    for a disk job, host ``slots[i]`` <-> the disk tier's ``disk_slots[i]``."""

    job_id: int
    direction: Direction
    device_blocks: Blocks
    slots: Blocks
    hashes: Hashes = ()
    request_id: str | None = None
    disk_slots: Blocks = ()
    # the full names of ``hashes`` (kvflow.core.names), for a disk or remote job: the shared
    # tiers key and authenticate entries by them (the engine fills them when it hands the job
    # over, unless every key is its own hash; a tier reads them with names.tier_names)
    names: tuple[BlockName, ...] = ()
