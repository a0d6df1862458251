"""The SimulatedExecutor as a component: its time model, streams, seeded faults and errors.

Every expectation here is computed from the documented model (``latency_us + bytes /
bandwidth``, one stream per direction, one ``random.Random(seed).random()`` per job in
submission order), never read back from the executor itself.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.core.commands import JobResult
from kvflow.core.errors import ConfigError, KvflowError, Rejected, UnknownJob
from kvflow.core.jobs import DISK_LOAD, DISK_STORE, LOAD, STORE, TransferJob
from kvflow.executors.simulated import SimulatedExecutor, TransferModel, VirtualClock

# 1 MB blocks at 10 GB/s: 0.1 ms per block, plus 0.05 ms per job.
MODEL = TransferModel(bytes_per_block=1_000_000, bandwidth_gbps=10.0, latency_us=50.0)


def job(job_id: int, direction: str = STORE, blocks: int = 1) -> TransferJob:
    ids = tuple(range(job_id * 100, job_id * 100 + blocks))
    return TransferJob(job_id=job_id, direction=direction, device_blocks=ids, slots=ids)  # type: ignore[arg-type]


def expected_ms(blocks: int, model: TransferModel = MODEL) -> float:
    return model.latency_us / 1e3 + blocks * model.bytes_per_block / (model.bandwidth_gbps * 1e9) * 1e3


def drain(ex: SimulatedExecutor, clock: VirtualClock) -> list[tuple[float, JobResult]]:
    """Advance the clock from completion to completion; (time, result) for every result."""
    out: list[tuple[float, JobResult]] = []
    while (due := ex.next_completion_ms()) is not None:
        clock.advance_to(due)
        out.extend((clock.now_ms, r) for r in ex.poll())
    return out


def done_at(results: list[tuple[float, JobResult]]) -> dict[int, float]:
    return {r.job_id: t for t, r in results}


# --- the time model ---------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [0, 1, 7, 64])
def test_duration_is_latency_plus_bytes_over_bandwidth(blocks: int) -> None:
    assert MODEL.duration_ms(blocks) == pytest.approx(0.05 + 0.1 * blocks)
    default = TransferModel()  # DESIGN §8: 2 MiB blocks at 55.5 GB/s, 20 µs per job
    assert default.duration_ms(blocks) == pytest.approx(0.02 + blocks * 2 * 1024 * 1024 / 55.5e9 * 1e3)


@pytest.mark.parametrize(
    "kwargs", [{"bytes_per_block": 0}, {"bandwidth_gbps": 0.0}, {"bandwidth_gbps": -1.0}, {"latency_us": -0.1}]
)
def test_nonsense_model_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        TransferModel(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"bandwidth_gbps": float("nan")}, {"latency_us": float("nan")}])
def test_nan_model_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        TransferModel(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"fault_rate": -0.1}, {"fault_rate": float("nan")}, {"fault_rate": 1.5}, {"world_size": 2, "fail_rank": 2}, {"fail_rank": -1}]
)
def test_nonsense_executor_options_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        SimulatedExecutor(VirtualClock(), MODEL, **kwargs)  # type: ignore[arg-type]


def test_a_job_completes_exactly_when_the_model_says() -> None:
    clock = VirtualClock(1000.0)
    ex = SimulatedExecutor(clock, MODEL)
    ex.submit([job(1, STORE, blocks=4)])
    due = 1000.0 + expected_ms(4)
    assert ex.next_completion_ms() == pytest.approx(due)
    clock.advance_to(due - 1e-6)
    assert ex.poll() == []  # not yet
    clock.advance_to(due)
    assert ex.poll() == [JobResult(job_id=1, rank=0, ok=True)]
    assert ex.poll() == []  # each result once
    assert ex.next_completion_ms() is None and ex.in_flight() == 0


def test_jobs_of_one_direction_serialize_on_their_stream() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL)
    ex.submit([job(1, STORE, 2), job(2, STORE, 3)])
    ex.submit([job(3, STORE, 1)])
    t = done_at(drain(ex, clock))
    assert t[1] == pytest.approx(expected_ms(2))
    assert t[2] == pytest.approx(expected_ms(2) + expected_ms(3))  # waited for job 1
    assert t[3] == pytest.approx(expected_ms(2) + expected_ms(3) + expected_ms(1))


def test_the_two_directions_overlap() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL)
    ex.submit([job(1, STORE, 10), job(2, LOAD, 10), job(3, LOAD, 1)])
    t = done_at(drain(ex, clock))
    assert t[1] == pytest.approx(expected_ms(10))
    assert t[2] == pytest.approx(expected_ms(10))  # not behind the store
    assert t[3] == pytest.approx(expected_ms(10) + expected_ms(1))  # behind the other load
    assert ex.stats.busy_ms == pytest.approx(
        {STORE: expected_ms(10), LOAD: expected_ms(10) + expected_ms(1), DISK_STORE: 0.0, DISK_LOAD: 0.0}
    )


def test_a_job_submitted_after_its_stream_went_idle_starts_at_submission() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL)
    ex.submit([job(1, LOAD, 1)])
    clock.advance_to(50.0)  # long after job 1 finished
    assert [r.job_id for r in ex.poll()] == [1]
    ex.submit([job(2, LOAD, 2)])
    assert ex.next_completion_ms() == pytest.approx(50.0 + expected_ms(2))


def test_results_come_in_completion_order_not_submission_order() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL)
    ex.submit([job(1, STORE, 20), job(2, LOAD, 1)])
    clock.advance_to(1e6)
    assert [r.job_id for r in ex.poll()] == [2, 1]


def test_stats_count_jobs_blocks_and_bytes() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, hang_jobs=[2])
    ex.submit([job(1, STORE, 3), job(2, LOAD, 2)])
    assert (ex.stats.jobs, ex.stats.blocks, ex.stats.bytes, ex.stats.hung) == (2, 5, 5_000_000, 1)


# --- faults -----------------------------------------------------------------------------------


def test_fault_rate_draws_one_random_per_job_in_submission_order() -> None:
    seed, rate = 1234, 0.35
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, fault_rate=rate, seed=seed)
    # 40 jobs over several submits, mixed directions and sizes, so completion order differs
    # from submission order: the draws must still follow submission order.
    order: list[int] = []
    jid = 0
    for batch in range(8):
        jobs = []
        for _k in range(5):
            jid += 1
            jobs.append(job(jid, LOAD if (jid * 7) % 3 == 0 else STORE, blocks=1 + (jid * 5) % 9))
        order += [j.job_id for j in jobs]
        ex.submit(jobs)
        clock.advance_to(clock.now_ms + 0.3 * batch)
    got = {r.job_id: r.ok for _, r in drain(ex, clock)}
    mine = random.Random(seed)
    expected = {j: not (mine.random() < rate) for j in order}
    assert got == expected
    assert 0 < sum(not ok for ok in got.values()) < len(got)  # the draw mattered both ways
    assert ex.stats.faults_injected == sum(not ok for ok in expected.values())


def test_fault_draws_continue_across_hung_and_scripted_jobs() -> None:
    """A hung job and a scripted failure still take their draw: the k-th draw is the k-th job's."""
    seed, rate = 99, 0.5
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, fault_rate=rate, seed=seed, hang_jobs=[2], fail_jobs=[4])
    ex.submit([job(i, STORE, 1) for i in range(1, 11)])
    got = {r.job_id: r.ok for _, r in drain(ex, clock)}
    mine = random.Random(seed)
    draws = [mine.random() < rate for _ in range(10)]
    expected = {i: not draws[i - 1] for i in range(1, 11) if i != 2}
    expected[4] = False
    assert got == expected


