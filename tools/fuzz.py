"""A seeded fuzzer of kvflow's readers and CLI verbs ("readers are total").

Every input is a golden trace (``traces/*.jsonl``) or the example workload (``kvflow/simulate/example.jsonl``)
damaged by one to three mutations: byte flips, truncation, duplicated / deleted / swapped /
moved lines, boundary numbers (0, -1, 2**31, 2**63, 2**64, 1e308, NaN...), values of the wrong
JSON type, deep nesting, bytes that are not UTF-8, CRLF, a BOM, blank lines, very long lines,
two files concatenated, small changes to the fields the fold checks (seq, job ids, slots,
ranks, record types), gzip damage (compress, then flip bytes or cut the stream), and special
files (``/dev/zero``, ``/dev/null``, a directory, a missing file). Each input goes through the
CLI verbs in-process with click's ``CliRunner``: ``replay``, ``replay --redecide``,
``incidents``, ``inspect --at N`` (sometimes following a job, block, request or slot) and
``kv-events`` for traces, ``simulate`` for workloads (and, now and then, a trace to simulate
and a workload to the trace verbs).

A run is a *traceback* when an exception escapes the verb, the exit status is not 0, 1 or 2,
or the output says "Traceback"; a *hang* when it outlives ``--timeout`` (an alarm in the
worker, and a watchdog in the parent that kills a worker stuck in C code). Workers run with
a memory limit, so an unbounded allocation is a MemoryError (a traceback), not a dead machine.

Input ``i`` depends only on ``--seed`` and ``i`` (and the golden files), so every finding is
reproduced by one command, which the summary prints::

    python tools/fuzz.py --inputs 10000 --seed 1            # the run; exit 1 on any finding
    python tools/fuzz.py --seed 1 --only 4711               # one input: verbs, full tracebacks
    python tools/fuzz.py --seed 1 --only 4711 --write bad.jsonl   # and keep the input
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import multiprocessing
import os
import queue
import random
import re
import resource
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = sorted((ROOT / "traces").glob("*.jsonl"))
WORKLOADS = [ROOT / "kvflow" / "simulate" / "example.jsonl"]  # the workload kvflow ships

TRACE_VERBS = ("replay", "replay --redecide", "incidents", "inspect", "kv-events")
WORKLOAD_VERBS = ("simulate",)
VERBS = TRACE_VERBS + WORKLOAD_VERBS
OK_EXIT = (0, 1, 2)

BOUNDARY = (
    b"0",
    b"-1",
    b"1",
    b"2",
    b"63",
    b"64",
    b"2147483647",
    b"2147483648",
    b"4294967296",
    b"9223372036854775807",
    b"9223372036854775808",
    b"18446744073709551615",
    b"18446744073709551616",
    b"-9223372036854775808",
    b"-9223372036854775809",
    b"100000000000000000000000000000",
    b"1e308",
    b"-1e308",
    b"1e400",
    b"1e-320",
    b"0.5",
    b"-0",
    b"NaN",
    b"Infinity",
    b"-Infinity",
)
WRONG_VALUES: tuple[Any, ...] = (
    "x",
    "",
    None,
    True,
    False,
    [],
    {},
    1.5,
    -1,
    [[[]]],
    [1, "a"],
    {"a": 1},
    "\u00e9\u2603",
    "x" * 5000,
    list(range(300)),
    2**64,
    -(2**63) - 1,
)
NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")


# --- inputs --------------------------------------------------------------------------------


@dataclass
class Input:
    """One fuzz input: the bytes of a file (or a special path) and how it was made."""

    index: int
    kind: str  # "trace" or "workload": which verbs it is meant for
    source: str
    data: bytes | None  # None: ``special`` names a path to use as it is
    suffix: str = ".jsonl"
    special: str | None = None
    mutations: list[str] = field(default_factory=list)
    verbs: list[tuple[str, list[str]]] = field(default_factory=list)  # (verb, extra args)

    def describe(self) -> str:
        return f"{self.source}: {'; '.join(self.mutations) or 'unchanged'}"


_SOURCES: dict[Path, bytes] = {}


def _source(path: Path) -> bytes:
    if path not in _SOURCES:
        _SOURCES[path] = path.read_bytes()
    return _SOURCES[path]


def _record_tags() -> list[str]:
    from kvflow.log.format import RECORD_TYPES

    return sorted(t.__struct_config__.tag for t in RECORD_TYPES)


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def _pick_line(rng: random.Random, lines: list[bytes], header_bias: float = 0.15) -> int:
    if len(lines) > 1 and rng.random() >= header_bias:
        return rng.randrange(1, len(lines))
    return 0


def m_flip(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    if not data:
        return data, "flip nothing (empty)"
    buf = bytearray(data)
    n = rng.choice((1, 1, 1, 2, 3, 8))
    where = []
    for _ in range(n):
        at = rng.randrange(len(buf)) if rng.random() < 0.8 else rng.randrange(min(len(buf), 400))
        buf[at] ^= rng.randrange(1, 256)
        where.append(at)
    return bytes(buf), f"flip bytes at {sorted(where)}"


def m_truncate(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    at = rng.randrange(len(data) + 1) if rng.random() < 0.5 else rng.randrange(len(data) * 9 // 10, len(data) + 1)
    return data[:at], f"truncate at byte {at}"


def m_lines(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    lines = _lines(data)
    if len(lines) < 2:
        return data + data, "double the file"
    op = rng.choice(("dup", "del", "swap", "swap-adjacent", "move", "del-header", "dup-header", "reverse-tail",
                     "shuffle-window", "drop-type", "every-other"))
    i = rng.randrange(1, len(lines))
    j = rng.randrange(1, len(lines))
    if op == "dup":
        lines.insert(j, lines[i])
    elif op == "del":
        del lines[i]
    elif op == "swap":
        lines[i], lines[j] = lines[j], lines[i]
    elif op == "swap-adjacent":
        i = min(i, len(lines) - 2) if len(lines) > 2 else 0
        lines[i], lines[i + 1] = lines[i + 1], lines[i]
    elif op == "move":
        lines.insert(j, lines.pop(i))
    elif op == "del-header":
        del lines[0]
    elif op == "dup-header":
        lines.insert(j, lines[0])
    elif op == "shuffle-window":
        window = lines[i : i + rng.randrange(2, 12)]
        rng.shuffle(window)
        lines[i : i + len(window)] = window
    elif op == "drop-type":
        found = re.search(rb'"type":"([a-z_]+)"', lines[i])
        tag = found.group() if found else b'"type":"checkpoint"'
        lines = [line for line in lines if tag not in line]
        return b"".join(lines), f"drop every {tag.decode()}"
    elif op == "every-other":
        lines = lines[:1] + lines[1:][i % 2 :: 2]
    else:
        lines[i:] = lines[i:][::-1]
    return b"".join(lines), f"{op} {i} {j}"


def m_number(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    lines = _lines(data)
    if not lines:
        return data, "no number (empty)"
    i = _pick_line(rng, lines)
    found = list(NUMBER.finditer(lines[i]))
    if not found:
        return data, f"no number on line {i + 1}"
    m = rng.choice(found)
    value = rng.choice(BOUNDARY)
    lines[i] = lines[i][: m.start()] + value + lines[i][m.end() :]
    return b"".join(lines), f"line {i + 1}: number {m.group().decode()} -> {value.decode()}"


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for n, v in enumerate(value[:20]):
            yield (*prefix, n)
            yield from _paths(v, (*prefix, n))


def _edit_json(rng: random.Random, data: bytes, edit: Callable[[random.Random, Any], str]) -> tuple[bytes, str]:
    lines = _lines(data)
    if not lines:
        return data, "no line (empty)"
    i = _pick_line(rng, lines)
    try:
        doc = json.loads(lines[i])
    except (ValueError, RecursionError):
        return data, f"line {i + 1} is not JSON"
    what = edit(rng, doc)
    end = b"\n" if lines[i].endswith(b"\n") else b""
    lines[i] = json.dumps(doc, separators=(",", ":")).encode() + end
    return b"".join(lines), f"line {i + 1}: {what}"


def _set_path(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    target = doc
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value


def _wrong_type(rng: random.Random, doc: Any) -> str:
    paths = list(_paths(doc))
    if not paths:
        return "nothing to change"
    path = rng.choice(paths)
    op = rng.random()
    if op < 0.15 and isinstance(path[-1], str):
        target = doc
        for step in path[:-1]:
            target = target[step]
        del target[path[-1]]
        return f"delete {'.'.join(map(str, path))}"
    if op < 0.25 and isinstance(doc, dict):
        key = rng.choice(("extra", "x" * 40, "type", "seq"))
        doc[key] = rng.choice(WRONG_VALUES)
        return f"set key {key}"
    value = rng.choice(WRONG_VALUES)
    _set_path(doc, path, value)
    shown = json.dumps(value)
    return f"{'.'.join(map(str, path))} = {shown[:30]}"


def m_wrong_type(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    return _edit_json(rng, data, _wrong_type)


def _semantic(rng: random.Random, doc: Any) -> str:
    """Small changes the fold, the walk and the renderers must survive: ids off by a little,
    another record type with the same fields, ranks, slots, lists shortened or repeated."""
    if not isinstance(doc, dict):
        return "not an object"
    keys = [k for k in doc if k not in ("format", "kvflow")]
    if not keys:
        return "no field"
    op = rng.random()
    if op < 0.15 and "type" in doc:
        old, doc["type"] = doc["type"], rng.choice(_record_tags())
        return f"type {old} -> {doc['type']}"
    if op < 0.25 and "rank" in doc:
        doc["rank"] = rng.randrange(-3, 70)
        return f"rank = {doc['rank']}"
    if op < 0.35 and isinstance(doc.get("config"), dict):
        key = rng.choice(("cpu_blocks", "world_size", "block_tokens", "job_deadline_ms", "policy", "store_mode"))
        value = rng.choice((0, 1, 2, 3, 64, 65, -1, 0.5, "arc", "lazy", "lru", "nope", 1e-300, 2**16, 2**24 + 1))
        doc["config"][key] = value
        return f"config.{key} = {value!r}"
    key = rng.choice(keys)
    value = doc[key]
    if isinstance(value, bool):
        doc[key] = not value
    elif isinstance(value, int):
        doc[key] = value + rng.choice((-2, -1, 1, 2, 100)) if rng.random() < 0.8 else rng.randrange(0, 5)
    elif isinstance(value, float):
        doc[key] = rng.choice((value * 2, value - 1e6, 0.0, -1.0, value + 1e-9))
    elif isinstance(value, list) and value:
        choice = rng.random()
        if choice < 0.3:
            doc[key] = value[: rng.randrange(len(value))]
        elif choice < 0.5:
            doc[key] = value + value[:1]
        elif isinstance(value[0], int):
            n = rng.randrange(len(value))
            value[n] = value[n] + rng.choice((-1, 1, 7)) if rng.random() < 0.7 else rng.randrange(0, 4)
        else:
            rng.shuffle(value)
    elif isinstance(value, list):
        doc[key] = [rng.randrange(0, 100)]
    elif isinstance(value, str):
        doc[key] = rng.choice((value + "x", "", "req-000", "r1", value.upper()))
    elif value is None:
        doc[key] = rng.choice(("req-000", 0, []))
    return f"{key} changed"


def m_semantic(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    return _edit_json(rng, data, _semantic)


FIELDS = (
    "rank", "seq", "job_id", "hashes", "device_blocks", "slots", "job_ids", "abandoned_job_ids",
    "num_tokens", "num_blocks", "device_hit_blocks", "block_hashes", "corrupt", "now_ms",
    "deadline_ms", "cpu_blocks", "world_size", "block_tokens", "job_deadline_ms", "version",
    "timestamp", "input_length", "output_length", "hash_ids", "results",
)
FIELD_VALUES: tuple[Any, ...] = (
    0, -1, 1, 2, 3, 63, 64, -2, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
    -(2**63) - 1, 10**30, 1e308, -1e308, 0.5, [], [0], [-1], [2**64], [0, 0], None, "0",
)


def m_field(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A boundary value in one named field (or one item of it) of a line that has it."""
    name = rng.choice(FIELDS)
    key = b'"' + name.encode() + b'":'
    lines = _lines(data)
    having = [i for i, line in enumerate(lines) if key in line]
    if not having:
        return data, f"no line has {name}"
    i = rng.choice(having)
    try:
        doc = json.loads(lines[i])
    except (ValueError, RecursionError):
        return data, f"line {i + 1} is not JSON"
    target = doc.get("config", doc) if isinstance(doc, dict) and name in doc.get("config", {}) else doc
    if not isinstance(target, dict) or name not in target:
        return data, f"line {i + 1} has {name} nested"
    value = rng.choice(FIELD_VALUES)
    current = target[name]
    if isinstance(current, list) and current and not isinstance(value, list) and rng.random() < 0.6:
        n = rng.randrange(len(current))
        current[n] = value
        what = f"{name}[{n}] = {value!r}"
    elif isinstance(current, list) and current and isinstance(current[0], dict):
        item = rng.choice(current)
        field_name = rng.choice(sorted(item) or ["rank"])
        item[field_name] = value
        what = f"{name}[..].{field_name} = {value!r}"
    else:
        target[name] = value
        what = f"{name} = {value!r}"
    end = b"\n" if lines[i].endswith(b"\n") else b""
    lines[i] = json.dumps(doc, separators=(",", ":")).encode() + end
    return b"".join(lines), f"line {i + 1}: {what}"


