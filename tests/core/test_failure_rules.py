"""The failure rules (docs/failure-rules.md) through ``OffloadManager``: the part of each rule
the decisions and the state own. F6, F9 and F10 belong mostly to the executor (its tests are
in tests/executors); F19's boundary checks are in test_values.py.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
from core_helpers import BT, DEADLINE_MS, consistent, manager, store, tokens

from kvflow.core.commands import JobResult
from kvflow.core.config import Config, config_from_dict
from kvflow.core.errors import (
    BlockHeld,
    ConfigError,
    IllegalTransition,
    Rejected,
    UnknownJob,
    UnknownRequest,
)
from kvflow.core.events import (
    TERMINAL_TYPES,
    BlocksEvicted,
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    LateResultIgnored,
    RankSucceeded,
    StoreQueued,
    StoreRejected,
)
from kvflow.core.jobs import TransferJob
from kvflow.core.state.apply import evolve
from kvflow.core.state.model import State
from kvflow.core.state.tables import BlockState
from kvflow.engine.manager import OffloadManager

A, B, C, D, E = 11, 12, 13, 14, 15


def load(m: OffloadManager, request_id: str, hashes: list[int], device_blocks: list[int]) -> int:
    """Lookup + accept + submit a load of ``hashes``; returns the job id (in flight)."""
    assert m.lookup(request_id, hashes, tokens(len(hashes))) == len(hashes)
    job_id = m.accept_hits(request_id, device_blocks)
    assert job_id is not None
    assert [j.job_id for j in m.plan_step(1.0)] == [job_id]
    return job_id


def terminal_counts(m: OffloadManager) -> Counter[int]:
    return Counter(e.job_id for e in m.log.events() if isinstance(e, TERMINAL_TYPES))


def used_slots(state: State) -> int:
    return len(state.entries)


def unchanged_after(m: OffloadManager, call: Any, error: type[Exception]) -> Exception:
    """``call`` raises ``error`` and appends nothing (F12: a refused command changes nothing)."""
    digest, records = m.state.digest(), list(m.log.records)
    with pytest.raises(error) as caught:
        call()
    assert m.state.digest() == digest
    assert m.log.records == records
    return caught.value


# --- F1 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["failed", "timed_out"])
def test_F1_failed_store_frees_slots_and_hides_hash(outcome: str) -> None:
    m = manager(cpu_blocks=4)
    free_before = len(m.state.free_slots)
    job_id = m.blocks_computed("r", [A, B], [5, 6])
    assert m.lookup("q", [A, B, C], tokens(3)) == 0, "a queued hash is not visible"
    m.plan_step(0.0)
    assert m.lookup("q", [A, B, C], tokens(3)) == 0, "an in-flight hash is not visible"
    assert sorted(m.held_device_blocks()) == [5, 6]
    m.take_notices()
    if outcome == "failed":
        m.job_result(job_id, ok=False, error="DMA error")
    else:
        assert m.tick(DEADLINE_MS) == 1
        # F15: the copy may still be writing: slots and device blocks stay fenced...
        fenced = m.take_notices()
        assert [job for job, _ in fenced.stores_failed] == [job_id]
        assert fenced.released_device_blocks == [] and sorted(m.held_device_blocks()) == [5, 6]
        assert len(m.state.free_slots) == free_before - 2
        assert m.lookup("q", [A, B, C], tokens(3)) == 0, "a timed-out store is never visible"
        # ...until the executor reports the copy over (its late result)
        m.job_result(job_id)
        lifted = m.take_notices()
        assert sorted(lifted.released_device_blocks) == [5, 6] and lifted.stores_failed == []
        lifted.stores_failed = fenced.stores_failed
        m.notice_book.notices = lifted
    notices = m.take_notices()
    assert len(m.state.free_slots) == free_before
    assert (
        m.state.block_state(A) is BlockState.ABSENT and m.state.block_state(B) is BlockState.ABSENT
    )
    assert m.lookup("q", [A, B, C], tokens(3)) == 0
    assert m.held_device_blocks() == []
    assert sorted(notices.released_device_blocks) == [5, 6]
    assert [job for job, _ in notices.stores_failed] == [job_id]
    assert notices.stores_finished == []
    # the hash was never visible: no lookup ever pinned it
    assert all(
        A not in getattr(e, "hashes", ())
        for e in m.log.events()
        if type(e).__name__ == "PinsAcquired"
    )
    consistent(m)


@pytest.mark.parametrize("outcome", ["failed", "timed_out"])
def test_F1_failed_load_keeps_entries_and_reports_recompute(outcome: str) -> None:
    m = manager(cpu_blocks=4)
    store(m, "w", [A, B], [1, 2])
    job_id = load(m, "r", [A, B], [20, 21])
    assert m.state.entries[A].pins == 1
    m.take_notices()
    if outcome == "failed":
        m.job_result(job_id, ok=False, error="H2D copy failed")
    else:
        assert m.tick(1.0 + DEADLINE_MS) == 1
        # F15: the request learns at once; the device blocks stay fenced (the copy may still
        # write them) until the executor reports the copy over
        fenced = m.take_notices()
        assert [f.fenced for f in fenced.loads_failed] == [True]
        assert fenced.released_device_blocks == [] and sorted(m.held_device_blocks()) == [20, 21]
        m.job_result(job_id)
        lifted = m.take_notices()
        assert sorted(lifted.released_device_blocks) == [20, 21] and lifted.loads_failed == []
        fenced.released_device_blocks = lifted.released_device_blocks
        m.notice_book.notices = fenced
    notices = m.take_notices()
    for h in (A, B):
        assert m.state.block_state(h) is BlockState.RESIDENT
        assert m.state.entries[h].pins == 0
    assert notices.loads_finished == []
    (failure,) = notices.loads_failed
    assert (failure.request_id, failure.job_id, failure.device_blocks) == ("r", job_id, (20, 21))
    if outcome == "failed":
        assert failure.error == "H2D copy failed"
    else:
        assert "timed out" in failure.error
    assert sorted(notices.released_device_blocks) == [20, 21]
    # still resident and unpinned: another request hits it, and it can be evicted
    assert m.lookup("q", [A, B], tokens(2)) == 2
    m.finish_request("q")
    assert m.evict(2) == 2
    consistent(m)


# --- F2 ------------------------------------------------------------------------------------


def test_F2_every_job_reaches_exactly_one_terminal_event() -> None:
    m = manager(cpu_blocks=8)
    ok = m.blocks_computed("r1", [A], [1])
    failed = m.blocks_computed("r2", [B], [2])
    timed_out = m.blocks_computed("r3", [C], [3])
    m.plan_step(0.0)
    m.job_result(ok)
    m.job_result(failed, ok=False, error="RuntimeError: copy engine died")
    assert m.tick(DEADLINE_MS) == 1  # times out the last one
    abandoned = m.blocks_computed("r4", [D], [4])
    abandoned_silent = m.blocks_computed("r5", [E], [5])
    m.plan_step(2.0)  # submits both
    cancelled = m.blocks_computed("r6", [16], [6])  # still queued when the reset comes
    m.reset()
    m.job_result(abandoned)  # an abandoned copy reports after the reset
    for job_id in (ok, failed, timed_out, cancelled):
        m.job_result(job_id)  # late results are recorded and ignored
    assert m.tick(10 * DEADLINE_MS) == 0  # an abandoned job's outcome is already known
    assert [f.job_id for f in m.fences()] == [abandoned_silent]  # F15: its copy never reported
    assert m.end_fences() == 1  # the executor closed: its copies stopped
    counts = terminal_counts(m)
    issued = range(1, m.state.last_job_id + 1)
    assert {j: counts[j] for j in issued} == {j: int(j != abandoned_silent) for j in issued}
    assert not m.has_live_jobs() and not m.state.jobs
    kinds = {e.job_id: type(e) for e in m.log.events() if isinstance(e, TERMINAL_TYPES)}
    assert kinds[ok] is JobCompleted and kinds[failed] is JobFailed
    assert kinds[timed_out] is JobTimedOut and kinds[cancelled] is JobFailed
    assert kinds[abandoned] is JobCompleted
    lifted = [(e.job_id, e.reason) for e in m.log.events() if isinstance(e, FenceLifted)]
    assert lifted == [(timed_out, "copy over"), (abandoned_silent, "executor closed")]
    late = [e.job_id for e in m.log.events() if isinstance(e, LateResultIgnored)]
    assert late == [ok, failed, timed_out, cancelled]
    consistent(m)


def test_F2_executor_exception_becomes_failed_event_with_its_text() -> None:
    m = manager()
    job_id = m.blocks_computed("r", [A], [1])
    m.plan_step(0.0)
    m.job_result(job_id, ok=False, error="RuntimeError: CUDA error: an illegal memory access")
    (failed,) = [e for e in m.log.events() if isinstance(e, JobFailed)]
    assert failed.error == "RuntimeError: CUDA error: an illegal memory access"
    assert failed.job_id == job_id and failed.direction == "store"


def test_F2_every_job_has_a_deadline_and_times_out_via_tick() -> None:
    m = manager()
    job_id = m.blocks_computed("r", [A], [1])
    m.plan_step(100.0)
    (submitted,) = [e for e in m.log.events() if isinstance(e, JobsSubmitted)]
    assert submitted.deadline_ms == 100.0 + DEADLINE_MS
    assert m.state.jobs[job_id].deadline_ms == 100.0 + DEADLINE_MS
    assert m.tick(100.0 + DEADLINE_MS - 0.5) == 0
    assert m.has_live_jobs()
    assert m.tick(100.0 + DEADLINE_MS) == 1
    assert not m.has_live_jobs()
    (timed_out,) = [e for e in m.log.events() if isinstance(e, JobTimedOut)]
    assert timed_out.job_id == job_id and timed_out.deadline_ms == 100.0 + DEADLINE_MS
    consistent(m)


@pytest.mark.parametrize("late_ok", [True, False])
def test_F2_late_result_after_timeout_is_recorded_and_changes_nothing_but_seq(
    late_ok: bool,
) -> None:
    m = manager()
    job_id = m.blocks_computed("r", [A], [1])
    m.plan_step(0.0)
    m.tick(DEADLINE_MS)
    fenced = m.state.copy()
    m.job_result(job_id, ok=late_ok, error=None if late_ok else "late failure")
    late, lifted = m.log.events()[-2:]
    assert isinstance(late, LateResultIgnored)
    assert (late.job_id, late.ok) == (job_id, late_ok)
    # F15: the late result says the copy is over: the fence is lifted, nothing else changes
    assert isinstance(lifted, FenceLifted) and (lifted.job_id, lifted.reason) == (job_id, "copy over")
    assert m.state.block_state(A) is BlockState.ABSENT
    assert job_id not in m.state.jobs and m.held_device_blocks() == [] and not m.state.fenced_slots
    assert sorted(m.state.free_slots) == sorted([*fenced.free_slots, *fenced.fenced_slots])
    assert m.state.policy.snapshot() == fenced.policy.snapshot()
    consistent(m)


def test_F2_repeated_rank_result_for_a_live_job_is_recorded_and_ignored() -> None:
    """An executor retry reports rank 0 twice before rank 1 reports: recorded, changes nothing
    but seq, never an exception out of the engine."""
    m = manager(world_size=2)
    job_id = m.blocks_computed("r", [A], [1])
    m.plan_step(0.0)
    m.job_result(job_id, rank=0)
    before = m.state.canonical()
    m.job_result(job_id, rank=0, ok=False, error="retry noise")
    after = m.state.canonical()
    assert after[0] == before[0] + 1 and after[1:] == before[1:]
    last = m.log.events()[-1]
    assert isinstance(last, LateResultIgnored) and (last.job_id, last.rank) == (job_id, 0)
    m.job_result(job_id, rank=1)
    assert isinstance(m.log.events()[-1], JobCompleted)
    consistent(m)


def test_F2_a_batch_of_results_with_a_repeat_applies_cleanly() -> None:
    m = manager(cpu_blocks=8, world_size=2)
    first = m.blocks_computed("a", [A], [1])
    second = m.blocks_computed("b", [B], [2])
    m.plan_step(0.0)
    m.job_results(
        [
            JobResult(job_id=first, rank=0),
            JobResult(job_id=first, rank=0),  # repeated
            JobResult(job_id=second, rank=1, ok=False, error="x"),
            JobResult(job_id=first, rank=1),
            JobResult(job_id=second, rank=0),  # after its failure: late
        ]
    )
    kinds = [type(e).__name__ for e in m.log.events()[-6:]]
    assert kinds == [
        "RankSucceeded",
        "LateResultIgnored",
        "JobFailed",  # rank 0 had not reported: fenced (F15)
        "JobCompleted",
        "LateResultIgnored",  # rank 0's copy is over...
        "FenceLifted",  # ...so the failed job's memory comes back
    ]
    assert terminal_counts(m) == Counter({first: 1, second: 1})
    consistent(m)


# --- F3 ------------------------------------------------------------------------------------


def test_F3_in_flight_store_is_deduplicated_across_steps_and_visible_only_when_complete() -> None:
    m = manager(cpu_blocks=8)
    first = m.blocks_computed("r1", [A, B], [1, 2])
    m.plan_step(0.0)
    # step 2: a second request hits the same blocks (same hashes, same device blocks)
    assert m.lookup("r2", [A, B, C], tokens(3)) == 0
    records = len(m.log.events())
    assert m.blocks_computed("r2", [A, B, C], [1, 2, 3]) is not None  # only C is new
    new_stores = [e for e in m.log.events()[records:] if isinstance(e, StoreQueued)]
    assert [(e.hashes, e.device_blocks) for e in new_stores] == [((C,), (3,))]
    # and once more with only the shared blocks: nothing is stored (a new request is known
    # from its first call, F18, which records its chain; a known one whose chain has the
    # blocks records nothing at all)
    records = len(m.log.events())
    assert m.blocks_computed("r3", [A, B], [1, 2]) is None
    assert [type(e).__name__ for e in m.log.events()[records:]] == ["ChainExtended"]
    assert m.blocks_computed("r2", [A, B], [1, 2]) is None
    assert len(m.log.events()) == records + 1
    assert m.state.held[1] == first and m.state.held[2] == first
    m.job_result(first)
    assert m.lookup("r4", [A, B, C], tokens(3)) == 2  # A, B now visible; C still in flight
    consistent(m)


def test_F3_a_held_device_block_named_with_another_hash_is_refused() -> None:
    m = manager()
    m.blocks_computed("r1", [A], [1])
    unchanged_after(m, lambda: m.blocks_computed("r2", [B], [1]), BlockHeld)


# --- F4 ------------------------------------------------------------------------------------


def test_F4_load_completing_in_a_later_step_is_reported_to_its_request() -> None:
    m = manager(cpu_blocks=8)
    store(m, "w", [A, B], [1, 2])
    job_id = load(m, "r", [A, B], [20, 21])
    m.take_notices()
    # several engine steps pass; the mapping lives in state, not in step metadata
    for step in range(5):
        m.blocks_computed(f"other{step}", [100 + step], [50 + step])
        m.plan_step(2.0 + step)
        assert not m.take_notices().loads_finished
        assert m.state.jobs[job_id].request_id == "r"
    m.job_result(job_id)
    assert m.take_notices().loads_finished == [("r", job_id)]
    consistent(m)


def test_F4_notices_are_kept_until_taken() -> None:
    m = manager(cpu_blocks=8)
    store(m, "w", [A, B], [1, 2])
    first = load(m, "r1", [A], [20])
    m.job_result(first)
    second = load(m, "r2", [A, B], [30, 31])
    m.plan_step(5.0)
    m.job_result(second, ok=False, error="x")
    notices = m.take_notices()
    assert ("r1", first) in notices.loads_finished
    assert [f.job_id for f in notices.loads_failed] == [second]
    assert not m.take_notices()


# --- F5 ------------------------------------------------------------------------------------


def test_F5_polling_twice_does_not_resubmit() -> None:
    m = manager(cpu_blocks=8)
    job_id = m.blocks_computed("r", [A, B], [1, 2])
    first = m.plan_step(0.0)
    assert [j.job_id for j in first] == [job_id]
    assert m.plan_step(1.0) == []
    assert m.plan_step(2.0) == []
    submitted = [e for e in m.log.events() if isinstance(e, JobsSubmitted)]
    assert [e.job_ids for e in submitted] == [(job_id,)]
    again = JobsSubmitted(seq=m.state.next_seq, job_ids=(job_id,), now_ms=3.0, deadline_ms=4.0)
    digest = m.state.digest()
    with pytest.raises(IllegalTransition):
        evolve(m.state, again)
    assert m.state.digest() == digest


def test_F5_a_job_is_handed_out_once_with_everything_its_copy_needs() -> None:
    """Each job reaches the executor once, naming the device blocks, slots and hashes its copy
    needs (a load reads exactly the slots the store wrote)."""
    m = manager(cpu_blocks=8)
    handed: list[TransferJob] = []
    store_id = m.blocks_computed("w", [A, B, C], [1, 2, 3])
    handed += m.plan_step(0.0)
    handed += m.plan_step(0.5)
    m.job_result(store_id)
    assert m.lookup("r", [A, B, 99], tokens(3)) == 2
    load_id = m.accept_hits("r", [30, 31])
    handed += m.plan_step(1.0)
    handed += m.plan_step(2.0)
    assert [j.job_id for j in handed] == [store_id, load_id]
    store_job, load_job = handed
    assert store_job == TransferJob(
        job_id=store_id,
        direction="store",
        device_blocks=(1, 2, 3),
        slots=store_job.slots,
        hashes=(A, B, C),
        request_id="w",
    )
    assert len(set(store_job.slots)) == 3 and all(0 <= s < 8 for s in store_job.slots)
    assert load_job.direction == "load" and load_job.device_blocks == (30, 31)
    assert load_job.hashes == (A, B) and load_job.request_id == "r"
    assert load_job.slots == tuple(m.state.entries[h].slot for h in (A, B))
    assert load_job.slots == store_job.slots[:2]  # reads exactly where the store wrote
    assert sorted(m.held_device_blocks()) == [30, 31]


# --- F6 ------------------------------------------------------------------------------------


def test_F6_results_can_arrive_in_any_order_from_any_rank() -> None:
    """The thread-safe channel is the executor's (tests/executors/test_result_channel.py); the
    core must accept results in whatever order it delivers them: every interleaving of 2 jobs
    x 2 ranks."""
    outcomes = set()
    for order in itertools.permutations([(j, r) for j in (1, 2) for r in (0, 1)]):
        m = manager(cpu_blocks=8, world_size=2)
        assert m.blocks_computed("a", [A, B], [1, 2]) == 1
        assert m.blocks_computed("b", [C], [3]) == 2
        m.plan_step(0.0)
        for job_id, rank in order:
            m.job_result(job_id, rank=rank)
        counts = terminal_counts(m)
        assert counts == Counter({1: 1, 2: 1})
        rank_events = [e for e in m.log.events() if isinstance(e, (RankSucceeded, JobCompleted))]
        assert len(rank_events) == 4
        assert not m.has_live_jobs()
        consistent(m)
        outcomes.add(
            tuple(sorted(h for h, e in m.state.entries.items() if e.state is BlockState.RESIDENT))
        )
    assert outcomes == {(A, B, C)}


# --- F7 ------------------------------------------------------------------------------------


def test_F7_a_hit_pinned_at_lookup_survives_cache_pressure() -> None:
    m = manager(cpu_blocks=2)
    store(m, "w", [A, B], [1, 2])
    assert m.lookup("r", [A, 99], tokens(2)) == 1  # A pinned (and the least recent)
    unchanged_after(m, lambda: m.evict(2), Rejected)
    # a store that needs both slots may only evict B
    m.blocks_computed("x", [C, D], [3, 4])
    evicted = [h for e in m.log.events() if isinstance(e, BlocksEvicted) for h in e.hashes]
    assert evicted == [B]
    rejected = [e for e in m.log.events() if isinstance(e, StoreRejected)]
    assert [e.hashes for e in rejected] == [(D,)]
    assert m.state.block_state(A) is BlockState.RESIDENT
    # ... until the engine allocates and loads it
    job_id = m.accept_hits("r", [20])
    m.plan_step(1.0)
    m.job_result(job_id)
    assert m.state.entries[A].pins == 0
    consistent(m)


# --- F8 ------------------------------------------------------------------------------------


def test_F8_eviction_is_all_or_nothing() -> None:
    m = manager(cpu_blocks=4)
    store(m, "w", [A, B, C, D], [1, 2, 3, 4])
    assert m.lookup("r", [A, B, 99], tokens(3)) == 2  # A, B pinned: two evictable left
    unchanged_after(m, lambda: m.evict(3), Rejected)
    assert m.evict(2) == 2
    assert {A, B} <= set(m.state.entries) and C not in m.state.entries and D not in m.state.entries
    consistent(m)


def test_F8_every_slot_a_store_evicts_goes_to_that_store() -> None:
    m = manager(cpu_blocks=3)
    store(m, "w", [A, B, C], [1, 2, 3])
    m.lookup("r", [A, 99], tokens(2))  # A pinned: only B, C evictable
    start = len(m.log.events())
    m.blocks_computed("x", [20, 21, 22, 23], [5, 6, 7, 8])
    events = m.log.events()[start:]
    (evicted,) = [e for e in events if isinstance(e, BlocksEvicted)]
    (queued,) = [e for e in events if isinstance(e, StoreQueued)]
    (rejected,) = [e for e in events if isinstance(e, StoreRejected)]
    assert sorted(evicted.slots) == sorted(queued.slots)  # no victim wasted
    assert queued.hashes == (20, 21) and rejected.hashes == (22, 23)
    consistent(m)


# --- F10 -----------------------------------------------------------------------------------


def test_F10_capacity_is_fixed_at_config_and_slots_always_add_up() -> None:
    cfg = Config(cpu_blocks=5, block_tokens=BT, job_deadline_ms=DEADLINE_MS)
    with pytest.raises(AttributeError):
        cfg.cpu_blocks = 7  # type: ignore[misc]
    m = OffloadManager(cfg)

    def check() -> None:
        s = m.state
        assert s.capacity == 5 and m.config.cpu_blocks == 5
        owned = {e.slot for e in s.entries.values()}
        fenced_only = [q for q in s.fenced_slots if q not in owned]  # (a fenced load's slot may be both)
        assert len(s.free_slots) + used_slots(s) + len(fenced_only) == 5
        slots = [*s.free_slots, *owned, *fenced_only]
        assert sorted(slots) == list(range(5))

    check()
    store(m, "w", [A, B, C], [1, 2, 3])
    check()
    load(m, "r", [A, B], [20, 21])
    check()
    m.blocks_computed("x", [D, E, 16, 17], [4, 5, 6, 7])
    check()
    m.plan_step(3.0)
    check()
    m.reset()
    check()  # in-flight slots fenced
    assert m.state.fenced_slots
    m.blocks_computed("y", [30, 31, 32], [40, 41, 42])
    check()
    m.tick(100 * DEADLINE_MS)
    check()
    m.plan_step(200 * DEADLINE_MS)
    check()
    m.job_result(m.state.last_job_id)
    check()
    assert m.state.fenced_slots  # the abandoned copies never reported: still fenced (F15)
    m.end_fences()
    check()
    assert not m.state.fenced_slots


# --- F11 -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("cpu_blocks", dict(cpu_blocks=-1)),
        ("cpu_blocks", dict(cpu_blocks=2.5)),
        ("cpu_blocks", dict(cpu_blocks=True)),
        ("cpu_blocks", dict(cpu_blocks="8")),
        ("block_tokens", dict(cpu_blocks=8, block_tokens=0)),
        ("store_mode", dict(cpu_blocks=8, store_mode="sometimes")),
        ("world_size", dict(cpu_blocks=8, world_size=0)),
        ("world_size", dict(cpu_blocks=8, world_size=False)),
        ("job_deadline_ms", dict(cpu_blocks=8, job_deadline_ms=0)),
        ("job_deadline_ms", dict(cpu_blocks=8, job_deadline_ms=float("inf"))),
    ],
)
def test_F11_bad_configuration_fails_fast_with_a_one_line_message(
    field: str, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError) as caught:
        Config(**kwargs)
    message = str(caught.value)
    assert "\n" not in message and field in message
    with pytest.raises(ConfigError) as caught:
        config_from_dict(kwargs)
    assert "\n" not in str(caught.value) and field in str(caught.value)


def test_F11_a_policy_of_the_wrong_type_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Config(cpu_blocks=8, policy=["lru"])  # type: ignore[arg-type]


def test_F11_unknown_policy_message_lists_known_policies() -> None:
    with pytest.raises(ConfigError) as caught:
        Config(cpu_blocks=8, policy="fifo")
    message = str(caught.value)
    assert "\n" not in message and "'fifo'" in message and "lru" in message and "arc" in message


def test_F11_zero_cpu_blocks_means_offload_disabled() -> None:
    m = manager(cpu_blocks=0)
    assert not m.config.enabled
    assert m.lookup("r", [A, B, C], tokens(3)) == 0
    assert m.blocks_computed("r", [A, B], [1, 2]) is None
    assert m.plan_step(0.0) == []
    m.touch([A])
    m.finish_request("r")
    assert m.log.events() == []
    assert not m.take_notices()
    assert m.state.capacity == 0 and list(m.state.free_slots) == []


def test_F11_disabled_offload_accepts_the_engine_s_usual_calls() -> None:
    m = manager(cpu_blocks=0)
    assert m.lookup("r", [A, B], tokens(2)) == 0
    assert m.accept_hits("r", []) is None  # the engine allocated nothing: a no-op
    assert m.log.events() == []
    # accepting hits that were never offered is still refused
    unchanged_after(m, lambda: m.accept_hits("r", [5]), Rejected)


# --- F12 -----------------------------------------------------------------------------------


def test_F12_storing_a_block_held_by_a_live_load_is_refused() -> None:
    m = manager(cpu_blocks=8)
    store(m, "w", [A], [1])
    load(m, "r", [A], [20])
    error = unchanged_after(m, lambda: m.blocks_computed("x", [B], [20]), BlockHeld)
    assert "20" in str(error) and "load" in str(error)
    # even with the same hash: a load's device block is not a store's duplicate
    unchanged_after(m, lambda: m.blocks_computed("x", [A], [20]), BlockHeld)
    # and a load cannot be queued into a held device block either
    assert m.lookup("q", [A, 99], tokens(2)) == 1
    unchanged_after(m, lambda: m.accept_hits("q", [20]), BlockHeld)


def test_F12_result_for_unknown_job_id_is_refused() -> None:
    m = manager()
    error = unchanged_after(m, lambda: m.job_result(1), UnknownJob)
    assert "1" in str(error)
    m.blocks_computed("r", [A], [1])
    unchanged_after(m, lambda: m.job_result(2), UnknownJob)
    unchanged_after(m, lambda: m.job_result(-3), UnknownJob)
    unchanged_after(m, lambda: m.job_result(1), Rejected)  # queued, never submitted
    m.plan_step(0.0)
    unchanged_after(m, lambda: m.job_result(1, rank=1), Rejected)  # rank outside world size


def test_F12_unknown_request_is_refused() -> None:
    m = manager()
    unchanged_after(m, lambda: m.accept_hits("ghost", [1]), UnknownRequest)


@pytest.mark.parametrize("bad_hash", [2**256, -(2**255) - 1, 2**300])
def test_F12_a_block_hash_wider_than_256_bits_is_refused_up_front(bad_hash: int) -> None:
    m = manager()
    unchanged_after(m, lambda: m.blocks_computed("r", [A, bad_hash], [1, 2]), Rejected)
    unchanged_after(m, lambda: m.lookup("r", [bad_hash], tokens(1)), Rejected)
    unchanged_after(m, lambda: m.touch([bad_hash]), Rejected)
    unchanged_after(m, lambda: m.device_blocks_evicting([bad_hash], [3]), Rejected)
    # the edges of 64 and 256 bits (signed and unsigned) are fine, and digest
    store(m, "r", [2**64 - 1, -(2**63), 2**256 - 1, -(2**255)], [1, 2, 3, 4])
    assert m.lookup("q", [2**64 - 1, -(2**63), 2**256 - 1, -(2**255), 5], tokens(5)) == 4
    assert len(m.state.digest()) == 32
    consistent(m)


# --- F13 -----------------------------------------------------------------------------------


def test_F13_prompt_exactly_two_blocks_long_hits_only_one_block() -> None:
    m = manager()
    store(m, "w", [A, B], [1, 2])
    assert m.lookup("r", [A, B], 2 * BT) == 1
    assert m.lookup("r", [A, B], 2 * BT + 1) == 2  # a repeated lookup replaces the pins
    assert m.lookup("r", [A, B], 2 * BT - 1) == 1
    assert m.lookup("r", [A, B], BT) == 0
    assert m.lookup("r", [A, B], 0) == 0
    assert m.state.entries[A].pins == 0 and m.state.entries[B].pins == 0
    consistent(m)


# --- F14 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "reorder-only"])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_F14_touching_a_chain_deepest_first_evicts_tails_before_heads(
    policy: str, reuse: bool
) -> None:
    m = manager(cpu_blocks=6, policy=policy)
    head, mid, tail = 1, 2, 3
    store(m, "w", [head, mid, tail], [1, 2, 3])
    m.touch([tail, mid, head], reuse=reuse)  # deepest first: the head ends most recent
    evicted = []
    for _ in range(3):
        m.evict(1)
        evicted += [h for h in (head, mid, tail) if h not in m.state.entries and h not in evicted]
    assert evicted == [tail, mid, head]
    consistent(m)


# --- F15 -----------------------------------------------------------------------------------


def fence_a_job(m: OffloadManager, direction: str, cause: str) -> int:
    """A store or a load of A, B (device blocks 10, 11) in flight on two ranks, fenced by
    ``cause``; returns its id."""
    if direction == "store":
        job_id = m.blocks_computed("r", [A, B], [10, 11])
        assert job_id is not None
        m.plan_step(0.0)
    else:
        store(m, "w", [A, B], [1, 2])
        m.finish_request("w")
        job_id = load(m, "r", [A, B], [10, 11])
    m.take_notices()
    if cause == "timed_out":
        assert m.tick(1.0 + DEADLINE_MS) == 1
    elif cause == "failed_on_one_rank":
        m.job_result(job_id, rank=0, ok=False, error="rank 0 lost its stream")
    else:
        m.reset()
    return job_id


@pytest.mark.parametrize("cause", ["timed_out", "failed_on_one_rank", "reset"])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_F15_fenced_memory_is_reused_only_after_the_copy_is_over(direction: str, cause: str) -> None:
    """The engine learns the outcome at once, but the job's slots and device blocks are not
    handed out again until every rank has reported its copy over."""
    m = manager(cpu_blocks=4, world_size=2)
    job_id = fence_a_job(m, direction, cause)
    job = m.state.jobs[job_id]
    slots, device_blocks = set(job.slots), [10, 11]

    # the outcome is known now
    told = m.take_notices()
    if direction == "load":
        assert [(f.job_id, f.fenced) for f in told.loads_failed] == [(job_id, True)]
    elif cause == "reset":
        assert told.all_blocks_cleared and told.stores_failed == []
    else:
        assert [jid for jid, _ in told.stores_failed] == [job_id]
    assert told.released_device_blocks == [] and not m.has_live_jobs()
    (fence,) = m.fences()
    assert (fence.job_id, fence.abandoned) == (job_id, cause == "reset")
    assert fence.ranks_pending == ((1,) if cause == "failed_on_one_rank" else (0, 1))

    # ...but its memory is fenced: no slot of it is free or given to a new store, and its
    # device blocks cannot be named by another job
    def fenced() -> None:
        assert slots <= set(m.state.fenced_slots) and not slots & set(m.state.free_slots)
        assert all(m.state.held.get(d) == job_id for d in device_blocks)
        assert not set(device_blocks) & set(m.take_notices().released_device_blocks)

    fenced()
    new_store = m.blocks_computed("x", [30, 31, 32, 33], [40, 41, 42, 43])
    assert new_store is not None and not slots & set(m.state.jobs[new_store].slots)
    assert m.take_notices().rejected_store_blocks == 2  # only the two unfenced slots were usable
    unchanged_after(m, lambda: m.blocks_computed("y", [50], [10]), BlockHeld)
    fenced()

    # every rank's report but the last leaves the fence in place; the last lifts it
    pending = list(fence.ranks_pending)
    for rank in pending[:-1]:
        m.job_result(job_id, rank=rank)
        fenced()
    m.job_result(job_id, rank=pending[-1])
    assert m.fences() == [] and job_id not in m.state.jobs and not m.state.fenced_slots
    assert sorted(m.take_notices().released_device_blocks) == device_blocks
    assert not set(device_blocks) & set(m.held_device_blocks())
    owned = set(m.state.slot_of.values())
    assert all(s in m.state.free_slots or s in owned for s in slots)
    consistent(m)


def test_F15_a_fence_the_executor_never_answers_ends_only_when_it_is_closed() -> None:
    m = manager(cpu_blocks=4)
    job_id = m.blocks_computed("r", [A, B], [10, 11])
    m.plan_step(0.0)
    assert m.tick(DEADLINE_MS) == 1
    for later in (10, 100, 1000):  # time alone never lifts a fence
        assert m.tick(later * DEADLINE_MS) == 0
        assert [f.job_id for f in m.fences()] == [job_id]
        assert sorted(m.held_device_blocks()) == [10, 11]
    assert m.end_fences() == 1  # the executor was closed: its copies stopped
    (lifted,) = [e for e in m.log.events() if isinstance(e, FenceLifted)]
    assert (lifted.job_id, lifted.reason) == (job_id, "executor closed")
    assert m.held_device_blocks() == [] and not m.state.fenced_slots
    assert m.end_fences() == 0
    consistent(m)


# --- F16 -----------------------------------------------------------------------------------


def test_F16_a_store_never_evicts_its_own_chain() -> None:
    from kvflow.core.events import BlocksEvicted

    m = manager(cpu_blocks=3)
    store(m, "a", [100, 101], [1, 2])  # 100 is the least recent
    store(m, "b", [900], [3])
    job = m.blocks_computed("c", [100, 101, 102], [4, 5, 6])
    (evicted,) = [e for e in m.log.events() if isinstance(e, BlocksEvicted)]
    assert evicted.hashes == (900,)  # not 100, the head of the chain being extended
    assert [j.hashes for j in m.plan_step(1.0) if j.job_id == job] == [(102,)]
    consistent(m)


def test_F16_when_only_the_own_chain_could_go_the_rest_of_the_store_is_rejected() -> None:
    from kvflow.core.events import BlocksEvicted, StoreRejected

    m = manager(cpu_blocks=2)
    store(m, "a", [100, 101], [1, 2])
    m.take_notices()
    assert m.blocks_computed("c", [100, 101, 102, 103], [3, 4, 5, 6]) is None
    assert not [e for e in m.log.events() if isinstance(e, BlocksEvicted)]
    (rejected,) = [e for e in m.log.events() if isinstance(e, StoreRejected)]
    assert rejected.hashes == (102, 103) and rejected.device_blocks == (5, 6)
    assert m.state.is_resident(100) and m.state.is_resident(101)
    assert m.take_notices().rejected_store_blocks == 2
    consistent(m)


# --- F17 -----------------------------------------------------------------------------------


def test_F17_an_integrity_failure_evicts_the_entries_it_names() -> None:
    from kvflow.core.commands import JobResult
    from kvflow.core.events import BlocksEvicted, JobFailed
    from kvflow.integrations.vllm.kv_events import BlockRemoved, KVEventPublisher

    m = manager(cpu_blocks=8)
    kv = KVEventPublisher(BT)
    m.subscribe(kv)
    store(m, "w", [A, B, C], [1, 2, 3])
    m.finish_request("w")
    job = load(m, "r", [A, B, C], [4, 5, 6])
    kv.take()
    m.job_results([JobResult(job_id=job, ok=False, error="checksum mismatch", corrupt=(B, 99))])
    failed, evicted = m.log.events()[-2:]
    assert type(failed) is JobFailed and failed.job_id == job
    assert type(evicted) is BlocksEvicted and evicted.reason == "corrupt"
    assert evicted.hashes == (B,)  # only the load's own blocks; 99 was never part of it
    assert [type(e) for e in kv.take()] == [BlockRemoved]
    m.finish_request("r")
    # bad bytes are never offered twice: the prefix now stops before B ...
    assert m.lookup("s", [A, B, C], tokens(3)) == 1
    m.accept_hits("s", [])
    # ... and the engine's recompute stores B again instead of deduplicating against it
    job2 = m.blocks_computed("s", [A, B, C], [7, 8, 9])
    assert [j.hashes for j in m.plan_step(2.0) if j.job_id == job2] == [(B,)]
    consistent(m)


def test_F17_an_entry_another_request_still_pins_is_not_evicted() -> None:
    from kvflow.core.commands import JobResult
    from kvflow.core.events import BlocksEvicted

    m = manager(cpu_blocks=8)
    store(m, "w", [A, B], [1, 2])
    m.finish_request("w")
    job = load(m, "r", [A, B], [3, 4])
    assert m.lookup("other", [A, B], tokens(2)) == 2  # offered to another request: pinned
    m.job_results([JobResult(job_id=job, ok=False, error="checksum mismatch", corrupt=(A, B))])
    assert not [e for e in m.log.events() if isinstance(e, BlocksEvicted)]
    assert m.state.is_resident(A) and m.state.is_resident(B)
    consistent(m)


def test_F17_invalidate_evicts_resident_unpinned_blocks_and_nothing_else() -> None:
    from kvflow.core.events import BlocksEvicted

    m = manager(cpu_blocks=8)
    store(m, "w", [A, B, C], [1, 2, 3])
    m.finish_request("w")
    assert m.lookup("r", [A], tokens(1)) == 1  # A is pinned by an offer
    pending = m.blocks_computed("x", [D], [4])  # D is being stored
    assert m.invalidate([A, B, D, E]) == 1
    (evicted,) = [e for e in m.log.events() if isinstance(e, BlocksEvicted)]
    assert evicted.hashes == (B,) and evicted.reason == "invalidated"
    assert m.state.is_resident(A) and m.state.is_resident(C) and pending
    assert m.invalidate([]) == 0 and m.invalidate([B]) == 0
    unchanged_after(m, lambda: m.invalidate([2**256]), Rejected)
    consistent(m)


def test_F17_a_trace_with_integrity_failures_replays_and_redecides(tmp_path: Any) -> None:
    from kvflow.core.commands import JobResult
    from kvflow.log.writer import TraceWriter
    from kvflow.replay.fold import replay

    path = tmp_path / "corrupt.jsonl"
    cfg = Config(cpu_blocks=8, block_tokens=BT, job_deadline_ms=DEADLINE_MS)
    m = OffloadManager(cfg, log=TraceWriter(path, cfg, checkpoint_every=3))
    store(m, "w", [A, B, C], [1, 2, 3])
    m.finish_request("w")
    job = load(m, "r", [A, B, C], [4, 5, 6])
    m.job_results([JobResult(job_id=job, ok=False, error="checksum mismatch", corrupt=(C,))])
    m.finish_request("r")
    m.invalidate([A])
    m.close()
    for redecide in (False, True):
        result = replay(path, redecide=redecide)
        assert result.ok, result.divergence
        assert result.state.digest() == m.state.digest()


def test_F17_a_corrupt_report_after_the_timeout_still_evicts_the_bad_block() -> None:
    """(Found by the swarm, seed 16.) The load timed out (fenced); its late result names a
    corrupt block: that block leaves the tier all the same, the others stay."""
    m = manager(cpu_blocks=4)
    store(m, "w", [A, B], [1, 2])
    m.finish_request("w")
    assert m.lookup("r", [A, B, C], tokens(3)) == 2
    job = m.accept_hits("r", [10, 11])
    m.plan_step(1.0)
    assert m.tick(1.0 + DEADLINE_MS) == 1
    m.job_results([JobResult(job_id=job, ok=False, error="checksum mismatch", corrupt=(B,))])
    assert m.state.is_resident(A) and not m.state.is_resident(B)
    evicted = [e for e in m.log.events() if isinstance(e, BlocksEvicted)]
    assert [(e.hashes, e.reason) for e in evicted] == [((B,), "corrupt")]
    consistent(m)


@pytest.mark.parametrize("how", ["times_out", "fails_otherwise", "hits_released"])
def test_F17_a_block_reported_corrupt_while_pinned_leaves_with_its_last_pin(how: str) -> None:
    """(Found by the swarm, seed 16.) b's load finds block A corrupt while c still pins it:
    A is remembered, and when c's pin goes, whatever way, A leaves the tier (reason corrupt)."""
    m = manager(cpu_blocks=4)
    store(m, "w", [A, B], [1, 2])
    m.finish_request("w")
    assert m.lookup("b", [A, C], tokens(2)) == 1
    bad_load = m.accept_hits("b", [10])
    assert m.lookup("c", [A, C], tokens(2)) == 1
    other = m.accept_hits("c", [20]) if how != "hits_released" else None
    m.plan_step(1.0)
    m.job_results([JobResult(job_id=bad_load, ok=False, error="checksum mismatch", corrupt=(A,))])
    assert m.state.is_resident(A) and A in m.state.bad  # still pinned by c: kept for now
    if how == "times_out":
        m.tick(1.0 + DEADLINE_MS)
    elif how == "fails_otherwise":
        m.job_result(other, ok=False, error="CUDA error")
    else:
        m.accept_hits("c", [])
    assert not m.state.is_resident(A) and not m.state.bad
    assert m.lookup("d", [A, C], tokens(2)) == 0  # never offered again
    consistent(m)


