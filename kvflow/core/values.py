"""Value rules, in one place: what an integer, a hash, a block id, a flag or a time must be,
and the engine-facing boundary (F19) that applies them before anything changes.

An engine calls kvflow with whatever its own code holds: numpy integers, ranges, lists, a NaN
from a broken clock, a string where a flag belongs. Everything that reaches a command is
normalised here to the plain values a trace can record and read back (ints within 64 bits,
``str`` request ids, ``bool`` flags, finite times), or refused with
:class:`~kvflow.core.errors.Rejected` and a one-line message, before the command exists: a refused
call leaves state and trace unchanged. Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any, SupportsIndex, TypeGuard, cast

import msgspec

from kvflow.core.commands import JobResult
from kvflow.core.errors import Rejected

HASH_MIN = -(2**63)  # block hashes are 64-bit, signed or unsigned
ID_LIMIT = 2**64  # device block ids and hashes stay below this (traces and digests encode them)
# msgspec encodes exactly the ints in [HASH_MIN, ID_LIMIT) and raises OverflowError for any
# other: the range check of a tuple of hashes is an encode (the bytes are thrown away)
_encode_ints = msgspec.msgpack.Encoder().encode


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``: Python's ``True`` is the integer 1, but a flag given
    where a count, an id or a size belongs is a caller's mistake, never a number."""
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def ints(values: Sequence[int], what: str = "block ids") -> tuple[int, ...]:
    """A tuple of plain ints. Tuples and lists of plain ints are taken as they are; numpy
    integers and other integer-likes are converted with ``operator.index``, which refuses lossy
    values such as 1.5 (and bools are integers: True is 1)."""
    if type(values) in (tuple, list, range) and operator.countOf(map(type, values), int) == len(values):
        return tuple(values)
    try:
        return tuple(map(operator.index, values))
    except TypeError:
        raise Rejected(f"{what} must be integers, got {list(values)[:4]!r}") from None


def fits_64_bits(values: tuple[int, ...]) -> bool:
    """Whether every one of ``values`` is within ``HASH_MIN .. ID_LIMIT - 1``: exactly the
    integers a trace can record (msgspec encodes those and refuses any other)."""
    try:
        _encode_ints(values)
    except OverflowError:
        return False
    return True


def hashes(values: Sequence[int]) -> tuple[int, ...]:
    """Block hashes: integers that fit in 64 bits (signed or unsigned), so that traces and
    state digests encode them exactly. Hash a longer digest down first (e.g. its first 8
    bytes as an int).

    A tuple passes as it is when msgpack writes each of its values in a 9-byte int form (a
    tag, 0xcf unsigned or 0xd3 signed, then 8 bytes): real block hashes, 64-bit digests, all
    are, and a bool, a float, a string or an int beyond 64 bits is written otherwise, so one
    encode answers both rules for the tuples an engine passes on every call
    (docs/performance.md); anything else is converted and checked value by value."""
    if type(values) is tuple:
        try:
            encoded = _encode_ints(values)
        except (OverflowError, TypeError):
            pass  # (named below)
        else:
            n = len(values)
            header = 1 if n < 16 else 3 if n < 2**16 else 5  # (the msgpack array's header)
            if len(encoded) == header + 9 * n and not encoded[header::9].translate(None, b"\xcf\xd3"):
                return values
    out = ints(values, "block hashes")
    if not fits_64_bits(out):
        raise Rejected("block hashes must fit in 64 bits; hash a longer digest down to 8 bytes first")
    return out


def device_blocks(values: Sequence[int]) -> tuple[int, ...]:
    """Device block ids: integers below 2**64 (negative ids are refused by the decisions,
    which also check them against the blocks live jobs hold)."""
    out = ints(values, "device blocks")
    if not fits_64_bits(out) and max(out) >= ID_LIMIT:  # (below -2**63: the decisions refuse it)
        raise Rejected(f"device block {max(out)} does not fit in 64 bits")
    return out


def request_id(value: object) -> str:
    if type(value) is not str:
        raise Rejected(f"request ids are str, got {type(value).__name__} {value!r}")
    return value


def optional_request_id(value: object) -> str | None:
    return None if value is None else request_id(value)


def flag(value: object, name: str) -> bool:
    if type(value) is not bool:
        raise Rejected(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def count(value: object, name: str) -> int:
    """A whole number >= 0 (numpy integers accepted, bools refused)."""
    if is_int(value):
        number = value
    elif isinstance(value, bool):
        raise Rejected(f"{name} must be a whole number >= 0, got {value!r}")
    else:
        try:
            number = operator.index(cast(SupportsIndex, value))  # (TypeError: no integer)
        except TypeError:
            raise Rejected(f"{name} must be a whole number >= 0, got {type(value).__name__} {value!r}") from None
    if number < 0:
        raise Rejected(f"{name} must be a whole number >= 0, got {number!r}")
    return number


def time_ms(value: object, name: str) -> float:
    """A finite time in milliseconds (a NaN or infinite clock would make a job that never
    times out and a trace that does not read back)."""
    if isinstance(value, float):
        ms = value
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        # (ints and numpy numbers are numbers.Real; bools, strings and None are refused)
        raise Rejected(f"{name} must be a number of milliseconds, got {type(value).__name__} {value!r}")
    else:
        ms = float(value)
    if not math.isfinite(ms):
        raise Rejected(f"{name} must be finite, got {value!r}")
    return ms


def result(value: Any) -> JobResult:
    """An executor's outcome as the decisions take it. Job id and rank are normalised to ints
    (a bad one is the decisions' to refuse, naming it); an ``ok`` that is not a bool or an
    ``error`` that is not a string makes the result a failure with a clear error, never a
    success (``ok="false"`` is truthy)."""
    if (
        type(value) is JobResult
        and type(value.job_id) is int
        and type(value.rank) is int
        and type(value.ok) is bool
        and (value.error is None or type(value.error) is str)
        and value.corrupt == ()
    ):
        return value  # (an executor's own well-formed result: nothing to normalise)
    job_id: Any = getattr(value, "job_id", None)
    rank: Any = getattr(value, "rank", None)
    try:
        job_id, rank = operator.index(job_id), operator.index(rank)
    except TypeError:
        pass  # left as they are: the decisions refuse them with their values
    ok, error = getattr(value, "ok", None), getattr(value, "error", None)
    corrupt = getattr(value, "corrupt", ())
    if type(corrupt) is not tuple or list(map(type, corrupt)).count(int) != len(corrupt):
        try:
            corrupt = hashes(corrupt)
        except (Rejected, TypeError):
            corrupt = ()  # unreadable: the failure itself still stands
    if type(ok) is bool and (error is None or type(error) is str):
        if type(value) is JobResult and job_id is value.job_id and rank is value.rank and corrupt is value.corrupt:
            return value
        return JobResult(job_id=job_id, rank=rank, ok=ok, error=error, corrupt=corrupt)
    return JobResult(
        job_id=job_id,
        rank=rank,
        ok=False,
        error=f"malformed executor result (ok={ok!r}, error={error!r}): treated as failed",
        corrupt=corrupt,
    )
