"""Jobs: what moves where. A job's direction, the tuples of block hashes and block ids that
events and commands carry, and ``TransferJob``, what an executor is asked to copy.

This module is pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# store / load: device <-> host slots. remote_load: the remote tier -> host slots (a CPU-tier
# entry filled like a store: visible when it completes); remote_store: host slots -> the remote
# tier (the entries stay resident, pinned by the job while it reads their slots).
Direction = Literal["store", "load", "remote_store", "remote_load"]
STORE: Direction = "store"
LOAD: Direction = "load"
REMOTE_STORE: Direction = "remote_store"
REMOTE_LOAD: Direction = "remote_load"
# jobs whose entries are pending (STORE_QUEUED / STORING) until they complete
FILLING: tuple[str, ...] = (STORE, REMOTE_LOAD)

Hashes = tuple[int, ...]
Blocks = tuple[int, ...]


# gc=False: a job holds only scalars and tuples of them (see events.py)
class TransferJob(msgspec.Struct, frozen=True, gc=False):
    """What an executor is asked to do: copy ``device_blocks[i]`` <-> host ``slots[i]``."""

    job_id: int
    direction: Direction
    device_blocks: Blocks
    slots: Blocks
    hashes: Hashes = ()
    request_id: str | None = None
