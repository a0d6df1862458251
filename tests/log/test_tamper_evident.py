"""Issue 11 item 2: a trace whose recorded fields or header were altered does not replay clean.

Version-3 checkpoints carry the digest of every byte before them (``Checkpoint.records``), so a
change to a field that drives no state (an error text, a request id, a time, the header) is a
divergence naming the checkpoint after it, and the reading verbs say so in one line on stderr.
Each case edits one JSON field of a golden trace the way a person would (load, change, dump).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvflow.cli.main import main
from kvflow.log.format import CHAINED_SINCE, TRACE_VERSION
from kvflow.log.reader import TraceReader
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay

TRACES = Path(__file__).resolve().parents[2] / "traces"


def kvflow(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def edit(name: str, tmp_path: Path, record_type: str, change: Callable[[dict[str, Any]], None]) -> tuple[Path, int]:
    """A copy of golden trace ``name`` whose first line of ``record_type`` (or the header, for
    "header") went through ``change``; the copy and the edited line's number."""
    lines = (TRACES / name).read_text(encoding="utf-8").splitlines(keepends=True)
    for i, text in enumerate(lines):
        record = json.loads(text)
        if (i == 0 and record_type == "header") or (i > 0 and record.get("type") == record_type):
            change(record)
            lines[i] = json.dumps(record, separators=(",", ":")) + "\n"
            break
    else:
        raise AssertionError(f"{name} has no {record_type} line")
    path = tmp_path / name
    path.write_text("".join(lines), encoding="utf-8")
    return path, i + 1


