"""The one-line messages for trace and workload lines a decoder refused: which field, and why
(invalid UTF-8 with its column, nesting too deep, a syntax error's position, a wrong type)."""

from __future__ import annotations

import re
import zlib

import msgspec

READ_ERRORS = (OSError, zlib.error)  # gzip.BadGzipFile is an OSError; EOFError is a torn .gz

# Errors a record decoder raises for a bad line: msgspec's own, bytes that are not UTF-8
# inside a string, and nesting deeper than the interpreter's recursion limit.
DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def read_error(exc: BaseException) -> str:
    if isinstance(exc, zlib.error):
        return f"corrupt compressed data ({exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def field_message(exc: BaseException) -> str:
    """The one-line message of a decoder's error (msgspec's), naming the field it was in."""
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


def is_utf8_error(exc: BaseException) -> bool:
    """Whether a decoder refused a line for bytes that are not UTF-8 (msgspec raised a
    ``UnicodeDecodeError`` before 0.23, a ``DecodeError`` saying so since)."""
    return isinstance(exc, UnicodeDecodeError) or (
        isinstance(exc, msgspec.DecodeError) and "utf-8" in str(exc).lower()
    )


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


def decode_problem(exc: BaseException, line: bytes) -> str:
    """The one-line message for a line the record decoder refused with ``exc``."""
    if is_utf8_error(exc):
        return utf8_problem(line)
    if isinstance(exc, RecursionError):
        return nesting_problem(line)
    message = field_message(exc)
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
