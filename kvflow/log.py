"""The event log: in memory, and as a trace file (DESIGN §5).

A trace is JSON lines (``.gz`` for gzip): one header line, then records in order: the commands
given to kvflow, the events it appended, and periodic checkpoints carrying the state digest.
Executor outcomes are the recorded ``job_result`` commands (with their error text).

Reading is streaming. A torn last line (a crash mid-write) is reported through ``warnings`` and
ignored; any other malformed line raises :class:`TraceError` naming file and line; a newer
version is refused. Older versions are upgraded record by record (``_UPCASTS``).
"""

from __future__ import annotations

import gzip
import io
import itertools
import operator
import os
import re
import zlib
from collections.abc import Generator, Iterator, Sequence
from itertools import compress, repeat
from typing import IO, Any, Union, cast

import msgspec

from kvflow._version import __version__
from kvflow.boundary import HASH_MIN, ID_LIMIT
from kvflow.config import Config, config_from_dict
from kvflow.errors import ConfigError, TraceError
from kvflow.events import COMMAND_TYPES, EVENT_TYPES, Command, Event, JobFailed, Touch

TRACE_FORMAT = "kvflow-trace"
TRACE_VERSION = 2
DEFAULT_CHECKPOINT_EVERY = 10_000


class Checkpoint(msgspec.Struct, frozen=True, tag="checkpoint", tag_field="type"):
    """The state digest after every event up to ``seq`` was applied."""

    seq: int
    digest: str


Record = Union[Command, Event, Checkpoint]  # type: ignore[valid-type]
RECORD_TYPES: tuple[type, ...] = (*COMMAND_TYPES, *EVENT_TYPES, Checkpoint)
_RecordUnion = Union[tuple(RECORD_TYPES)]  # type: ignore[valid-type]


class Header(msgspec.Struct, frozen=True, kw_only=True):
    format: str
    version: int
    kvflow: str
    config: dict[str, Any]
    meta: dict[str, Any] = {}


class NullLog:
    """Keeps nothing: what a long-running engine uses when it records no trace (the state is
    the only thing it needs; a retained log would grow without bound)."""

    def record_command(self, command: Command) -> None:
        pass

    def record_events(self, events: list[Event]) -> None:
        pass

    def after_command(self, state: Any) -> None:
        pass

    def close(self, state: Any = None) -> None:
        pass