def test_no_fault_rate_means_no_failures_and_no_draws() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, fault_rate=0.0, seed=5)
    state = ex.rng.getstate()
    ex.submit([job(i, STORE, 1) for i in range(1, 30)])
    assert all(r.ok for _, r in drain(ex, clock))
    assert ex.rng.getstate() == state


def test_fault_rate_one_fails_everything() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, fault_rate=1.0, error_text="link down")
    ex.submit([job(1, STORE), job(2, LOAD)])
    results = [r for _, r in drain(ex, clock)]
    assert {(r.job_id, r.ok, r.error) for r in results} == {(1, False, "link down"), (2, False, "link down")}


def test_fail_jobs_counts_submitted_jobs_from_one_across_submits() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, fail_jobs=[2, 4])
    # job ids are not ordinals: the 2nd and 4th *submitted* jobs fail
    ex.submit([job(10, STORE), job(11, LOAD)])
    ex.submit([job(7, STORE)])
    ex.submit([job(30, LOAD), job(31, STORE)])
    got = {r.job_id: r.ok for _, r in drain(ex, clock)}
    assert got == {10: True, 11: False, 7: True, 30: False, 31: True}


def test_hang_jobs_never_complete() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, hang_jobs=[1, 3])
    ex.submit([job(5, STORE), job(6, STORE), job(7, LOAD)])
    results = drain(ex, clock)
    assert [r.job_id for _, r in results] == [6]
    clock.advance_to(1e9)
    assert ex.poll() == [] and ex.next_completion_ms() is None
    # the hung job still occupied its stream: job 6 finished after it
    assert done_at(results)[6] == pytest.approx(2 * expected_ms(1))


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_world_size_two_reports_every_rank_and_fails_only_fail_rank(fail_rank: int) -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, world_size=2, fail_rank=fail_rank, fail_jobs=[2])
    ex.submit([job(1, STORE), job(2, STORE)])
    results = [r for _, r in drain(ex, clock)]
    by_job: dict[int, dict[int, bool]] = {}
    for r in results:
        assert r.rank not in by_job.setdefault(r.job_id, {})  # one result per rank
        by_job[r.job_id][r.rank] = r.ok
    assert by_job == {1: {0: True, 1: True}, 2: {fail_rank: False, 1 - fail_rank: True}}