def set_field(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(record: dict[str, Any]) -> None:
        assert field in record, (field, record)
        record[field] = value

    return change


def set_config(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        assert field in header["config"]
        header["config"][field] = value

    return change


ALTERATIONS = [
    ("store_failures.jsonl", "job_failed", set_field("error", "everything is fine")),
    ("clean.jsonl", "job_completed", set_field("slots", [47, 46, 45, 44, 43, 42])),
    ("clean.jsonl", "lookup", set_field("request_id", "req-999")),
    ("clean.jsonl", "plan_step", set_field("now_ms", 11.0)),
    ("timeouts.jsonl", "job_timed_out", set_field("now_ms", 1.0)),
    ("clean.jsonl", "header", set_config("block_tokens", 32)),
    ("load_failures.jsonl", "header", set_config("store_mode", "eager")),
    ("clean.jsonl", "header", set_config("job_deadline_ms", 5.0)),
]


@pytest.mark.parametrize(
    ("name", "record_type", "change"), ALTERATIONS, ids=[f"{n}:{t}:{i}" for i, (n, t, _) in enumerate(ALTERATIONS)]
)
def test_an_altered_field_or_header_is_a_divergence_naming_the_line(
    tmp_path: Path, name: str, record_type: str, change: Callable[[dict[str, Any]], None]
) -> None:
    path, edited = edit(name, tmp_path, record_type, change)
    result = kvflow("replay", path)
    assert result.exit_code == 1, result.output
    found = re.search(rf"DIVERGENCE \((\w+)\) at seq \d+ \({re.escape(str(path))}:(\d+)\)", result.stdout)
    assert found, result.stdout
    line = int(found.group(2))
    assert line >= edited
    if found.group(1) == "records":  # (a changed slot may be caught by the fold before)
        assert "a line after line" in result.stdout and "altered, added or removed" in result.stdout
        checkpoints = [n for n, text in enumerate(path.read_text().splitlines(), 1) if '"checkpoint"' in text]
        assert line == min(n for n in checkpoints if n > edited)  # the first checkpoint after it


@pytest.mark.parametrize(("name", "record_type", "change"), ALTERATIONS[:1] + ALTERATIONS[5:6])
@pytest.mark.parametrize("verb", [["incidents"], ["inspect", "--job", "1"], ["kv-events"]])
def test_the_reading_verbs_say_in_one_line_that_a_trace_does_not_verify(
    tmp_path: Path, name: str, record_type: str, change: Callable[[dict[str, Any]], None], verb: list[str]
) -> None:
    path, _ = edit(name, tmp_path, record_type, change)
    result = kvflow(verb[0], path, *verb[1:])
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not verify" in lines[0] and str(path) in lines[0], result.stderr


@pytest.mark.parametrize("verb", [["replay"], ["incidents"], ["inspect", "--job", "1"], ["kv-events"]])
def test_an_unaltered_trace_verifies_without_a_word(verb: list[str]) -> None:
    result = kvflow(verb[0], TRACES / "store_failures.jsonl", *verb[1:])
    assert result.exit_code == 0 and result.stderr == "", result.output


def test_every_checkpoint_of_a_current_trace_carries_a_record_digest_that_verifies() -> None:
    for path in sorted(TRACES.glob("*.jsonl")):
        with TraceReader(path) as reader:
            checkpoints = [rec for _, rec in reader.records() if type(rec).__name__ == "Checkpoint"]
        assert reader.mismatch is None and reader.complete, path
        if reader.version >= CHAINED_SINCE:
            assert checkpoints and all(len(cp.records) == 32 for cp in checkpoints), path
        else:
            assert all(cp.records == "" for cp in checkpoints), path  # older versions lack it
    assert TRACE_VERSION >= CHAINED_SINCE


def test_removing_the_record_digests_does_not_pass_for_an_older_trace(tmp_path: Path) -> None:
    text = (TRACES / "clean.jsonl").read_text()
    path = tmp_path / "stripped.jsonl"
    path.write_text(re.sub(r',"records":"[0-9a-f]+"', "", text))
    result = replay(path)
    assert result.divergence is not None and result.divergence.kind == "records"
    assert "records none" in result.divergence.message


def test_a_version_downgraded_to_2_still_checks_the_digests_it_carries(tmp_path: Path) -> None:
    text = (TRACES / "clean.jsonl").read_text()
    path = tmp_path / "downgraded.jsonl"
    path.write_text(text.replace(f'"version":{TRACE_VERSION},', '"version":2,', 1))
    result = replay(path)
    assert result.divergence is not None and result.divergence.kind == "records"


def test_an_added_or_removed_line_does_not_verify(tmp_path: Path) -> None:
    lines = (TRACES / "clean.jsonl").read_text().splitlines(keepends=True)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("".join(lines[:10] + ["\n"] + lines[10:]))  # a blank line reads, but is a change
    commands = ("lookup", "blocks_computed", "plan_step", "accept_hits", "touch")
    cut = next(i for i, line in enumerate(lines) if i >= 5 and json.loads(line).get("type") in commands)
    removed = tmp_path / "removed.jsonl"
    removed.write_text("".join(lines[:cut] + lines[cut + 1 :]))  # a command: the fold never sees it
    for path in (blank, removed):
        result = replay(path)
        assert result.divergence is not None and result.divergence.kind == "records", path


def test_records_after_the_last_checkpoint_are_reported_unverified(tmp_path: Path) -> None:
    lines = (TRACES / "clean.jsonl").read_text().splitlines(keepends=True)
    assert '"checkpoint"' in lines[-1]
    path = tmp_path / "unclosed.jsonl"
    path.write_text("".join(lines[:-1]))
    result = replay(path)
    assert result.ok
    assert any("are not verified" in w for w in result.warnings), result.warnings


def test_the_writer_chains_what_the_async_engine_detaches_too(tmp_path: Path) -> None:
    """Lines taken out with take_pending (the async engine's worker-thread writes) are part of
    the record digest like those written by flush."""
    from kvflow.core.config import Config
    from kvflow.engine.manager import OffloadManager

    config = Config(cpu_blocks=16, block_tokens=16)
    path = tmp_path / "detached.jsonl"
    writer = TraceWriter(path, config, checkpoint_every=3, auto_flush=False)
    manager = OffloadManager(config, log=writer)
    for i in range(6):
        rid = f"r{i}"
        manager.lookup(rid, [100 + i, 200 + i], 40)
        manager.blocks_computed(rid, [100 + i, 200 + i], [2 * i, 2 * i + 1])
        writer.write_bytes(writer.take_pending())
        manager.finish_request(rid)
    manager.close()
    result = replay(path)
    assert result.ok and result.checkpoints >= 3 and not result.warnings, result.divergence


@pytest.mark.parametrize("where", ["first", "last", "after the last checkpoint"])
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("num_tokens", "many", "field 'num_tokens': expected `int`"), ("block_hashes", [2**70], "block_hashes[0]")],
)
def test_a_plain_fold_skims_commands_yet_refuses_a_bad_one_wherever_it_is(
    tmp_path: Path, where: str, field: str, value: Any, message: str
) -> None:
    """The fold skims commands where a checkpoint vouches for them; a bad one before a
    checkpoint (which then does not verify) or after the last one is still a TraceError."""
    lines = (TRACES / "clean.jsonl").read_text().splitlines(keepends=True)
    lookups = [i for i, text in enumerate(lines) if text.startswith('{"type":"lookup"')]
    i = lookups[0] if where == "first" else lookups[-1]
    record = json.loads(lines[i])
    record[field] = value
    lines[i] = json.dumps(record, separators=(",", ":")) + "\n"
    if where == "after the last checkpoint":
        assert '"checkpoint"' in lines[-1]
        lines.pop()  # the closing checkpoint: nothing vouches for the last lines now
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(lines))
    result = kvflow("replay", path)
    assert result.exit_code == 2, result.output
    assert f"{path}:{i + 1}: " in result.stderr and message in result.stderr, result.stderr


