"""What a trace file holds (DESIGN §5): its header, its records and their versions, and the
record chain that makes an altered trace evident.

A trace is JSON lines (``.gz`` for gzip): one header line, then records in order: the commands
given to kvflow, the events it appended, and periodic checkpoints. A checkpoint carries the state
digest at its ``seq`` and, from version 3, ``records``: a digest of every byte of the trace
before the checkpoint's own line, header included (``RecordChain``). The fold checks the state
digest; the reader checks the record digest, so a changed field that drives no state (an error
text, a request id, a time, the header) is found too.
"""

from __future__ import annotations

import hashlib
from typing import Any, Union

import msgspec

from kvflow.core.commands import COMMAND_TYPES, Command, Touch
from kvflow.core.events import EVENT_TYPES, Event, JobCompleted, JobFailed, JobTimedOut

TRACE_FORMAT = "kvflow-trace"
TRACE_VERSION = 3
DEFAULT_CHECKPOINT_EVERY = 10_000
CHAINED_SINCE = 3
"""The first version whose checkpoints carry the record digest (``Checkpoint.records``)."""

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


Record = Union[Command, Event, Checkpoint]  # type: ignore[valid-type]
RECORD_TYPES: tuple[type, ...] = (*COMMAND_TYPES, *EVENT_TYPES, Checkpoint)
RecordUnion = Union[tuple(RECORD_TYPES)]  # type: ignore[valid-type]


def _skimmed(command: type) -> type:
    """A record type with ``command``'s tag and no fields: decoding a line into it checks the
    JSON and skips every field without building a value (``SKIM_UNION``)."""
    tag = command.__struct_config__.tag  # type: ignore[attr-defined]
    return msgspec.defstruct(f"Skimmed{command.__name__}", [], tag=tag, tag_field="type", frozen=True, gc=False)


SKIMMED_COMMANDS: tuple[type, ...] = tuple(map(_skimmed, COMMAND_TYPES))
SkimUnion = Union[(*SKIMMED_COMMANDS, *EVENT_TYPES, Checkpoint)]  # type: ignore[valid-type]
"""Events and checkpoints in full, commands skimmed: what a plain fold needs from a chained
trace, whose record digests vouch for the commands' bytes (``TraceReader``)."""

JOB_PAYLOAD = ("hashes", "device_blocks", "slots")
"""The fields a job's end repeats from the job the state holds (its queued event's)."""


class TrustedRank(int):
    """A rank read by ``trusted_decoder(world_size)``, which checks as it decodes that it is a
    rank of the trace's world_size, so that the reader need not walk a chunk's records for the
    ranks (``kvflow.log.ranges``)."""


class FailedRank(TrustedRank):
    """A job_failed's rank: -1 too (the job was cancelled before any rank ran)."""


def _trusted_form(event: type) -> type:
    """``event`` as ``TrustedUnion`` reads it: its tag and its fields less ``JOB_PAYLOAD`` (decoding
    a line into it checks the payload's JSON and skips it without building three tuples of
    integers), its rank a ``TrustedRank``."""
    rank = FailedRank if event is JobFailed else TrustedRank
    names = msgspec.structs.fields(event)
    fields: list[Any] = []
    for f in names:
        if f.name in JOB_PAYLOAD:
            continue
        kind = rank if f.name == "rank" else f.type
        fields.append((f.name, kind) if f.required else (f.name, kind, f.default))
    tag = event.__struct_config__.tag  # type: ignore[attr-defined]
    form = "WithoutPayload" if any(f.name in JOB_PAYLOAD for f in names) else "RankChecked"
    return msgspec.defstruct(
        f"{event.__name__}{form}", fields, tag=tag, tag_field="type", frozen=True, kw_only=True, gc=False
    )


JOB_ENDS_WITHOUT_PAYLOAD: dict[type, type] = {
    _trusted_form(end): end for end in (JobCompleted, JobFailed, JobTimedOut)
}
"""Job ends read without their payload -> the event each stands for. The fold applies one
unchecked as it is: an unchecked job end reads its payload from its job in the state, never
from the event (``kvflow.core.state.job_events``)."""
TRUSTED_FORMS: dict[type, type] = {
    **JOB_ENDS_WITHOUT_PAYLOAD,
    **{
        _trusted_form(event): event
        for event in EVENT_TYPES
        if event not in JOB_ENDS_WITHOUT_PAYLOAD.values()
        and any(f.name == "rank" for f in msgspec.structs.fields(event))
    },
}
"""The events ``TrustedUnion`` reads in a form of their own -> the event each stands for: the job
ends without their payload, and every other event with a rank (a ``TrustedRank``). The fold
applies each with its event's evolver (kvflow.replay.fold)."""
TrustedUnion = Union[  # type: ignore[valid-type]
    (
        *SKIMMED_COMMANDS,
        *(t for t in EVENT_TYPES if t not in TRUSTED_FORMS.values()),
        *TRUSTED_FORMS,
    )
]
"""``SkimUnion`` with ``TRUSTED_FORMS``: what the fold needs where it applies events unchecked, as
the live engine did, and lets the checkpoints judge (kvflow.replay.fold): there the job in the state
holds the payload, and the record digest vouches that the line carried the same. Read with
``trusted_decoder``. It holds no checkpoint: a chunk with one is read line by line (the record
chain checks its digest against the bytes before its line)."""


def trusted_decoder(world_size: int) -> msgspec.json.Decoder[Any]:
    """The decoder of ``TrustedUnion`` for a trace of ``world_size`` ranks: a rank outside
    ``0..world_size - 1`` (or -1 for a job_failed) fails the decoding like a bad line."""
    # every rank there is, made once (world_size is at most MAX_WORLD_SIZE): a decoded rank is
    # looked up, not built; a job_failed's from -1
    ranks: dict[type, tuple[TrustedRank, ...]] = {
        TrustedRank: tuple(map(TrustedRank, range(world_size))),
        FailedRank: tuple(map(FailedRank, range(-1, world_size))),
    }

    def rank(kind: type, value: Any) -> TrustedRank:
        if type(value) is int:
            low = -1 if kind is FailedRank else 0
            if low <= value < world_size:
                return ranks[kind][value - low]
        raise ValueError(f"not a rank of world_size {world_size}")

    return msgspec.json.Decoder(TrustedUnion, dec_hook=rank)


class Header(msgspec.Struct, frozen=True, kw_only=True):
    format: str
    version: int
    kvflow: str
    config: dict[str, Any]
    meta: dict[str, Any] = {}


class RecordChain:
    """The running digest of a trace's bytes: SHA-256 (hardware-accelerated on current x86 and
    Arm cores: about 3x blake2b's speed where measured), cut to 128 bits like the state digest.
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
differs from 3 only in the record digest its checkpoints lack.)"""