def test_F17_a_corrupt_report_in_a_batch_the_engine_must_split_still_evicts_the_bad_block() -> None:
    """(Found by the swarm, seed 155.) A batch holding a result for a job nobody issued is
    refused, and the engine applies its results one by one: the integrity report (``corrupt``)
    must survive that split, or the bad host copy stays on offer."""
    from kvflow.engine.sync import SyncEngine
    from kvflow.executors.simulated import SimulatedExecutor, VirtualClock

    clock = VirtualClock()
    cfg = Config(cpu_blocks=4, block_tokens=BT, job_deadline_ms=DEADLINE_MS)
    engine = SyncEngine(cfg, SimulatedExecutor(clock), clock=clock, keep_log=True)
    engine.blocks_computed("w", [A, B], [1, 2])
    engine.step()
    clock.advance_to(100.0)
    engine.step()
    engine.finish_request("w")
    assert engine.lookup("r", [A, B, C], tokens(3)) == 2
    job = engine.accept_hits("r", [10, 11])
    engine.step(results=[])  # submitted; its outcome is the one handed in below
    bad = JobResult(job_id=job, ok=False, error="checksum mismatch", corrupt=(B,))
    unknown = JobResult(job_id=job + 1000, ok=True)
    report = engine.step(results=[bad, unknown])
    assert engine.counters.unknown_results == 1  # the batch was split, the stray one refused
    assert [f.job_id for f in report.loads_failed] == [job]
    state = engine.manager.state
    assert state.is_resident(A) and not state.is_resident(B)
    evicted = [e for e in engine.manager.log.events() if isinstance(e, BlocksEvicted)]
    assert [(e.hashes, e.reason) for e in evicted] == [((B,), "corrupt")]
    consistent(engine.manager)


