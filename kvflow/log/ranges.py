"""Range checks at read time: a record's integers must be values a live engine could have
recorded (kvflow.core.values).

Block hashes fit in 64 bits, signed or unsigned; every other integer (seq, job ids, device
blocks, slots, counts) is within 0..2**64-1; a rank is below the header's world_size (a
job_failed's rank may be -1: the job was cancelled before any rank ran). A chunk is checked
as a whole: encoding it as msgpack refuses any integer outside 64 bits, a negative integer needs
a '-' right after ':', ',' or '[' (or blanks), and its ranks are compared with the world size.
Only a chunk that fails one of these is walked record by record, to name the line and field (or
to find that the '-' was inside a string); docs/performance.md says why.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import compress, repeat
from typing import Any, cast

import msgspec

from kvflow.core.errors import TraceError
from kvflow.core.events import JobFailed
from kvflow.core.values import HASH_MIN, ID_LIMIT
from kvflow.log.format import RECORD_TYPES

_ONE, _MANY, _NESTED = 0, 1, 2
_HASH_FIELDS = frozenset({"hashes", "block_hashes", "corrupt"})
_WORLD = -1  # the upper bound is the header's world_size


def _int_fields(cls: type) -> tuple[tuple[str, int, int, int], ...]:
    """(field, kind, low, high) for every integer field of a record type (and every field
    holding records, kind _NESTED)."""
    import msgspec.inspect as mi

    out: list[tuple[str, int, int, int]] = []
    info = cast(Any, mi.type_info(cls))  # (a StructType: every record type is a struct)
    for f in info.fields:
        t = f.type
        if isinstance(t, mi.IntType):
            kind = _ONE
        elif isinstance(t, mi.VarTupleType) and isinstance(t.item_type, mi.IntType):
            kind = _MANY
        elif isinstance(t, mi.VarTupleType) and isinstance(t.item_type, mi.StructType):
            out.append((f.name, _NESTED, 0, 0))
            continue
        else:
            continue
        if f.name in _HASH_FIELDS:
            low, high = HASH_MIN, ID_LIMIT
        elif f.name == "rank":
            cancelled = info.tag == JobFailed.__struct_config__.tag
            low, high = (-1 if cancelled else 0), _WORLD
        else:
            low, high = 0, ID_LIMIT
        out.append((f.name, kind, low, high))
    return tuple(out)


_INT_FIELDS: dict[type, tuple[tuple[str, int, int, int], ...]] = {t: _int_fields(t) for t in RECORD_TYPES}
_RANKED = frozenset(t for t, fields in _INT_FIELDS.items() if any(f[0] == "rank" for f in fields))
_NESTING = frozenset(t for t, fields in _INT_FIELDS.items() if any(f[1] == _NESTED for f in fields))
_BEFORE_MINUS = (b":", b",", b"[", b" ", b"\t", b"\r")
_rank_of = operator.attrgetter("rank")
_encode_msgpack_into = msgspec.msgpack.Encoder().encode_into


def _bounds_text(name: str, low: int, high: int, world: int) -> str:
    if name in _HASH_FIELDS:
        return "does not fit in 64 bits (block hashes are within -2**63..2**64-1)"
    if high == _WORLD:
        cancelled = "; -1: cancelled before any rank ran" if low < 0 else ""
        return f"is not a rank of world_size {world} ({low}..{world - 1}{cancelled})"
    return "is out of range (0..2**64-1)"


def range_problem(rec: Any, world: int) -> str | None:
    """The first integer of ``rec`` outside its range, as ``field 'x': message``."""
    for name, kind, low, high in _INT_FIELDS.get(type(rec), ()):
        value = getattr(rec, name)
        top = world if high == _WORLD else high
        if kind == _ONE:
            if not low <= value < top:
                return f"field '{name}': {value} {_bounds_text(name, low, high, world)}"
        elif kind == _MANY:
            if value and (min(value) < low or max(value) >= top):
                i, bad = next((i, v) for i, v in enumerate(value) if not low <= v < top)
                return f"field '{name}[{i}]': {bad} {_bounds_text(name, low, high, world)}"
        else:
            for i, item in enumerate(value):
                problem = range_problem(item, world)
                if problem is not None:
                    return problem.replace("field '", f"field '{name}[{i}].", 1)
    return None


def _may_hold_negative(block: bytes) -> bool:
    """Could ``block`` (JSON lines) hold a negative number? Only if a '-' follows ':', ',', '['
    or a blank; a '-' inside a string ("req-7") may too: then the records are walked."""
    if b"-" not in block:
        return False
    pieces = block.split(b"-")
    pieces.pop()
    return any(map(bytes.endswith, pieces, repeat(_BEFORE_MINUS)))


def _ranks_fit(recs: list[Any], kinds: set[type], world: int) -> bool:
    """Every rank below ``world`` (ranks are known to be >= 0 here); ``kinds``: the set of the
    records' types."""
    if not kinds.isdisjoint(_RANKED):
        ranked = compress(recs, map(_RANKED.__contains__, map(type, recs)))
        if max(map(_rank_of, ranked)) >= world:
            return False
    if kinds.isdisjoint(_NESTING):
        return True
    for rec in compress(recs, map(_NESTING.__contains__, map(type, recs))):
        for name, kind, _low, _high in _INT_FIELDS[type(rec)]:
            if kind == _NESTED and not all(
                range_problem(item, world) is None for item in getattr(rec, name)
            ):
                return False
    return True


def first_out_of_range(
    path: str,
    block: bytes,
    numbers: Sequence[int],
    recs: list[Any],
    world: int,
    scratch: bytearray,
) -> TraceError | None:
    """The TraceError naming the first record of ``recs`` (read from ``block``, lines
    ``numbers``) with an integer out of its range, or None; ``scratch`` is reused to encode
    into."""
    try:
        _encode_msgpack_into(recs, scratch)  # raises for an integer outside 64 bits
        suspect = _may_hold_negative(block) or not _ranks_fit(recs, set(map(type, recs)), world)
    except (OverflowError, ValueError, TypeError):
        suspect = True
    if not suspect:
        return None
    for line, rec in zip(numbers, recs):
        problem = range_problem(rec, world)
        if problem is not None:
            return TraceError(path, line, problem)
    return None
