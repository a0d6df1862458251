"""Issue 11 item 3: a trace writer killed at any point leaves a trace readable to its last
complete record, plain or gzip, and ``--redecide`` of a cut trace stops cleanly.

A kill is simulated by cutting a finished trace at a byte offset (what is on disk when a
process dies is a prefix of what it would have written), and for real by
``tools/crash_traces.py``, which SIGKILLs writers.
"""

from __future__ import annotations

import gzip
import random
import subprocess
import sys
from pathlib import Path

from core_helpers import mixed_run

from kvflow.core.config import Config
from kvflow.engine.manager import OffloadManager
from kvflow.log.reader import TraceReader
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "traces"


def record_run(path: Path, flush_records: int = 4096, requests: int = 40) -> list[tuple[int, int]]:
    """Write a small engine-like run's trace; after each write (flush), the file's size and
    how many records had been handed to it."""
    config = Config(cpu_blocks=24, block_tokens=16)
    writer = TraceWriter(path, config, checkpoint_every=20, flush_records=flush_records)
    sizes: list[tuple[int, int]] = []
    write = writer.write_bytes
    written = [0]

    def write_and_measure(blob: bytes) -> None:
        write(blob)
        written[0] += blob.count(b"\n")
        sizes.append((path.stat().st_size, written[0]))

    writer.write_bytes = write_and_measure  # type: ignore[method-assign]
    manager = OffloadManager(config, log=writer)
    mixed_run(manager, requests, seed=5)
    manager.close()
    return sizes


def assert_reads_to_last_complete_record(path: Path, text: bytes, full: bytes) -> int:
    """``path`` holds ``text``, a prefix of the trace ``full``: it reads, replays and re-decides
    clean, and yields exactly its complete records. Returns how many."""
    complete = text.count(b"\n") - 1  # lines after the header
    if full[len(text) : len(text) + 1] == b"\n" and not text.endswith(b"\n"):
        complete += 1  # cut just before a newline: the record itself is whole
    with TraceReader(path) as reader:
        count = sum(1 for _ in reader.records())
    assert count == complete and reader.mismatch is None, path
    for redecide in (False, True):
        result = replay(path, redecide=redecide)
        assert result.ok, (redecide, result.divergence)
    return count


def test_a_trace_cut_at_any_byte_reads_to_its_last_complete_record(tmp_path: Path) -> None:
    full = tmp_path / "full.jsonl"
    record_run(full)
    data = full.read_bytes()
    first_line = data.index(b"\n") + 1
    rng = random.Random(1)
    offsets = sorted({first_line, len(data) - 1, *rng.sample(range(first_line, len(data)), 150)})
    cut = tmp_path / "cut.jsonl"
    read = []
    for offset in offsets:
        cut.write_bytes(data[:offset])
        read.append(assert_reads_to_last_complete_record(cut, data[:offset], data))
    assert read == sorted(read) and read[-1] > 0


def test_a_gzip_trace_cut_at_any_byte_keeps_every_record_flushed_before_the_cut(tmp_path: Path) -> None:
    full = tmp_path / "full.jsonl.gz"
    sizes = record_run(full, flush_records=1)
    data = full.read_bytes()
    text = gzip.decompress(data)
    rng = random.Random(2)
    cut = tmp_path / "cut.jsonl.gz"
    for offset in sorted(rng.sample(range(sizes[0][0], len(data)), 120)):
        cut.write_bytes(data[:offset])
        with TraceReader(cut) as reader:
            recs = list(reader.records())
        on_disk = max(count for size, count in sizes if size <= offset)  # flushed before the cut
        assert len(recs) >= on_disk, (offset, len(recs), on_disk)  # nothing flushed is lost
        assert_reads_to_last_complete_record(cut, _gunzip_prefix(cut.read_bytes()), text)


def _gunzip_prefix(data: bytes) -> bytes:
    """What a gzip prefix decompresses to (zlib's own reading, not kvflow's)."""
    import zlib

    return zlib.decompressobj(wbits=31).decompress(data)


def test_redecide_of_a_trace_cut_inside_a_command_stops_at_the_command_before(tmp_path: Path) -> None:
    lines = (TRACES / "clean.jsonl").read_bytes().splitlines(keepends=True)
    # a command followed by at least two events: cut after its first event
    for i in range(len(lines) - 3, 1, -1):
        if b'"seq"' not in lines[i] and b'"seq"' in lines[i + 1] and b'"seq"' in lines[i + 2]:
            break
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[: i + 2]))
    result = replay(cut, redecide=True)
    assert result.ok, result.divergence
    assert any("ends inside this command" in w and f":{i + 1}:" in w for w in result.warnings), result.warnings
    # the whole trace (it ends on its closing checkpoint) re-decides clean, without a warning
    whole = replay(TRACES / "clean.jsonl", redecide=True)
    assert whole.ok and not whole.warnings


def test_the_writer_hands_records_to_the_file_every_flush_records(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    sizes = record_run(path, flush_records=50)
    assert len(sizes) > 5
    counts = [count for _, count in sizes]
    assert all(50 <= b - a < 60 for a, b in zip(counts, counts[1:-1]))  # (plus one command's events)


def test_the_header_of_a_gzip_trace_is_readable_before_the_first_flush(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    writer = TraceWriter(path, Config(cpu_blocks=4, block_tokens=16))
    with TraceReader(path) as reader:
        assert reader.config.cpu_blocks == 4 and list(reader.records()) == []
    writer.close()


def test_writers_killed_with_sigkill_leave_readable_traces() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "crash_traces.py"), "--kills", "4", "--requests", "1200", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 writers killed" in result.stdout and ": 0 failed;" in result.stdout