def test_F17_a_single_result_carries_its_integrity_report() -> None:
    m = manager(cpu_blocks=4)
    store(m, "w", [A, B], [1, 2])
    m.finish_request("w")
    job = load(m, "r", [A, B], [3, 4])
    m.job_result(job, ok=False, error="checksum mismatch", corrupt=[A])
    assert not m.state.is_resident(A) and m.state.is_resident(B)
    consistent(m)


# --- F18 -----------------------------------------------------------------------------------


def test_F18_finishing_a_request_kvflow_never_saw_is_a_no_op() -> None:
    m = manager()
    digest = m.state.digest()
    assert m.finish_request("ghost") is False
    assert m.state.digest() == digest and not m.log.events()
    m.lookup("r", [A], tokens(1))
    assert m.finish_request("r") is True  # closed and forgotten
    events = len(m.log.events())
    assert m.finish_request("r") is False  # routine for an engine: nothing happens
    assert len(m.log.events()) == events
    consistent(m)


def test_F18_requests_survive_a_reset_and_hear_of_their_abandoned_loads() -> None:
    from kvflow.engine.sync import SyncEngine
    from kvflow.executors.simulated import SimulatedExecutor, VirtualClock

    clock = VirtualClock()
    engine = SyncEngine(Config(cpu_blocks=2, block_tokens=BT, job_deadline_ms=DEADLINE_MS), SimulatedExecutor(clock), clock=clock, keep_log=True)
    engine.blocks_computed("w", [A, B], [1, 2])
    engine.step()
    clock.advance_to(100.0)
    engine.step()
    engine.finish_request("w")
    assert engine.lookup("r", [A, B], tokens(2)) == 2
    load_id = engine.accept_hits("r", [10, 11])
    engine.step()  # the load is in flight
    engine.reset()
    report = engine.step()
    assert report.all_blocks_cleared
    assert [(f.request_id, f.job_id, f.device_blocks) for f in report.loads_failed] == [("r", load_id, (10, 11))]
    assert 10 in engine.held_device_blocks()  # fenced until the abandoned copy reports
    assert engine.finish_request("r") is True  # still known (today: UnknownRequest)
    # a store the full tier cannot take is reported in the step, not dropped
    assert engine.lookup("x", [C, D, E], tokens(3)) == 0
    engine.blocks_computed("x", [C, D, E], [20, 21, 22])
    assert engine.step().rejected_store_blocks == 3  # both slots still read by the abandoned load
    consistent(engine.manager)


