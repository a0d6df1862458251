"""Reader of Mooncake-format workloads, the input of ``kvflow simulate`` (docs/simulate.md).

A workload is JSON Lines, one request per line, in arrival order::

    {"timestamp": <ms>, "input_length": <n>, "output_length": <n>, "hash_ids": [<id>, ...]}

with one hash id per ``block_tokens``-token block of the prompt, the last one usually partial.
Equal ids name reusable prefix blocks. Other keys on a line are ignored, so traces that carry
extra annotations still read.

The reader streams (one line in memory at a time) and checks every line, because a simulator fed a
subtly wrong workload reports plausible but wrong hit rates; a bad line stops the read with a
:class:`~kvflow.core.errors.TraceError` naming the file, the line and the field. A line is decoded
into a typed msgspec Struct whose constraints are the per-value checks; a line that fails is
decoded a second time, generically, to tell broken JSON from a wrong field and to quote the
offending value.

The package carries one workload, :data:`EXAMPLE_WORKLOAD`, for ``kvflow simulate --example``.

This module does no clock or randomness work and imports no torch.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated, cast

import msgspec

from kvflow.core.errors import ConfigError, TraceError
from kvflow.core.values import ID_LIMIT, is_int

__all__ = ["EXAMPLE_WORKLOAD", "MOONCAKE_BLOCK_TOKENS", "WorkloadRequest", "read_workload"]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake's released traces."""

EXAMPLE_WORKLOAD = Path(__file__).with_name("example.jsonl")
"""The workload that ships with kvflow (``kvflow simulate --example``): 200 requests from 4 shared
system prompts and 10 interleaved multi-turn conversations (each turn resends the whole history,
so prompts grow and share prefixes), Poisson arrivals (mean 400 ms), prompts of 2-29 blocks of
512 tokens, 589 distinct blocks. From the repository root,
``python tools/gen_workload.py --requests 200 --seed 7 --block-tokens 512 --out
kvflow/simulate/example.jsonl`` regenerates it byte for byte (a test checks it).

What the sequential simulation gives on it (LRU, eager stores, no device cache; the tests pin
these): 256 CPU blocks hit 865,792 of its 1,198,285 prompt tokens (72%) with 298 evictions;
an unbounded tier hits 950,272 (79%), the most its prefix reuse allows."""

MAX_LINE_BYTES = 64 << 20
"""The longest line the reader accepts (64 MiB, a prompt of millions of blocks): a longer one,
or a file that never ends a line (``/dev/zero``), is refused rather than read into memory."""


class WorkloadRequest(msgspec.Struct, frozen=True):
    """One request of a workload, as read and checked from its line."""

    line: int
    """1-based line number in the file, so that later errors can point back at the input."""
    timestamp_ms: float
    """Arrival time in ms since the start of the trace; non-decreasing along the file."""
    input_length: int
    """Prompt tokens, at least 1."""
    output_length: int
    """Generated tokens, at least 0."""
    hash_ids: tuple[int, ...]
    """One non-negative id per ``block_tokens``-token block of the prompt (last one partial)."""


_NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


class _MooncakeLine(msgspec.Struct):
    """The wire shape of one line; its constraints are the checks of each value."""

    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: _NonNegativeInt
    hash_ids: tuple[_NonNegativeInt, ...]


_LINE_DECODER = msgspec.json.Decoder(_MooncakeLine)


