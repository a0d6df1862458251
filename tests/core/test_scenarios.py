"""End-to-end scenarios through ``OffloadManager`` as an engine would drive it, and the trace
file round trip (TraceWriter → replay / redecide), including damaged and newer traces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from core_helpers import BT, DEADLINE_MS, config, consistent, manager, store, tokens

from kvflow.core.config import Config
from kvflow.core.errors import BlockHeld, TraceError
from kvflow.core.events import (
    BlocksEvicted,
    BlocksTouched,
    FenceLifted,
    JobCompleted,
    JobFailed,
    LateResultIgnored,
    LoadQueued,
    PinsReleased,
    RankSucceeded,
    RequestClosed,
    RequestFinished,
    StoreQueued,
    StoreRejected,
)
from kvflow.core.state.apply import fold
from kvflow.core.state.model import State
from kvflow.core.state.tables import BlockState
from kvflow.engine.manager import OffloadManager
from kvflow.integrations.vllm.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    kv_events,
)
from kvflow.log.format import TRACE_VERSION
from kvflow.log.reader import TraceReader, read_trace
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay

A, B, C, D, E, F = 21, 22, 23, 24, 25, 26


def new_events(m: OffloadManager, start: int) -> list[Any]:
    return m.log.events()[start:]


# --- stores and loads ----------------------------------------------------------------------


def test_eager_store_then_load_round_trip() -> None:
    m = manager(cpu_blocks=8)
    store_id = m.blocks_computed("r1", [A, B, C], [1, 2, 3])
    (store_job,) = m.plan_step(0.0)
    m.job_result(store_id)
    assert m.take_notices().stores_finished == [store_id]
    m.finish_request("r1")
    # a second request with the same prefix
    assert m.lookup("r2", [A, B, C, D], tokens(4)) == 3
    load_id = m.accept_hits("r2", [10, 11, 12])
    (load_job,) = m.plan_step(1.0)
    assert load_job.direction == "load" and load_job.slots == store_job.slots
    assert load_job.device_blocks == (10, 11, 12)
    assert all(m.state.entries[h].pins == 1 for h in (A, B, C))
    m.job_result(load_id)
    notices = m.take_notices()
    assert notices.loads_finished == [("r2", load_id)]
    assert sorted(notices.released_device_blocks) == [10, 11, 12]
    assert all(m.state.entries[h].pins == 0 for h in (A, B, C))
    # r2 computes D and stores only it
    assert m.blocks_computed("r2", [A, B, C, D], [10, 11, 12, 13]) is not None
    (job,) = m.plan_step(2.0)
    assert job.hashes == (D,)
    m.job_result(job.job_id)
    m.finish_request("r2")
    assert not m.state.requests and not m.state.jobs and not m.state.held
    consistent(m)


def test_F13_a_prompt_exactly_two_blocks_long_loads_one_block_and_computes_the_last() -> None:
    m = manager()
    store(m, "w", [A, B], [1, 2])
    assert m.lookup("r", [A, B], 2 * BT) == 1
    load_id = m.accept_hits("r", [30])
    (job,) = m.plan_step(1.0)
    assert job.hashes == (A,)
    m.job_result(load_id)
    # the last block is computed (it is already on the tier: no store)
    assert m.blocks_computed("r", [A, B], [30, 31]) is None
    m.finish_request("r")
    consistent(m)


def test_F3_a_second_request_sharing_in_flight_device_blocks_stores_nothing_new() -> None:
    m = manager(cpu_blocks=8)
    first = m.blocks_computed("r1", [A, B], [1, 2])
    m.plan_step(0.0)
    # before the store lands, r2 shares the prefix on the device (same blocks, same hashes)
    assert m.lookup("r2", [A, B, C], tokens(3)) == 0
    start = len(m.log.events())
    assert m.blocks_computed("r2", [A, B], [1, 2]) is None
    assert m.plan_step(1.0) == []
    assert not any(isinstance(e, StoreQueued) for e in new_events(m, start))
    m.job_result(first)
    assert m.state.jobs == {} and m.state.held == {}
    assert m.lookup("r3", [A, B, C], tokens(3)) == 2
    consistent(m)


def test_duplicate_store_of_resident_hashes_uses_no_slots() -> None:
    m = manager(cpu_blocks=4)
    store(m, "w", [A, B], [1, 2])
    free = list(m.state.free_slots)
    start = len(m.log.events())
    assert m.blocks_computed("x", [A, B], [5, 6]) is None
    # no slot, no job: only "x" becomes known (F18), with its chain
    assert list(m.state.free_slots) == free and [type(e).__name__ for e in new_events(m, start)] == ["ChainExtended"]
    # a mixed call stores only the new hash
    job_id = m.blocks_computed("x", [A, B, C], [5, 6, 7])
    assert m.state.jobs[job_id].hashes == (C,)
    assert len(m.state.free_slots) == len(free) - 1
    consistent(m)


# --- eviction ------------------------------------------------------------------------------


def test_lru_storing_c_evicts_a() -> None:
    m = manager(cpu_blocks=2)
    store(m, "a", [A], [1])
    store(m, "b", [B], [2])
    start = len(m.log.events())
    store(m, "c", [C], [3])
    (evicted,) = [e for e in new_events(m, start) if isinstance(e, BlocksEvicted)]
    assert evicted.hashes == (A,) and evicted.reason == "capacity"
    assert set(m.state.entries) == {B, C}
    consistent(m)


def test_touched_blocks_survive_eviction() -> None:
    m = manager(cpu_blocks=2)
    store(m, "a", [A], [1])
    store(m, "b", [B], [2])
    assert m.touch([A, 99]) == 1  # unknown hashes are skipped
    store(m, "c", [C], [3])
    assert set(m.state.entries) == {A, C}
    consistent(m)


def test_F7_a_hit_pinned_at_lookup_survives_cache_pressure_before_allocation() -> None:
    m = manager(cpu_blocks=3)
    store(m, "w", [A, B, C], [1, 2, 3])
    assert m.lookup("r", [A, B, 99], tokens(3)) == 2  # pins A, B (the coldest)
    # before the engine allocates device blocks, other requests push hard on the tier
    for i in range(4):
        m.blocks_computed(f"x{i}", [100 + i], [40 + i])
        m.plan_step(float(i))
        m.job_result(m.state.last_job_id)
    assert m.state.is_resident(A) and m.state.is_resident(B)
    assert (
        sum(isinstance(e, StoreRejected) for e in m.log.events()) == 0
    )  # one slot kept turning over
    load_id = m.accept_hits("r", [50, 51])
    m.plan_step(10.0)
    m.job_result(load_id)
    assert m.take_notices().loads_finished == [("r", load_id)]
    consistent(m)


# --- request cleanup -----------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["ok", "failed", "timed_out"])
@pytest.mark.parametrize("direction", ["load", "store"])
def test_F4_a_request_finished_during_its_job_closes_only_after_the_job_ends(
    direction: str, outcome: str
) -> None:
    m = manager(cpu_blocks=8)
    if direction == "load":
        store(m, "w", [A, B], [1, 2])
        m.finish_request("w")
        assert m.lookup("r", [A, B, 99], tokens(3)) == 2
        job_id = m.accept_hits("r", [10, 11])
    else:
        job_id = m.blocks_computed("r", [A, B], [10, 11])
    m.plan_step(0.0)
    start = len(m.log.events())
    m.finish_request("r", preempted=(direction == "store"))
    events = new_events(m, start)
    if direction == "load":  # its chain on the tier, deepest first (99 is not there)
        assert [type(e) for e in events] == [BlocksTouched, RequestFinished]
        assert events[0].hashes == (B, A) and events[0].reuse is False
    else:  # a preempted request is not over: no recency yet
        assert [type(e) for e in events] == [RequestFinished]
    assert "r" in m.state.requests and m.state.requests["r"].finished
    assert sorted(m.held_device_blocks()) == [10, 11]
    if outcome == "ok":
        m.job_result(job_id)
    elif outcome == "failed":
        m.job_result(job_id, ok=False, error="boom")
    else:
        m.tick(DEADLINE_MS)
    last = m.log.events()[-1]
    assert isinstance(last, RequestClosed) and last.request_id == "r"
    if outcome == "timed_out":  # F15: the request is done, its job's memory stays fenced
        assert "r" not in m.state.requests and sorted(m.held_device_blocks()) == [10, 11]
        m.job_result(job_id)  # the copy reports, late
    assert "r" not in m.state.requests and not m.held_device_blocks()
    if direction == "load":
        assert m.state.entries[A].pins == 0 and m.state.entries[B].pins == 0
    consistent(m)


def test_engine_accepts_two_of_four_offered_hits() -> None:
    m = manager(cpu_blocks=8)
    store(m, "w", [A, B, C, D], [1, 2, 3, 4])
    assert m.lookup("r", [A, B, C, D, E], tokens(5)) == 4
    start = len(m.log.events())
    load_id = m.accept_hits("r", [10, 11])
    events = new_events(m, start)
    assert [type(e) for e in events] == [LoadQueued, PinsReleased, BlocksTouched]
    assert events[0].hashes == (A, B) and events[1].hashes == (C, D)
    assert events[2].hashes == (B, A) and events[2].reuse  # the loaded hits, deepest first
    assert [m.state.entries[h].pins for h in (A, B, C, D)] == [1, 1, 0, 0]
    m.plan_step(1.0)
    m.job_result(load_id)
    assert [m.state.entries[h].pins for h in (A, B, C, D)] == [0, 0, 0, 0]
    consistent(m)


# --- reset ---------------------------------------------------------------------------------


def test_F15_a_reset_fences_the_slots_of_jobs_in_flight_until_they_report() -> None:
    m = manager(cpu_blocks=4)
    store(m, "w", [A, B], [1, 2])
    m.finish_request("w")
    assert m.lookup("r", [A, 99], tokens(2)) == 1
    load_id = m.accept_hits("r", [10])
    store_id = m.blocks_computed("s", [C], [11])
    m.plan_step(0.0)
    queued_id = m.blocks_computed("s2", [D], [12])  # queued: cancelled by the reset
    m.take_notices()
    m.reset()
    notices = m.take_notices()
    assert notices.all_blocks_cleared
    cancelled = [e for e in m.log.events() if isinstance(e, JobFailed)]
    assert [e.job_id for e in cancelled] == [queued_id]
    fenced = {m.state.jobs[load_id].slots[0], m.state.jobs[store_id].slots[0]}
    assert set(m.state.fenced_slots) == fenced
    assert m.state.entries == {}
    # F18: the live requests stay known (no pins, no jobs); the abandoned load is reported
    assert sorted(m.state.requests) == ["r", "s", "s2"]
    assert [(f.request_id, f.job_id, f.device_blocks) for f in notices.loads_failed] == [("r", load_id, (10,))]
    assert sorted(m.held_device_blocks()) == [10, 11]  # still being copied
    # new stores may not take fenced slots: only 2 of 4 are usable
    m.blocks_computed("n", [E, F, 27], [20, 21, 22])
    used = {e.slot for e in m.state.entries.values()}
    assert len(used) == 2 and not used & fenced
    assert sum(len(e.hashes) for e in m.log.events() if isinstance(e, StoreRejected)) == 1
    # the abandoned jobs report: their slots are freed, nothing becomes visible
    m.job_result(store_id)
    m.job_result(load_id, ok=False, error="late")
    assert m.state.fenced_slots == {} and not {10, 11} & set(m.held_device_blocks())
    assert fenced <= set(m.state.free_slots)
    assert m.state.block_state(C) is BlockState.ABSENT
    assert m.lookup("q", [C, 99], tokens(2)) == 0
    consistent(m)


def test_F15_a_slot_two_abandoned_loads_read_is_freed_when_both_report() -> None:
    m = manager(cpu_blocks=4)
    store(m, "w", [A], [1])
    m.finish_request("w")
    jobs = []
    for request_id, device_block in (("r1", 10), ("r2", 11)):
        assert m.lookup(request_id, [A, 99], tokens(2)) == 1
        jobs.append(m.accept_hits(request_id, [device_block]))
    m.plan_step(0.0)
    m.reset()
    slot = m.state.jobs[jobs[0]].slots[0]
    m.job_result(jobs[0])
    assert slot in m.state.fenced_slots, "the other load still reads this slot"
    m.job_result(jobs[1])
    assert m.state.fenced_slots == {} and slot in m.state.free_slots
    consistent(m)


def test_F15_an_abandoned_store_that_completes_releases_its_blocks_and_shows_nothing() -> None:
    m = manager(cpu_blocks=4)
    job_id = m.blocks_computed("r", [A], [1])
    m.plan_step(0.0)
    m.reset()
    m.take_notices()
    m.job_result(job_id)
    notices = m.take_notices()
    assert notices.released_device_blocks == [1]
    assert m.state.block_state(A) is BlockState.ABSENT
    assert job_id not in notices.stores_finished
    completed = m.log.events()[-1]
    assert isinstance(completed, JobCompleted) and completed.abandoned
    assert [type(e).__name__ for e in kv_events(m.log.events(), BT)] == ["AllBlocksCleared"]
    consistent(m)


def test_F15_a_load_reading_one_slot_twice_frees_it_once_after_a_reset() -> None:
    m = manager(cpu_blocks=4)
    store(m, "w", [A], [1])
    m.finish_request("w")
    assert m.lookup("r", [A, A, 99], tokens(3)) in (1, 2)
    job_id = m.accept_hits("r", [10, 11][: len(m.state.requests["r"].offered)])
    m.plan_step(0.0)
    m.reset()
    m.job_result(job_id)
    assert m.state.fenced_slots == {}
    consistent(m)


# --- several ranks -------------------------------------------------------------------------


def test_F3_a_store_on_two_ranks_becomes_visible_only_after_both_report() -> None:
    m = manager(cpu_blocks=4, world_size=2)
    job_id = m.blocks_computed("r", [A], [1])
    m.plan_step(0.0)
    m.job_result(job_id, rank=1)
    assert isinstance(m.log.events()[-1], RankSucceeded)
    assert m.lookup("q", [A, 99], tokens(2)) == 0  # not visible yet
    assert m.held_device_blocks() == [1]
    m.job_result(job_id, rank=0)
    last = m.log.events()[-1]
    assert isinstance(last, JobCompleted) and last.rank == 0
    assert m.lookup("q", [A, 99], tokens(2)) == 1
    consistent(m)


@pytest.mark.parametrize("failing_rank", [0, 1])
@pytest.mark.parametrize("failure_first", [True, False])
def test_F15_a_job_failed_on_one_rank_stays_fenced_until_the_other_reports(failing_rank: int, failure_first: bool) -> None:
    m = manager(cpu_blocks=4, world_size=2)
    job_id = m.blocks_computed("r", [A], [1])
    m.plan_step(0.0)
    other = 1 - failing_rank
    if not failure_first:
        m.job_result(job_id, rank=other)
    m.job_result(job_id, rank=failing_rank, ok=False, error="rank died")
    failed = [e for e in m.log.events() if isinstance(e, JobFailed)]
    assert [(e.job_id, e.rank) for e in failed] == [(job_id, failing_rank)]
    assert m.state.block_state(A) is BlockState.ABSENT  # the outcome applies at once
    # F15: while the other rank has not reported, its copy may still write the slot
    assert failed[0].fenced is failure_first and bool(m.state.jobs) is failure_first
    if failure_first:
        assert m.held_device_blocks() == [1] and m.state.fenced_slots
        m.job_result(job_id, rank=other)
        late, lifted = m.log.events()[-2:]
        assert isinstance(late, LateResultIgnored) and (late.job_id, late.rank) == (job_id, other)
        assert isinstance(lifted, FenceLifted) and lifted.job_id == job_id
    assert m.state.block_state(A) is BlockState.ABSENT and not m.state.jobs and not m.state.fenced_slots
    consistent(m)


# --- ARC -----------------------------------------------------------------------------------


def test_arc_policy_through_the_manager() -> None:
    """ARC keeps a block used twice over a newer block used once (LRU would not), and a quick
    return of an evicted block adapts p."""
    runs = {}
    for policy in ("lru", "arc"):
        m = manager(cpu_blocks=2, policy=policy)
        store(m, "a", [A], [1])
        m.touch([A])  # A used twice: ARC moves it to T2
        store(m, "b", [B], [2])  # B seen once, and more recent than A
        store(m, "c", [C], [3])
        runs[policy] = m
        consistent(m)
    assert set(runs["lru"].state.entries) == {B, C}
    arc = runs["arc"]
    assert set(arc.state.entries) == {A, C}
    name, t1, t2, b1, b2, p = arc.state.policy.snapshot()
    assert (name, t1, t2, b1, p) == ("arc", [C], [A], [B], 0)
    store(arc, "b", [B], [4])  # B returns from the B1 ghost list: p grows, B goes to T2
    name, t1, t2, b1, b2, p = arc.state.policy.snapshot()
    assert p == 1 and B in t2
    consistent(arc)
    # replay rebuilds the same ARC state, ghosts included
    assert (
        fold(State(arc.config), arc.log.events()).policy.snapshot() == arc.state.policy.snapshot()
    )


def test_arc_reorder_only_touch_does_not_count_as_a_second_use() -> None:
    m = manager(cpu_blocks=2, policy="arc")
    store(m, "a", [A], [1])
    m.touch([A], reuse=False)  # the end-of-request ordering pass: A stays in T1
    touched = m.log.events()[-1]
    assert isinstance(touched, BlocksTouched) and touched.reuse is False
    name, t1, t2, *_ = m.state.policy.snapshot()
    assert (t1, t2) == ([A], [])
    store(m, "b", [B], [2])
    store(m, "c", [C], [3])  # T1 holds A (older) and B: A goes first, as in LRU
    assert set(m.state.entries) == {B, C}
    consistent(m)


# --- KV events -------------------------------------------------------------------------------


def announced_after(stream: list[Any]) -> set[int]:
    """What a consumer of the KV events believes is on the CPU tier."""
    announced: set[int] = set()
    for kv in stream:
        assert getattr(kv, "medium", MEDIUM_CPU) == MEDIUM_CPU  # (AllBlocksCleared names none)
        if isinstance(kv, BlockStored):
            assert not announced & set(kv.block_hashes), "announced twice"
            announced |= set(kv.block_hashes)
        elif isinstance(kv, BlockRemoved):
            assert set(kv.block_hashes) <= announced, "removed a block never announced"
            announced -= set(kv.block_hashes)
        else:
            assert isinstance(kv, AllBlocksCleared)
            announced = set()
    return announced


def resident(m: OffloadManager) -> set[int]:
    return {h for h, e in m.state.entries.items() if e.state is BlockState.RESIDENT}


def test_kv_events_announce_blocks_only_when_readable() -> None:
    m = manager(cpu_blocks=3)
    publisher = KVEventPublisher(BT)
    m.subscribe(publisher)
    stream: list[Any] = []

    def step() -> list[Any]:
        new = publisher.take()
        stream.extend(new)
        assert announced_after(stream) == resident(m)
        return new

    ok = m.blocks_computed("r", [A, B], [1, 2])
    failing = m.blocks_computed("s", [C], [3])
    m.plan_step(0.0)
    assert step() == []  # queued and in flight: not announced (F3)
    m.job_result(ok)
    (stored,) = step()
    assert isinstance(stored, BlockStored) and stored.block_hashes == [A, B]
    assert stored.block_size == BT and stored.seq == m.log.events()[-1].seq
    m.job_result(failing, ok=False, error="x")
    assert step() == []  # a failed store was never visible, so nothing is removed
    store(m, "t", [D, E], [4, 5])  # needs a slot: evicts A
    kinds = [type(kv).__name__ for kv in step()]
    assert kinds == ["BlockRemoved", "BlockStored"]
    assert stream[-2].block_hashes == [A]
    assert m.evict(1) == 1
    (removed,) = step()
    assert isinstance(removed, BlockRemoved)
    abandoned = m.blocks_computed("u", [F], [6])
    m.plan_step(1.0)
    m.reset()
    assert [type(kv) for kv in step()] == [AllBlocksCleared]
    m.job_result(abandoned)
    assert step() == []  # the abandoned copy landed, but nothing became readable
    # the publisher saw exactly what the log implies
    assert stream == kv_events(m.log.events(), BT)


def test_kv_events_from_a_replayed_trace_match_the_live_stream(tmp_path: Path) -> None:
    path = tmp_path / "kv.jsonl"
    cfg = config(cpu_blocks=4)
    m = OffloadManager(cfg, log=TraceWriter(path, cfg))
    publisher = KVEventPublisher(BT)
    m.subscribe(publisher)
    drive_workload(m)
    m.close()
    live = publisher.take()
    assert {type(kv) for kv in live} == {BlockStored, BlockRemoved, AllBlocksCleared}
    _, records = read_trace(path)
    events = [r for _, r in records if hasattr(r, "seq") and type(r).__name__ != "Checkpoint"]
    assert kv_events(events, BT) == live
    assert announced_after(live) == resident(m)


# --- traces --------------------------------------------------------------------------------


def drive_workload(m: OffloadManager) -> None:
    """Stores, loads, a failure, a timeout, a late result, eviction, reset, more stores."""
    store(m, "w1", [A, B, C], [1, 2, 3])
    m.finish_request("w1")
    assert m.lookup("r1", [A, B, C, D], tokens(4)) == 3
    load_id = m.accept_hits("r1", [10, 11])
    m.plan_step(4.0)
    m.job_result(load_id)
    m.blocks_computed("r1", [A, B, C, D], [10, 11, 12, 13])
    m.plan_step(5.0)
    m.job_result(m.state.last_job_id, ok=False, error="store failed")
    m.touch([C, B, A])
    m.finish_request("r1")
    m.blocks_computed("r2", [E, F], [20, 21])
    m.plan_step(6.0)
    m.tick(6.0 + DEADLINE_MS)
    m.job_result(m.state.last_job_id)  # late
    m.evict(1)
    m.blocks_computed("r3", [30, 31, 32], [30, 31, 32])
    m.plan_step(7.0)
    m.reset()
    m.blocks_computed("r4", [40], [40])
    m.plan_step(8.0)
    m.job_result(m.state.last_job_id - 1)
    m.job_result(m.state.last_job_id)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_trace_round_trip_replays_to_the_live_digest(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"run{suffix}"
    cfg = config(cpu_blocks=4)
    m = OffloadManager(cfg, log=TraceWriter(path, cfg, checkpoint_every=3))
    drive_workload(m)
    live = m.state.digest()
    m.close()
    if suffix.endswith(".gz"):
        with gzip.open(path, "rb") as fh:
            assert json.loads(fh.readline())["format"] == "kvflow-trace"
    folded = replay(path)
    assert folded.ok, folded.divergence
    assert folded.state.digest() == live and folded.checkpoints >= 3 and folded.warnings == []
    redecided = replay(path, redecide=True)
    assert redecided.ok, redecided.divergence
    assert redecided.state.digest() == live and redecided.commands > 10


def test_trace_round_trip_with_an_integer_deadline(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    cfg = Config(cpu_blocks=4, block_tokens=BT, job_deadline_ms=1000)
    m = OffloadManager(cfg, log=TraceWriter(path, cfg, checkpoint_every=1))
    m.blocks_computed("r", [A], [1])
    m.plan_step(0)  # an integer virtual clock
    m.close()
    result = replay(path)
    assert result.ok, result.divergence


def write_trace(path: Path) -> OffloadManager:
    cfg = config(cpu_blocks=4)
    m = OffloadManager(cfg, log=TraceWriter(path, cfg, checkpoint_every=1000))
    drive_workload(m)
    m.close()
    return m


def test_torn_last_line_is_reported_and_ignored(tmp_path: Path) -> None:
    path = tmp_path / "torn.jsonl"
    m = write_trace(path)
    lines = path.read_bytes().splitlines(keepends=True)
    # a crash while writing one more record: half a line, no newline
    path.write_bytes(b"".join(lines) + b'{"type":"blocks_touched","hashes":[21,')
    result = replay(path)
    assert result.ok, result.divergence
    assert result.state.digest() == m.state.digest()
    (warning,) = result.warnings
    assert "torn" in warning and f"{path}:{len(lines) + 1}" in warning
    # a torn *event* line: replay stops before it, still without error
    path.write_bytes(b"".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2])
    result = replay(path)
    assert result.ok and len(result.warnings) == 1


def test_truncated_gzip_trace_is_reported_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl.gz"
    write_trace(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 30])
    result = replay(path)
    assert result.warnings


def test_malformed_middle_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    write_trace(path)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[4] = b'{"type":"blocks_touched","hashes":"not a list","seq":3}\n'
    path.write_bytes(b"".join(lines))
    with pytest.raises(TraceError) as caught:
        replay(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:5:") and "\n" not in message and "hashes" in message
    lines[4] = b"this is not json\n"
    path.write_bytes(b"".join(lines))
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value).startswith(f"{path}:5:")
    assert caught.value.line == 5


def test_newer_trace_version_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "future.jsonl"
    write_trace(path)
    lines = path.read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["version"] = TRACE_VERSION + 1
    path.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(lines[1:]))
    with pytest.raises(TraceError) as caught:
        TraceReader(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:1:")
    assert "newer" in message and str(TRACE_VERSION + 1) in message and "upgrade" in message


def test_a_trace_streams_records_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "stream.jsonl"
    m = write_trace(path)
    with TraceReader(path) as reader:
        assert reader.config == m.config
        first_line, first = next(iter(reader.records()))
    assert first_line == 2 and type(first).__name__ == "BlocksComputed"


def test_F15_a_store_cannot_reuse_a_device_block_an_abandoned_copy_still_reads() -> None:
    """After a reset, an abandoned in-flight store still reads its device blocks: storing the
    same hash from the same device block again is not a duplicate (the hash left the tier)
    and must wait until the abandoned copy reports."""
    m = OffloadManager(config(cpu_blocks=4))
    job = m.blocks_computed("a", [1, 2], [0, 1])
    m.plan_step(0.0)
    m.reset()
    assert m.state.jobs[job].abandoned
    records = len(m.log.records)
    with pytest.raises(BlockHeld, match="device block 0 is held by live store job"):
        m.blocks_computed("b", [1, 2], [0, 1])
    assert len(m.log.records) == records
    m.job_result(job)  # the abandoned copy ends: its device blocks are free again
    assert m.blocks_computed("b", [1, 2], [0, 1]) is not None
    consistent(m)