def test_F18_a_reset_recorded_before_keeps_requests_forgets_every_request() -> None:
    from kvflow.core.events import PinsAcquired, Reset

    state = State(Config(cpu_blocks=4, block_tokens=BT))
    evolve(state, PinsAcquired(seq=1, request_id="r", hashes=(), num_tokens=5))
    evolve(state, Reset(seq=2, abandoned_job_ids=()))  # as a trace from before F18 reads
    assert state.requests == {}


def test_F18_a_preempted_request_comes_back_under_its_id_while_its_jobs_run() -> None:
    """Preempted with a load and a store in flight, the request is looked up and computes
    again under the same id: it resumes (``request_resumed``); its earlier jobs finish on
    their own and the engine tells them apart by job id."""
    from kvflow.core.events import RequestClosed, RequestResumed

    m = manager(cpu_blocks=8)
    store(m, "w", [A, B], [1, 2])
    m.finish_request("w")
    m.take_notices()
    assert m.lookup("r", [A, B, C], tokens(3)) == 2
    old_load = m.accept_hits("r", [10, 11])
    old_store = m.blocks_computed("r", [C], [12])
    m.plan_step(1.0)
    assert m.finish_request("r", preempted=True)
    assert m.state.requests["r"].finished  # its jobs are live: it is not closed

    before = len(m.log.events())
    assert m.lookup("r", [A, B, C, D], tokens(4)) == 2  # C is still being stored: not a hit
    kinds = [type(e) for e in m.log.events()[before:]]
    assert kinds[0] is RequestResumed and not m.state.requests["r"].finished
    new_load = m.accept_hits("r", [20, 21])
    new_store = m.blocks_computed("r", [C, D], [22, 23])  # C is being stored already (F3)
    assert m.state.jobs[new_store].hashes == (D,)
    m.plan_step(2.0)

    m.job_result(old_load)
    m.job_result(old_store)
    notices = m.take_notices()
    assert notices.loads_finished == [("r", old_load)] and notices.stores_finished == [old_store]
    assert "r" in m.state.requests  # live again: the old jobs' end does not close it
    m.job_result(new_load)
    m.job_result(new_store)
    assert m.take_notices().loads_finished == [("r", new_load)]
    m.finish_request("r")
    assert isinstance(m.log.events()[-1], RequestClosed) and "r" not in m.state.requests
    consistent(m)


