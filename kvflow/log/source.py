"""The bytes of a trace file, as far as they can be read: plain, or gzip decompressed by us up to
the damage (a cut stream, corrupt data), in blocks of whole lines of bounded length."""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Generator, Iterator
from typing import IO, cast

from kvflow.core.errors import TraceError
from kvflow.log.format import MAX_LINE_BYTES
from kvflow.log.problems import READ_ERRORS

STDIN = "-"
"""The path that names standard input (every verb that reads a trace takes it)."""
STDIN_NAME = "<stdin>"
"""How messages name standard input."""
GZIP_MAGIC = b"\x1f\x8b"


def open_bytes(path: str) -> IO[bytes]:
    if path == STDIN:
        return cast("IO[bytes]", _Stdin(sys.stdin.buffer))
    try:
        return open(path, "rb")
    except OSError as exc:
        raise TraceError(path, None, f"cannot open: {exc.strerror or exc}") from None


def is_gzip(path: str, file: IO[bytes]) -> bool:
    """A file is gzip by its name (``.gz``); standard input, which has none, by its first bytes."""
    if isinstance(file, _Stdin):
        return file.head(len(GZIP_MAGIC)) == GZIP_MAGIC
    return path.endswith(".gz")


def spool(stream: IO[bytes], folder: str) -> str:
    """Copy ``stream`` (standard input) to a file in ``folder``, for a reader that reads its
    trace more than once; the file's name says whether it is gzip, as its first bytes do."""
    import shutil

    head = stream.read(len(GZIP_MAGIC))
    path = os.path.join(folder, "stdin.jsonl.gz" if head == GZIP_MAGIC else "stdin.jsonl")
    with open(path, "wb") as out:
        out.write(head)
        shutil.copyfileobj(stream, out, 1 << 20)
    return path


class _Stdin:
    """Standard input as a trace's bytes: its first bytes can be looked at before they are
    read (to tell gzip), and closing it leaves the process's stdin open."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._head = b""

    def head(self, n: int) -> bytes:
        while len(self._head) < n:
            more = self._stream.read(n - len(self._head))
            if not more:
                break
            self._head += more
        return self._head[:n]

    def read(self, size: int = -1) -> bytes:
        head, self._head = self._head, b""
        if not head:
            return self._stream.read(size)
        if 0 <= size < len(head):
            head, self._head = head[:size], head[size:]
        return head  # (a short read: readers read on until one returns nothing)

    def close(self) -> None:
        pass


def plain_data(file: IO[bytes], size: int) -> Generator[bytes, None, None]:
    read = file.read
    while data := read(size):
        yield data


def gzip_data(file: IO[bytes], size: int) -> Generator[bytes, None, None]:
    """The decompressed bytes of a gzip file of one or more members, as far as they are
    intact: everything before a cut (a writer killed mid-write) is yielded, then EOFError is
    raised; corrupt data raises zlib.error after everything before it. At most ``4 * size``
    bytes come out of one step, however well the input compresses."""
    out_limit = 4 * size
    inflate = zlib.decompressobj(wbits=31)
    in_member = False
    while True:
        raw = file.read(size)
        if not raw:
            if in_member:
                raise EOFError("compressed stream ends early")
            return
        while raw:
            if not in_member and not raw.strip(b"\x00"):
                break  # zero padding after a member (gzip's own reader skips it too)
            in_member = True
            data = inflate.decompress(raw, out_limit)
            while data:
                yield data
                data = inflate.decompress(inflate.unconsumed_tail, out_limit) if inflate.unconsumed_tail else b""
            if inflate.eof:  # the member ended: what is left starts the next one
                raw = inflate.unused_data
                inflate = zlib.decompressobj(wbits=31)
                in_member = False
            else:
                raw = b""


def _last_blocks(carry: list[bytes | memoryview]) -> Generator[tuple[bytes, bool], None, None]:
    """What is left when the data ends: its whole lines, then an unfinished one."""
    rest = b"".join(carry)
    cut = rest.rfind(b"\n") + 1
    if cut:
        yield rest[:cut], True
    if cut < len(rest):
        yield rest[cut:], False


class LineTooLong(Exception):
    """A line runs past MAX_LINE_BYTES (TraceReader names its line number)."""


def line_blocks(data_in: Iterator[bytes], limit: int = MAX_LINE_BYTES) -> Generator[tuple[bytes, bool], None, None]:
    """The data ``data_in`` yields as ``(block, complete)``: blocks of whole lines, each
    ending with a newline; the last one may be an unfinished line (``complete`` False). A
    line longer than ``limit`` raises LineTooLong. A read error (a corrupt or cut
    gzip stream) is raised after the whole lines before it."""
    carry: list[bytes | memoryview] = []  # the start of a line that has not ended yet
    carried = 0
    while True:
        try:
            data = next(data_in, b"")
        except (EOFError, *READ_ERRORS):
            yield from _last_blocks(carry)
            raise
        if not data:
            yield from _last_blocks(carry)
            return
        cut = data.rfind(b"\n")
        if cut < 0:
            carry.append(data)
            carried += len(data)
            if carried > limit:
                raise LineTooLong
            continue
        if carry:
            if carried + data.find(b"\n") > limit:
                raise LineTooLong
            carry.append(memoryview(data)[: cut + 1])  # (copied once, by the join)
            block = b"".join(carry)
        else:
            block = data if cut == len(data) - 1 else data[: cut + 1]
        rest = data[cut + 1 :]
        carry = [rest] if rest else []
        carried = len(rest)
        yield block, True