def test_events_no_checkpoint_vouches_for_are_checked_one_by_one(tmp_path: Path) -> None:
    """The fold applies vouched events as the live engine did; an altered trace is not vouched
    for, so an event made illegal is named at its own line, before the checkpoint after it."""
    path, edited = edit("clean.jsonl", tmp_path, "blocks_evicted", set_field("hashes", [12345]))
    result = replay(path)
    assert result.divergence is not None
    assert (result.divergence.kind, result.divergence.line) == ("illegal", edited)


def test_a_vouched_event_today_s_code_cannot_apply_is_an_illegal_divergence_not_a_crash(tmp_path: Path) -> None:
    """A trace whose digests verify but whose event today's code refuses (a writer's bug, or
    rules changed since it was recorded): the unchecked fold falls back to checking every event
    of that stretch, and reports the event's own line."""
    from kvflow.core.commands import Evict
    from kvflow.core.config import Config
    from kvflow.core.events import BlocksEvicted

    class Recorded:  # the state a buggy engine reported at the checkpoint
        last_seq = 1

        def digest(self) -> str:
            return "0" * 32

    path = tmp_path / "bug.jsonl"
    writer = TraceWriter(path, Config(cpu_blocks=4, block_tokens=16))
    writer.record_command(Evict(num_blocks=1))
    writer.record_events([BlocksEvicted(seq=1, hashes=(12345,), slots=(0,), reason="capacity")])
    writer.close(Recorded())
    with TraceReader(path) as reader:
        list(reader.records())
    assert reader.mismatch is None  # the record digests verify
    result = replay(path)
    assert result.divergence is not None
    assert (result.divergence.kind, result.divergence.line) == ("illegal", 3), result.divergence


def test_events_after_the_last_checkpoint_are_checked_one_by_one(tmp_path: Path) -> None:
    """No checkpoint vouches for the tail of an unclosed trace: its events are checked."""
    lines = (TRACES / "clean.jsonl").read_text().splitlines(keepends=True)
    assert '"checkpoint"' in lines[-1]
    lines.pop()
    last = max(i for i, text in enumerate(lines) if text.startswith('{"type":"blocks_evicted"'))
    assert all('"checkpoint"' not in text for text in lines[last:])  # it is in the tail
    record = json.loads(lines[last])
    record["hashes"] = [12345]
    lines[last] = json.dumps(record, separators=(",", ":")) + "\n"
    path = tmp_path / "tail.jsonl"
    path.write_text("".join(lines))
    result = replay(path)
    assert result.divergence is not None
    assert (result.divergence.kind, result.divergence.line) == ("illegal", last + 1)