def test_F18_a_finished_request_does_not_come_back() -> None:
    """Only a preempted request resumes; one that finished (its jobs still running) refuses
    new work under its id, changing nothing."""
    m = manager(cpu_blocks=8)
    job = m.blocks_computed("r", [A], [1])
    m.plan_step(0.0)
    m.finish_request("r")
    for call in (lambda: m.lookup("r", [A, B], tokens(2)), lambda: m.blocks_computed("r", [B], [2])):
        unchanged_after(m, call, Rejected)
    m.job_result(job)
    assert "r" not in m.state.requests
    assert m.lookup("r", [A, B], tokens(2)) == 1  # closed: the id is free again, a new request


@pytest.mark.parametrize("chain_recency", [True, False])
def test_F18_a_request_is_known_from_its_first_call_even_when_no_job_was_queued(chain_recency: bool) -> None:
    """Its blocks were all on the tier already (nothing to store): kvflow still knows it, so
    finishing it is a real finish (True), not the no-op for a request never seen. (With
    chain recency the event that records its chain makes it known.)"""
    from kvflow.core.events import ChainExtended, RequestOpened

    m = manager(cpu_blocks=4, chain_recency=chain_recency)
    store(m, "w", [A], [1])
    m.finish_request("w")
    assert m.blocks_computed("x", [A], [2]) is None
    first = ChainExtended if chain_recency else RequestOpened
    assert type(m.log.events()[-1]) is first and "x" in m.state.requests
    assert m.blocks_computed("x", [A], [2]) is None  # known now: nothing more is recorded
    assert type(m.log.events()[-2]) is not first
    assert m.finish_request("x") is True and "x" not in m.state.requests
    consistent(m)


def test_F18_a_load_abandoned_by_two_resets_is_reported_failed_once() -> None:
    """(Found by the swarm, seed 151.) The second reset abandons the job again; its request
    was told at the first one and is not told twice."""
    m = manager(cpu_blocks=4)
    store(m, "w", [A, B], [1, 2])
    m.finish_request("w")
    assert m.lookup("r", [A, B, C], tokens(3)) == 2
    job = m.accept_hits("r", [10, 11])
    m.plan_step(1.0)
    m.take_notices()
    m.reset()
    assert [f.job_id for f in m.take_notices().loads_failed] == [job]
    m.reset()
    assert m.take_notices().loads_failed == []
    m.job_result(job, ok=False, error="stream destroyed")  # the copy ends
    consistent(m)
    m.reset()
    assert m._told_abandoned == set()  # the ended job is forgotten at the next reset
