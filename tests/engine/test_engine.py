"""The engine (SyncEngine and the anyio Engine) with real executors on a virtual or real clock.

The SimulatedExecutor runs on a VirtualClock, so durations, deadlines and latencies are exact.
The faulty executors below are test doubles of an *external* component (a transfer backend
whose submit or poll raises); they wrap a real SimulatedExecutor and add only the fault.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog
from structlog.testing import capture_logs

from kvflow.core.commands import JobResult
from kvflow.core.config import Config
from kvflow.core.errors import BlockHeld, ConfigError, Rejected
from kvflow.core.events import FenceLifted, LateResultIgnored
from kvflow.core.jobs import LOAD, STORE, TransferJob
from kvflow.core.state.invariants import check_invariants
from kvflow.engine.async_engine import Engine
from kvflow.engine.notices import NOTICE_FIELDS, LoadFailure, Notices, StepReport, merge_reports
from kvflow.engine.sync import SyncEngine
from kvflow.engine.watch import Counters, Latencies, percentile
from kvflow.executors.simulated import SimulatedExecutor, TransferModel, VirtualClock
from kvflow.replay.fold import replay

B = 16  # tokens per block
BPB = 1_000_000  # bytes per block
MODEL = TransferModel(bytes_per_block=BPB, bandwidth_gbps=10.0, latency_us=50.0)  # 0.05 + 0.1/block ms
A_HASHES = (101, 102, 103)
DEADLINE_MS = 40.0


def ms(blocks: int) -> float:
    return 0.05 + 0.1 * blocks


def make(
    *, cpu_blocks: int = 8, world_size: int = 1, trace: Path | None = None, **executor: Any
) -> tuple[SyncEngine, SimulatedExecutor, VirtualClock]:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, world_size=world_size, **executor)
    config = Config(cpu_blocks=cpu_blocks, block_tokens=B, world_size=world_size, job_deadline_ms=DEADLINE_MS)
    engine = SyncEngine(
        config, ex, clock=clock, bytes_per_block=BPB, trace_path=None if trace is None else str(trace)
    )
    return engine, ex, clock


def test_notices_are_kept_until_a_step_takes_them() -> None:
    engine, _, clock = make()
    assert engine.step() == StepReport(now_ms=0.0) and not engine.manager.has_notices()
    engine.lookup("A", (1, 2), 2 * B + 1)
    job = engine.blocks_computed("A", (1, 2), (0, 1))
    submitted = engine.step()
    assert [j.job_id for j in submitted.submitted] == [job] and not engine.manager.has_notices()
    clock.advance_to(clock.now_ms + ms(2))
    engine.manager.apply_results(engine.executor.poll())  # the store ends outside a step...
    assert engine.manager.has_notices()
    done = engine.step()  # ...and the next step's report tells it
    assert done.stores_finished == [job] and sorted(done.released_device_blocks) == [0, 1]
    assert not engine.manager.has_notices()
    assert engine.manager.take_notices() == Notices()


def run_until_idle(engine: SyncEngine, ex: SimulatedExecutor, clock: VirtualClock) -> StepReport:
    """Step, jumping the virtual clock to the next completion (or the earliest deadline)."""
    merged = engine.step()
    for _ in range(1000):
        if not engine.has_live_jobs():
            return merged
        due = ex.next_completion_ms()
        deadline = engine.manager.next_deadline_ms()
        if due is None or (deadline is not None and deadline < due):
            due = deadline
        clock.advance_to(due)
        report = engine.step()
        merge_reports(merged, report)
        merged.now_ms = report.now_ms
    raise AssertionError("engine never became idle")


def store_a(engine: SyncEngine, ex: SimulatedExecutor, clock: VirtualClock) -> StepReport:
    """Request A computes three blocks into device blocks 0..2; they are stored; A finishes."""
    engine.lookup("A", A_HASHES, 3 * B + 1)
    engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    report = run_until_idle(engine, ex, clock)
    engine.finish_request("A")
    return report


def assert_clean(engine: SyncEngine) -> None:
    assert check_invariants(engine.manager.state) == []
    assert engine.held_device_blocks() == []
    assert not engine.has_live_jobs()


# --- the round trip -----------------------------------------------------------------------


def test_lookup_accept_compute_step_complete_round_trip() -> None:
    engine, ex, clock = make()
    assert engine.lookup("A", A_HASHES, 3 * B + 1) == 0  # empty tier
    job_a = engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    assert job_a is not None
    assert sorted(engine.held_device_blocks()) == [0, 1, 2]  # held from queue time

    first = engine.step()
    assert [(j.job_id, j.direction, j.device_blocks) for j in first.submitted] == [(job_a, STORE, (0, 1, 2))]
    assert first.stores_finished == [] and first.released_device_blocks == []
    assert engine.step().submitted == []  # submitted once (F5)

    clock.advance_to(ms(3))
    done = engine.step()
    assert done.stores_finished == [job_a]
    assert sorted(done.released_device_blocks) == [0, 1, 2]
    assert engine.held_device_blocks() == []
    engine.finish_request("A")

    # B shares A's three blocks and has a fourth, partial block of its own
    assert engine.lookup("B", (*A_HASHES, 104), 3 * B + 5) == 3
    job_b = engine.accept_hits("B", (10, 11, 12))
    assert job_b is not None and job_b != job_a
    assert sorted(engine.held_device_blocks()) == [10, 11, 12]
    sub = engine.step()
    assert [(j.job_id, j.direction, j.device_blocks) for j in sub.submitted] == [(job_b, LOAD, (10, 11, 12))]
    assert sorted(sub.submitted[0].slots) == sorted(first.submitted[0].slots)  # the slots A's store filled
    clock.advance_to(clock.now_ms + ms(3))
    loaded = engine.step()
    assert loaded.loads_finished == [("B", job_b)]
    assert loaded.loads_failed == []
    assert sorted(loaded.released_device_blocks) == [10, 11, 12]
    engine.finish_request("B")
    assert_clean(engine)

    c = engine.counters
    assert (c.lookups, c.jobs_submitted, c.jobs_completed, c.jobs_failed, c.jobs_timed_out) == (2, 2, 2, 0, 0)
    assert (c.blocks_stored, c.blocks_loaded, c.bytes_stored, c.bytes_loaded) == (3, 3, 3 * BPB, 3 * BPB)
    assert c.hit_tokens == 3 * B
    assert engine.latencies.store_ms == pytest.approx([ms(3)])
    assert engine.latencies.load_ms == pytest.approx([ms(3)])


def test_released_device_blocks_are_exactly_what_was_held() -> None:
    engine, ex, clock = make(cpu_blocks=16)
    store_a(engine, ex, clock)
    engine.lookup("B", (*A_HASHES, 201, 202), 5 * B + 1)
    engine.accept_hits("B", (20, 21))  # accept only two of the three hits
    engine.blocks_computed("B", (A_HASHES[2], 201, 202), (22, 23, 24))  # 103 is already resident
    held = sorted(engine.held_device_blocks())
    assert held == [20, 21, 23, 24]
    report = run_until_idle(engine, ex, clock)
    assert sorted(report.released_device_blocks) == held
    assert len(report.loads_finished) == 1 and len(report.stores_finished) == 1
    engine.finish_request("B")
    assert_clean(engine)


def test_F12_a_device_block_held_by_a_live_job_is_refused_until_released() -> None:
    engine, ex, clock = make()
    engine.lookup("A", A_HASHES, 3 * B + 1)
    engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    engine.step()
    with pytest.raises(BlockHeld):
        engine.blocks_computed("A", (999,), (1,))
    clock.advance_to(ms(3))
    assert 1 in engine.step().released_device_blocks
    assert engine.blocks_computed("A", (999,), (1,)) is not None  # free again


def test_F1_a_failed_load_names_the_device_blocks_and_keeps_the_entries() -> None:
    engine, ex, clock = make(fail_jobs=[2])  # the 2nd submitted job: B's load
    store_a(engine, ex, clock)
    assert engine.lookup("B", (*A_HASHES, 104), 3 * B + 5) == 3
    job_b = engine.accept_hits("B", (10, 11, 12))
    report = run_until_idle(engine, ex, clock)
    assert report.loads_finished == []
    [failure] = report.loads_failed
    assert (failure.request_id, failure.job_id, failure.device_blocks) == ("B", job_b, (10, 11, 12))
    assert "simulated transfer failure" in failure.error
    assert sorted(report.released_device_blocks) == [10, 11, 12]
    state = engine.manager.state
    for h in A_HASHES:  # F1: still resident and unpinned
        assert state.is_resident(h) and state.evictable(h)
    engine.finish_request("B")
    assert_clean(engine)
    assert engine.lookup("C", A_HASHES + (105,), 3 * B + 2) == 3  # still served
    c = engine.counters
    assert (c.jobs_failed, c.blocks_loaded) == (1, 0)


def test_F1_a_failed_store_frees_its_slots_and_never_shows_the_hashes() -> None:
    engine, ex, clock = make(fail_jobs=[1])
    report = store_a(engine, ex, clock)
    assert report.stores_finished == []
    assert [jid for jid, _ in report.stores_failed] == [1]
    assert sorted(report.released_device_blocks) == [0, 1, 2]
    assert engine.lookup("B", (*A_HASHES, 104), 3 * B + 5) == 0
    assert len(engine.manager.state.free_slots) == 8
    engine.finish_request("B")
    assert_clean(engine)
    assert engine.counters.blocks_stored == 0


def test_drain_does_not_lose_a_load_failure() -> None:
    engine, ex, clock = make(fail_jobs=[2])
    store_a(engine, ex, clock)
    engine.lookup("B", (*A_HASHES, 104), 3 * B + 5)
    job = engine.accept_hits("B", (10, 11, 12))
    engine.step()  # submitted
    # drain's sleep hook moves the virtual clock, so the load comes due while draining
    drained = engine.drain(timeout_ms=1000, sleep=lambda _s: clock.advance_to(clock.now_ms + 0.5))
    assert not engine.has_live_jobs()
    assert isinstance(drained, StepReport)
    assert [(f.job_id, f.device_blocks) for f in drained.loads_failed] == [(job, (10, 11, 12))]
    assert sorted(drained.released_device_blocks) == [10, 11, 12]
    assert engine.step().loads_failed == []  # reported once


def test_drain_gives_up_after_its_timeout_on_the_engine_clock() -> None:
    engine, ex, clock = make(hang_jobs=[1])
    engine.lookup("A", A_HASHES, 3 * B + 1)
    engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    drained = engine.drain(timeout_ms=5, sleep=lambda _s: clock.advance_to(clock.now_ms + 1))
    assert engine.has_live_jobs()  # the hung job is still in flight: drain did not wait 40 ms
    assert 5 < drained.now_ms < DEADLINE_MS
    assert [j.job_id for j in drained.submitted] == [1]


# --- deadlines and late results ----------------------------------------------------------


def test_F2_a_hung_job_times_out_by_the_engine_clock_and_its_late_result_is_ignored() -> None:
    engine, ex, clock = make(hang_jobs=[1])
    engine.lookup("A", A_HASHES, 3 * B + 1)
    job = engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    assert job is not None
    engine.step()  # submitted at t=0: deadline t=40
    assert ex.next_completion_ms() is None  # the executor will never answer
    clock.advance_to(DEADLINE_MS - 0.001)
    early = engine.step()
    assert early.timed_out == 0 and engine.has_live_jobs()
    clock.advance_to(DEADLINE_MS)
    report = engine.step()
    assert report.timed_out == 1
    assert [jid for jid, _ in report.stores_failed] == [job]
    assert "timed out" in report.stores_failed[0][1]
    # F15: the copy may still run: its device blocks stay held, visibly fenced
    assert report.released_device_blocks == [] and sorted(engine.held_device_blocks()) == [0, 1, 2]
    assert [f.job_id for f in engine.fences()] == [job] and engine.counters.jobs_fenced == 1
    assert engine.counters.jobs_timed_out == 1
    assert engine.latencies.store_ms == pytest.approx([DEADLINE_MS])

    # the copy finally reports, after the deadline: the fence is lifted
    seen: list[object] = []
    engine.manager.subscribe(seen.append)
    engine.apply_results([JobResult(job_id=job, rank=0, ok=True)])
    late, lifted = seen[-2:]
    assert isinstance(late, LateResultIgnored) and late.job_id == job
    assert isinstance(lifted, FenceLifted) and lifted.job_id == job
    assert sorted(engine.step().released_device_blocks) == [0, 1, 2]
    assert engine.counters.late_results == 1 and engine.counters.fences_lifted == 1
    assert engine.lookup("B", A_HASHES, 3 * B + 1) == 0  # the late success made nothing visible
    engine.finish_request("A")
    engine.finish_request("B")
    assert_clean(engine)

    # and the engine keeps serving
    report = store_a_again(engine, ex, clock)
    assert len(report.stores_finished) == 1
    assert engine.lookup("D", A_HASHES, 3 * B + 1) == 3


def store_a_again(engine: SyncEngine, ex: SimulatedExecutor, clock: VirtualClock) -> StepReport:
    engine.lookup("A2", A_HASHES, 3 * B + 1)
    engine.blocks_computed("A2", A_HASHES, (5, 6, 7))
    report = run_until_idle(engine, ex, clock)
    engine.finish_request("A2")
    return report


def test_F2_a_hung_load_times_out_as_a_failed_load() -> None:
    engine, ex, clock = make(hang_jobs=[2])
    store_a(engine, ex, clock)
    engine.lookup("B", A_HASHES + (104,), 3 * B + 5)
    job = engine.accept_hits("B", (10, 11, 12))
    report = run_until_idle(engine, ex, clock)
    assert report.timed_out == 1
    failures = [(f.job_id, f.device_blocks, f.fenced) for f in report.loads_failed]
    assert failures == [(job, (10, 11, 12), True)]
    assert all(engine.manager.state.is_resident(h) for h in A_HASHES)
    engine.finish_request("B")
    # the executor never answers: the fence stays (F15) until close() stops the copies
    assert sorted(engine.held_device_blocks()) == [10, 11, 12]
    engine.close()
    assert_clean(engine)


def test_F15_a_load_that_outlives_its_deadline_never_has_its_blocks_handed_back_early() -> None:
    """F15 on the simulated executor: the load reports 25 ms after its deadline; until then
    its device blocks and slots stay fenced, then the late result lifts the fence."""
    engine, ex, clock = make(slow_jobs=[2], slow_by_ms=DEADLINE_MS + 25)
    store_a(engine, ex, clock)
    engine.lookup("B", A_HASHES + (104,), 3 * B + 5)
    job = engine.accept_hits("B", (10, 11, 12))
    timed_out = run_until_idle(engine, ex, clock)  # until the timeout: the outcome is known
    assert [(f.job_id, f.fenced) for f in timed_out.loads_failed] == [(job, True)]
    assert timed_out.released_device_blocks == []
    # the load's blocks are resident and unpinned (lookups see them), but evicting one would
    # free no slot while the late copy may read it: eviction for space passes them over
    assert engine.lookup("C", A_HASHES + (105,), 3 * B + 5) == 3
    engine.accept_hits("C", [])
    assert engine.manager.state.fenced_slots
    with pytest.raises(Rejected):
        engine.manager.evict(1)
    due = ex.next_completion_ms()
    assert due is not None and due > DEADLINE_MS
    while not engine.step().released_device_blocks:
        assert clock.now_ms <= due, "the late copy's fence was never lifted"
        clock.advance_to(clock.now_ms + 5)
    assert engine.counters.fences_lifted == 1 and engine.fences() == []
    engine.finish_request("B")
    engine.finish_request("C")
    assert_clean(engine)


# --- a faulty executor (an external component) ---------------------------------------------


class RaisingSubmit:
    """A transfer backend whose ``submit`` raises on the n-th call (wraps a real executor)."""

    def __init__(self, inner: SimulatedExecutor, fail_on: int) -> None:
        self.inner, self.fail_on, self.calls = inner, fail_on, 0

    def submit(self, jobs: Any, compute_done: Any = None) -> None:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("DMA engine on fire")
        self.inner.submit(jobs, compute_done)

    def poll(self) -> list[JobResult]:
        return self.inner.poll()

    def close(self) -> None:
        self.inner.close()


class RaisingPoll(RaisingSubmit):
    """A transfer backend whose ``poll`` raises once (its results stay queued inside)."""

    def __init__(self, inner: SimulatedExecutor, fail_on: int) -> None:
        super().__init__(inner, fail_on=0)
        self.poll_fail_on, self.polls = fail_on, 0

    def poll(self) -> list[JobResult]:
        self.polls += 1
        if self.polls == self.poll_fail_on:
            raise OSError("completion channel hiccup")
        return self.inner.poll()


def faulty_engine(wrapper: type[RaisingSubmit], fail_on: int) -> tuple[SyncEngine, SimulatedExecutor, VirtualClock]:
    clock = VirtualClock()
    inner = SimulatedExecutor(clock, MODEL)
    engine = SyncEngine(
        Config(cpu_blocks=8, block_tokens=B, job_deadline_ms=DEADLINE_MS),
        wrapper(inner, fail_on),
        clock=clock,
        bytes_per_block=BPB,
    )
    return engine, inner, clock


def test_F2_an_executor_whose_submit_raises_fails_the_batch_and_leaks_nothing() -> None:
    engine, inner, clock = faulty_engine(RaisingSubmit, fail_on=2)
    store_a(engine, inner, clock)  # 1st submit: fine
    engine.lookup("B", (*A_HASHES, 104, 105), 5 * B + 1)
    load = engine.accept_hits("B", (10, 11, 12))
    store = engine.blocks_computed("B", (104, 105), (13, 14))
    report = engine.step()  # 2nd submit raises: never out of step()
    assert {j.job_id for j in report.submitted} == {load, store}
    assert [(f.job_id, f.device_blocks) for f in report.loads_failed] == [(load, (10, 11, 12))]
    assert [jid for jid, _ in report.stores_failed] == [store]
    assert "DMA engine on fire" in report.loads_failed[0].error
    assert sorted(report.released_device_blocks) == [10, 11, 12, 13, 14]
    c = engine.counters
    assert (c.executor_errors, c.jobs_failed, c.jobs_completed) == (1, 2, 1)
    engine.finish_request("B")
    assert_clean(engine)
    state = engine.manager.state
    assert all(state.is_resident(h) and state.evictable(h) for h in A_HASHES)
    assert not any(h in state.entries for h in (104, 105))  # the failed store took no slot
    assert len(state.free_slots) == 8 - 3

    # the 3rd submit goes through: the engine kept serving
    engine.lookup("C", (*A_HASHES, 104, 105), 5 * B + 1)
    engine.accept_hits("C", (20, 21, 22))
    engine.blocks_computed("C", (104, 105), (23, 24))
    report = run_until_idle(engine, inner, clock)
    assert len(report.loads_finished) == 1 and len(report.stores_finished) == 1
    engine.finish_request("C")
    assert_clean(engine)


def test_F2_an_executor_whose_poll_raises_once_does_not_kill_the_engine() -> None:
    engine, inner, clock = faulty_engine(RaisingPoll, fail_on=1)
    engine.lookup("A", A_HASHES, 3 * B + 1)
    engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    report = engine.step()  # poll #1 raises, inside step()
    assert engine.counters.executor_errors == 1
    assert len(report.submitted) == 1  # the step went on to submit
    clock.advance_to(ms(3))
    report = engine.step()
    assert report.stores_finished == [1]
    engine.finish_request("A")
    assert_clean(engine)
    assert engine.counters.executor_errors == 1


def test_F2_a_result_for_an_unknown_job_is_counted_not_raised() -> None:
    engine, ex, clock = make()
    engine.lookup("A", A_HASHES, 3 * B + 1)
    engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    engine.step()
    clock.advance_to(ms(3))
    good = ex.poll()
    assert [r.job_id for r in good] == [1]
    # a bogus id in the same batch as a good result: the good one is still applied
    report = engine.step(results=[JobResult(job_id=777, rank=0, ok=True), *good])
    assert report.stores_finished == [1]
    assert engine.counters.unknown_results == 1
    engine.apply_results([JobResult(job_id=-3, rank=0, ok=False, error="?")])
    assert engine.counters.unknown_results == 2
    engine.finish_request("A")
    assert_clean(engine)


# --- several ranks -------------------------------------------------------------------------


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_world_size_two_fails_the_job_when_either_rank_fails(fail_rank: int) -> None:
    engine, ex, clock = make(world_size=2, fail_rank=fail_rank, fail_jobs=[2])
    store_a(engine, ex, clock)
    engine.lookup("B", (*A_HASHES, 104), 3 * B + 5)
    job = engine.accept_hits("B", (10, 11, 12))
    report = run_until_idle(engine, ex, clock)
    assert [(f.job_id, f.device_blocks) for f in report.loads_failed] == [(job, (10, 11, 12))]
    assert report.loads_finished == []
    engine.finish_request("B")
    assert_clean(engine)


def test_F3_a_store_on_two_ranks_is_visible_only_when_both_report() -> None:
    engine, ex, clock = make(world_size=2)
    engine.lookup("A", A_HASHES, 3 * B + 1)
    engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    engine.step()
    clock.advance_to(ms(3))
    results = ex.poll()
    assert sorted(r.rank for r in results) == [0, 1]
    rank0 = [r for r in results if r.rank == 0]
    rank1 = [r for r in results if r.rank == 1]
    half = engine.step(results=rank0)
    assert half.stores_finished == [] and engine.has_live_jobs()
    assert sorted(engine.held_device_blocks()) == [0, 1, 2]
    assert engine.lookup("X", A_HASHES, 3 * B + 1) == 0  # not visible before every rank
    full = engine.step(results=rank1)
    assert full.stores_finished == [1]
    assert engine.lookup("Y", A_HASHES, 3 * B + 1) == 3


# --- counters and latencies ---------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == 5.0
    assert percentile(values, 20) == 1.0
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 5.0
    assert percentile([], 50) is None
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0


def test_counters_and_latency_percentiles_are_readable() -> None:
    engine, ex, clock = make(cpu_blocks=64)
    sizes = [1, 2, 3, 4, 5]
    next_block = 0
    for i, n in enumerate(sizes):
        hashes = tuple(1000 * (i + 1) + k for k in range(n))
        rid = f"r{i}"
        engine.lookup(rid, hashes, n * B + 1)
        engine.blocks_computed(rid, hashes, tuple(range(next_block, next_block + n)))
        next_block += n
        run_until_idle(engine, ex, clock)
        engine.finish_request(rid)
    summary = engine.latencies.summary()
    assert set(summary) == {f"{d}_p{q}_ms" for d in ("load", "store") for q in (50, 90, 99)}
    assert summary["load_p50_ms"] is None
    assert summary["store_p50_ms"] == pytest.approx(ms(3))
    assert summary["store_p90_ms"] == pytest.approx(ms(5))
    assert summary["store_p99_ms"] == pytest.approx(ms(5))
    counters = engine.counters.as_dict()
    assert set(counters) == set(Counters().as_dict())
    assert counters["jobs_submitted"] == counters["jobs_completed"] == 5
    assert counters["blocks_stored"] == sum(sizes)
    assert counters["bytes_stored"] == sum(sizes) * BPB
    assert all(isinstance(v, int) for v in counters.values())
    assert isinstance(engine.latencies, Latencies)


# --- recording ------------------------------------------------------------------------------


def test_a_recorded_engine_run_replays_and_redecides_clean(tmp_path: Path) -> None:
    trace = tmp_path / "engine.jsonl"
    engine, ex, clock = make(cpu_blocks=4, trace=trace, fail_jobs=[3], hang_jobs=[5])
    store_a(engine, ex, clock)  # job 1
    engine.lookup("B", (*A_HASHES, 104), 4 * B + 1)
    engine.accept_hits("B", (10, 11, 12))  # job 2: load
    engine.blocks_computed("B", (104,), (13,))  # job 3: store, fails
    run_until_idle(engine, ex, clock)
    engine.finish_request("B")
    engine.lookup("C", (201, 202, 203), 3 * B + 1)
    engine.blocks_computed("C", (201, 202, 203), (20, 21, 22))  # job 4: evicts
    run_until_idle(engine, ex, clock)
    engine.finish_request("C")
    engine.lookup("D", (301,), B + 1)
    hung = engine.blocks_computed("D", (301,), (30,))  # job 5: hangs, times out
    run_until_idle(engine, ex, clock)
    engine.apply_results([JobResult(job_id=hung, rank=0, ok=True)])  # late
    engine.apply_results([JobResult(job_id=4242, rank=0, ok=True)])  # unknown: not recorded
    engine.finish_request("D")
    engine.reset()
    engine.close()
    c = engine.counters
    assert (c.jobs_failed, c.jobs_timed_out, c.late_results, c.unknown_results) == (1, 1, 1, 1)
    assert c.blocks_evicted > 0

    result = replay(trace, redecide=True)
    assert result.ok, result.divergence
    assert result.events == engine.manager.state.last_seq
    assert result.state.digest() == engine.manager.state.digest()
    assert replay(trace).ok


# --- logging --------------------------------------------------------------------------------


def test_failed_and_timed_out_jobs_are_logged_with_dotted_names(restore_structlog: None) -> None:
    with capture_logs() as logs:
        engine, ex, clock = make(fail_jobs=[2], hang_jobs=[3])
        store_a(engine, ex, clock)
        engine.lookup("B", (*A_HASHES, 104), 3 * B + 5)
        load = engine.accept_hits("B", (10, 11, 12))
        run_until_idle(engine, ex, clock)
        engine.finish_request("B")
        engine.lookup("C", (401,), B + 1)
        hung = engine.blocks_computed("C", (401,), (40,))
        run_until_idle(engine, ex, clock)
    names = [entry["event"] for entry in logs]
    assert names and all(n.startswith("kvflow.") and " " not in n for n in names)
    failed = [e for e in logs if e["event"] == "kvflow.job_failed" and e["log_level"] in ("warning", "error")]
    assert len(failed) == 1
    assert failed[0]["job"] == load and failed[0]["request"] == "B"
    assert "simulated transfer failure" in failed[0]["error"]
    timed = [e for e in logs if e["event"] == "kvflow.job_timed_out" and e["log_level"] in ("warning", "error")]
    assert [(e["job"], e["request"]) for e in timed] == [(hung, "C")]
    completed = [e for e in logs if e["event"] == "kvflow.job_completed"]
    assert [(e["job"], e["request"]) for e in completed] == [(1, "A")]


def test_unconfigured_structlog_prints_nothing_for_a_failed_job(
    restore_structlog: None, capsys: pytest.CaptureFixture[str]
) -> None:
    structlog.reset_defaults()
    assert not structlog.is_configured()
    engine, ex, clock = make(fail_jobs=[1, 2])
    report = store_a(engine, ex, clock)
    engine.lookup("B", A_HASHES, 3 * B + 1)
    assert len(report.stores_failed) == 1  # it did fail...
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # ...silently: counters and reports carry it
    assert engine.counters.jobs_failed == 1

    # an executor error, by contrast, is always emitted (positive control for the capture)
    faulty, inner, fclock = faulty_engine(RaisingSubmit, fail_on=1)
    faulty.lookup("A", A_HASHES, 3 * B + 1)
    faulty.blocks_computed("A", A_HASHES, (0, 1, 2))
    faulty.step()
    out = capsys.readouterr()
    assert "kvflow.executor_submit_failed" in out.out + out.err
    assert "kvflow.job_failed" not in out.out + out.err


# --- the async engine -----------------------------------------------------------------------


def torch_kv(seed: int, num_blocks: int = 16) -> list[Any]:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand((num_blocks, 2, 4, 8), generator=gen) for _ in range(3)]


async def test_async_engine_round_trip_with_the_torch_executor(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from kvflow.executors.torch.executor import TorchExecutor

    kv = torch_kv(1)
    original = [t.clone() for t in kv]
    ex = TorchExecutor(kv, 8)
    trace = tmp_path / "async.jsonl"
    config = Config(cpu_blocks=8, block_tokens=B)
    async with Engine(config, ex, trace_path=str(trace), bytes_per_block=ex.layout.block_bytes) as engine:
        engine.lookup("A", A_HASHES, 3 * B + 1)
        job_a = engine.blocks_computed("A", A_HASHES, (0, 1, 2))
        first = await engine.step()
        assert [j.job_id for j in first.submitted] == [job_a]
        stored = await engine.wait_idle(timeout_s=20)
        assert stored.stores_finished == [job_a]
        assert sorted(stored.released_device_blocks) == [0, 1, 2]
        engine.finish_request("A")

        for t in kv:  # the device blocks are reused for something else
            t.copy_(torch.rand(t.shape, generator=torch.Generator().manual_seed(99)))
        assert engine.lookup("B", (*A_HASHES, 104), 3 * B + 5) == 3
        job_b = engine.accept_hits("B", (8, 9, 10))
        await engine.step()
        loaded = await engine.wait_idle(timeout_s=20)
        assert loaded.loads_finished == [("B", job_b)]
        assert sorted(loaded.released_device_blocks) == [8, 9, 10]
        for now, before in zip(kv, original, strict=True):
            assert torch.equal(now[8:11], before[0:3])
        engine.finish_request("B")
        assert engine.counters.bytes_loaded == 3 * ex.layout.block_bytes
    with pytest.raises(Exception, match="closed"):
        ex.submit([TransferJob(99, STORE, (0,), (0,))])  # the engine closed its executor
    result = replay(trace, redecide=True)
    assert result.ok, result.divergence
    assert result.events >= 10


async def test_F2_the_async_engine_times_out_a_hung_job_on_a_wall_driven_virtual_clock() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, hang_jobs=[1])
    start = time.monotonic()

    async def tick() -> None:
        while True:
            clock.advance_to((time.monotonic() - start) * 1000.0)
            await anyio.sleep(0.001)

    config = Config(cpu_blocks=8, block_tokens=B, job_deadline_ms=30.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        async with Engine(config, ex, clock=clock) as engine:
            engine.lookup("A", A_HASHES, 3 * B + 1)
            hung = engine.blocks_computed("A", A_HASHES, (0, 1, 2))
            engine.lookup("B", (501,), B + 1)
            fine = engine.blocks_computed("B", (501,), (3,))
            report = await engine.wait_idle(timeout_s=10)
            assert report.timed_out == 1
            assert [jid for jid, _ in report.stores_failed] == [hung]
            assert report.stores_finished == [fine]
            assert sorted(report.released_device_blocks) == [3]  # the hung job's stay fenced
            assert [f.job_id for f in engine.fences()] == [hung]
            assert clock.now_ms >= 30.0
            assert engine.counters.jobs_timed_out == 1
        tg.cancel_scope.cancel()


async def test_cancelling_the_task_group_closes_the_executor_and_flushes_the_trace(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from kvflow.executors.torch.executor import TorchExecutor

    ex = TorchExecutor(torch_kv(2), 8)
    trace = tmp_path / "cancelled.jsonl"

    async def serve(*, task_status: Any) -> None:
        async with Engine(Config(cpu_blocks=8, block_tokens=B), ex, trace_path=str(trace)) as engine:
            engine.lookup("A", A_HASHES, 3 * B + 1)
            engine.blocks_computed("A", A_HASHES, (0, 1, 2))
            await engine.step()
            task_status.started(engine)
            await anyio.sleep_forever()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            engine = await tg.start(serve)
            tg.cancel_scope.cancel()
    assert engine.core.closed
    with pytest.raises(Exception, match="closed"):
        ex.submit([TransferJob(99, STORE, (0,), (0,))])
    result = replay(trace, redecide=True)  # flushed: header, commands, events, final checkpoint
    assert result.ok, result.divergence
    assert result.events >= 3 and result.checkpoints >= 1


async def test_an_exception_in_the_engine_body_propagates_unchanged() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL)
    with pytest.raises(KeyError):
        async with Engine(Config(cpu_blocks=8, block_tokens=B), ex, clock=clock) as engine:
            engine.lookup("A", A_HASHES, 3 * B + 1)
            raise KeyError("the application's own error")
    assert engine.core.closed


def test_an_engine_without_a_trace_keeps_no_log_so_memory_stays_bounded() -> None:
    engine, ex, clock = make()
    for i in range(50):
        rid = f"r{i}"
        engine.lookup(rid, A_HASHES, 3 * B + 1)
        engine.blocks_computed(rid, A_HASHES, (3 * i, 3 * i + 1, 3 * i + 2))
        engine.drain(sleep=lambda _s: clock.advance_to(clock.now_ms + 1))
        engine.finish_request(rid)
    assert engine.manager.state.last_seq > 100
    assert not hasattr(engine.manager.log, "records")  # nothing retained per event


def test_latency_samples_stay_bounded() -> None:
    from kvflow.engine.watch import Latencies

    lat = Latencies(window=10)
    for i in range(100):
        lat.add("load", float(i))
    assert 10 <= len(lat.load_ms) <= 20
    assert lat.load_ms[-1] == 99.0  # the most recent samples are kept
    assert lat.summary()["load_p50_ms"] is not None and lat.store_ms == []


def test_F7_a_request_that_keeps_its_lookup_pins_is_made_visible(restore_structlog: None) -> None:
    """A request looked up again every step but never scheduled keeps its hits pinned (they
    cannot be evicted): past ``pin_warn_ms`` it is counted and warned about once; releasing
    them with ``accept_hits(request, [])`` ends it."""
    engine, ex, clock = make()
    store_a(engine, ex, clock)
    with capture_logs() as logs:
        for _ in range(5):  # the scheduler cannot place B: it asks again each step
            assert engine.lookup("B", A_HASHES + (104,), 3 * B + 5) == 3
            engine.step()
            clock.advance_to(clock.now_ms + DEADLINE_MS / 2)
    assert engine.counters.pins_overdue == 1
    (warning,) = [e for e in logs if e["event"] == "kvflow.pins_held"]
    assert warning["request"] == "B" and warning["blocks"] == 3
    assert engine.accept_hits("B", []) is None  # released: nothing stays pinned
    assert engine.manager.state.pin_count == {}
    engine.step()
    engine.finish_request("B")
    assert_clean(engine)


def test_F15_a_fence_the_executor_never_answers_is_counted_and_warned_about_once(
    restore_structlog: None,
) -> None:
    engine, ex, clock = make(hang_jobs=[1])
    engine.lookup("A", A_HASHES, 3 * B + 1)
    job = engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    engine.step()
    with capture_logs() as logs:
        for _ in range(6):
            clock.advance_to(clock.now_ms + DEADLINE_MS)
            engine.step()
    assert engine.counters.jobs_fenced == 1 and engine.counters.fences_overdue == 1
    (warning,) = [e for e in logs if e["event"] == "kvflow.fence_held"]
    assert warning["job"] == job and warning["device_blocks"] == 3 and warning["ranks_pending"] == [0]
    engine.close()  # the executor stops its copies: the fence ends
    assert engine.counters.fences_lifted == 1 and engine.held_device_blocks() == []


def test_every_public_engine_method_says_what_it_does() -> None:
    """Item 8 of the engine-contract issue: the embedding API documents itself."""
    import inspect

    for cls in (SyncEngine, Engine):
        missing = [
            name
            for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and len((fn.__doc__ or "").strip()) < 20
        ]
        assert missing == [], f"{cls.__name__}: {missing}"


def test_F19_calls_after_close_are_refused_and_change_nothing(tmp_path: Path) -> None:
    from kvflow.core.errors import EngineClosed

    trace = tmp_path / "closed.jsonl"
    engine, ex, clock = make(trace=trace)
    store_a(engine, ex, clock)
    engine.close()
    size, digest = trace.stat().st_size, engine.manager.state.digest()
    for call in (
        lambda: engine.lookup("B", A_HASHES, 3 * B + 1),
        lambda: engine.blocks_computed("B", (7,), (9,)),
        lambda: engine.finish_request("A"),
        lambda: engine.reset(),
    ):
        with pytest.raises(EngineClosed):
            call()
    assert trace.stat().st_size == size and engine.manager.state.digest() == digest
    assert replay(str(trace)).ok


def test_a_call_from_a_second_thread_while_one_is_decided_is_refused() -> None:
    """Thread A is inside a decision (held there by a subscriber); thread B's call is refused
    with ConcurrentCall instead of interleaving its events into A's."""
    import threading

    from kvflow.core.errors import ConcurrentCall
    from kvflow.core.events import PinsAcquired

    engine, ex, clock = make()
    inside, release = threading.Event(), threading.Event()

    def hold(event: object) -> None:
        inside.set()
        release.wait(10)

    engine.manager.subscribe(hold, (PinsAcquired,))
    first = threading.Thread(target=lambda: engine.lookup("A", A_HASHES, 3 * B + 1))
    first.start()
    assert inside.wait(10)
    events = len(engine.manager.state.requests)
    with pytest.raises(ConcurrentCall):
        engine.lookup("B", A_HASHES, 3 * B + 1)
    release.set()
    first.join(10)
    assert len(engine.manager.state.requests) == events == 1  # only A's call happened
    assert engine.lookup("B", A_HASHES, 3 * B + 1) == 0  # and B can call once A is done


