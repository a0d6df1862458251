"""A replay names every problem at its own line, however the reader cuts the file into chunks:
a bad, blank, doubled, joined or cut line, an altered job end, and the counts of what it read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvflow.cli.main import main
from kvflow.core.events import EVENT_TYPES
from kvflow.log import reader as reader_module
from kvflow.log.format import Checkpoint
from kvflow.log.reader import read_trace
from kvflow.replay.fold import replay

TRACES = Path(__file__).resolve().parents[2] / "traces"
DEFAULT_CHUNK_BYTES = reader_module.CHUNK_BYTES


@pytest.fixture(autouse=True, params=[300, 1000, 4096, 1 << 16])
def chunk_bytes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Small reads cut a golden trace into many chunks, most of them without a checkpoint."""
    monkeypatch.setattr(reader_module, "CHUNK_BYTES", request.param)
    return int(request.param)


def kvflow(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _rewrite(name: str, tmp_path: Path, change: Any) -> tuple[Path, list[str]]:
    lines = (TRACES / name).read_text().splitlines(keepends=True)
    lines = change(lines)
    path = tmp_path / name
    path.write_text("".join(lines))
    return path, lines


@pytest.mark.parametrize("where", ["first", "after the last checkpoint"])
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("hashes", [2**70], "field 'hashes[0]'"), ("slots", "many", "field 'slots': expected `array`")],
)
def test_a_bad_payload_of_a_job_end_is_a_trace_error_at_its_line(
    tmp_path: Path, where: str, field: str, value: Any, message: str
) -> None:
    """A job end's payload is decoded and range-checked like every other field."""
    at: list[int] = []

    def change(lines: list[str]) -> list[str]:
        ends = [i for i, text in enumerate(lines) if text.startswith('{"type":"job_completed"')]
        i = ends[0] if where == "first" else ends[-1]
        record = json.loads(lines[i])
        record[field] = value
        lines[i] = json.dumps(record, separators=(",", ":")) + "\n"
        if where != "first":
            assert '"checkpoint"' in lines[-1]
            lines.pop()  # nothing vouches for the last lines now
        at.append(i + 1)
        return lines

    path, _ = _rewrite("clean.jsonl", tmp_path, change)
    result = kvflow("replay", path)
    assert result.exit_code == 2, result.output
    assert f"{path}:{at[0]}: " in result.stderr and message in result.stderr, result.stderr


def test_two_records_on_one_line_beside_a_blank_one_are_named(tmp_path: Path) -> None:
    """A chunk with as many records as newlines may still hold a line with two records (and
    a blank one): it is named at its line."""
    at: list[int] = []

    def change(lines: list[str]) -> list[str]:
        i = next(k for k, text in enumerate(lines) if k > 20 and text.startswith('{"type":"lookup"'))
        lines[i : i + 2] = [lines[i].rstrip("\n") + " " + lines[i + 1], "\n"]
        at.append(i + 1)
        return lines

    path, lines = _rewrite("clean.jsonl", tmp_path, change)
    assert sum(map(str.count, lines, "\n" * len(lines))) == len((TRACES / "clean.jsonl").read_text().splitlines())
    result = kvflow("replay", path)
    assert result.exit_code == 2, result.output
    assert f"{path}:{at[0]}: " in result.stderr and "trailing characters" in result.stderr.lower(), result.stderr


def test_an_altered_job_end_payload_is_found_by_the_checked_fold_at_its_line(tmp_path: Path) -> None:
    """A job end whose hashes are not its job's: the fold checks every event, so it names
    this one (before the checkpoint whose record digest would not verify)."""
    at: list[int] = []

    def change(lines: list[str]) -> list[str]:
        i = next(k for k, text in enumerate(lines) if text.startswith('{"type":"job_completed"'))
        record = json.loads(lines[i])
        record["hashes"] = list(reversed(record["hashes"])) + [424242]
        lines[i] = json.dumps(record, separators=(",", ":")) + "\n"
        at.append(i + 1)
        return lines

    path, _ = _rewrite("clean.jsonl", tmp_path, change)
    result = replay(path)
    assert result.divergence is not None
    assert (result.divergence.kind, result.divergence.line) == ("illegal", at[0]), result.divergence
    assert "does not describe job" in result.divergence.message


@pytest.mark.parametrize("bad", ["cut short", "rank out of range"])
def test_a_bad_line_after_a_blank_one_is_named_at_its_own_line(tmp_path: Path, bad: str) -> None:
    """A blank line reads (it is skipped) but leaves a chunk with fewer records than newlines:
    that chunk is walked line by line, so the lines after it keep their numbers."""
    at: list[int] = []

    def change(lines: list[str]) -> list[str]:
        i = next(k for k, text in enumerate(lines) if k > 20 and text.startswith('{"type":"job_completed"'))
        if bad == "cut short":
            lines[i] = lines[i][:25] + "\n"  # newline kept: a malformed line, not a torn one
        else:
            record = json.loads(lines[i])
            record["rank"] = 5
            lines[i] = json.dumps(record, separators=(",", ":")) + "\n"
        lines.insert(i, "\n")  # (in the same chunk as the bad line, for some chunk sizes)
        at.append(i + 2)
        return lines

    path, _ = _rewrite("clean.jsonl", tmp_path, change)
    result = kvflow("replay", path)
    assert result.exit_code == 2, result.output
    assert f"{path}:{at[0]}: " in result.stderr, result.stderr


