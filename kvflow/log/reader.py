"""Reading a trace: streaming, total on any bytes, and checking the record chain.

Every input gives valid records or a :class:`TraceError` naming file, line and field. A torn
last line (a crash mid-write) is reported through ``warnings`` and ignored; so is a gzip stream
that ends early: every line before the cut is read, whatever member or flush it was in. A newer
version is refused; older versions are upgraded record by record (``UPCASTS``). The record
digests of version-3 checkpoints are checked as the lines go by (``mismatch``), and what follows
the last checkpoint is counted (``unverified``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from kvflow._version import __version__
from kvflow.core.config import config_from_dict
from kvflow.core.errors import ConfigError, TraceError
from kvflow.core.state.model import State
from kvflow.core.values import is_int
from kvflow.log import source
from kvflow.log.format import (
    CHAINED_SINCE,
    INCREMENTAL_DIGEST_SINCE,
    MAX_LINE_BYTES,
    TRACE_FORMAT,
    TRACE_VERSION,
    UPCASTS,
    Checkpoint,
    Header,
    RecordChain,
    RecordUnion,
)
from kvflow.log.problems import (
    DECODE_ERRORS,
    READ_ERRORS,
    decode_problem,
    field_message,
    is_utf8_error,
    read_error,
)
from kvflow.log.ranges import first_out_of_range

CHUNK_BYTES = 1 << 16
"""How much a reader reads at a time (unless told): records come in chunks of whole lines of
about this size (tests make it small to cut a trace into many chunks)."""


class TraceReader:
    """Streams a trace: ``header``/``config`` first, then ``records()`` (with line numbers).

    ``warnings`` collects non-fatal findings (a torn last line, a cut gzip stream, records after
    the last checkpoint). ``mismatch`` is ``(line, message)`` for the first checkpoint whose
    record digest differs from the bytes read before it (the trace was altered), else None;
    ``findings()`` is both, one line each. After the last record: ``complete`` tells whether the
    trace ended on a checkpoint as a closed writer leaves it, ``unverified`` how many records
    come after the last checkpoint. Lines are at most ``MAX_LINE_BYTES`` long, the header's
    config is checked as ``Config`` checks it (``cpu_blocks`` at most ``MAX_CPU_BLOCKS``), and every record's integers are range-checked.
    """

    def __init__(self, path: str | os.PathLike[str], chunk_bytes: int | None = None) -> None:
        self.path = source.STDIN_NAME if str(path) == source.STDIN else str(path)
        self.warnings: list[str] = []
        self.mismatch: tuple[int, str] | None = None
        self.complete = False
        self.unverified = 0
        self._checked_line = 1  # the last line the record chain vouches for (the header)
        self._file = source.open_bytes(str(path))
        try:
            size = min(chunk_bytes or CHUNK_BYTES, MAX_LINE_BYTES)  # so a line within one read is short enough
            unzip = source.gzip_data if source.is_gzip(self.path, self._file) else source.plain_data
            self._data = unzip(self._file, size)
            first = self._read_header_line()
            self.header = self._parse_header(first)
            self.version = self.header.version
            try:
                self.config = config_from_dict(self.header.config)
            except ConfigError as exc:
                raise TraceError(self.path, 1, f"field 'config': {exc}") from None
        except BaseException:
            self._file.close()  # a refused header leaves no file open
            raise
        self._chain = RecordChain(first)
        self._decoder = msgspec.json.Decoder(RecordUnion)
        self._scratch = bytearray()  # where first_out_of_range encodes a chunk as msgpack

    def _read_header_line(self) -> bytes:
        """The first line, newline included; what follows it is kept for the records."""
        parts: list[bytes] = []
        got = 0
        self._rest = b""
        try:
            for data in self._data:
                cut = data.find(b"\n")
                if cut >= 0:
                    parts.append(data[: cut + 1])
                    self._rest = data[cut + 1 :]
                    break
                parts.append(data)
                got += len(data)
                if got > MAX_LINE_BYTES:
                    break
        except EOFError as exc:
            if not parts:
                raise TraceError(self.path, 1, f"cannot read: {exc}") from None
        except READ_ERRORS as exc:
            raise TraceError(self.path, 1, f"cannot read: {read_error(exc)}") from None
        first = b"".join(parts)
        if len(first) > MAX_LINE_BYTES:
            raise TraceError(
                self.path, 1, f"line longer than {MAX_LINE_BYTES:,} bytes (is this a kvflow trace?)"
            )
        return first

    def _parse_header(self, first: bytes) -> Header:
        if not first.strip():
            raise TraceError(self.path, 1, "empty file: expected a kvflow-trace header")
        try:
            raw = msgspec.json.decode(first)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            if isinstance(exc, msgspec.DecodeError) and not is_utf8_error(exc):
                raise TraceError(self.path, 1, "header is not JSON (is this a kvflow trace?)") from None
            raise TraceError(self.path, 1, f"header: {decode_problem(exc, first)}") from None
        if not isinstance(raw, dict) or raw.get("format") != TRACE_FORMAT:
            raise TraceError(self.path, 1, "field 'format': not a kvflow-trace header")
        version = raw.get("version")
        if not is_int(version) or version < 1:
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
            raise TraceError(self.path, 1, field_message(exc)) from None
        except RecursionError:
            raise TraceError(self.path, 1, "header: nested too deeply") from None

    def new_state(self) -> State:
        """An empty state to fold this trace into: its digest is the form this trace's
        checkpoints carry (the whole state's before version 4)."""
        return State(self.config, full_digest=self.version < INCREMENTAL_DIGEST_SINCE)

    def records(self) -> Iterator[tuple[int, Any]]:
        """Yield ``(line_number, record)`` for every record after the header."""
        return itertools.chain.from_iterable(
            zip(lines, recs) for lines, recs in self.record_chunks()
        )

    def findings(self) -> list[str]:
        """The warnings, and the record digest that did not match (one line each)."""
        out = list(self.warnings)
        if self.mismatch is not None:
            out.append(f"{self.path}:{self.mismatch[0]}: {self.mismatch[1]}")
        return out

    def record_chunks(self) -> Iterator[tuple[Sequence[int], list[Any]]]:
        """The records in chunks ``(line_numbers, records)`` of whole lines, as the file is
        read. A chunk is decoded and range-checked as a whole; only a chunk holding a bad,
        blank or torn line (or a value that may be out of range) is walked line by line, to
        name the line. A bad line raises its TraceError after the records before it, so what
        a reader yields does not depend on where the chunks are cut."""
        decode = self._decoder.decode
        upcast = UPCASTS.get(self.version)
        world = self.config.world_size
        lineno = 1  # the header
        data = itertools.chain((self._rest,), self._data) if self._rest else self._data
        self._rest = b""
        blocks = source.line_blocks(data, MAX_LINE_BYTES)
        ended = False
        try:
            for block, complete in blocks:
                lines = block.split(b"\n")
                if complete:
                    lines.pop()  # the empty rest after the last newline
                numbers: Sequence[int] = range(lineno + 1, lineno + 1 + len(lines))
                torn, bad = False, None
                try:
                    recs = list(map(decode, lines))
                except DECODE_ERRORS:
                    numbers, recs, torn, bad = self._decode_lines(lines, lineno, complete)
                out_of_range = first_out_of_range(self.path, block, numbers, recs, world, self._scratch)
                if out_of_range is not None:
                    bad = out_of_range  # (range-checked records are decoded ones: it comes first)
                if bad is not None:  # the records before the bad line only
                    keep = sum(1 for n in numbers if n < (bad.line or 0))
                    numbers, recs = numbers[:keep], recs[:keep]
                self._chain_block(block, lines, lineno + 1, numbers, recs)
                lineno += len(lines)
                if recs:
                    if upcast is not None:
                        recs = [upcast(rec) for rec in recs]
                    yield numbers, recs
                if bad is not None:
                    raise bad
                if torn:
                    break
            else:
                ended = True
        except source.LineTooLong:
            raise TraceError(self.path, lineno + 1, f"line longer than {MAX_LINE_BYTES:,} bytes") from None
        except EOFError:
            # a gzip stream cut short is the compressed form of a torn last line
            self.warnings.append(f"{self.path}:{lineno}: compressed stream ends early; rest ignored")
        except READ_ERRORS as exc:
            raise TraceError(self.path, lineno + 1, f"cannot read: {read_error(exc)}") from None
        finally:
            blocks.close()
        self.complete = ended and self.unverified == 0 and self._checked_line > 1
        if ended and self.unverified and self.version >= CHAINED_SINCE:  # (a cut trace says so)
            self.warnings.append(
                f"{self.path}:{self._checked_line}: the {self.unverified:,} records after this line "
                "have no checkpoint after them, so they are not verified (a writer that was not "
                "closed, or a cut trace)"
            )

    def _chain_block(
        self, block: bytes, lines: list[bytes], first: int, numbers: Sequence[int], recs: list[Any]
    ) -> None:
        """Feed ``block`` (lines ``first``..., split into ``lines``; ``numbers``: the lines of
        ``recs``) to the record chain, checking each checkpoint's record digest against the
        bytes before its line."""
        chain = self._chain
        checkpoints = [k for k, rec in enumerate(recs) if type(rec) is Checkpoint]
        if not checkpoints:
            chain.update(block)
            self.unverified += len(recs)
            return
        view = memoryview(block)
        done = 0
        for k in checkpoints:
            line = numbers[k]
            i = line - first  # its index in ``lines`` (blank lines are skipped in ``recs``)
            start = sum(map(len, lines[:i])) + i
            chain.update(view[done:start])
            done = start
            self._check_checkpoint(line, recs[k])
        chain.update(view[done:])
        self.unverified = len(recs) - checkpoints[-1] - 1

    def _check_checkpoint(self, line: int, cp: Checkpoint) -> None:
        """The checkpoint's record digest must match the bytes before it (unless it has none,
        in a trace older than the record chain): the first that does not is ``mismatch``."""
        if cp.records or self.version >= CHAINED_SINCE:
            expected = self._chain.value()
            if cp.records != expected and self.mismatch is None:
                recorded = cp.records or "none"
                self.mismatch = (
                    line,
                    f"the trace does not verify: the bytes before this checkpoint digest to "
                    f"{expected}, it records {recorded}: a line after line {self._checked_line} "
                    "(or the header) was altered, added or removed",
                )
        self._checked_line = line

    def _decode_lines(
        self, lines: list[bytes], lineno: int, complete: bool
    ) -> tuple[list[int], list[Any], bool, TraceError | None]:
        """Decode line by line: blank lines are skipped, a torn last line ends the trace with
        a warning (returns torn=True); any other bad line ends the records with the TraceError
        naming it (returned, to be raised once the records before it are read)."""
        decode = self._decoder.decode
        numbers: list[int] = []
        recs: list[Any] = []
        last = len(lines) - 1
        for i, line in enumerate(lines):
            lineno += 1
            try:
                recs.append(decode(line))
            except DECODE_ERRORS as exc:
                if i == last and not complete:
                    # only the last line can lack its newline: a crash mid-write
                    self.warnings.append(f"{self.path}:{lineno}: torn last line ({len(line)} bytes) ignored")
                    return numbers, recs, True, None
                if not line.strip():
                    continue
                return numbers, recs, False, TraceError(self.path, lineno, decode_problem(exc, line))
            numbers.append(lineno)
        return numbers, recs, False, None

    def close(self) -> None:
        self._data.close()
        self._file.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str | os.PathLike[str]) -> tuple[TraceReader, list[tuple[int, Any]]]:
    """Read a whole trace (small traces, tests). Prefer ``TraceReader.records()`` to stream."""
    reader = TraceReader(path)
    with reader:
        records = list(reader.records())
    return reader, records