# --- the step's report and the executor's declared abilities ----------------------------------


def test_merge_reports_adds_up_every_field_of_a_report() -> None:
    """A field added to ``Notices`` or ``StepReport`` and left out of ``merge_reports`` fails here."""
    more = StepReport(now_ms=5.0)
    for name in StepReport.__struct_fields__:
        value = getattr(more, name)
        if isinstance(value, list):
            value.append(object())
        elif isinstance(value, bool):
            setattr(more, name, True)
        elif isinstance(value, int):
            setattr(more, name, 3)
    into = StepReport(now_ms=1.0)
    merge_reports(into, more)
    for name in StepReport.__struct_fields__:
        assert name == "now_ms" or getattr(into, name) == getattr(more, name), name
    merge_reports(into, Notices(rejected_store_blocks=1, all_blocks_cleared=False))
    assert into.rejected_store_blocks == 4 and into.all_blocks_cleared  # (notices add up too)


def test_a_step_applies_a_batch_with_a_bad_result_one_by_one_and_reports_the_refused(restore_structlog: None) -> None:
    engine, ex, clock = make()
    engine.lookup("A", A_HASHES, 3 * B + 1)
    job = engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    engine.step()
    clock.advance_to(ms(3))
    results = [*ex.poll(), JobResult(job_id=job, rank=7), JobResult(job_id=999)]
    with capture_logs() as logs:
        report = engine.step(results=results)
    assert report.stores_finished == [job] and report.refused_results == 2
    assert engine.counters.unknown_results == 2
    assert [(e["job"], e["rank"]) for e in logs if e["event"] == "kvflow.result_rejected"] == [(job, 7), (999, 0)]


