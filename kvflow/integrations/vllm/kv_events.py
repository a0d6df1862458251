"""vLLM-compatible KV cache events, derived from kvflow's event log.

Consumers outside kvflow (a KV-aware router, a cache index) subscribe to vLLM's KV events:
``BlockStored`` when blocks become available in a medium, ``BlockRemoved`` when they leave it,
``AllBlocksCleared`` on a reset. kvflow derives them from its own events, per tier (medium
``CPU``, ``DISK``, ``REMOTE``):

* a job that filled a tier completed (and was not abandoned by a reset) -> ``BlockStored`` in
  that tier: a store or a load from a lower tier (``CPU``), a disk store (``DISK``), a remote
  store (``REMOTE``);
* blocks evicted -> ``BlockRemoved`` (``CPU``); disk entries evicted or found unusable ->
  ``BlockRemoved`` (``DISK``); a remote load that failed drops its blocks from kvflow's view of
  the remote tier -> ``BlockRemoved`` (``REMOTE``);
* the disk tier's journal vouched for entries at start (a warm restart) -> ``BlockStored``
  (``DISK``);
* a reset -> ``AllBlocksCleared``: the CPU tier's blocks are gone. (vLLM's event names no
  medium; a reset leaves the disk and remote entries in place, and a consumer learns of them
  again as they are stored.)

A hash becomes visible only when its store completes (F3), so consumers never learn of a
block that is not readable. Pure: a function of the events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import msgspec

from kvflow.core.events import (
    BlocksEvicted,
    DiskEvicted,
    DiskIndexed,
    Event,
    JobCompleted,
    JobFailed,
    Reset,
)
from kvflow.core.jobs import DISK_LOAD, DISK_STORE, REMOTE_LOAD, REMOTE_STORE, STORE

MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE = "CPU", "DISK", "REMOTE"
# the tier a completed job of each direction put its blocks in
STORED_IN = {STORE: MEDIUM_CPU, REMOTE_LOAD: MEDIUM_CPU, DISK_LOAD: MEDIUM_CPU,
             DISK_STORE: MEDIUM_DISK, REMOTE_STORE: MEDIUM_REMOTE}  # fmt: skip


# The structs follow vLLM's KV event schema (vllm/distributed/kv_events.py): the same tags
# (the class name, in a ``type`` field), field names, order, required fields and None
# defaults, omitted when default, so vLLM's own decoder and consumers (routers, cache
# indexes) read them. ``seq`` is kvflow's alone (the event that caused it, for debugging);
# left at 0 it is omitted, which is how they go on the wire (kvflow.integrations.vllm.kv_events_zmq).
class BlockStored(msgspec.Struct, frozen=True, tag="BlockStored", omit_defaults=True):
    """Blocks now readable in ``medium`` (named by kvflow's hashes, or vLLM's own: bytes or
    ints, vLLM's ``ExternalBlockHash``)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    seq: int = 0  # kvflow's: the event that caused it


class BlockRemoved(msgspec.Struct, frozen=True, tag="BlockRemoved", omit_defaults=True):
    """Blocks no longer readable in ``medium``."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    seq: int = 0


class AllBlocksCleared(msgspec.Struct, frozen=True, tag="AllBlocksCleared", omit_defaults=True):
    """Every block of the publisher is gone (vLLM's has no fields: the medium is implied)."""

    seq: int = 0


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """vLLM's batch on the wire: ``[ts, events, data_parallel_rank]`` (msgpack)."""

    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def kv_event(event: Event, block_tokens: int) -> KVEvent | None:
    """The KV event one kvflow event implies, or None."""
    found = kv_events((event,), block_tokens)
    return found[0] if found else None


def kv_events(events: Iterable[Event], block_tokens: int) -> list[KVEvent]:
    """Every KV event the log implies, in log order."""
    publisher = KVEventPublisher(block_tokens)
    for event in events:
        publisher(event)
    return publisher.take()


class KVEventPublisher:
    """Collects KV events as a manager applies events: ``manager.subscribe(pub)``, then
    ``pub.take()`` each step (e.g. to hand to vLLM's ``KVEventBatch``)."""

    # the kvflow events that can imply a KV event (``subscribe`` reads this)
    event_types = (JobCompleted, JobFailed, BlocksEvicted, DiskEvicted, DiskIndexed, Reset)

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._pending: list[KVEvent] = []

    def __call__(self, event: Event) -> None:
        """The KV event ``event`` implies, if any, is kept for ``take`` (the translation's
        one home: ``kv_event`` and ``kv_events`` go through it too)."""
        kv: KVEvent
        if isinstance(event, (JobCompleted, DiskIndexed)):
            medium = MEDIUM_DISK if isinstance(event, DiskIndexed) else STORED_IN.get(event.direction)
            if medium is None or getattr(event, "abandoned", False):
                return
            kv = BlockStored(
                block_hashes=list(event.hashes),
                parent_block_hash=None,
                token_ids=[],
                block_size=self.block_tokens,
                lora_id=None,
                medium=medium,
                lora_name=None,
                seq=event.seq,
            )
        elif isinstance(event, JobFailed):
            if event.direction != REMOTE_LOAD or event.abandoned:
                return
            kv = BlockRemoved(block_hashes=list(event.hashes), medium=MEDIUM_REMOTE, seq=event.seq)
        elif isinstance(event, BlocksEvicted):
            kv = BlockRemoved(block_hashes=list(event.hashes), medium=MEDIUM_CPU, seq=event.seq)
        elif isinstance(event, DiskEvicted):
            kv = BlockRemoved(block_hashes=list(event.hashes), medium=MEDIUM_DISK, seq=event.seq)
        elif isinstance(event, Reset):
            kv = AllBlocksCleared(seq=event.seq)
        else:
            return
        self._pending.append(kv)

    def take(self) -> list[KVEvent]:
        out, self._pending = self._pending, []
        return out