def m_nesting(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    depth = rng.choice((40, 200, 1000, 100_000))
    lines = _lines(data)
    if not lines:
        return b"[" * depth, f"nesting {depth} (empty file)"
    i = _pick_line(rng, lines, 0.3)
    line = lines[i]
    brace = line.rfind(b"}")
    if brace < 0:
        return data, f"no object on line {i + 1}"
    opener, closer = (b"[", b"]") if rng.random() < 0.6 else (b'{"a":', b"}")
    nested = b',"deep":' + opener * depth + b"1" + closer * depth
    lines[i] = line[:brace] + nested + line[brace:]
    return b"".join(lines), f"line {i + 1}: nesting {depth}"


def m_utf8(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    bad = rng.choice((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\xe2\x82"))
    quotes = [m.start() for m in re.finditer(rb'"', data[:200_000])]
    if not quotes:
        at = rng.randrange(len(data) + 1)
    else:
        at = rng.choice(quotes) + 1
    return data[:at] + bad + data[at:], f"bytes {bad!r} at {at}"


def m_control(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    op = rng.choice(("crlf", "bom", "blank", "nul", "cr", "tab", "concat"))
    if op == "crlf":
        return data.replace(b"\n", b"\r\n"), "CRLF line ends"
    if op == "bom":
        return b"\xef\xbb\xbf" + data, "UTF-8 BOM"
    if op == "concat":
        other = _source(TRACES[rng.randrange(len(TRACES))])
        return data + other, "another trace appended"
    lines = _lines(data)
    at = rng.randrange(len(lines) + 1)
    insert = {"blank": rng.choice((b"\n", b"   \n", b"\t\r\n")), "nul": b"\x00\n", "cr": b"\r", "tab": b"\t"}[op]
    lines.insert(at, insert)
    return b"".join(lines), f"{op} inserted before line {at + 1}"


def m_long_line(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    size = rng.choice((100_000, 1 << 20, 3 << 20))
    filler = rng.choice((b"1", b"a", b" ", b"["))
    lines = _lines(data)
    at = rng.randrange(len(lines) + 1)
    newline = rng.random() < 0.6
    line = filler * size + (b"\n" if newline else b"")
    if rng.random() < 0.5:
        line = b'{"type":"touch","block_hashes":[' + b"1," * (size // 2) + b"1]}\n"
    lines.insert(at, line)
    return b"".join(lines), f"a {size}-byte line of {filler!r} before line {at + 1}"


MUTATIONS: tuple[tuple[Callable[[random.Random, bytes], tuple[bytes, str]], int], ...] = (
    (m_flip, 16),
    (m_truncate, 8),
    (m_lines, 14),
    (m_number, 18),
    (m_wrong_type, 14),
    (m_semantic, 18),
    (m_field, 14),
    (m_nesting, 3),
    (m_utf8, 4),
    (m_control, 4),
    (m_long_line, 1),
)


def gzip_damage(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    packed = bytearray(gzip.compress(data, mtime=0))
    op = rng.choice(("none", "flip-body", "flip-body", "flip-header", "flip-trailer", "truncate", "truncate", "append"))
    if op == "flip-body" and len(packed) > 20:
        for _ in range(rng.choice((1, 1, 3))):
            packed[rng.randrange(10, len(packed) - 8)] ^= rng.randrange(1, 256)
    elif op == "flip-header":
        packed[rng.randrange(min(10, len(packed)))] ^= rng.randrange(1, 256)
    elif op == "flip-trailer" and len(packed) > 8:
        packed[rng.randrange(len(packed) - 8, len(packed))] ^= rng.randrange(1, 256)
    elif op == "truncate":
        del packed[rng.randrange(len(packed) + 1) :]
    elif op == "append":
        packed += rng.choice((b"\x00" * 10, b"garbage", bytes(gzip.compress(b"{}\n"))))
    return bytes(packed), f"gzip ({op})"


def make_input(seed: int, index: int) -> Input:
    """Input ``index`` of the run seeded ``seed``: deterministic."""
    rng = random.Random(f"kvflow-fuzz:{seed}:{index}")
    kind = "trace" if rng.random() < 0.8 else "workload"
    src = rng.choice(TRACES if kind == "trace" else WORKLOADS)
    item = Input(index, kind, src.name, _source(src))
    roll = rng.random()
    if roll < 0.03:
        special = rng.choice(("/dev/zero", "/dev/null", "<dir>", "<missing>", "<empty>", "<blank>", "<urandom>"))
        item.mutations.append(f"special {special}")
        if special in ("/dev/zero", "/dev/null", "<dir>", "<missing>"):
            item.data, item.special = None, special
        elif special == "<urandom>":
            item.data = rng.randbytes(rng.choice((10, 1000, 100_000)))
        else:
            item.data = b"" if special == "<empty>" else b" \n\n\t\n"
    else:
        weights = [w for _, w in MUTATIONS]
        for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
            (mutate, _w) = rng.choices(MUTATIONS, weights)[0]
            assert item.data is not None
            item.data, what = mutate(rng, item.data)
            item.mutations.append(f"{mutate.__name__[2:]}: {what}")
        if rng.random() < 0.12:
            assert item.data is not None
            item.data, what = gzip_damage(rng, item.data)
            item.mutations.append(what)
            item.suffix = ".jsonl.gz"
        elif rng.random() < 0.01:
            item.suffix = ".jsonl.gz"  # plain text under a gzip name
            item.mutations.append("plain text named .gz")
    item.verbs = _verbs(rng, kind)
    return item


def _verbs(rng: random.Random, kind: str) -> list[tuple[str, list[str]]]:
    verbs: list[tuple[str, list[str]]] = []
    as_trace = kind == "trace" or rng.random() < 0.05
    as_workload = kind == "workload" or rng.random() < 0.05
    if as_trace:
        verbs.append(("replay", ["--json"] if rng.random() < 0.3 else []))
        verbs.append(("replay --redecide", ["--strict"] if rng.random() < 0.2 else []))
        verbs.append(("incidents", ["--json"] if rng.random() < 0.3 else []))
        extra = ["--at", str(rng.randrange(0, 500) if rng.random() < 0.9 else rng.randrange(0, 2000))]
        follow = rng.random()
        if follow < 0.15:
            extra = ["--job", str(rng.randrange(1, 60))] + (extra if rng.random() < 0.5 else [])
        elif follow < 0.25:
            extra = ["--request", f"req-{rng.randrange(0, 60):03d}"] + (extra if rng.random() < 0.5 else [])
        elif follow < 0.35:
            extra = ["--slot", str(rng.randrange(0, 100))] + (extra if rng.random() < 0.5 else [])
        if rng.random() < 0.3:
            extra.append("--json")
        verbs.append(("inspect", extra))
        verbs.append(("kv-events", ["--until", str(rng.randrange(0, 800))] if rng.random() < 0.2 else []))
    if as_workload:
        extra = [
            "--cpu-blocks", str(rng.choice((0, 4, 64, 2000))),
            "--device-blocks", str(rng.choice((0, 8, 100))),
            "--mode", rng.choice(("sequential", "timed")),
            "--policy", rng.choice(("lru", "arc")),
            "--store", rng.choice(("eager", "lazy")),
            "--fault-rate", rng.choice(("0", "0.2")),
        ]
        if rng.random() < 0.5:
            extra.append("--json")
        verbs.append(("simulate", extra))
    return verbs


# --- running -------------------------------------------------------------------------------


class _Hang(BaseException):
    """Raised by the alarm inside a verb that ran past the time limit."""


@dataclass
class Outcome:
    index: int
    verb: str
    args: list[str]
    status: str  # "ok", "traceback" or "hang"
    exit_code: int | None
    detail: str = ""  # the traceback (or why it counts as one)
    where: str = ""  # exception type and innermost kvflow frame: groups findings by cause


def _write_input(item: Input, workdir: Path) -> str:
    if item.special == "<dir>":
        return str(workdir)
    if item.special == "<missing>":
        return str(workdir / "missing.jsonl")
    if item.special is not None:
        return item.special
    path = workdir / f"input-{item.index}{item.suffix}"
    assert item.data is not None
    path.write_bytes(item.data)
    return str(path)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "kvflow" in f.filename and "click" not in f.filename]
    frame = (ours or frames or [None])[-1]
    place = f" at {Path(frame.filename).name}:{frame.lineno} ({frame.name})" if frame else ""
    return f"{type(exc).__name__}{place}"


def _alarm(_signum: int, _frame: Any) -> None:
    raise _Hang


def run_verb(index: int, verb: str, path: str, extra: list[str], timeout: float) -> Outcome:
    """Run one verb in-process through CliRunner and classify what happened."""
    from click.testing import CliRunner

    from kvflow.cli.main import main

    args = verb.split() + [path] + extra
    runner = CliRunner()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        result = runner.invoke(main, args, catch_exceptions=True, env={"COLUMNS": "120"})
    except _Hang:
        return Outcome(index, verb, args, "hang", None, f"ran past {timeout:g} s", "hang")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return Outcome(index, verb, args, "traceback", result.exit_code, text, _where(exc))
    output = result.output  # stdout and stderr, as a terminal shows them
    if result.exit_code not in OK_EXIT:
        return Outcome(index, verb, args, "traceback", result.exit_code, output[-2000:], f"exit {result.exit_code}")
    if "Traceback" in output:
        return Outcome(index, verb, args, "traceback", result.exit_code, output[-4000:], "Traceback in output")
    return Outcome(index, verb, args, "ok", result.exit_code)


def run_input(item: Input, workdir: Path, timeout: float, verb_filter: str | None = None,
              on_start: Callable[[str], None] | None = None) -> list[Outcome]:
    path = _write_input(item, workdir)
    outcomes = []
    try:
        for verb, extra in item.verbs:
            if verb_filter is not None and verb != verb_filter:
                continue
            if on_start is not None:
                on_start(verb)
            outcomes.append(run_verb(item.index, verb, path, extra, timeout))
    finally:
        if item.special is None:
            with contextlib.suppress(OSError):
                os.remove(path)
    return outcomes


def _limit_memory(mb: int) -> None:
    if mb > 0:
        limit = mb << 20
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _worker(wid: int, seed: int, tasks: Any, results: Any, timeout: float, memory_mb: int) -> None:
    _limit_memory(memory_mb)
    import kvflow.cli.main  # noqa: F401  (import once, before the clock of the first input starts)

    workdir = Path(tempfile.mkdtemp(prefix=f"kvflow-fuzz-{wid}-"))
    try:
        while True:
            index = tasks.get()
            if index is None:
                break
            try:
                item = make_input(seed, index)
            except Exception:  # a bug of the fuzzer itself: say so, and go on
                results.put(("broken", wid, index, traceback.format_exc()))
                continue
            results.put(("input", wid, index, item.kind, item.describe(), len(item.verbs)))
            for outcome in run_input(item, workdir, timeout, on_start=lambda v, i=index: results.put(("start", wid, i, v))):
                results.put(("done", wid, outcome))
    finally:
        with contextlib.suppress(OSError):
            for leftover in workdir.iterdir():
                leftover.unlink()
            workdir.rmdir()
        results.put(("exit", wid))


@dataclass
class Summary:
    seed: int
    inputs: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    runs: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    findings: list[Outcome] = field(default_factory=list)
    described: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    workers: int = 1
    broken: list[tuple[int, str]] = field(default_factory=list)  # inputs the fuzzer failed to make

    @property
    def tracebacks(self) -> list[Outcome]:
        return [o for o in self.findings if o.status == "traceback"]

    @property
    def hangs(self) -> list[Outcome]:
        return [o for o in self.findings if o.status == "hang"]

    def add(self, outcome: Outcome) -> None:
        counts = self.runs[outcome.verb]
        counts["runs"] += 1
        if outcome.status == "ok":
            counts[f"exit {outcome.exit_code}"] += 1
        else:
            counts[outcome.status] += 1
            self.findings.append(outcome)


def fuzz(inputs: int, seed: int, *, start: int = 0, jobs: int | None = None, timeout: float = 10.0,
         memory_mb: int = 4096, progress: bool = False) -> Summary:
    """Run inputs ``start .. start+inputs-1`` of ``seed`` in ``jobs`` worker processes."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, inputs))
    ctx = multiprocessing.get_context("fork")
    tasks: Any = ctx.Queue()
    results: Any = ctx.Queue()
    for index in range(start, start + inputs):
        tasks.put(index)
    for _ in range(jobs):
        tasks.put(None)
    summary = Summary(seed=seed, workers=jobs)
    t0 = time.perf_counter()
    workers: dict[int, Any] = {}
    running: dict[int, tuple[int, str, float]] = {}  # worker -> (input, verb, started)
    next_id = 0

    def spawn() -> None:
        nonlocal next_id
        proc = ctx.Process(target=_worker, args=(next_id, seed, tasks, results, timeout, memory_mb), daemon=True)
        proc.start()
        workers[next_id] = proc
        next_id += 1

    for _ in range(jobs):
        spawn()
    hard_limit = timeout + 10.0
    last_report = time.perf_counter()
    while workers:
        try:
            msg = results.get(timeout=0.5)
        except queue.Empty:
            msg = None
        if msg is not None:
            tag, wid = msg[0], msg[1]
            if tag == "input":
                _, _, index, kind, described, _n = msg
                summary.inputs += 1
                summary.kinds[kind] += 1
                summary.described[index] = described
            elif tag == "broken":
                summary.broken.append((msg[2], msg[3]))
            elif tag == "start":
                running[wid] = (msg[2], msg[3], time.perf_counter())
            elif tag == "done":
                running.pop(wid, None)
                summary.add(msg[2])
            elif tag == "exit":
                running.pop(wid, None)
                proc = workers.pop(wid, None)
                if proc is not None:
                    proc.join(5)
        now = time.perf_counter()
        for wid, (index, verb, started) in list(running.items()):
            if now - started > hard_limit:  # stuck where the alarm cannot reach (C code)
                proc = workers.pop(wid)
                proc.kill()
                proc.join(5)
                running.pop(wid)
                summary.add(Outcome(index, verb, [verb], "hang", None, f"killed after {now - started:.0f} s", "hang (killed)"))
                spawn()
        for wid, proc in list(workers.items()):
            if msg is None and not proc.is_alive():
                # died without saying goodbye (killed by the system, e.g. out of memory)
                workers.pop(wid)
                if wid in running:
                    index, verb, started = running.pop(wid)
                    summary.add(Outcome(index, verb, [verb], "traceback", proc.exitcode,
                                        f"worker died (exit {proc.exitcode})", "worker died"))
                tasks.put(None)  # its replacement's end (harmless if it had taken its own)
                spawn()
        if progress and now - last_report > 10:
            last_report = now
            print(f"  ... {summary.inputs} inputs, {len(summary.tracebacks)} tracebacks, "
                  f"{len(summary.hangs)} hangs, {now - t0:.0f} s", file=sys.stderr, flush=True)
    summary.seconds = time.perf_counter() - t0
    return summary


def report(summary: Summary, out: Any = sys.stdout) -> None:
    def say(text: str = "") -> None:
        print(text, file=out)

    kinds = ", ".join(f"{n} {k}s" for k, n in sorted(summary.kinds.items()))
    say(f"kvflow fuzz: seed {summary.seed}, {summary.inputs} inputs ({kinds}), "
        f"{summary.seconds:.1f} s, {summary.workers} worker{'s' if summary.workers != 1 else ''}")
    say(f"  {'verb':<18} {'runs':>7} {'exit 0':>7} {'exit 1':>7} {'exit 2':>7} {'tracebacks':>11} {'hangs':>6}")
    total: Counter[str] = Counter()
    for verb in VERBS:
        c = summary.runs.get(verb, Counter())
        total.update(c)
        say(f"  {verb:<18} {c['runs']:>7} {c['exit 0']:>7} {c['exit 1']:>7} {c['exit 2']:>7} "
            f"{c['traceback']:>11} {c['hang']:>6}")
    say(f"  {'all':<18} {total['runs']:>7} {total['exit 0']:>7} {total['exit 1']:>7} {total['exit 2']:>7} "
        f"{total['traceback']:>11} {total['hang']:>6}")
    say(f"tracebacks: {len(summary.tracebacks)}, hangs: {len(summary.hangs)}")
    for index, text in summary.broken:
        say(f"fuzzer error making input {index} (not a kvflow finding): {text.strip().splitlines()[-1]}")
    if not summary.findings:
        return
    groups: dict[str, list[Outcome]] = defaultdict(list)
    for o in summary.findings:
        groups[o.where].append(o)
    say(f"\n{len(groups)} distinct causes (exception and innermost kvflow frame):")
    for where, found in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        verbs = Counter(o.verb for o in found)
        say(f"\n{where}: {len(found)} run{'s' if len(found) != 1 else ''} "
            f"({', '.join(f'{v} {n}' for v, n in verbs.most_common())})")
        first = found[0]
        last_line = first.detail.strip().splitlines()[-1] if first.detail.strip() else first.status
        say(f"  {last_line[:200]}")
        for o in found[:3]:
            say(f"  input {o.index} ({summary.described.get(o.index, '?')[:160]})")
            say(f"    reproduce: python tools/fuzz.py --seed {summary.seed} --only {o.index} --verb {json.dumps(o.verb)}")
    say("\nevery finding:")
    for o in summary.findings:
        say(f"  {o.status:<9} {o.verb:<18} python tools/fuzz.py --seed {summary.seed} --only {o.index} --verb {json.dumps(o.verb)}")


def reproduce(seed: int, index: int, verb: str | None, timeout: float, write: str | None) -> int:
    """Run one input in this process and print each verb's outcome and full traceback."""
    item = make_input(seed, index)
    print(f"input {index} of seed {seed}: {item.kind} from {item.describe()}")
    if write is not None and item.data is not None:
        Path(write).write_bytes(item.data)
        print(f"written to {write}")
    found = 0
    with tempfile.TemporaryDirectory(prefix="kvflow-fuzz-") as tmp:
        for o in run_input(item, Path(tmp), timeout, verb):
            print(f"  {o.status:<9} exit {o.exit_code}  kvflow {' '.join(o.args)}")
            if o.status != "ok":
                found += 1
                print(o.detail)
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--inputs", type=int, default=1000, help="how many inputs (default 1000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, help="first input index")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPUs)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per verb run")
    parser.add_argument("--memory-mb", type=int, default=4096, help="address-space limit per worker")
    parser.add_argument("--only", type=int, default=None, metavar="INDEX", help="run one input here, verbosely")
    parser.add_argument("--verb", default=None, choices=VERBS, help="with --only: just this verb")
    parser.add_argument("--write", default=None, metavar="PATH", help="with --only: save the input")
    args = parser.parse_args(argv)
    if args.only is not None:
        return reproduce(args.seed, args.only, args.verb, args.timeout, args.write)
    summary = fuzz(args.inputs, args.seed, start=args.start, jobs=args.jobs, timeout=args.timeout,
                   memory_mb=args.memory_mb, progress=sys.stderr.isatty())
    report(summary)
    return 1 if summary.findings or summary.broken else 0


if __name__ == "__main__":
    sys.exit(main())