def test_a_step_refuses_a_bad_time_before_applying_anything() -> None:
    engine, ex, clock = make()
    engine.lookup("A", A_HASHES, 3 * B + 1)
    job = engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    engine.step()
    digest = engine.manager.state.digest()
    with pytest.raises(Rejected, match="now_ms"):
        engine.manager.step(float("nan"), [JobResult(job_id=job)])
    assert engine.manager.state.digest() == digest


class _NoPoll:
    def submit(self, jobs: Any, compute_done: Any = None) -> None: ...

    def close(self) -> None: ...


def test_an_object_that_is_not_an_executor_is_refused_naming_what_it_lacks() -> None:
    with pytest.raises(ConfigError, match="_NoPoll is not an executor: it lacks poll"):
        SyncEngine(Config(cpu_blocks=8, block_tokens=B), _NoPoll())


def test_a_remote_tier_needs_an_executor_that_probes_it() -> None:
    clock = VirtualClock()
    config = Config(cpu_blocks=8, block_tokens=B, remote_blocks=64)
    with pytest.raises(ConfigError, match="remote_blocks=64 needs an executor that probes a remote tier"):
        SyncEngine(config, SimulatedExecutor(clock, MODEL), clock=clock)


def test_the_executor_tells_the_bytes_of_a_block_unless_the_engine_is_told() -> None:
    clock = VirtualClock()
    config = Config(cpu_blocks=8, block_tokens=B)
    assert SyncEngine(config, SimulatedExecutor(clock, MODEL), clock=clock).bytes_per_block == BPB
    told = SyncEngine(config, SimulatedExecutor(clock, MODEL), clock=clock, bytes_per_block=7)
    assert told.bytes_per_block == 7


