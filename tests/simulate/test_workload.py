"""Tests of the Mooncake workload reader (kvflow.simulate.workload) and of the example workload."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from kvflow.core.errors import ConfigError, TraceError
from kvflow.simulate.workload import EXAMPLE_WORKLOAD, WorkloadRequest, read_workload

REPO = Path(__file__).resolve().parents[2]
MOONCAKE_TRACE = REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"

GOOD = '{"timestamp": 0, "input_length": 1600, "output_length": 7, "hash_ids": [1, 2, 3, 4]}'


def write(tmp_path: Path, text: str, name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def read_error(path: Path, block_tokens: int = 512) -> TraceError:
    with pytest.raises(TraceError) as caught:
        list(read_workload(path, block_tokens))
    return caught.value


def test_reads_requests_with_line_numbers(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        GOOD + "\n"
        + "\n   \n"  # blank lines are skipped but still counted
        + '{"timestamp": 12.5, "input_length": 512, "output_length": 0, "hash_ids": [1],'
        ' "extra": "ignored"}\n',
    )
    assert list(read_workload(path)) == [
        WorkloadRequest(
            line=1, timestamp_ms=0.0, input_length=1600, output_length=7, hash_ids=(1, 2, 3, 4)
        ),
        WorkloadRequest(
            line=4, timestamp_ms=12.5, input_length=512, output_length=0, hash_ids=(1,)
        ),
    ]


def test_equal_timestamps_crlf_and_missing_final_newline_are_fine(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "\r\n" + GOOD)
    assert [r.line for r in read_workload(path)] == [1, 2]


def test_gzip_reads_the_same_as_plain(tmp_path: Path) -> None:
    text = GOOD + "\n" + GOOD.replace('"timestamp": 0', '"timestamp": 3') + "\n"
    plain = write(tmp_path, text)
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    assert list(read_workload(packed)) == list(read_workload(plain))
    assert len(list(read_workload(packed))) == 2


def test_block_tokens_sets_the_expected_id_count(tmp_path: Path) -> None:
    path = write(tmp_path, '{"timestamp": 0, "input_length": 9, "output_length": 1, '
                 '"hash_ids": [1, 2, 3]}\n')
    assert [r.hash_ids for r in read_workload(path, block_tokens=4)] == [(1, 2, 3)]
    assert "expected ceil(9/512) = 1" in str(read_error(path))


@pytest.mark.parametrize("block_tokens", [0, -512, True, 512.0])
def test_bad_block_tokens_fails_fast(block_tokens: object) -> None:
    with pytest.raises(ConfigError, match="block_tokens"):
        read_workload("does-not-matter.jsonl", block_tokens)  # type: ignore[arg-type]


def _line(**fields: object) -> str:
    """GOOD with some fields replaced (a value of ... drops the field)."""
    record: dict[str, object] = json.loads(GOOD)
    for name, value in fields.items():
        if value is ...:
            del record[name]
        else:
            record[name] = value
    return json.dumps(record)


BAD_LINES = [
    pytest.param('{"timestamp": 0, "input_length": 1600,', "not valid JSON", id="broken-json"),
    pytest.param(GOOD + " trailing", "not valid JSON", id="trailing-garbage"),
    pytest.param("[1, 2, 3]", "not a JSON object (expected object, got array)", id="array"),
    pytest.param('"text"', "not a JSON object", id="string"),
    pytest.param(_line(timestamp=...), "missing field 'timestamp'", id="no-timestamp"),
    pytest.param(_line(input_length=...), "missing field 'input_length'", id="no-input"),
    pytest.param(_line(output_length=...), "missing field 'output_length'", id="no-output"),
    pytest.param(_line(hash_ids=...), "missing field 'hash_ids'", id="no-hash-ids"),
    pytest.param(
        _line(input_length="1600"),
        "field 'input_length': expected int, got str (\"1600\")",
        id="input-str",
    ),
    pytest.param(
        _line(input_length=1600.0), "field 'input_length': expected int, got float",
        id="input-float",
    ),
    pytest.param(
        _line(input_length=True), "field 'input_length': expected int, got bool (true)",
        id="input-bool",
    ),
    pytest.param(
        _line(output_length=False), "field 'output_length': expected int, got bool",
        id="output-bool",
    ),
    pytest.param(
        _line(timestamp=True), "field 'timestamp': expected number, got bool", id="timestamp-bool"
    ),
    pytest.param(
        _line(timestamp=None), "field 'timestamp': expected number, got null", id="timestamp-null"
    ),
    pytest.param(
        _line(timestamp="0"), "field 'timestamp': expected number, got str", id="timestamp-str"
    ),
    pytest.param(
        _line(timestamp=-1), "field 'timestamp': expected number >= 0.0, got -1",
        id="timestamp-negative",
    ),
    pytest.param(
        GOOD.replace('"timestamp": 0', '"timestamp": 1e400'),
        "field 'timestamp': number out of range",
        id="timestamp-overflow",
    ),
    pytest.param(
        _line(input_length=-1), "field 'input_length': expected int >= 1, got -1",
        id="input-negative",
    ),
    pytest.param(
        _line(input_length=0), "field 'input_length': expected int >= 1, got 0", id="input-zero"
    ),
    pytest.param(
        _line(output_length=-5), "field 'output_length': expected int >= 0, got -5",
        id="output-negative",
    ),
    pytest.param(
        _line(hash_ids={"0": 1}), "field 'hash_ids': expected array, got object",
        id="hash-ids-object",
    ),
    pytest.param(
        _line(hash_ids=[1, 2, 3]),
        "field 'hash_ids': has 3 ids, expected ceil(1600/512) = 4",
        id="too-few-ids",
    ),
    pytest.param(
        _line(hash_ids=[1, 2, 3, 4, 5]),
        "field 'hash_ids': has 5 ids, expected ceil(1600/512) = 4",
        id="too-many-ids",
    ),
    pytest.param(
        _line(hash_ids=[1, -2, 3, 4]), "field 'hash_ids': item 1: expected int >= 0, got -2",
        id="negative-id",
    ),
    pytest.param(
        _line(hash_ids=[1, 2, 3.5, 4]), "field 'hash_ids': item 2: expected int, got float (3.5)",
        id="float-id",
    ),
    pytest.param(
        _line(hash_ids=[1, 2, 3, True]), "field 'hash_ids': item 3: expected int, got bool",
        id="bool-id",
    ),
    pytest.param(
        _line(hash_ids=[1, 2, "3", 4]), "field 'hash_ids': item 2: expected int, got str",
        id="str-id",
    ),
]


@pytest.mark.parametrize(("bad_line", "message"), BAD_LINES)
def test_bad_line_names_file_line_and_field(tmp_path: Path, bad_line: str, message: str) -> None:
    # The bad line is the third, after a good line and a blank one, and is newline-terminated.
    path = write(tmp_path, GOOD + "\n\n" + bad_line + "\n")
    error = read_error(path)
    assert (error.path, error.line) == (str(path), 3)
    assert str(error).startswith(f"{path}:3: ")
    assert message in str(error)
    assert "torn" not in str(error)


def test_streams_requests_before_a_later_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "\n" + "not json\n")
    requests = read_workload(path)
    assert next(requests).line == 1
    with pytest.raises(TraceError, match=r":2: not valid JSON"):
        next(requests)


def test_timestamps_going_backwards_is_an_error(tmp_path: Path) -> None:
    later = GOOD.replace('"timestamp": 0', '"timestamp": 1300')
    earlier = GOOD.replace('"timestamp": 0', '"timestamp": 1200.5')
    # Equal timestamps (lines 1 and 2) are fine; going back (line 3) is not.
    error = read_error(write(tmp_path, f"{later}\n{later}\n{earlier}\n"))
    assert error.line == 3
    assert "field 'timestamp': 1200.5 is before 1300 of line 2" in str(error)


@pytest.mark.parametrize("text", ["", "\n", "  \n\n"])
def test_a_file_without_requests_is_an_error(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    error = read_error(path)
    assert error.line is None
    assert str(error) == f"{path}: no requests"


def test_torn_last_line_is_an_error_not_a_warning(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "\n" + GOOD[:30])
    error = read_error(path)
    assert error.line == 2
    assert "not valid JSON" in str(error) and "torn" in str(error)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    error = read_error(path)
    assert (error.path, error.line) == (str(path), None)
    assert "cannot open" in str(error)


def test_gz_that_is_not_gzip(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "\n", name="trace.jsonl.gz")
    assert "cannot read" in str(read_error(path))


def test_gzip_cut_short(tmp_path: Path) -> None:
    packed = gzip.compress(((GOOD + "\n") * 2000).encode())
    path = tmp_path / "trace.jsonl.gz"
    path.write_bytes(packed[: len(packed) // 2])
    error = read_error(path)
    assert "cannot read" in str(error) and error.line is not None and error.line > 1


def test_mooncake_synthetic_trace() -> None:
    if not MOONCAKE_TRACE.exists():
        pytest.skip(f"{MOONCAKE_TRACE} is absent (../shared beside the checkout)")
    started = time.perf_counter()
    requests = list(read_workload(MOONCAKE_TRACE))
    elapsed_s = time.perf_counter() - started
    assert len(requests) == 3993
    assert requests[0].input_length == 40160 and requests[0].hash_ids[:3] == (0, 1, 2)
    assert len(requests[0].hash_ids) == 79
    assert requests[-1].line == 3993
    # Measured at ~15 ms; the bound only catches an accidental per-line slow path.
    assert elapsed_s < 2.0


def _load_generator() -> ModuleType:
    """Import tools/gen_workload.py, which is a script rather than part of the package."""
    if "gen_workload" in sys.modules:
        return sys.modules["gen_workload"]
    script = REPO / "tools" / "gen_workload.py"
    spec = importlib.util.spec_from_file_location("gen_workload", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_workload"] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


def test_example_workload_reads_and_is_reproducible(tmp_path: Path) -> None:
    requests = list(read_workload(EXAMPLE_WORKLOAD))
    assert len(requests) == 200
    assert all(1 <= len(r.hash_ids) <= 30 for r in requests)
    # The exact command in EXAMPLE_WORKLOAD's docstring regenerates the file byte for byte.
    out = tmp_path / "example.jsonl"
    generator = _load_generator()
    argv = ["--requests", "200", "--seed", "7", "--block-tokens", "512", "--out", str(out)]
    assert generator.main(argv) == 0
    assert out.read_bytes() == EXAMPLE_WORKLOAD.read_bytes()


def test_generator_seeds_differ_and_output_reads_back(tmp_path: Path) -> None:
    generator = _load_generator()
    first = generator.generate_workload(50, seed=1, block_tokens=16, max_prompt_blocks=12)
    assert first == generator.generate_workload(50, seed=1, block_tokens=16, max_prompt_blocks=12)
    assert first != generator.generate_workload(50, seed=2, block_tokens=16, max_prompt_blocks=12)
    path = write(tmp_path, "".join(json.dumps(record) + "\n" for record in first))
    requests = list(read_workload(path, block_tokens=16))
    assert len(requests) == 50
    assert max(len(r.hash_ids) for r in requests) <= 12
