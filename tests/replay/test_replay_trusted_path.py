"""The plain fold's fast path (issue 8): where the checkpoints judge, the reader decodes a whole
chunk in one call and reads job ends without the payload their job already holds; the replay
makes them whole from the state. Every problem the line-by-line path finds is still found, at
its own line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner, Result

from kvflow.cli.main import main
from kvflow.core.events import (
    JobCompleted,
    JobFailed,
    JobTimedOut,
    LateResultIgnored,
    RankSucceeded,
)
from kvflow.log import reader as reader_module
from kvflow.log.format import (
    JOB_ENDS_WITHOUT_PAYLOAD,
    JOB_PAYLOAD,
    TRUSTED_FORMS,
    trusted_decoder,
)
from kvflow.log.reader import TraceReader
from kvflow.replay.fold import replay

TRACES = Path(__file__).resolve().parents[2] / "traces"
PAYLOAD = {"hashes": (2**63 + 5, -7, 12), "device_blocks": (3, 4, 5), "slots": (9, 8, 7)}
COMMON = {"seq": 41, "job_id": 17, "direction": "load", "request_id": "r-9", "abandoned": True, **PAYLOAD}
JOB_ENDS = [
    JobCompleted(rank=1, **COMMON),
    JobFailed(rank=-1, error="copy failed", fenced=True, **COMMON),
    JobTimedOut(now_ms=12.5, deadline_ms=10.0, fenced=True, **COMMON),
]


@pytest.fixture(autouse=True, params=[300, 1000, 4096, 1 << 16])
def chunk_bytes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Small reads cut a golden trace into many chunks, most of them without a checkpoint:
    the ones the fast path takes."""
    monkeypatch.setattr(reader_module, "CHUNK_BYTES", request.param)
    return int(request.param)


def kvflow(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _stands_for(read: Any, whole: Any) -> bool:
    """``read``, an event in its trusted form (a job end without its payload), carries every
    other field of ``whole``."""
    fields = read.__struct_fields__
    return TRUSTED_FORMS[type(read)] is type(whole) and all(
        getattr(read, f) == getattr(whole, f) for f in fields
    )


@pytest.mark.parametrize("end", JOB_ENDS, ids=lambda e: type(e).__name__)
def test_a_job_end_read_without_its_payload_keeps_every_other_field(end: Any) -> None:
    """Every field but the payload comes from the line (the fold applies the end as it is,
    its evolver reading the payload from the job): a field added to a job end and missing
    from the read fails here."""
    read = trusted_decoder(2).decode(msgspec.json.encode(end))
    assert set(read.__struct_fields__) == set(end.__struct_fields__) - set(JOB_PAYLOAD)
    assert _stands_for(read, end)


RANKED = [
    *(e for e in JOB_ENDS if "rank" in e.__struct_fields__),
    RankSucceeded(job_id=3, rank=1, seq=8),
    LateResultIgnored(job_id=3, rank=0, ok=False, error="late", seq=9),
]


@pytest.mark.parametrize("end", RANKED, ids=lambda e: type(e).__name__)
def test_a_rank_read_in_a_trusted_chunk_is_checked_as_it_is_decoded(end: Any) -> None:
    """The reader does not walk a trusted chunk for its ranks: the decoding refuses one that
    is no rank of the trace's world_size (-1: a job_failed's only), and keeps every field."""
    for rank in (-2, -1, 0, 1, 2, 64, 2**70, True, 1.0):
        line = msgspec.json.encode(msgspec.structs.replace(end, rank=rank))
        fits = type(rank) is int and (0 <= rank < 2 or (rank == -1 and type(end) is JobFailed))
        if fits:
            read = trusted_decoder(2).decode(line)
            assert _stands_for(read, msgspec.structs.replace(end, rank=rank))
        else:
            with pytest.raises(msgspec.ValidationError, match="not a rank of world_size 2"):
                trusted_decoder(2).decode(line)


def test_the_trusted_chunks_give_the_events_a_full_read_gives(chunk_bytes: int) -> None:
    """Job ends without payload (applied from the job the fold's state holds) and everything
    else equal to the line-by-line decoding, line numbers included."""
    path = TRACES / "two_ranks.jsonl"
    with TraceReader(path) as reader:
        full = list(reader.records())
    with TraceReader(path) as reader:
        fast = [(n, r) for numbers, recs in reader.record_chunks(True, float("inf")) for n, r in zip(numbers, recs)]
    assert [n for n, _ in fast] == [n for n, _ in full]
    without = [(n, r) for n, r in fast if type(r) in JOB_ENDS_WITHOUT_PAYLOAD]
    assert without or chunk_bytes > 30_000, "small chunks without a checkpoint take the fast path"
    ranked = [(n, r) for n, r in fast if type(r) in TRUSTED_FORMS and type(r) not in JOB_ENDS_WITHOUT_PAYLOAD]
    assert ranked or chunk_bytes > 30_000, "two ranks: their rank_succeeded events are read in a form of their own"
    by_line = dict(full)
    for n, r in without + ranked:
        assert _stands_for(r, by_line[n])
    assert replay(path).state.digest() == replay(path, strict=True).state.digest()


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
    """The fast path skips a job end's payload; the record chain does not vouch for an
    altered line, so it is decoded in full and named."""
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
    a blank one): the record chain does not vouch for it, and it is named at its line."""
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
    """A job end whose hashes are not its job's: the record digest does not verify, and the
    fold applied again with checks names the event (its payload is read in full there)."""
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


def test_the_fast_path_reports_what_the_line_by_line_path_reports(
    tmp_path: Path, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines deleted, added, blanked, doubled, joined, cut or with a byte changed (after a blank
    line or not), in a trace with many checkpoints: the replay reports the same (divergence, line, message, counts,
    warnings, digest, or TraceError) whether or not any chunk takes the fast path."""
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
        if k % 2:  # a blank line a few lines before: the first fold's numbers are off after it
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
    fast = [_outcome(p) for p in paths]
    monkeypatch.setattr(TraceReader, "_decode_trusted", staticmethod(lambda *args: None))
    assert [_outcome(p) for p in paths] == fast
    assert fast[0][0] is None  # (the unaltered trace replays clean)


@pytest.mark.parametrize("name", ["clean.jsonl", "divergent.jsonl", "timeouts.jsonl", "two_ranks.jsonl"])
def test_the_chunk_fold_counts_what_the_record_fold_counts(name: str, chunk_bytes: int) -> None:
    """The chunk fold counts a chunk's commands from its length, less its events and
    checkpoints, also where it stops inside the chunk (``--until``, a divergence): the same
    counts as the record-by-record fold (an observer makes replay take it), which counts
    each record."""

    def both(until: int | None) -> list[Any]:
        chunked = replay(TRACES / name, until=until)
        by_record = replay(TRACES / name, until=until, on_event=lambda line, event: None)
        return [_summary(chunked), _summary(by_record)]

    last = replay(TRACES / name).state.last_seq
    for until in (None, 0, 1, 7, last // 3, last // 2 + 1, last - 1):
        chunked, by_record = both(until)
        assert chunked == by_record, until


def _summary(r: Any) -> Any:
    d = r.divergence
    found = None if d is None else (d.kind, d.seq, d.line, d.message)
    return (found, r.events, r.commands, r.checkpoints, r.stopped_at, r.state.digest())
