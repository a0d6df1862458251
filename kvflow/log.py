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
import os
from collections.abc import Iterator, Sequence
from typing import IO, Any, Union, cast

import msgspec

from kvflow._version import __version__
from kvflow.config import Config, config_from_dict
from kvflow.errors import ConfigError, TraceError
from kvflow.events import COMMAND_TYPES, EVENT_TYPES, Command, Event, Touch

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


def _open_bytes(path: str) -> IO[bytes]:
    try:
        if path.endswith(".gz"):
            return cast(IO[bytes], gzip.open(path, "rb"))
        return open(path, "rb")
    except OSError as exc:
        raise TraceError(path, None, f"cannot open: {exc.strerror or exc}") from None


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


class TraceReader:
    """Streams a trace: ``header``/``config`` first, then ``records()`` (with line numbers).

    ``warnings`` collects non-fatal findings (a torn last line).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.warnings: list[str] = []
        self._file = _open_bytes(self.path)
        self._stream: IO[bytes] = (
            self._file if hasattr(self._file, "peek") else cast(IO[bytes], io.BufferedReader(self._file))  # type: ignore[type-var]
        )
        self.header = self._read_header()
        self.version = self.header.version
        try:
            self.config = config_from_dict(self.header.config)
        except ConfigError as exc:
            raise TraceError(self.path, 1, f"field 'config': {exc}") from None
        self._decoder = msgspec.json.Decoder(_RecordUnion)

    def _read_header(self) -> Header:
        try:
            first = self._stream.readline()
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise TraceError(self.path, 1, f"cannot read: {exc}") from None
        if not first.strip():
            raise TraceError(self.path, 1, "empty file: expected a kvflow-trace header")
        try:
            raw = msgspec.json.decode(first)
        except msgspec.DecodeError:
            raise TraceError(self.path, 1, "header is not JSON (is this a kvflow trace?)") from None
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

    def records(self) -> Iterator[tuple[int, Any]]:
        """Yield ``(line_number, record)`` for every record after the header."""
        return itertools.chain.from_iterable(
            zip(lines, recs) for lines, recs in self.record_chunks()
        )

    def record_chunks(self, chunk_bytes: int = 1 << 16) -> Iterator[tuple[Sequence[int], list[Any]]]:
        """The records in chunks ``(line_numbers, records)`` of about ``chunk_bytes`` of trace
        each: a chunk is decoded in one C-level pass, and only a chunk holding a bad, blank
        or torn line is walked line by line to name it."""
        decode = self._decoder.decode
        upcast = _UPCASTS.get(self.version)
        lineno = 1  # the header
        try:
            while True:
                lines = self._stream.readlines(chunk_bytes)
                if not lines:
                    return
                numbers: Sequence[int]
                try:
                    recs = list(map(decode, lines))
                    numbers = range(lineno + 1, lineno + 1 + len(lines))
                    torn = False
                except (msgspec.DecodeError, msgspec.ValidationError):
                    numbers, recs, torn = self._decode_lines(lines, lineno)
                lineno += len(lines)
                if upcast is not None:
                    recs = [upcast(rec) for rec in recs]
                if recs:
                    yield numbers, recs
                if torn:
                    return
        except EOFError:
            # a gzip stream cut short is the compressed form of a torn last line
            self.warnings.append(f"{self.path}:{lineno}: compressed stream ends early; rest ignored")
        except (OSError, gzip.BadGzipFile) as exc:
            raise TraceError(self.path, lineno, f"cannot read: {exc}") from None

    def _decode_lines(self, lines: list[bytes], lineno: int) -> tuple[list[int], list[Any], bool]:
        """Decode line by line: blank lines are skipped, a torn last line ends the trace with
        a warning (returns torn=True), any other bad line raises TraceError naming it."""
        decode = self._decoder.decode
        numbers: list[int] = []
        recs: list[Any] = []
        for line in lines:
            lineno += 1
            try:
                recs.append(decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                if not line.endswith(b"\n"):
                    # only the last line can lack its newline: a crash mid-write
                    self.warnings.append(f"{self.path}:{lineno}: torn last line ({len(line)} bytes) ignored")
                    return numbers, recs, True
                if not line.strip():
                    continue
                raise TraceError(self.path, lineno, _field_message(exc)) from None
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