class MemoryLog:
    """Commands and events kept in a list; the default log of a bare OffloadManager (tests,
    tools, short runs). It grows with every event: long-running engines use a trace file or
    NullLog."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.records: list[Any] = []

    def record_command(self, command: Command) -> None:
        self.records.append(command)

    def record_events(self, events: list[Event]) -> None:
        self.records.extend(events)

    def after_command(self, state: Any) -> None:
        pass

    def events(self) -> list[Event]:
        return [cast(Event, r) for r in self.records if isinstance(r, EVENT_TYPES)]

    def commands(self) -> list[Command]:
        return [cast(Command, r) for r in self.records if isinstance(r, COMMAND_TYPES)]

    def close(self, state: Any = None) -> None:
        pass


class TraceWriter:
    """Writes a trace file as the manager runs. Deterministic: the same run gives the same
    bytes (no timestamps in the header; events carry only injected time)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config,
        *,
        meta: dict[str, Any] | None = None,
        checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
        auto_flush: bool = True,
    ) -> None:
        self.path = str(path)
        self.auto_flush = auto_flush
        self.config = config
        self.checkpoint_every = max(1, checkpoint_every)
        self._encoder = msgspec.json.Encoder()
        raw: IO[bytes]
        if self.path.endswith(".gz"):
            raw = cast(IO[bytes], gzip.GzipFile(self.path, "wb", compresslevel=6, mtime=0))
        else:
            raw = open(self.path, "wb")
        self._file = raw
        self._buffer: list[bytes] = []
        self._since_checkpoint = 0
        self._last_checkpoint_seq = 0
        self.closed = False
        header = Header(
            format=TRACE_FORMAT,
            version=TRACE_VERSION,
            kvflow=__version__,
            config=config.to_dict(),
            meta=dict(meta or {}),
        )
        self._file.write(self._encoder.encode(header) + b"\n")
        self._file.flush()  # on disk at once: a writer killed before its first flush leaves a readable trace

    def record_command(self, command: Command) -> None:
        self._buffer.append(self._encoder.encode(command))

    def record_events(self, events: list[Event]) -> None:
        encode = self._encoder.encode
        self._buffer.extend(encode(e) for e in events)
        self._since_checkpoint += len(events)

    def after_command(self, state: Any) -> None:
        if self._since_checkpoint >= self.checkpoint_every:
            self.checkpoint(state)
        if self.auto_flush and len(self._buffer) >= 4096:
            self.flush()

    def take_pending(self) -> bytes:
        """Detach the encoded lines not yet written (the async engine writes them from a
        worker thread with ``write_bytes``, keeping file I/O off the event loop)."""
        if not self._buffer:
            return b""
        self._buffer.append(b"")
        blob = b"\n".join(self._buffer)
        self._buffer.clear()
        return blob

    def write_bytes(self, blob: bytes) -> None:
        if blob:
            self._file.write(blob)
            self._file.flush()

    def checkpoint(self, state: Any) -> None:
        if state.last_seq == self._last_checkpoint_seq and self._last_checkpoint_seq:
            return
        self._buffer.append(self._encoder.encode(Checkpoint(seq=state.last_seq, digest=state.digest())))
        self._since_checkpoint = 0
        self._last_checkpoint_seq = state.last_seq

    def flush(self) -> None:
        if self._buffer:
            self._buffer.append(b"")
            self._file.write(b"\n".join(self._buffer))
            self._buffer.clear()
        self._file.flush()

    def close(self, state: Any = None) -> None:
        if self.closed:
            return
        if state is not None:
            self.checkpoint(state)
        self.flush()
        self._file.close()
        self.closed = True


# --- reading -------------------------------------------------------------------------------

MAX_LINE_BYTES = 64 << 20
"""The longest line a reader accepts (64 MiB; a record listing a million hashes is about 20 MiB).
A longer one, or a file that never ends a line (``/dev/zero``), is refused rather than read
into memory without bound."""

from kvflow.config import MAX_CPU_BLOCKS  # noqa: E402  (one bound for configs and readers)

"""The largest CPU tier (``config.cpu_blocks``) a trace header may declare: replaying one
allocates the tier's bookkeeping up front (about 80 bytes a slot, 1.3 GB at this maximum), so a
corrupted header must not be able to ask for more."""

_READ_ERRORS = (OSError, zlib.error)  # gzip.BadGzipFile is an OSError; EOFError is a torn .gz


def _open_bytes(path: str) -> IO[bytes]:
    try:
        if path.endswith(".gz"):
            return cast(IO[bytes], gzip.open(path, "rb"))
        return open(path, "rb")
    except OSError as exc:
        raise TraceError(path, None, f"cannot open: {exc.strerror or exc}") from None


def _read_error(exc: BaseException) -> str:
    if isinstance(exc, zlib.error):
        return f"corrupt compressed data ({exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _field_message(exc: msgspec.ValidationError | msgspec.DecodeError) -> str:
    text = str(exc)
    if " - at `$" in text:
        what, _, where = text.partition(" - at `$")
        field = where.rstrip("`").lstrip(".") or "record"
        if field == "type" and what.startswith("Invalid value"):
            return f"field 'type': unknown record type {what.split('Invalid value ', 1)[1]}"
        return f"field '{field}': {what[0].lower() + what[1:] if what[1:2].islower() else what}"
    if text.startswith("Object missing required field"):
        return "missing required field " + text.split("field", 1)[1].strip().replace("`", "'")
    if not text:
        return "malformed record"
    # "Expected ..." -> "expected ...", but keep "JSON is malformed" as it is
    return text[0].lower() + text[1:] if text[1:2].islower() else text


