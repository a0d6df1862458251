"""What a trace file holds: its header, its records and their versions, and the
record chain that makes an altered trace evident.

A trace is JSON lines (``.gz`` for gzip): one header line, then records in order: the commands
given to kvflow, the events it appended, and periodic checkpoints. A checkpoint carries the state
digest at its ``seq`` (from version 4 the one kept as the state changes) and, from version 3, ``records``: a digest of every byte of the trace
before the checkpoint's own line, header included (``RecordChain``). The fold checks the state
digest; the reader checks the record digest, so a changed field that drives no state (an error
text, a request id, a time, the header) is found too.
"""

from __future__ import annotations

import hashlib
from typing import Any, Union

import msgspec

from kvflow.core.commands import COMMAND_TYPES, Command, Touch
from kvflow.core.events import EVENT_TYPES, Event

TRACE_FORMAT = "kvflow-trace"
TRACE_VERSION = 4
DEFAULT_CHECKPOINT_EVERY = 10_000
CHAINED_SINCE = 3
"""The first version whose checkpoints carry the record digest (``Checkpoint.records``)."""
INCREMENTAL_DIGEST_SINCE = 4
"""The first version whose checkpoints carry the state digest kept as the state changes
(kvflow.core.state.digest); an older trace's carry the digest of the whole state, and its fold
computes that one (``State(config, full_digest=True)``)."""

MAX_LINE_BYTES = 64 << 20
"""The longest line a reader accepts (64 MiB; a record listing a million hashes is about 20 MiB).
A longer one, or a file that never ends a line (``/dev/zero``), is refused rather than read
into memory without bound."""


class Checkpoint(msgspec.Struct, frozen=True, tag="checkpoint", tag_field="type", omit_defaults=True):
    """The state digest after every event up to ``seq`` was applied, and (version 3) the digest
    of the trace's bytes before this line."""

    seq: int
    digest: str
    records: str = ""


Record = Union[Command, Event, Checkpoint]
RECORD_TYPES: tuple[type, ...] = (*COMMAND_TYPES, *EVENT_TYPES, Checkpoint)
RecordUnion = Union[tuple(RECORD_TYPES)]  # type: ignore[valid-type]


class Header(msgspec.Struct, frozen=True, kw_only=True):
    format: str
    version: int
    kvflow: str
    config: dict[str, Any]
    meta: dict[str, Any] = {}


class RecordChain:
    """The running digest of a trace's bytes: SHA-256 (hardware-accelerated on current x86 and
    Arm cores, unlike the state digest's blake2b), cut to 128 bits like the state digest.
    The writer and the reader feed it the same bytes in the same order; a checkpoint records
    ``value()`` before its own line is fed."""

    def __init__(self, first: bytes = b"") -> None:
        self._hash = hashlib.sha256(first)

    def update(self, data: bytes | memoryview) -> None:
        self._hash.update(data)

    def value(self) -> str:
        return self._hash.hexdigest()[:32]


def _upcast_v1(record: Any) -> Any:
    """Version 1 (before F14 kept touches of blocks still being stored): its touches skipped
    such blocks, so re-deciding one must too."""
    if type(record) is Touch:
        return msgspec.structs.replace(record, keep_pending=False)
    return record


UPCASTS: dict[int, Any] = {1: _upcast_v1}
"""Version upgrades: version -> function mapping an old record to the current form. (Version 2
differs from 3 only in the record digest its checkpoints lack, and 3 from 4 only in the form of
the state digest its checkpoints carry: ``INCREMENTAL_DIGEST_SINCE``.)"""
