"""Range checks at read time: a record's integers must be values a live engine could have
recorded (kvflow.core.values).

Block hashes fit in 64 bits, signed or unsigned; every other integer (seq, job ids, device
blocks, slots, counts) is within 0..2**64-1; a rank is below the header's world_size (a
job_failed's rank may be -1: the job was cancelled before any rank ran). Every record is
checked as it is read, and the first integer out of its range is named with its line and field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

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
    for f in cast(Any, mi.type_info(cls)).fields:
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
            cancelled = cls.__struct_config__.tag == JobFailed.__struct_config__.tag  # type: ignore[attr-defined]
            low, high = (-1 if cancelled else 0), _WORLD
        else:
            low, high = 0, ID_LIMIT
        out.append((f.name, kind, low, high))
    return tuple(out)


_INT_FIELDS: dict[type, tuple[tuple[str, int, int, int], ...]] = {t: _int_fields(t) for t in RECORD_TYPES}


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


def first_out_of_range(path: str, numbers: Sequence[int], recs: list[Any], world: int) -> TraceError | None:
    """The TraceError naming the first record of ``recs`` (read from lines ``numbers``) with an
    integer out of its range, or None."""
    for line, rec in zip(numbers, recs):
        problem = range_problem(rec, world)
        if problem is not None:
            return TraceError(path, line, problem)
    return None