def read_workload(
    path: str | os.PathLike[str], block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> Iterator[WorkloadRequest]:
    """Yield the requests of the Mooncake workload at ``path`` (``.jsonl`` or ``.jsonl.gz``).

    Blank lines are skipped. Every other line must hold a JSON object with ``timestamp``
    (number >= 0, not before the previous request's, since the timed mode replays arrivals in
    file order), ``input_length`` (int >= 1), ``output_length`` (int >= 0) and ``hash_ids``
    (non-negative ints, exactly ``ceil(input_length / block_tokens)`` of them). Booleans are not
    ints. A file with no request is an error.

    Unlike kvflow's own traces, a torn last line (no trailing newline, not valid JSON)
    is an error here, not a warning: workloads are produced by generators and converters, not by
    processes that may crash mid-write, so a torn line means a damaged file.

    ``block_tokens`` is checked at once; the file is opened and read lazily, so I/O and content
    errors surface while iterating, as :class:`~kvflow.core.errors.TraceError`.
    """
    if not is_int(block_tokens) or block_tokens <= 0:
        raise ConfigError(f"block_tokens must be a positive int, got {block_tokens!r}")
    return _read_requests(os.fspath(path), block_tokens)


def _read_requests(path: str, block_tokens: int) -> Iterator[WorkloadRequest]:
    try:
        stream = cast(IO[bytes], gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb"))
    except OSError as exc:
        raise TraceError(path, None, f"cannot open: {exc.strerror or exc}") from exc

    with stream:
        line_number = 0
        previous: WorkloadRequest | None = None
        while True:
            # Read errors (bad gzip header, gzip stream cut short) are reported at the line the
            # reader was trying to get, rather than escaping as a bare OSError/EOFError.
            try:
                raw = stream.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:
                raise TraceError(path, line_number + 1, f"cannot read: {exc.strerror or exc}") from None
            except EOFError as exc:  # a gzip stream cut short
                raise TraceError(path, line_number + 1, f"cannot read: {exc}") from None
            except zlib.error as exc:
                raise TraceError(path, line_number + 1, f"cannot read: corrupt compressed data ({exc})") from None
            if not raw:
                break
            line_number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(path, line_number, f"line longer than {MAX_LINE_BYTES:,} bytes")
            if raw.isspace():
                continue
            request = _parse_line(path, line_number, raw, block_tokens)
            if previous is not None and request.timestamp_ms < previous.timestamp_ms:
                raise TraceError(
                    path,
                    line_number,
                    f"field 'timestamp': {_format_number(request.timestamp_ms)} is before "
                    f"{_format_number(previous.timestamp_ms)} of line {previous.line}; "
                    "requests must be in arrival order",
                )
            previous = request
            yield request

    if previous is None:
        raise TraceError(path, None, "no requests")


def _parse_line(path: str, line_number: int, raw: bytes, block_tokens: int) -> WorkloadRequest:
    try:
        parsed = _LINE_DECODER.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise TraceError(path, line_number, _explain_bad_line(raw, exc)) from None
    except UnicodeDecodeError:  # bytes that are not UTF-8 inside a string
        from kvflow.log.problems import utf8_problem  # (the error path only)

        raise TraceError(path, line_number, utf8_problem(raw)) from None
    except RecursionError:  # a value (of an ignored key, too) nested deeper than the decoder goes
        from kvflow.log.problems import nesting_problem

        raise TraceError(path, line_number, nesting_problem(raw)) from None

    if parsed.hash_ids and max(parsed.hash_ids) >= ID_LIMIT:  # (they become 64-bit block hashes)
        index, value = next((i, h) for i, h in enumerate(parsed.hash_ids) if h >= ID_LIMIT)
        raise TraceError(
            path,
            line_number,
            f"field 'hash_ids': item {index}: {value} does not fit in 64 bits (ids are 0..2**64-1)",
        )

    expected_ids = -(-parsed.input_length // block_tokens)
    if len(parsed.hash_ids) != expected_ids:
        raise TraceError(
            path,
            line_number,
            f"field 'hash_ids': has {len(parsed.hash_ids)} ids, expected "
            f"ceil({parsed.input_length}/{block_tokens}) = {expected_ids}",
        )
    return WorkloadRequest(
        line=line_number,
        timestamp_ms=parsed.timestamp,
        input_length=parsed.input_length,
        output_length=parsed.output_length,
        hash_ids=parsed.hash_ids,
    )


# --- turning a decode failure into a message about the field ------------------------------------

_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]*)`")
_AT_PATH = re.compile(r"^(?P<problem>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_STEP = re.compile(r"\.(?P<key>[^.\[]+)|\[(?P<index>\d+)\]")
_NOT_DECODED = object()


def _explain_bad_line(raw: bytes, error: msgspec.DecodeError) -> str:
    """Say why ``raw`` failed the typed decode, naming the field where there is one.

    The typed decoder stops at the first value of the wrong type, so a broken line such as
    ``{"input_length": "x", `` is reported as a type error; decoding again without a schema tells
    broken JSON apart and gives the actual value to quote.
    """
    try:
        document: object = msgspec.json.decode(raw)
    except (msgspec.ValidationError, RecursionError):  # valid JSON msgspec cannot hold: 1e400
        document = _NOT_DECODED
    except UnicodeDecodeError:
        from kvflow.log.problems import utf8_problem  # (the error path only)

        return utf8_problem(raw)
    except msgspec.DecodeError as json_error:
        from kvflow.log.problems import is_utf8_error, syntax_error_field, utf8_problem

        if is_utf8_error(json_error):
            return utf8_problem(raw)

        torn = "" if raw.endswith(b"\n") else " (last line has no newline: a torn write?)"
        field = syntax_error_field(str(json_error), raw)
        where = "" if field is None else f"field {field!r}: "
        return f"{where}not valid JSON: {json_error}{torn}"

    message = str(error)
    missing = _MISSING_FIELD.match(message)
    if missing:
        return f"missing field {missing['field']!r}"

    at_path = _AT_PATH.match(message)
    assert at_path is not None  # the pattern matches any string
    # msgspec names the Python type; a float field accepts any JSON number, so say "number".
    problem = at_path["problem"].replace("`", "").replace("Expected float", "Expected number")
    problem = problem[:1].lower() + problem[1:]
    if not at_path["path"]:
        # The only check without a location is the top-level one: the line is not an object.
        return f"not a JSON object ({problem})"

    steps = [(m["key"], m["index"]) for m in _PATH_STEP.finditer(at_path["path"])]
    where = f"field {steps[0][0]!r}" + "".join(f": item {index}" for _, index in steps[1:])
    value = _value_at(document, steps)
    if value is not _NOT_DECODED and value is not None:  # "got null" already says it all
        shown = msgspec.json.encode(value).decode()
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        problem += f" ({shown})" if ", got " in problem else f", got {shown}"
    return f"{where}: {problem}"


def _value_at(document: object, steps: list[tuple[str | None, str | None]]) -> object:
    value = document
    for key, index in steps:
        try:
            value = value[key] if key is not None else value[int(index or 0)]  # type: ignore[index]
        except (LookupError, TypeError):
            return _NOT_DECODED
    return value


def _format_number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)