# --- submission errors and wait ---------------------------------------------------------------


def test_F5_a_job_submitted_twice_is_refused() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL)
    ex.submit([job(1)])
    with pytest.raises((ValueError, KvflowError), match="1"):
        ex.submit([job(1)])
    # also after the job completed
    clock.advance_to(1e6)
    assert [r.job_id for r in ex.poll()] == [1]
    with pytest.raises((ValueError, KvflowError)):
        ex.submit([job(1)])


def test_F5_a_job_named_twice_in_one_call_is_refused() -> None:
    ex = SimulatedExecutor(VirtualClock(), MODEL)
    with pytest.raises((ValueError, KvflowError)):
        ex.submit([job(3), job(3)])


def test_a_refused_submit_launches_nothing_of_the_call() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL)
    ex.submit([job(1)])
    with pytest.raises((ValueError, KvflowError)):
        ex.submit([job(2), job(1)])
    assert ex.in_flight() == 1 and ex.stats.jobs == 1  # F5: nothing of the call launched
    ex.submit([job(2)])  # job 2 was never submitted, so this is its first submission
    assert ex.in_flight() == 2


def test_a_refused_submit_draws_no_fault() -> None:
    seed, rate = 3, 0.5
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, fault_rate=rate, seed=seed)
    ex.submit([job(1)])
    with pytest.raises((ValueError, KvflowError)):
        ex.submit([job(2), job(3), job(1)])
    ex.submit([job(2), job(3)])
    got = {r.job_id: r.ok for _, r in drain(ex, clock)}
    mine = random.Random(seed)
    assert got == {j: not (mine.random() < rate) for j in (1, 2, 3)}


def test_F12_wait_on_an_unknown_job_raises() -> None:
    ex = SimulatedExecutor(VirtualClock(), MODEL)
    with pytest.raises(UnknownJob):
        ex.wait(42)
    ex.submit([job(1)])
    with pytest.raises(UnknownJob):
        ex.wait(2)


def test_wait_advances_the_clock_and_keeps_other_results_for_poll() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL)
    ex.submit([job(1, LOAD, 1), job(2, STORE, 5)])
    assert ex.wait(2) == [JobResult(job_id=2, rank=0, ok=True)]
    assert clock.now_ms == pytest.approx(expected_ms(5))
    assert ex.poll() == [JobResult(job_id=1, rank=0, ok=True)]  # came due meanwhile: not lost
    assert ex.wait(2) == []  # already reported


