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
from kvflow.core.config import MAX_CPU_BLOCKS, config_from_dict
from kvflow.core.errors import ConfigError, TraceError
from kvflow.log import source
from kvflow.log.format import (
    CHAINED_SINCE,
    MAX_LINE_BYTES,
    TRACE_FORMAT,
    TRACE_VERSION,
    UPCASTS,
    Checkpoint,
    Header,
    RecordChain,
    RecordUnion,
    SkimUnion,
    trusted_decoder,
)
from kvflow.log.problems import (
    DECODE_ERRORS,
    READ_ERRORS,
    decode_problem,
    field_message,
    read_error,
)
from kvflow.log.ranges import check_ranges

CHUNK_BYTES = 1 << 16
"""How much a reader reads at a time (unless told): records come in chunks of whole lines of
about this size (tests make it small to cut a trace into many chunks)."""

_SKIM_DECODER = msgspec.json.Decoder(SkimUnion)


class TraceReader:
    """Streams a trace: ``header``/``config`` first, then ``records()`` (with line numbers).

    ``warnings`` collects non-fatal findings (a torn last line, a cut gzip stream, records after
    the last checkpoint). ``mismatch`` is ``(line, message)`` for the first checkpoint whose
    record digest differs from the bytes read before it (the trace was altered), else None;
    ``findings()`` is both, one line each. After the last record: ``complete`` tells whether the
    trace ended on a checkpoint as a closed writer leaves it, ``unverified`` how many records
    come after the last checkpoint. Lines are at most ``MAX_LINE_BYTES`` long, the header's
    ``cpu_blocks`` at most ``MAX_CPU_BLOCKS``, and every record's integers are range-checked.
    """

    def __init__(self, path: str | os.PathLike[str], chunk_bytes: int | None = None) -> None:
        self.path = str(path)
        self.warnings: list[str] = []
        self.mismatch: tuple[int, str] | None = None
        self.complete = False
        self.unverified = 0
        self._checked_line = 1  # the last line the record chain vouches for (the header)
        self._file = source.open_bytes(self.path)
        try:
            size = min(chunk_bytes or CHUNK_BYTES, MAX_LINE_BYTES)  # so a line within one read is short enough
            unzip = source.gzip_data if self.path.endswith(".gz") else source.plain_data
            self._data = unzip(self._file, size)
            first = self._read_header_line()
            self.header = self._parse_header(first)
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
        self._chain = RecordChain(first)
        self._decoder = msgspec.json.Decoder(RecordUnion)
        self._scratch = bytearray()  # where check_ranges encodes a chunk as msgpack
        # skimming: (first line number, whole lines) whose commands the record chain has not
        # vouched for yet, and their size (see record_chunks)
        self._held: list[tuple[int, bytes]] | None = None
        self._held_bytes = 0

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
        except msgspec.DecodeError:
            raise TraceError(self.path, 1, "header is not JSON (is this a kvflow trace?)") from None
        except (UnicodeDecodeError, RecursionError) as exc:
            raise TraceError(self.path, 1, f"header: {decode_problem(exc, first)}") from None
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
            raise TraceError(self.path, 1, field_message(exc)) from None
        except RecursionError:
            raise TraceError(self.path, 1, "header: nested too deeply") from None

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

    def record_chunks(
        self, skim_commands: bool = False, trusted_through: float = 0
    ) -> Iterator[tuple[Sequence[int], list[Any]]]:
        """The records in chunks ``(line_numbers, records)``: a chunk is decoded and
        range-checked in C-level passes, and only a chunk holding a bad, blank or torn line (or
        a value that may be out of range) is walked line by line to name it.

        ``skim_commands`` (what a plain fold asks for; version 3 on): commands come back as
        field-less ``SKIMMED_COMMANDS``, their JSON checked but not built, which cuts the
        decoding of a typical trace by about a third. Their lines are held until a checkpoint's record digest
        vouches for their bytes (a kvflow writer wrote them, so they are valid); lines it cannot
        vouch for (before a checkpoint that does not verify, after the last one, or more than
        MAX_LINE_BYTES of them) are decoded in full before reading goes on, so a bad command
        still raises its TraceError.

        ``trusted_through`` (while skimming): the caller applies the events up to this line
        unchecked and lets the checkpoints judge (kvflow.replay.fold). A chunk within it is decoded
        in one call for all its lines (``trusted_decoder``: its job ends without their payload,
        its ranks checked as they are decoded, ``TRUSTED_FORMS``) and its integers' widths
        unchecked; it is walked line by line as above unless it gave one record per newline
        and holds no checkpoint. Its lines are held like the commands', so lines the record
        chain does not vouch for (two records on one line beside a blank one included) are
        decoded in full, one by one. Where it is
        infinite (the replay's first fold), the newlines are not counted: the line numbers
        follow from the records, which is exact wherever the record chain verifies (a writer
        puts one record on each line). Where it does not, the caller must not report what this
        pass found (a line number, a TraceError, a warning) but read again with a finite
        ``trusted_through`` (kvflow.replay.fold does)."""
        skim = skim_commands and self.version >= CHAINED_SINCE
        decode = (_SKIM_DECODER if skim else self._decoder).decode
        decode_trusted = trusted_decoder(self.config.world_size).decode_lines if skim else None
        trust_all = trusted_through == float("inf")
        self._held = [] if skim else None
        upcast = UPCASTS.get(self.version)
        world = self.config.world_size
        lineno = 1  # the header
        data = itertools.chain((self._rest,), self._data) if self._rest else self._data
        self._rest = b""
        blocks = source.line_blocks(data, MAX_LINE_BYTES)
        ended = False
        try:
            for block, complete in blocks:
                recs: list[Any] | None = None
                # the set of the types of ``recs`` read line by line (found once: two checks
                # ask); none is needed where the block was read in one call
                kinds: set[type] = set()
                torn = False
                lines: list[bytes] | None = None  # (None: read in one call, ``TrustedUnion``)
                count = -1  # the block's lines, counted only where a number may be reported
                if decode_trusted is not None:
                    if trust_all:
                        # the numbers follow from the records (see trusted_through)
                        recs = self._decode_trusted(decode_trusted, block, complete)
                        count = -1 if recs is None else len(recs)
                    else:
                        count = block.count(b"\n") + (not complete)  # (a last line without newline)
                        if lineno + count <= trusted_through:
                            recs = self._decode_trusted(decode_trusted, block, complete, count)
                numbers: Sequence[int] = range(lineno + 1, lineno + 1 + count)
                if recs is None:
                    lines = block.split(b"\n")
                    if complete:
                        lines.pop()  # the empty rest after the last newline
                    count = len(lines)
                    numbers = range(lineno + 1, lineno + 1 + count)
                    try:
                        recs = list(map(decode, lines))
                    except DECODE_ERRORS:
                        numbers, recs, torn = self._decode_lines(lines, lineno, complete)
                    kinds = set(map(type, recs))
                self._chain_block(block, lines, lineno + 1, numbers, recs, kinds, torn)
                lineno += count
                if recs:
                    # (read in one call: the record chain checks the widths, the decoding the ranks)
                    trusted = lines is None
                    check_ranges(self.path, block, numbers, recs, world, self._scratch, trusted, kinds)
                    if upcast is not None:
                        recs = [upcast(rec) for rec in recs]
                    yield numbers, recs
                if torn:
                    break
            else:
                ended = True
            self._vouch()  # what no checkpoint vouched for is decoded in full
        except source.LineTooLong:
            raise TraceError(self.path, lineno + 1, f"line longer than {MAX_LINE_BYTES:,} bytes") from None
        except EOFError:
            # a gzip stream cut short is the compressed form of a torn last line
            self.warnings.append(f"{self.path}:{lineno}: compressed stream ends early; rest ignored")
            self._vouch()
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

    @staticmethod
    def _decode_trusted(
        decode: Any, block: bytes, complete: bool, count: int = -1
    ) -> list[Any] | None:
        """The block's records in one call, or None if it must be walked line by line: a bad
        line, a checkpoint (``TrustedUnion`` has none: the record chain needs its line), a rank
        out of range, fewer or more records than ``count`` lines (a blank line, two records on
        one) or a line without newline."""
        try:
            recs: list[Any] = decode(block)
        except DECODE_ERRORS:
            return None
        if not complete or (count >= 0 and len(recs) != count):
            return None
        return recs

    def _chain_block(
        self, block: bytes, lines: list[bytes] | None, first: int, numbers: Sequence[int],
        recs: list[Any], kinds: set[type], torn: bool,
    ) -> None:  # fmt: skip
        """Feed ``block`` (lines ``first``..., split into ``lines`` unless each gave one record;
        ``kinds``: the records' types) to the record chain, checking each checkpoint's record
        digest against the bytes before its line; hold the lines to vouch for."""
        chain = self._chain
        end = len(block) - len(lines[-1]) if torn and lines else len(block)  # (a torn line is no record)
        if lines is None or Checkpoint not in kinds:  # (most blocks: cheaper than a byte search)
            chain.update(block)
            self.unverified += len(recs)
            self._hold(first, block if end == len(block) else block[:end])
            return
        view = memoryview(block)
        done = 0
        last = -1
        held_line, held_from = first, 0
        for k, rec in enumerate(recs):
            if type(rec) is not Checkpoint:
                continue
            line = numbers[k]
            i = line - first  # its index in ``lines`` (blank lines are skipped in ``recs``)
            start = sum(map(len, lines[:i])) + i
            chain.update(view[done:start])
            done = start
            self._hold(held_line, block[held_from:start])
            if not self._check_checkpoint(line, rec):
                self._vouch()  # the chain cannot vouch for them: every line must decode in full
            elif self._held is not None:
                self._held.clear()
                self._held_bytes = 0
            held_line, held_from = line + 1, start + len(lines[i]) + 1  # (the checkpoint is decoded in full)
            last = k
        chain.update(view[done:])
        self._hold(held_line, block[held_from:end])
        self.unverified = len(recs) - last - 1 if last >= 0 else self.unverified + len(recs)

    def _hold(self, first: int, data: bytes) -> None:
        """While skimming: keep the whole lines ``data`` (from line ``first``) until a
        checkpoint vouches for them, at most about MAX_LINE_BYTES of them."""
        if self._held is None or not data:
            return
        self._held.append((first, data))
        self._held_bytes += len(data)
        if self._held_bytes > MAX_LINE_BYTES:
            self._vouch()

    def _vouch(self) -> None:
        """Decode the held lines in full: a bad command among them raises its TraceError."""
        if not self._held:
            return
        decode = self._decoder.decode
        for first, data in self._held:
            lines = data.split(b"\n")
            if data.endswith(b"\n"):
                lines.pop()
            numbers: Sequence[int]
            try:
                recs = list(map(decode, lines))
                numbers = range(first, first + len(lines))
            except DECODE_ERRORS:
                numbers, recs, _ = self._decode_lines(lines, first - 1, True)
            if recs:
                check_ranges(self.path, data, numbers, recs, self.config.world_size, self._scratch)
        self._held.clear()
        self._held_bytes = 0

    def _check_checkpoint(self, line: int, cp: Checkpoint) -> bool:
        """Does the checkpoint's record digest match the bytes before it (or has it none, in
        a trace older than the record chain)?"""
        ok = True
        if cp.records or self.version >= CHAINED_SINCE:
            expected = self._chain.value()
            ok = cp.records == expected
            if not ok and self.mismatch is None:
                recorded = cp.records or "none"
                self.mismatch = (
                    line,
                    f"the trace does not verify: the bytes before this checkpoint digest to "
                    f"{expected}, it records {recorded}: a line after line {self._checked_line} "
                    "(or the header) was altered, added or removed",
                )
        self._checked_line = line
        return ok

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
            except DECODE_ERRORS as exc:
                if i == last and not complete:
                    # only the last line can lack its newline: a crash mid-write
                    self.warnings.append(f"{self.path}:{lineno}: torn last line ({len(line)} bytes) ignored")
                    return numbers, recs, True
                if not line.strip():
                    continue
                raise TraceError(self.path, lineno, decode_problem(exc, line)) from None
            numbers.append(lineno)
        return numbers, recs, False

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