def test_a_submit_that_raises_fails_the_jobs_on_every_rank_and_fences_nothing() -> None:
    clock = VirtualClock()
    inner = SimulatedExecutor(clock, MODEL, world_size=2)
    config = Config(cpu_blocks=8, block_tokens=B, world_size=2, job_deadline_ms=DEADLINE_MS)
    engine = SyncEngine(config, RaisingSubmit(inner, fail_on=1), clock=clock, bytes_per_block=BPB)
    engine.lookup("A", A_HASHES, 3 * B + 1)
    job = engine.blocks_computed("A", A_HASHES, (0, 1, 2))
    report = engine.step()
    assert [j for j, _ in report.stores_failed] == [job]
    assert sorted(report.released_device_blocks) == [0, 1, 2]
    assert engine.fences() == [] and engine.held_device_blocks() == []
    engine.finish_request("A")
    assert_clean(engine)


def test_a_step_report_carries_every_notice_and_merging_reports_keeps_them_all() -> None:
    """The notices are named once (``Notices``): a step report has each under its name and
    type, and ``merge_reports`` adds each (what the engine's step loop and tests merge)."""
    notice_types = {f.name: f.type for f in msgspec.structs.fields(Notices)}
    report_types = {f.name: f.type for f in msgspec.structs.fields(StepReport)}
    assert NOTICE_FIELDS == tuple(notice_types) and all(report_types[n] == t for n, t in notice_types.items())
    failure = LoadFailure("r", 2, (5,), "x")
    one = StepReport(now_ms=1.0, loads_finished=[("a", 1)], loads_failed=[failure], stores_finished=[3],
                     stores_failed=[(4, "e")], released_device_blocks=[7], timed_out=1, rejected_store_blocks=2)
    two = StepReport(now_ms=2.0, loads_finished=[("b", 9)], released_device_blocks=[8], timed_out=2,
                     rejected_store_blocks=1, all_blocks_cleared=True)
    merge_reports(one, two)
    assert one == StepReport(
        now_ms=1.0, loads_finished=[("a", 1), ("b", 9)], loads_failed=[failure], stores_finished=[3],
        stores_failed=[(4, "e")], released_device_blocks=[7, 8], timed_out=3, rejected_store_blocks=3,
        all_blocks_cleared=True,
    )


def test_the_engine_reads_a_simulated_executors_clock_unless_given_another() -> None:
    """A simulated executor's copies take time on its virtual clock: the engine's deadlines must
    run on the same one, so it is the default; a clock given explicitly wins."""
    clock = VirtualClock(5.0)
    config = Config(cpu_blocks=8, block_tokens=B)
    engine = SyncEngine(config, SimulatedExecutor(clock, MODEL))
    assert engine.clock is clock and engine.step().now_ms == 5.0
    wall = SyncEngine(config, SimulatedExecutor(clock, MODEL), clock=lambda: 42.0)
    assert wall.step().now_ms == 42.0
