"""The remote tier's lifecycle in the pure core: write-through remote stores, remote loads on a
lookup that misses the CPU tier, the remote index, and every failure (a dead key, a timeout, a
reset), each checked against the invariants and a fold of the log."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from core_helpers import DEADLINE_MS, config, consistent, manager, store, tokens

from kvflow.core.config import Config, config_from_dict
from kvflow.core.errors import ConfigError
from kvflow.core.events import EVENT_TYPES, RemoteLoadQueued, RemoteStoreQueued
from kvflow.core.jobs import REMOTE_LOAD, REMOTE_STORE
from kvflow.core.policies.lru import LRUPolicy
from kvflow.core.state.tables import BlockState
from kvflow.engine.manager import OffloadManager
from kvflow.log.reader import TraceReader
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay


def remote_manager(cpu_blocks: int = 4, remote_blocks: int = 100, **kw) -> OffloadManager:
    return manager(cpu_blocks, remote_blocks=remote_blocks, **kw)


def submit(m: OffloadManager, now_ms: float = 0.0) -> list:
    return m.plan_step(now_ms)


def test_write_through_queues_a_remote_store_that_pins_until_it_ends() -> None:
    m = remote_manager()
    job = store(m, "a", [1, 2], [10, 11])
    push = m.state.jobs[job + 1]
    assert (push.direction, push.hashes) == (REMOTE_STORE, (1, 2))
    assert m.state.pin_count == {1: 1, 2: 1}  # its slots are read: not evictable
    with pytest.raises(Exception):
        m.evict(1)
    (transfer,) = submit(m)
    assert transfer.direction == REMOTE_STORE and transfer.device_blocks == ()
    m.job_result(job + 1)
    assert list(m.state.remote) == [1, 2] and m.state.pin_count == {}
    assert m.evict(2) == 2  # the CPU tier may drop them now: the remote tier has them
    consistent(m)


def test_no_remote_tier_no_remote_job() -> None:
    m = manager()
    store(m, "a", [1, 2], [10, 11])
    assert m.state.jobs == {} and m.state.remote == {}


def test_lookup_miss_loads_from_the_remote_tier_then_hits() -> None:
    m = remote_manager()
    assert m.remote_found([5, 6, 7]) == 3
    assert m.remote_found([6, 7]) == 0  # already known
    assert m.lookup("r", [5, 6, 8, 7], tokens(4)) == 0  # nothing on the CPU tier yet
    (job,) = m.state.jobs.values()
    assert (job.direction, job.hashes) == (REMOTE_LOAD, (5, 6))  # up to the first gap (8)
    assert [m.state.block_state(h) for h in (5, 6)] == [BlockState.STORE_QUEUED] * 2
    submit(m)
    m.job_result(job.job_id)
    m.accept_hits("r", [])
    assert m.lookup("r", [5, 6, 8, 7], tokens(4)) == 2  # now CPU-tier hits
    consistent(m)


def test_F20_a_dead_key_is_tried_once_never_in_a_loop() -> None:
    m = remote_manager()
    m.remote_found([5, 6])
    m.lookup("r", [5, 6], tokens(2))
    (job,) = m.state.jobs.values()
    submit(m)
    m.job_result(job.job_id, ok=False, error="remote miss: absent")
    assert m.state.remote == {} and 5 not in m.state.slot_of  # dropped at the first failure
    m.accept_hits("r", [])
    assert m.lookup("r", [5, 6], tokens(2)) == 0
    assert m.state.jobs == {}  # no second remote load of the dead keys
    assert m.lookup_and_probe("r", [5, 6], tokens(2))[1] == [5, 6]  # a probe may re-find
    consistent(m)


def test_F15_a_timed_out_remote_load_is_fenced_until_its_copy_reports() -> None:
    m = remote_manager()
    m.remote_found([5])
    m.lookup("r", [5, 9], tokens(2))
    (job,) = m.state.jobs.values()
    submit(m, 0.0)
    slot = job.slots[0]
    assert m.tick(DEADLINE_MS + 1) == 1
    assert 5 not in m.state.slot_of and 5 not in m.state.remote
    assert slot in m.state.fenced_slots and slot not in m.state.free_slots  # F15
    m.job_result(job.job_id)  # the thread's copy is over (late)
    assert slot not in m.state.fenced_slots and slot in m.state.free_slots
    consistent(m)


def test_failed_remote_store_leaves_the_block_resident_and_not_indexed() -> None:
    m = remote_manager()
    job = store(m, "a", [1], [10])
    submit(m)
    m.job_result(job + 1, ok=False, error="OutOfMemoryError: command not allowed")
    assert m.state.remote == {} and m.state.is_resident(1) and m.state.pin_count == {}
    consistent(m)


def test_remote_load_never_evicts_pinned_hits_and_takes_only_free_room() -> None:
    m = remote_manager(cpu_blocks=2)
    store(m, "a", [1, 2], [10, 11])
    for job_id in list(m.state.jobs):  # the write-through of 1 and 2
        submit(m)
        m.job_result(job_id)
    m.remote_found([3, 4])
    assert m.lookup("r", [1, 2, 3, 4], tokens(4)) == 2  # 1, 2 hit and are pinned
    assert not any(j.direction == REMOTE_LOAD for j in m.state.jobs.values())  # no room
    m.accept_hits("r", [])
    assert m.lookup("r2", [3, 4], tokens(2)) == 0  # unpinned now: 1, 2 make room
    (job,) = [j for j in m.state.jobs.values() if j.direction == REMOTE_LOAD]
    assert job.hashes == (3, 4)
    consistent(m)


def test_reset_abandons_remote_jobs_and_keeps_the_remote_index() -> None:
    m = remote_manager()
    job = store(m, "a", [1], [10])
    submit(m)
    m.reset()
    assert m.state.jobs[job + 1].abandoned and list(m.state.remote) == []
    m.job_result(job + 1)  # the copy ends: nothing becomes visible, its slot comes back
    assert m.state.jobs == {} and m.state.remote == {}
    m.remote_found([7])
    m.reset()
    assert list(m.state.remote) == [7]  # the remote tier did not change
    consistent(m)


def test_remote_index_forgets_its_oldest_beyond_capacity() -> None:
    m = remote_manager(remote_blocks=2)
    m.remote_found([1, 2])
    m.remote_found([3])
    assert list(m.state.remote) == [2, 3]
    consistent(m)


def test_config_records_the_remote_tier_only_when_on() -> None:
    assert "remote_blocks" not in Config(cpu_blocks=4).to_dict()
    on = Config(cpu_blocks=4, remote_blocks=8)
    assert config_from_dict(on.to_dict()) == on
    for bad in (dict(remote_blocks=-1), dict(remote_blocks=True), dict(remote_store_mode="x")):
        with pytest.raises(ConfigError):
            Config(cpu_blocks=4, **bad)


def test_a_recorded_remote_run_replays_and_redecides(tmp_path: Path) -> None:
    path = tmp_path / "remote.jsonl"
    writer = TraceWriter(str(path), config(4, remote_blocks=16), checkpoint_every=5)
    m = OffloadManager(config(4, remote_blocks=16), log=writer)
    job = store(m, "a", [1, 2], [10, 11])
    submit(m)
    m.job_result(job + 1)
    m.remote_found([3])
    m.lookup("b", [1, 2, 3, 4], tokens(4))
    m.accept_hits("b", [20, 21])
    submit(m, 1.0)
    m.tick(1.0 + DEADLINE_MS)
    for jid in list(m.state.jobs):
        m.job_result(jid, ok=False, error="lost")
    m.close()
    kinds = {type(e) for e in writer_events(path)}
    assert {RemoteStoreQueued, RemoteLoadQueued} <= kinds
    for redecide in (False, True):
        result = replay(path, redecide=redecide)
        assert result.divergence is None, result.divergence
        assert result.state.digest() == m.state.digest()


def writer_events(path: Path) -> list:
    with TraceReader(str(path)) as reader:
        return [r for _, r in reader.records() if isinstance(r, EVENT_TYPES)]



def test_incidents_tell_what_recovery_did_for_remote_jobs(tmp_path: Path) -> None:
    from kvflow.inspect.incidents import find_incidents

    path = tmp_path / "remote.jsonl"
    m = OffloadManager(config(4, remote_blocks=16), log=TraceWriter(str(path), config(4, remote_blocks=16)))
    job = store(m, "a", [1], [10])
    submit(m)
    m.job_result(job + 1, ok=False, error="OutOfMemoryError: command not allowed")
    m.remote_found([3])
    m.lookup("b", [3, 4], tokens(2))
    submit(m, 1.0)
    m.tick(1.0 + DEADLINE_MS)
    m.job_result(job + 2, ok=False, error="remote miss")
    m.close()
    store_failure, load_timeout = find_incidents(path).incidents
    assert store_failure.recovery["entries_kept_resident"] == [1]
    assert load_timeout.recovery["hashes_never_visible"] == [3]
    assert load_timeout.recovery["dropped_from_remote_index"] == [3]
    assert load_timeout.fence_lifted is not None


def test_ahead_of_eviction_copies_the_coldest_blocks_once_the_tier_runs_low() -> None:
    m = remote_manager(cpu_blocks=16, remote_store_mode="ahead_of_eviction")  # window: 2 blocks
    store(m, "a", list(range(1, 15)), list(range(100, 114)))  # 14 of 16 slots: 2 free
    assert m.state.jobs == {}  # nothing is copied while the tier has room (and no write-through)
    store(m, "b", [15], [200])  # 1 free slot left: below the window
    (push,) = m.state.jobs.values()
    assert push.direction == REMOTE_STORE and push.hashes == (1, 2)  # the policy's coldest two
    assert push.state.name == "IN_FLIGHT"  # queued and handed over by the same plan step
    m.job_result(push.job_id)
    assert list(m.state.remote) == [1, 2]
    assert m.plan_step(1.0) == []  # the coldest are on the remote tier: nothing more to copy
    assert m.evict(2) == 2 and m.state.remote.keys() == {1, 2}  # evicted here, kept there
    consistent(m)


class CountingLRU(LRUPolicy):
    """LRU that counts the blocks it is asked for."""

    __slots__ = ()
    asked: list[int] = []

    def victims(self, num_blocks: int, pinned: Callable[[int], bool]) -> list[int] | None:
        CountingLRU.asked.append(num_blocks)
        return super().victims(num_blocks, pinned)


def test_ahead_of_eviction_asks_the_policy_again_only_when_its_answer_may_differ() -> None:
    """With the tier's coldest window on the remote tier, steps that change neither the policy's
    order, the remote index nor the live copies (loads here) ask the policy nothing; a touch
    (the order changed) or a failed copy (the block is lacking again) asks."""
    CountingLRU.asked = []
    m = remote_manager(
        cpu_blocks=16, remote_store_mode="ahead_of_eviction", policy=f"{__name__}:CountingLRU", chain_recency=False
    )
    store(m, "a", list(range(1, 15)), list(range(100, 114)))
    store(m, "b", [15], [200])  # 1 free slot: below the window (2)
    (push,) = m.state.jobs.values()
    assert push.hashes == (1, 2)
    m.job_result(push.job_id)

    def load(i: int) -> list:
        assert m.lookup(f"r{i}", [5], tokens(1)) == 1
        m.accept_hits(f"r{i}", [300 + i])
        jobs = m.plan_step(float(i))
        m.job_result(next(j.job_id for j in jobs if j.direction == "load"))
        m.finish_request(f"r{i}")
        return [j for j in jobs if j.direction == REMOTE_STORE]

    assert load(0) == []  # asked: the remote index changed since
    asked = len(CountingLRU.asked)
    for i in range(1, 20):
        assert load(i) == []
    assert len(CountingLRU.asked) == asked  # the same order, index and copies: nothing asked
    m.touch([1])  # 1 is warm now: 3 is among the coldest two, and the remote tier lacks it
    (push,) = load(20)
    assert push.hashes == (3,) and len(CountingLRU.asked) == asked + 1
    m.job_result(push.job_id, ok=False, error="remote down")  # 3 is lacking again
    (again,) = load(21)
    assert again.hashes == (3,)
    consistent(m)


def test_inspect_follows_remote_jobs_blocks_and_the_remote_index(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvflow.cli.main import main

    path = tmp_path / "remote.jsonl"
    cfg = config(4, remote_blocks=16)
    m = OffloadManager(cfg, log=TraceWriter(str(path), cfg))
    job = store(m, "a", [1], [10])
    submit(m)
    m.job_result(job + 1, ok=False, error="OutOfMemoryError: command not allowed")
    m.remote_found([3])
    m.lookup("b", [3, 4], tokens(2))
    m.close()
    run = CliRunner().invoke
    out = run(main, ["inspect", str(path), "--job", str(job + 1)]).output
    assert "remote_store job 2 queued: 1 block [1] from slots [0]" in out
    assert "[IN_FLIGHT -> FAILED]" in out
    out = run(main, ["inspect", str(path), "--block", "3"]).output
    assert "remote tier holds 1 block [3]" in out and "[ABSENT -> STORE_QUEUED slot 1]" in out
    out = run(main, ["inspect", str(path), "--at", str(m.state.last_seq)]).output
    assert "remote tier: 1 blocks known there [3]" in out