def test_next_completion_ms_tracks_the_earliest_pending_result() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, hang_jobs=[3])
    assert ex.next_completion_ms() is None
    ex.submit([job(1, STORE, 4), job(2, LOAD, 2), job(3, LOAD, 1)])
    assert ex.next_completion_ms() == pytest.approx(expected_ms(2))
    clock.advance_to(expected_ms(2))
    ex.poll()
    assert ex.next_completion_ms() == pytest.approx(expected_ms(4))
    clock.advance_to(expected_ms(4))
    ex.poll()
    assert ex.next_completion_ms() is None  # only the hung job is left
    assert ex.in_flight() == 0


def test_close_drops_pending_work() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL)
    ex.submit([job(1), job(2, LOAD)])
    ex.close()
    clock.advance_to(1e6)
    assert ex.poll() == [] and ex.next_completion_ms() is None


def test_virtual_clock_never_goes_back() -> None:
    clock = VirtualClock(5.0)
    clock.advance_to(3.0)
    assert clock() == 5.0
    clock.advance_to(7.5)
    assert clock() == 7.5


# --- determinism ------------------------------------------------------------------------------


def _scripted_run(seed: int) -> list[tuple[float, JobResult]]:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, world_size=2, fail_rank=1, fault_rate=0.3, seed=seed, hang_jobs=[5])
    out: list[tuple[float, JobResult]] = []
    for b in range(6):
        ex.submit([job(b * 3 + k + 1, LOAD if k == 1 else STORE, 1 + (b + k) % 4) for k in range(3)])
        clock.advance_to(clock.now_ms + 0.25)
        out += [(clock.now_ms, r) for r in ex.poll()]
    return out + drain(ex, clock)


def test_deterministic_for_a_seed() -> None:
    a, b = _scripted_run(7), _scripted_run(7)
    assert a == b
    assert _scripted_run(8) != a  # the seed matters


@given(st.lists(st.integers(1, 60), max_size=80), st.lists(st.integers(0, 70), max_size=20))
def test_the_submitted_ids_are_remembered_exactly_in_ranges(added: list[int], probes: list[int]) -> None:
    from kvflow.executors.simulated import _IdSet

    ids, model = _IdSet(), set()
    for job_id in added:
        ids.add(job_id)
        model.add(job_id)
    assert all((p in ids) == (p in model) for p in [*probes, *added])
    runs = sum(1 for j in model if j - 1 not in model)
    assert ids.ranges() == runs  # merged: as many ranges as runs of consecutive ids


def test_a_million_submissions_in_order_take_one_range() -> None:
    from kvflow.executors.simulated import _IdSet

    ids = _IdSet()
    for job_id in range(1, 1_000_001):
        ids.add(job_id)
    assert ids.ranges() == 1 and 1 in ids and 1_000_000 in ids and 1_000_001 not in ids


DISK = TransferModel(bytes_per_block=MODEL.bytes_per_block, bandwidth_gbps=2.0, latency_us=80.0)


def disk_job(job_id: int, direction: str, n: int) -> TransferJob:
    return TransferJob(
        job_id=job_id, direction=direction, device_blocks=(), slots=tuple(range(n)),  # type: ignore[arg-type]
        hashes=tuple(range(100, 100 + n)), disk_slots=tuple(range(n)),
    )  # fmt: skip


def test_disk_jobs_take_the_disk_models_time_on_streams_of_their_own() -> None:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, MODEL, disk=DISK, disk_slots=8)
    ex.submit([job(1, STORE, 4), disk_job(2, DISK_STORE, 4), disk_job(3, DISK_STORE, 2), disk_job(4, DISK_LOAD, 1)])
    t = done_at(drain(ex, clock))
    assert t[1] == pytest.approx(expected_ms(4))  # the link's stream, not behind the disk
    assert t[2] == pytest.approx(DISK.duration_ms(4))
    assert t[3] == pytest.approx(DISK.duration_ms(4) + DISK.duration_ms(2))  # behind the other disk store
    assert t[4] == pytest.approx(DISK.duration_ms(1))  # the disk's read stream
    assert ex.stats.blocks == 4  # (device blocks copied over the link only)


def test_a_disk_job_without_a_disk_model_is_refused() -> None:
    ex = SimulatedExecutor(VirtualClock(), MODEL)
    with pytest.raises(Rejected):
        ex.submit([disk_job(1, DISK_LOAD, 1)])
    with pytest.raises(ConfigError):
        SimulatedExecutor(VirtualClock(), MODEL, disk_slots=4)
