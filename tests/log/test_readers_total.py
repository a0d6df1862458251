"""The readers are total: every input gives valid records or the one documented error.

``TraceReader`` (kvflow traces) and ``read_workload`` (Mooncake JSONL) raise
:class:`~kvflow.core.errors.TraceError` naming ``file:line`` and the field for every bad input,
which the CLI prints as one line with exit 2. Each test below is one root cause that used to
escape as a traceback (found by hand or by ``tools/fuzz.py``).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import kvflow.log.format as trace_format
import kvflow.log.reader as trace_reader
import kvflow.log.source as trace_source
import kvflow.simulate.workload as workload
from kvflow.cli.main import main
from kvflow.core.config import MAX_CPU_BLOCKS, MAX_WORLD_SIZE, Config
from kvflow.core.errors import TraceError
from kvflow.engine.manager import OffloadManager
from kvflow.log.reader import TraceReader, read_trace
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay
from kvflow.simulate.workload import EXAMPLE_WORKLOAD, read_workload

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "traces"
TRACE_VERBS = (["replay"], ["replay", "--redecide"], ["incidents"], ["inspect", "--at", "5"], ["kv-events"])


def kvflow(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert "\n" not in err and err.startswith("kvflow: error: "), err
    assert "Traceback" not in result.output
    return err


def trace_error(path: Path) -> TraceError:
    """The TraceError reading the whole trace raises (header or records)."""
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path)), message
    return caught.value


def workload_error(path: Path) -> TraceError:
    with pytest.raises(TraceError) as caught:
        list(read_workload(path))
    return caught.value


def golden_lines(name: str = "clean.jsonl") -> list[bytes]:
    return (TRACES / name).read_bytes().splitlines(keepends=True)


def edited(tmp_path: Path, name: str, lineno: int, edit: Any, source: str = "clean.jsonl") -> Path:
    """A copy of a golden trace whose line ``lineno`` (1-based) is ``edit(record dict)``."""
    lines = golden_lines(source)
    record = json.loads(lines[lineno - 1])
    edit(record)
    lines[lineno - 1] = json.dumps(record, separators=(",", ":")).encode() + b"\n"
    path = tmp_path / name
    path.write_bytes(b"".join(lines))
    return path


def first_line_of(source: str, record_type: str, where: Any = lambda r: True) -> int:
    for n, line in enumerate(golden_lines(source), start=1):
        if n > 1:
            record = json.loads(line)
            if record["type"] == record_type and where(record):
                return n
    raise AssertionError(f"no {record_type} in {source}")


def assert_cli_refuses(path: Path, *needles: str, verbs: tuple[list[str], ...] = TRACE_VERBS) -> None:
    for verb in verbs:
        args = [verb[0], path, *verb[1:]]
        err = one_line_error(kvflow(*args))
        for needle in needles:
            assert needle in err, (verb, err)


# --- invalid UTF-8 (was UnicodeDecodeError) ----------------------------------------------------


def test_invalid_utf_8_inside_a_string_names_line_and_field(tmp_path: Path) -> None:
    lines = golden_lines()
    assert lines[1].startswith(b'{"type":"lookup","request_id":"req-000"')
    lines[1] = lines[1].replace(b'"req-000"', b'"req-\xff00"', 1)
    path = tmp_path / "utf8.jsonl"
    path.write_bytes(b"".join(lines))
    error = trace_error(path)
    assert error.line == 2
    assert "field 'request_id'" in str(error) and "not valid UTF-8" in str(error) and "0xff" in str(error)
    assert_cli_refuses(path, f"{path}:2:", "request_id", "UTF-8")


def test_invalid_utf_8_in_the_header_and_in_a_key(tmp_path: Path) -> None:
    lines = golden_lines()
    path = tmp_path / "header.jsonl"
    path.write_bytes(lines[0].replace(b'"golden":"clean"', b'"golden":"cl\xc3"', 1) + b"".join(lines[1:]))
    error = trace_error(path)
    assert error.line == 1 and "header" in str(error) and "field 'meta'" in str(error)
    # a key that is not UTF-8 is an unknown key (skipped undecoded): its field is missing
    lines[3] = lines[3].replace(b'"request_id"', b'"request\xe2\x82_id"', 1)
    path.write_bytes(b"".join(lines))
    error = trace_error(path)
    assert error.line == 4 and "request_id" in str(error)


def test_invalid_utf_8_in_a_workload_names_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_bytes(b'{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                     b'{"timestamp": 1, "input_length": "1\xff", "output_length": 1, "hash_ids": [2]}\n')
    error = workload_error(path)
    assert error.line == 2 and "field 'input_length'" in str(error) and "not valid UTF-8" in str(error)
    one_line_error(kvflow("simulate", path, "--block-tokens", "16"))


# --- deep nesting (was RecursionError) ---------------------------------------------------------


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_nesting_in_a_record_is_refused(tmp_path: Path, depth: int) -> None:
    lines = golden_lines()
    lines[2] = lines[2].rstrip(b"}\n") + b',"extra":' + b"[" * depth + b"]" * depth + b"}\n"
    path = tmp_path / "deep.jsonl"
    path.write_bytes(b"".join(lines))
    error = trace_error(path)
    assert error.line == 3 and "field 'extra'" in str(error) and "nested too deeply" in str(error)
    assert_cli_refuses(path, f"{path}:3:", "nested too deeply")


def test_deep_nesting_in_the_header_is_refused(tmp_path: Path) -> None:
    header = json.loads(golden_lines()[0])
    header["meta"] = "@"
    text = json.dumps(header).replace('"@"', "[" * 50_000 + "]" * 50_000)
    path = tmp_path / "deep_header.jsonl"
    path.write_text(text + "\n")
    error = trace_error(path)
    assert error.line == 1 and "nested too deeply" in str(error)


def test_deep_nesting_in_a_workload_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "x": ' + deep + "}\n")
    error = workload_error(path)
    assert error.line == 1 and "nested too deeply" in str(error)
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ' + deep + "}\n")
    assert workload_error(path).line == 1


# --- corrupt deflate data (was zlib.error) -----------------------------------------------------


def _invalid_deflate_member() -> bytes:
    """A gzip member whose first deflate block has the reserved block type (BTYPE 11)."""
    member = bytearray(gzip.compress(b'{"type":"evict","num_blocks":0}\n' * 100, mtime=0))
    member[10] |= 0b110  # gzip.compress writes a 10-byte header (no file name)
    return bytes(member)


def test_corrupt_deflate_data_in_the_header_is_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(_invalid_deflate_member())
    error = trace_error(path)
    assert error.line == 1 and "corrupt compressed data" in str(error)
    assert_cli_refuses(path, f"{path}:1:", "corrupt compressed data")


def test_corrupt_deflate_data_after_the_header_is_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.gz"
    lines = golden_lines()
    # two gzip members: the header and 20 records read fine, then the stream is corrupt
    path.write_bytes(gzip.compress(b"".join(lines[:21]), mtime=0) + _invalid_deflate_member())
    error = trace_error(path)
    assert error.line == 22 and "corrupt compressed data" in str(error)
    # (inspect --at 5 stops reading before the damage: what comes before it reads)
    verbs = (*TRACE_VERBS[:3], ["inspect", "--at", "600"], ["kv-events"])
    assert_cli_refuses(path, f"{path}:22:", "corrupt compressed data", verbs=verbs)
    assert kvflow("inspect", path, "--at", "5").exit_code == 0


def test_corrupt_deflate_data_in_a_workload_is_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(_invalid_deflate_member())
    assert "corrupt compressed data" in str(workload_error(path))


# --- a line that never ends (was unbounded memory) ----------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_line_that_never_ends_is_refused() -> None:
    error = trace_error(Path("/dev/zero"))
    assert error.line == 1 and f"longer than {trace_format.MAX_LINE_BYTES:,} bytes" in str(error)
    assert "longer than" in str(workload_error(Path("/dev/zero")))
    assert_cli_refuses(Path("/dev/zero"), "/dev/zero:1:", "longer than", verbs=(["replay"],))
    one_line_error(kvflow("simulate", "/dev/zero"))


def test_a_long_line_after_the_header_names_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_reader, "MAX_LINE_BYTES", 10_000)
    lines = golden_lines()
    path = tmp_path / "long.jsonl"
    long_line = b'{"type":"touch","block_hashes":[' + b"1," * 20_000 + b"1]}\n"
    path.write_bytes(b"".join(lines[:30]) + long_line + b"".join(lines[30:]))
    error = trace_error(path)
    assert error.line == 31 and "longer than 10,000 bytes" in str(error)
    path.write_bytes(b"".join(lines[:30]) + long_line.rstrip(b"\n"))  # and with no newline at all
    assert trace_error(path).line == 31
    # lines up to the limit still read
    monkeypatch.setattr(trace_reader, "MAX_LINE_BYTES", max(map(len, lines)))
    assert len(read_trace(TRACES / "clean.jsonl")[1]) == len(lines) - 1


def test_a_long_workload_line_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workload, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "long.jsonl"
    path.write_bytes(EXAMPLE_WORKLOAD.read_bytes().splitlines(keepends=True)[0] + b" " * 5000 + b"\n")
    error = workload_error(path)
    assert error.line == 2 and "longer than 1,000 bytes" in str(error)


# --- header sizes (was MemoryError / an allocation without bound) --------------------------------


def header_with(tmp_path: Path, **config: Any) -> Path:
    lines = golden_lines()
    header = json.loads(lines[0])
    header["config"].update(config)
    path = tmp_path / "header.jsonl"
    path.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(lines[1:]))
    return path


@pytest.mark.parametrize("cpu_blocks", [2**62, 2**33, MAX_CPU_BLOCKS + 1])
def test_a_header_cpu_tier_beyond_the_maximum_is_refused(tmp_path: Path, cpu_blocks: int) -> None:
    path = header_with(tmp_path, cpu_blocks=cpu_blocks)
    error = trace_error(path)
    assert error.line == 1 and "cpu_blocks" in str(error) and f"{MAX_CPU_BLOCKS:,}" in str(error)
    assert_cli_refuses(path, f"{path}:1:", "cpu_blocks")


def test_the_maximum_cpu_tier_itself_reads(tmp_path: Path) -> None:
    with TraceReader(header_with(tmp_path, cpu_blocks=MAX_CPU_BLOCKS)) as reader:
        assert reader.config.cpu_blocks == MAX_CPU_BLOCKS


@pytest.mark.parametrize("world_size", [2**40, MAX_WORLD_SIZE + 1, 0, -1])
def test_a_header_world_size_beyond_the_maximum_is_refused(tmp_path: Path, world_size: int) -> None:
    error = trace_error(header_with(tmp_path, world_size=world_size))
    assert error.line == 1 and "world_size" in str(error) and str(MAX_WORLD_SIZE) in str(error)


# --- ranks, seq, hashes and device blocks are range-checked at read time ------------------------


def test_a_negative_rank_is_refused_at_read_time(tmp_path: Path) -> None:
    """It used to reach the fold: "negative shift count" (kvflow/state/apply.py)."""
    n = first_line_of("two_ranks.jsonl", "rank_succeeded")
    path = edited(tmp_path, "rank.jsonl", n, lambda r: r.update(rank=-1), source="two_ranks.jsonl")
    error = trace_error(path)
    assert error.line == n and "field 'rank'" in str(error) and "world_size 2" in str(error)
    # (``inspect --at`` reads the trace up to its seq: here, one past the bad line's)
    verbs = tuple(["inspect", "--at", "100"] if verb[0] == "inspect" else verb for verb in TRACE_VERBS)
    assert_cli_refuses(path, f"{path}:{n}:", "rank", verbs=verbs)


@pytest.mark.parametrize("rank", [2, 64, 2**40, 2**63])
def test_a_rank_outside_the_world_is_refused_at_read_time(tmp_path: Path, rank: int) -> None:
    n = first_line_of("two_ranks.jsonl", "rank_succeeded")
    path = edited(tmp_path, "rank.jsonl", n, lambda r: r.update(rank=rank), source="two_ranks.jsonl")
    error = trace_error(path)
    assert error.line == n and f"{rank} is not a rank of world_size 2" in str(error)


def test_a_cancelled_job_keeps_its_rank_minus_one() -> None:
    assert any(b'"rank":-1' in line for line in golden_lines("reset_inflight.jsonl"))
    assert replay(TRACES / "reset_inflight.jsonl", redecide=True).ok


def test_a_nested_result_rank_is_checked(tmp_path: Path) -> None:
    n = first_line_of("clean.jsonl", "job_result")
    lines = golden_lines()
    lines[n - 1] = b'{"type":"job_results","results":[{"type":"job_result","job_id":1},' \
                   b'{"type":"job_result","job_id":1,"rank":7}]}\n'
    path = tmp_path / "results.jsonl"
    path.write_bytes(b"".join(lines))
    error = trace_error(path)
    assert error.line == n and "field 'results[1].rank'" in str(error)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hashes", 2**64, "does not fit in 64 bits"),
        ("hashes", -(2**63) - 1, "does not fit in 64 bits"),
        ("hashes", 10**30, "does not fit in 64 bits"),
        ("device_blocks", -1, "out of range"),
        ("device_blocks", 2**64, "out of range"),
        ("slots", -5, "out of range"),
        ("seq", -1, "out of range"),
        ("seq", 2**64, "out of range"),
        ("job_id", -3, "out of range"),
    ],
)
def test_out_of_range_values_are_refused_at_read_time(tmp_path: Path, field: str, value: int, message: str) -> None:
    """A hash >= 2**64 used to pass the fold and then break the state digest."""
    n = first_line_of("clean.jsonl", "store_queued")

    def edit(record: dict[str, Any]) -> None:
        if isinstance(record[field], list):
            record[field][1] = value
        else:
            record[field] = value

    path = edited(tmp_path, "range.jsonl", n, edit)
    error = trace_error(path)
    assert error.line == n and f"field '{field}" in str(error) and message in str(error), str(error)
    assert str(value) in str(error)
    assert_cli_refuses(path, f"{path}:{n}:", field)


def test_out_of_range_values_in_commands_are_refused(tmp_path: Path) -> None:
    n = first_line_of("clean.jsonl", "lookup")
    path = edited(tmp_path, "cmd.jsonl", n, lambda r: r["block_hashes"].append(2**64))
    assert "field 'block_hashes[" in str(trace_error(path))
    path = edited(tmp_path, "cmd.jsonl", n, lambda r: r.update(num_tokens=-1))
    assert "field 'num_tokens'" in str(trace_error(path))


def test_64_bit_extremes_and_negative_looking_strings_read(tmp_path: Path) -> None:
    """What a live engine may record still reads, replays and re-decides: hashes at both 64-bit
    ends, request ids with '-' after ':' or ',' inside strings."""
    path = tmp_path / "extremes.jsonl"
    config = Config(cpu_blocks=8, block_tokens=4)
    m = OffloadManager(config, log=TraceWriter(path, config, checkpoint_every=2))
    m.blocks_computed("a:-1,[-2", [2**64 - 1, -(2**63), 5], [0, 1, 2])
    m.plan_step(0.0)
    for job in list(m.state.jobs):
        m.job_result(job)
    m.lookup("b", [2**64 - 1, -(2**63), 7], 12)
    m.finish_request("b")
    m.close()
    folded, redecided = replay(path), replay(path, redecide=True)
    assert folded.ok and redecided.ok, (folded.divergence, redecided.divergence)
    assert folded.state.digest() == m.state.digest()


def test_a_bad_value_far_into_a_trace_names_its_line(tmp_path: Path) -> None:
    """The checks run per chunk at C speed; a bad value in a late chunk still names its line."""
    lines = golden_lines("clean_idle_ticks.jsonl")
    n = max(i for i, line in enumerate(lines, start=1) if b'"type":"store_queued"' in line)
    assert n > 1000  # several 64 KiB chunks in
    lines[n - 1] = re.sub(rb'"device_blocks":\[(\d+)', rb'"device_blocks":[-7', lines[n - 1], count=1)
    path = tmp_path / "late.jsonl"
    path.write_bytes(b"".join(lines))
    error = trace_error(path)
    assert error.line == n and "field 'device_blocks[0]': -7 is out of range" in str(error)


# --- found by tools/fuzz.py -------------------------------------------------------------------


def test_redecide_of_an_event_before_any_command_is_a_divergence(tmp_path: Path) -> None:
    """``replay --redecide`` of a trace whose first record is an event (an AttributeError in
    kvflow/replay.py before: ``python tools/fuzz.py --seed 20261123 --only 262``)."""
    lines = golden_lines()
    path = tmp_path / "event_first.jsonl"
    path.write_bytes(lines[0] + lines[2] + lines[1] + b"".join(lines[3:]))
    result = replay(path, redecide=True)
    assert result.divergence is not None and "before any command" in result.divergence.message
    assert kvflow("replay", path, "--redecide").exit_code == 1


# --- file handles -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        b"not json\n",
        b'{"format":"kvflow-trace","version":99,"kvflow":"9","config":{"cpu_blocks":4}}\n',
        b'{"format":"kvflow-trace","version":2,"kvflow":"0","config":{"cpu_blocks":-1}}\n',
        b'{"format":"kvflow-trace","version":2,"kvflow":"0","config":{"cpu_blocks":4611686018427387904}}\n',
        b'{"format":"kvflow-trace","version":2,"kvflow":"0","config":{"cpu_blocks":4},"meta":"\xff"}\n',
        b"",
    ],
)
def test_no_file_handle_stays_open_on_a_refused_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, header: bytes
) -> None:
    opened: list[Any] = []
    real_open = trace_source.open_bytes

    def spy(path: str) -> Any:
        opened.append(real_open(path))
        return opened[-1]

    monkeypatch.setattr(trace_source, "open_bytes", spy)
    for suffix in (".jsonl", ".jsonl.gz"):
        path = tmp_path / f"refused{suffix}"
        path.write_bytes(gzip.compress(header) if suffix.endswith(".gz") else header)
        with pytest.raises(TraceError):
            TraceReader(path)
    assert len(opened) == 2 and all(f.closed for f in opened)


# --- what still reads as before ------------------------------------------------------------------


def test_every_golden_trace_and_its_gzip_copy_still_read(tmp_path: Path) -> None:
    for path in sorted(TRACES.glob("*.jsonl")):
        reader, recs = read_trace(path)
        assert len(recs) == len(golden_lines(path.name)) - 1 and not reader.warnings
        zipped = tmp_path / (path.name + ".gz")
        zipped.write_bytes(gzip.compress(path.read_bytes(), mtime=0))
        assert [r for _, r in read_trace(zipped)[1]] == [r for _, r in recs]


def test_crlf_line_ends_and_blank_lines_still_read(tmp_path: Path) -> None:
    lines = golden_lines()
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b"".join(line.replace(b"\n", b"\r\n") for line in lines[:40]) + b"\n  \n" + b"".join(lines[40:]))
    reader, recs = read_trace(path)
    assert len(recs) == len(lines) - 1 and recs[-1][0] == len(lines) + 2