def _outcome(path: Path) -> Any:
    """Everything a replay reports, or its TraceError's message."""
    from kvflow.core.errors import TraceError

    try:
        r = replay(path)
    except TraceError as exc:
        return str(exc)
    d = r.divergence
    found = None if d is None else (d.kind, d.seq, d.line, d.message)
    return (found, r.events, r.commands, r.checkpoints, r.stopped_at, r.warnings, r.state.digest())




def test_every_altered_trace_is_reported_and_the_chunks_do_not_change_what(
    tmp_path: Path, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines deleted, added, blanked, doubled, joined, cut or with a byte changed (after a blank
    line or not), in a trace with many checkpoints: the replay never passes an altered trace
    clean, and reports the same (divergence, line, message, counts, warnings, digest, or
    TraceError) whatever the size of the chunks the reader cuts the file into."""
    import random

    from kvflow.core.config import Config
    from kvflow.engine.manager import OffloadManager
    from kvflow.log.writer import TraceWriter

    config = Config(cpu_blocks=64, block_tokens=16)
    clean = tmp_path / "clean.jsonl"
    writer = TraceWriter(clean, config, checkpoint_every=40)
    manager = OffloadManager(config, log=writer)
    rng = random.Random(chunk_bytes)
    for i in range(60):
        hashes = [rng.randrange(40) for _ in range(rng.randint(1, 5))]
        hashes = list(dict.fromkeys(hashes))
        rid = f"r{i}"
        hits = manager.lookup(rid, hashes, len(hashes) * 16 + 1)
        manager.accept_hits(rid, range(100 * i, 100 * i + hits))
        manager.blocks_computed(rid, hashes, range(100 * i + 50, 100 * i + 50 + len(hashes)))
        for job in manager.plan_step(float(i)):
            manager.job_result(job.job_id, ok=rng.random() > 0.1, error="x")
        manager.finish_request(rid)
    manager.close()
    lines = clean.read_bytes().split(b"\n")[:-1]
    paths = [clean]
    for k in range(48):
        mutated = list(lines)
        i = rng.randrange(10, len(mutated) - 1)
        if k % 2:  # a blank line a few lines before: the lines after it keep their numbers
            mutated.insert(i - rng.randint(1, 8), b"")
            i += 1
        op = k % 6
        if op == 0:
            del mutated[i]
        elif op == 1:
            mutated.insert(i, b"")
        elif op == 2:
            mutated.insert(i, mutated[i])
        elif op == 3:
            mutated[i : i + 2] = [mutated[i] + b" " + mutated[i + 1]]
            mutated.insert(rng.randrange(1, len(mutated)), b"")
        elif op == 4:
            mutated[i] = mutated[i][: rng.randrange(len(mutated[i]))]
        else:
            line = bytearray(mutated[i])
            line[rng.randrange(len(line))] = rng.choice(b'0123456789{}[],:"x-')
            mutated[i] = bytes(line)
        path = tmp_path / f"m{k}.jsonl"
        path.write_bytes(b"\n".join(mutated) + b"\n")
        paths.append(path)
    outcomes = [_outcome(p) for p in paths]
    assert outcomes[0][0] is None  # (the unaltered trace replays clean)
    for path, outcome in zip(paths[1:], outcomes[1:]):
        if not isinstance(outcome, str):  # (a TraceError names its line)
            altered = outcome[0] is not None or outcome[5]
            assert altered or path.read_bytes() == clean.read_bytes(), (path.name, outcome)
    monkeypatch.setattr(reader_module, "CHUNK_BYTES", DEFAULT_CHUNK_BYTES)
    assert [_outcome(p) for p in paths] == outcomes


@pytest.mark.parametrize("name", ["clean.jsonl", "divergent.jsonl", "timeouts.jsonl", "two_ranks.jsonl"])
def test_a_replay_counts_the_records_it_read(name: str, chunk_bytes: int) -> None:
    """The events applied, the commands read and the checkpoints verified are the trace's
    records up to where the replay stopped (the end, ``--until``, or a divergence)."""
    _, records = read_trace(TRACES / name)
    last = replay(TRACES / name).state.last_seq
    for until in (None, 0, 1, 7, last // 3, last // 2 + 1, last - 1):
        r = replay(TRACES / name, until=until)
        if r.divergence is not None:
            stop = next(i for i, (line, _) in enumerate(records) if line == r.divergence.line)
        elif until is not None:
            stop = next((i for i, (_, rec) in enumerate(records) if isinstance(rec, EVENT_TYPES) and rec.seq > until), len(records))
        else:
            stop = len(records)
        read = [rec for _, rec in records[:stop]]
        events = sum(isinstance(rec, EVENT_TYPES) for rec in read)
        checkpoints = sum(isinstance(rec, Checkpoint) for rec in read)
        assert (r.events, r.commands, r.checkpoints) == (events, len(read) - events - checkpoints, checkpoints), until
        assert r.state.last_seq == events
