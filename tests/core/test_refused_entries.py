"""What a shared tier refused, in the pure core: the ``tier_refused`` command records an
``entries_refused`` event that drops the refused blocks from the tier's index where it holds them
(the remote index; the disk index unless a job is reading the slot) and changes nothing else; a
malformed refusal is refused and appends nothing; the event's legality; the digest; a trace with
refusals replays and re-decides unchanged, and ``kvflow incidents`` lists them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from core_helpers import config, consistent, manager, store, tokens

from kvflow.cli.main import main
from kvflow.core.commands import JobResult, TierRefused
from kvflow.core.errors import IllegalTransition, Rejected
from kvflow.core.events import EntriesRefused
from kvflow.core.jobs import DISK_LOAD
from kvflow.core.names import name_of
from kvflow.core.state.apply import evolve
from kvflow.engine.manager import OffloadManager
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay


def refused(tier: str, hashes: tuple[int, ...], reasons: tuple[str, ...], job_ids: tuple[int, ...]) -> TierRefused:
    return TierRefused(tier=tier, block_hashes=hashes, reasons=reasons, job_ids=job_ids)  # type: ignore[arg-type]


def last_event(m: OffloadManager) -> object:
    return list(m.log.events())[-1]


def test_F20_a_remote_refusal_drops_what_the_remote_index_holds_and_nothing_else() -> None:
    m = manager(remote_blocks=16)
    store(m, "a", [1], [10])  # resident, and remotely stored by its write-through
    m.plan_step(0.0)
    m.job_result(m.state.last_job_id)
    m.remote_found([5, 6])
    assert list(m.state.remote) == [1, 5, 6]
    entries, pins = dict(m.state.slot_of), dict(m.state.pin_count)
    assert m.tier_refused(refused("remote", (5, 9), ("another tenant", "forged"), (0, 0))) == 1
    event = last_event(m)
    assert isinstance(event, EntriesRefused)
    assert (event.tier, event.hashes, event.reasons, event.job_ids, event.dropped) == (
        "remote", (5, 9), ("another tenant", "forged"), (0, 0), (5,)
    )
    assert list(m.state.remote) == [1, 6]  # the order of the rest is kept
    assert dict(m.state.slot_of) == entries and dict(m.state.pin_count) == pins  # the CPU tier as it was
    consistent(m)
    # a refusal of what no index holds is recorded, and changes nothing but the seq
    before = m.state.copy()
    assert m.tier_refused(refused("remote", (77,), ("unknown key",), (0,))) == 0
    assert last_event(m).dropped == ()  # type: ignore[attr-defined]
    assert list(m.state.remote) == list(before.remote) and m.state.next_seq == before.next_seq + 1
    consistent(m)


def test_the_digest_tells_a_dropping_refusal_from_one_that_drops_nothing() -> None:
    def run(drop: int) -> str:
        m = manager(remote_blocks=16)
        m.remote_found([5, 6])
        m.tier_refused(refused("remote", (drop,), ("forged",), (0,)))
        return m.state.digest()

    assert run(5) != run(99)
    assert run(5) == run(5)


def test_a_disk_refusal_drops_an_idle_entry_and_leaves_a_busy_one_to_its_load() -> None:
    m = manager(4, disk_blocks=8, disk_store_mode="write_through")
    m.disk_restored([(0, name_of(1)), (1, name_of(2))])
    assert m.lookup("r", [2], tokens(1)) == 0  # queues the disk load of block 2
    (load,) = [j for j in m.state.jobs.values() if j.direction == DISK_LOAD]
    m.plan_step(1.0)
    disk = m.state.disk
    assert disk is not None
    assert m.tier_refused(refused("disk", (1, 2), ("unknown key", "unknown key"), (0, load.job_id))) == 1
    assert last_event(m).dropped == (1,)  # type: ignore[attr-defined]
    assert 1 not in disk.slot_of and 0 in disk.free  # its slot is free again
    assert disk.slot_of.get(2) == 1  # its slot is being read: the load's failure drops it
    consistent(m)
    m.job_result(load.job_id, ok=False, error="disk load failed on 1 of 1 blocks (block 2: unknown key)")
    assert 2 not in disk.slot_of
    consistent(m)


@pytest.mark.parametrize(
    ("command", "why"),
    [
        (refused("tape", (1,), ("forged",), (0,)), "no shared tier"),
        (refused("remote", (1, 2), ("forged",), (0, 0)), "reasons"),
        (refused("remote", (1,), ("forged",), ()), "job ids"),
        (refused("remote", (1,), (7,), (0,)), "strings"),  # type: ignore[arg-type]
        (refused("remote", (1,), ("forged",), (-1,)), ">= 0"),
        (refused("disk", (1,), ("forged",), (0,)), "configuration has not"),
    ],
)
def test_a_malformed_refusal_is_refused_and_appends_nothing(command: TierRefused, why: str) -> None:
    m = manager(remote_blocks=16)
    m.remote_found([1])
    before, records = m.state.digest(), len(m.log.records)
    with pytest.raises(Rejected, match=why):
        m.tier_refused(command)
    assert m.state.digest() == before and len(m.log.records) == records


def test_a_malformed_refusal_in_a_step_is_logged_never_raised() -> None:
    m = manager(remote_blocks=16)
    m.remote_found([1])
    m.step(1.0, refusals=[refused("remote", (1,), ("forged", "forged"), (0,)), refused("remote", (1,), ("forged",), (0,))])
    assert 1 not in m.state.remote  # the good one was recorded
    assert sum(isinstance(e, EntriesRefused) for e in m.log.events()) == 1


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"hashes": (5,), "reasons": ("forged",), "job_ids": (0,), "dropped": (6,)}, "refused ones"),
        ({"hashes": (7,), "reasons": ("forged",), "job_ids": (0,), "dropped": (7,)}, "not in the remote index"),
        ({"hashes": (5,), "reasons": (), "job_ids": (0,)}, "must match"),
        ({"hashes": (), "reasons": (), "job_ids": ()}, "non-empty"),
        ({"hashes": (5, 5), "reasons": ("a", "b"), "job_ids": (0, 0), "dropped": (5, 5)}, "each named once"),
    ],
)
def test_an_illegal_entries_refused_event_changes_nothing(fields: dict, why: str) -> None:
    m = manager(remote_blocks=16)
    m.remote_found([5, 6])
    state = m.state.copy()
    before = state.digest()
    with pytest.raises(IllegalTransition, match=why):
        evolve(state, EntriesRefused(seq=state.next_seq, tier="remote", **fields))
    assert state.digest() == before


def test_an_entries_refused_event_needs_the_tier_and_a_free_disk_slot() -> None:
    m = manager(remote_blocks=16)
    with pytest.raises(IllegalTransition, match="no disk tier"):
        evolve(m.state, EntriesRefused(seq=m.state.next_seq, tier="disk", hashes=(1,), reasons=("x",), job_ids=(0,)))
    d = manager(4, disk_blocks=8)
    d.disk_restored([(0, name_of(2))])
    d.lookup("r", [2], tokens(1))  # its disk load reads slot 0
    state = d.state
    with pytest.raises(IllegalTransition, match="in use by a job"):
        evolve(
            state,
            EntriesRefused(seq=state.next_seq, tier="disk", hashes=(2,), reasons=("x",), job_ids=(0,), dropped=(2,)),
        )


def refusal_trace(path: Path) -> OffloadManager:
    """A run whose remote load is refused (its job fails and the refusal names it) and whose
    probe refuses another block by its head."""
    cfg = config(4, remote_blocks=16)
    m = OffloadManager(cfg, log=TraceWriter(str(path), cfg))
    m.remote_found([3, 4])
    m.lookup("b", [3, 4, 8], tokens(3))
    m.accept_hits("b", [])
    (load,) = m.plan_step(1.0)
    # the step's refusals come with the load's failure (the tier refused block 4's value)
    m.step(
        2.0,
        [_failure(load.job_id)],
        refusals=[
            refused("remote", (4,), ("forged",), (load.job_id,)),
            refused("remote", (8,), ("another tenant",), (0,)),
        ],
    )
    m.finish_request("b")
    m.close()
    return m


def _failure(job_id: int) -> JobResult:
    return JobResult(job_id=job_id, ok=False, error="remote miss on 1 of 2 blocks (block 4: forged)")


def test_a_trace_with_refusals_replays_and_redecides_to_the_same_state(tmp_path: Path) -> None:
    path = tmp_path / "refused.jsonl"
    m = refusal_trace(path)
    for redecide in (False, True):
        result = replay(path, redecide=redecide)
        assert result.divergence is None, result.divergence
        assert result.state.digest() == m.state.digest()


def test_incidents_list_the_refused_entries_beside_the_failed_load(tmp_path: Path) -> None:
    from kvflow.inspect.incidents import find_incidents

    path = tmp_path / "refused.jsonl"
    refusal_trace(path)
    report = find_incidents(path)
    (failed,) = report.incidents
    forged, probed = report.refused
    assert (forged.tier, forged.block, forged.reason, forged.job_id) == ("remote", 4, "forged", failed.job_id)
    assert (forged.job_seq, forged.job_line) == (failed.seq, failed.line)
    assert (probed.block, probed.reason, probed.job_id, probed.job_seq) == (8, "another tenant", None, None)
    assert not forged.dropped  # the failed load dropped it first
    runner = CliRunner()
    found = json.loads(runner.invoke(main, ["incidents", str(path), "--json"]).stdout)
    assert [f["kind"] for f in found] == ["job", "refused_entry", "refused_entry"]
    assert found[1] == {
        "kind": "refused_entry", "seq": forged.seq, "line": forged.line, "step": forged.step,
        "time_ms": forged.time_ms, "tier": "remote", "reason": "forged", "block": 4,
        "job_id": failed.job_id, "job_seq": failed.seq, "job_line": failed.line, "dropped_from_index": False,
    }  # fmt: skip
    text = runner.invoke(main, ["incidents", str(path)], env={"COLUMNS": "200"}).stdout
    assert "3 incidents of 1 jobs (1 failed, 2 refused entries)" in text
    assert "remote entry refused" in text and "another tenant" in text and "refused by a probe" in text
    narrow = runner.invoke(main, ["incidents", str(path)], env={"COLUMNS": "80"}).stdout
    assert "remote entry refused: block 8" in narrow
    assert f"never served: its load job {failed.job_id} failed (seq {failed.seq})" in " ".join(narrow.split())
    history = runner.invoke(main, ["inspect", str(path), "--block", "8"]).stdout
    assert "remote tier REFUSED 1 block [8 (another tenant, probe)]" in history
    assert "the remote tier refused 1 block [8 (another tenant, probe)]" in history