# A JSON string, or a string used as a key (group 1), or a bracket: enough of a tokenizer to
# name the field around a byte offset of a line that a decoder refused.
_TOKENS = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*:|"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_INSIDE_KEY = re.compile(rb'(?:[^"\\]|\\.)*"\s*:', re.DOTALL)
_DEEP = 64  # nesting deeper than any record's: where a too-deep line is reported


def _top_field(line: bytes, stop: int | None = None, depth_limit: int | None = None) -> str | None:
    """The top-level key of ``line`` whose value holds byte ``stop`` (or first nests deeper
    than ``depth_limit``); None when there is none."""
    if stop is not None and _INSIDE_KEY.match(line, stop):
        return None  # the byte is in a key, not in a value
    depth, key = 0, None
    for m in _TOKENS.finditer(line, 0, len(line) if stop is None else stop):
        token = m.group()
        if m.group(1) is not None:
            if depth == 1:
                key = m.group(1)
        elif token in (b"[", b"{"):
            depth += 1
            if depth_limit is not None and depth > depth_limit:
                break
        elif token in (b"]", b"}"):
            depth -= 1
    else:
        if depth_limit is not None:
            return None
    if key is None:
        return None
    return key.decode("utf-8", "replace")


def utf8_problem(line: bytes) -> str:
    """Why ``line`` is refused when it holds bytes that are not UTF-8: the field and column."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = exc.start
        field = _top_field(line, at)
        where = f"field '{field}': " if field is not None else ""
        return f"{where}not valid UTF-8 (byte 0x{line[at]:02x} at column {at + 1})"
    return "not valid UTF-8"


def nesting_problem(line: bytes) -> str:
    """Why ``line`` is refused when it nests deeper than the decoder goes: the field."""
    field = _top_field(line, depth_limit=_DEEP)
    where = f"field '{field}': " if field is not None else ""
    return f"{where}nested too deeply"


def _decode_problem(exc: BaseException, line: bytes) -> str:
    """The one-line message for a line the record decoder refused with ``exc``."""
    if isinstance(exc, UnicodeDecodeError):
        return utf8_problem(line)
    if isinstance(exc, RecursionError):
        return nesting_problem(line)
    message = _field_message(exc)  # type: ignore[arg-type]
    if message.startswith("field ") or message.startswith("missing "):
        return message
    field = syntax_error_field(str(exc), line)
    return message if field is None else f"field '{field}': {message}"


_AT_BYTE = re.compile(r"\(byte (\d+)\)")
_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")


def syntax_error_field(message: str, line: bytes) -> str | None:
    """The top-level field of a JSON ``line`` where msgspec's decode error ``message`` points:
    at its ``(byte N)``, at a number too large for a float, or at the end of a truncated
    line. None when the error is outside every field (or the line is not an object)."""
    at: int | None = None
    found = _AT_BYTE.search(message)
    if found:
        at = int(found.group(1))
    elif message.lower().startswith("number out of range"):
        at = next((m.start() for m in _NUMBER.finditer(line) if abs(float(m.group())) == float("inf")), None)
    elif "truncated" in message:
        at = len(line)
    if at is None or not line.lstrip().startswith(b"{"):
        return None
    return _top_field(line, min(at, len(line)))


# Errors a record decoder raises for a bad line: msgspec's own, bytes that are not UTF-8
# inside a string, and nesting deeper than the interpreter's recursion limit.
_DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


# --- range checks at read time ---------------------------------------------------------------
#
# A record's integers must be values a live engine could have recorded (kvflow.boundary):
# block hashes fit in 64 bits, signed or unsigned; every other integer (seq, job ids, device
# blocks, slots, counts) is within 0..2**64-1; a rank is below the header's world_size (a
# job_failed's rank may be -1: the job was cancelled before any rank ran). Checked once per
# chunk at C speed: encoding the chunk as msgpack raises for any integer outside 64 bits, a
# negative integer needs a '-' right after ':', ',' or '[' (or blanks), and the ranks are
# gathered with C-level iterators. Only a chunk that fails one of these is walked record by
# record, to name the line and field (or to find that the '-' was inside a string).

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
            low, high = (-1 if cls is JobFailed else 0), _WORLD
        else:
            low, high = 0, ID_LIMIT
        out.append((f.name, kind, low, high))
    return tuple(out)


_INT_FIELDS: dict[type, tuple[tuple[str, int, int, int], ...]] = {
    t: _int_fields(t) for t in RECORD_TYPES
}
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


def _range_problem(rec: Any, world: int) -> str | None:
    """The first integer of ``rec`` outside its range, as ``field 'x': message``."""
    for name, kind, low, high in _INT_FIELDS[type(rec)]:
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
                problem = _range_problem(item, world)
                if problem is not None:
                    return problem.replace("field '", f"field '{name}[{i}].", 1)
    return None


def _may_hold_negative(block: bytes) -> bool:
    """Could ``block`` (JSON lines) hold a negative number? Only if a '-' follows ':', ',', '['
    or a blank; a '-' inside a string ("req-7") may too, which costs only the slow check."""
    if b"-" not in block:
        return False
    pieces = block.split(b"-")
    pieces.pop()
    return any(map(bytes.endswith, pieces, repeat(_BEFORE_MINUS)))


def _ranks_fit(recs: list[Any], types: list[type], world: int) -> bool:
    """Every rank below ``world`` (ranks are known to be >= 0 here)."""
    ranked = list(compress(recs, map(_RANKED.__contains__, types)))
    if ranked and max(map(_rank_of, ranked)) >= world:
        return False
    for rec in compress(recs, map(_NESTING.__contains__, types)):
        for name, kind, _low, _high in _INT_FIELDS[type(rec)]:
            if kind == _NESTED and not all(
                _range_problem(item, world) is None for item in getattr(rec, name)
            ):
                return False
    return True


class _LineTooLong(Exception):
    """A line runs past MAX_LINE_BYTES (TraceReader names its line number)."""


class TraceReader:
    """Streams a trace: ``header``/``config`` first, then ``records()`` (with line numbers).

    ``warnings`` collects non-fatal findings (a torn last line). Every input gives valid
    records or a :class:`TraceError` naming file, line and field (the readers are total):
    lines are at most ``MAX_LINE_BYTES`` long, the header's ``cpu_blocks`` at most
    ``MAX_CPU_BLOCKS``, and every record's integers are range-checked as it is read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.warnings: list[str] = []
        self._file = _open_bytes(self.path)
        try:
            self._stream: IO[bytes] = (
                self._file if hasattr(self._file, "peek") else cast(IO[bytes], io.BufferedReader(self._file))  # type: ignore[type-var]
            )
            self.header = self._read_header()
            self.version = self.header.version
            try:
                self.config = config_from_dict(self.header.config)
            except ConfigError as exc:
                raise TraceError(self.path, 1, f"field 'config': {exc}") from None
            if self.config.cpu_blocks > MAX_CPU_BLOCKS:
                raise TraceError(
                    self.path,
                    1,
                    f"field 'config': cpu_blocks {self.config.cpu_blocks} is more than a trace "
                    f"may declare (at most {MAX_CPU_BLOCKS:,})",
                )
        except BaseException:
            self._file.close()  # a refused header leaves no file open
            raise
        self._decoder = msgspec.json.Decoder(_RecordUnion)
        self._scratch = bytearray()  # where _check_ranges encodes a chunk as msgpack

    def _read_header(self) -> Header:
        try:
            first = self._stream.readline(MAX_LINE_BYTES + 1)
        except EOFError as exc:
            raise TraceError(self.path, 1, f"cannot read: {exc}") from None
        except _READ_ERRORS as exc:
            raise TraceError(self.path, 1, f"cannot read: {_read_error(exc)}") from None
        if len(first) > MAX_LINE_BYTES:
            raise TraceError(
                self.path, 1, f"line longer than {MAX_LINE_BYTES:,} bytes (is this a kvflow trace?)"
            )
        if not first.strip():
            raise TraceError(self.path, 1, "empty file: expected a kvflow-trace header")
        try:
            raw = msgspec.json.decode(first)
        except msgspec.DecodeError:
            raise TraceError(self.path, 1, "header is not JSON (is this a kvflow trace?)") from None
        except (UnicodeDecodeError, RecursionError) as exc:
            raise TraceError(self.path, 1, f"header: {_decode_problem(exc, first)}") from None
        if not isinstance(raw, dict) or raw.get("format") != TRACE_FORMAT:
            raise TraceError(self.path, 1, "field 'format': not a kvflow-trace header")
        version = raw.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise TraceError(self.path, 1, f"field 'version': expected a positive integer, got {version!r}")
        if version > TRACE_VERSION:
            raise TraceError(
                self.path,
                1,
                f"field 'version': trace version {version} is newer than this kvflow "
                f"({__version__}) reads (up to {TRACE_VERSION}); upgrade kvflow",
            )
        try:
            return msgspec.convert(raw, Header)
        except msgspec.ValidationError as exc:
            raise TraceError(self.path, 1, _field_message(exc)) from None
        except RecursionError:
            raise TraceError(self.path, 1, "header: nested too deeply") from None

    def records(self) -> Iterator[tuple[int, Any]]:
        """Yield ``(line_number, record)`` for every record after the header."""
        return itertools.chain.from_iterable(
            zip(lines, recs) for lines, recs in self.record_chunks()
        )

    def _blocks(self, chunk_bytes: int) -> Generator[tuple[bytes, bool], None, None]:
        """The file after the header as ``(block, complete)``: blocks of whole lines of about
        ``chunk_bytes``, each ending with a newline; the last one may be an unfinished line
        (``complete`` False). A line longer than ``MAX_LINE_BYTES`` raises _LineTooLong. A read
        error (a corrupt or cut gzip stream) is raised after the whole lines before it."""
        stream = self._stream
        read = stream.read
        size = min(chunk_bytes, MAX_LINE_BYTES)  # so a line within one read is short enough
        carry: list[bytes] = []  # the start of a line that has not ended yet
        carried = 0
        try:
            position: int | None = stream.tell()
        except (OSError, ValueError):
            position = None  # not seekable: a failed read salvages nothing
        while True:
            error: BaseException | None = None
            try:
                data = read(size)
            except (EOFError, *_READ_ERRORS) as exc:
                data, error = self._salvage(position, size), exc
            if position is not None:
                position += len(data)
            if not data:
                if error is not None:
                    raise error
                if carry:
                    yield b"".join(carry), False
                return
            cut = data.rfind(b"\n")
            if cut < 0:
                carry.append(data)
                carried += len(data)
                if carried > MAX_LINE_BYTES:
                    raise _LineTooLong
                if error is not None:
                    raise error
                continue
            if carry:
                if carried + data.find(b"\n") > MAX_LINE_BYTES:
                    raise _LineTooLong
                carry.append(data[: cut + 1])
                block = b"".join(carry)
            else:
                block = data if cut == len(data) - 1 else data[: cut + 1]
            rest = data[cut + 1 :]
            carry = [rest] if rest else []
            carried = len(rest)
            yield block, True
            if error is not None:
                raise error

    def _salvage(self, position: int | None, size: int) -> bytes:
        """After a failed read from ``position``: the bytes that can still be read there, line
        by line, before the failure (so that the error names a line near the damage)."""
        if position is None:
            return b""
        parts: list[bytes] = []
        got = 0
        try:
            self._stream.seek(position)
            while got < size:
                line = self._stream.readline(size - got)
                if not line:
                    break
                parts.append(line)
                got += len(line)
        except (EOFError, ValueError, *_READ_ERRORS):
            pass
        return b"".join(parts)

    def record_chunks(self, chunk_bytes: int = 1 << 16) -> Iterator[tuple[Sequence[int], list[Any]]]:
        """The records in chunks ``(line_numbers, records)`` of about ``chunk_bytes`` of trace
        each: a chunk is decoded and range-checked in C-level passes, and only a chunk holding
        a bad, blank or torn line (or a value that may be out of range) is walked line by line
        to name it."""
        decode = self._decoder.decode
        upcast = _UPCASTS.get(self.version)
        lineno = 1  # the header
        blocks = self._blocks(chunk_bytes)
        try:
            for block, complete in blocks:
                lines = block.split(b"\n")
                if complete:
                    lines.pop()  # the empty rest after the last newline
                numbers: Sequence[int]
                try:
                    recs = list(map(decode, lines))
                    numbers = range(lineno + 1, lineno + 1 + len(lines))
                    torn = False
                except _DECODE_ERRORS:
                    numbers, recs, torn = self._decode_lines(lines, lineno, complete)
                lineno += len(lines)
                if recs:
                    self._check_ranges(block, numbers, recs)
                    if upcast is not None:
                        recs = [upcast(rec) for rec in recs]
                    yield numbers, recs
                if torn:
                    return
        except _LineTooLong:
            raise TraceError(self.path, lineno + 1, f"line longer than {MAX_LINE_BYTES:,} bytes") from None
        except EOFError:
            # a gzip stream cut short is the compressed form of a torn last line
            self.warnings.append(f"{self.path}:{lineno}: compressed stream ends early; rest ignored")
        except _READ_ERRORS as exc:
            raise TraceError(self.path, lineno + 1, f"cannot read: {_read_error(exc)}") from None
        finally:
            blocks.close()

    def _check_ranges(self, block: bytes, numbers: Sequence[int], recs: list[Any]) -> None:
        """Raise TraceError naming the first record with an integer out of its range."""
        world = self.config.world_size
        try:
            _encode_msgpack_into(recs, self._scratch)  # raises for an integer outside 64 bits
            suspect = _may_hold_negative(block) or not _ranks_fit(recs, list(map(type, recs)), world)
        except (OverflowError, ValueError, TypeError):
            suspect = True
        if not suspect:
            return
        for line, rec in zip(numbers, recs):
            problem = _range_problem(rec, world)
            if problem is not None:
                raise TraceError(self.path, line, problem)

    def _decode_lines(
        self, lines: list[bytes], lineno: int, complete: bool
    ) -> tuple[list[int], list[Any], bool]:
        """Decode line by line: blank lines are skipped, a torn last line ends the trace with
        a warning (returns torn=True), any other bad line raises TraceError naming it."""
        decode = self._decoder.decode
        numbers: list[int] = []
        recs: list[Any] = []
        last = len(lines) - 1
        for i, line in enumerate(lines):
            lineno += 1
            try:
                recs.append(decode(line))
            except _DECODE_ERRORS as exc:
                if i == last and not complete:
                    # only the last line can lack its newline: a crash mid-write
                    self.warnings.append(f"{self.path}:{lineno}: torn last line ({len(line)} bytes) ignored")
                    return numbers, recs, True
                if not line.strip():
                    continue
                raise TraceError(self.path, lineno, _decode_problem(exc, line)) from None
            numbers.append(lineno)
        return numbers, recs, False

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _upcast_v1(record: Any) -> Any:
    """Version 1 (before F14 kept touches of blocks still being stored): its touches skipped
    such blocks, so re-deciding one must too."""
    if type(record) is Touch:
        return msgspec.structs.replace(record, keep_pending=False)
    return record


# Version upgrades: version -> function mapping an old record to the current form.
_UPCASTS: dict[int, Any] = {1: _upcast_v1}


def read_trace(path: str | os.PathLike[str]) -> tuple[TraceReader, list[tuple[int, Any]]]:
    """Read a whole trace (small traces, tests). Prefer ``TraceReader.records()`` to stream."""
    reader = TraceReader(path)
    with reader:
        records = list(reader.records())
    return reader, records
