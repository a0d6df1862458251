"""The disk tier's lifecycle in the pure core: spills ahead of eviction and write-through disk
stores, disk loads on a lookup that misses the CPU tier, kvflow's own disk slots and their
eviction, a warm restart's entries, and every failure (a bad entry, a timeout, a reset), each
checked against the invariants and a fold of the log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from core_helpers import DEADLINE_MS, consistent, manager, store, tokens

from kvflow.core.config import Config, config_from_dict
from kvflow.core.errors import ConfigError, Rejected
from kvflow.core.jobs import DISK_LOAD, DISK_STORE
from kvflow.core.names import name_of
from kvflow.core.state.tables import BlockState
from kvflow.engine.manager import OffloadManager
from kvflow.log.reader import TraceReader
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay


def disk_manager(cpu_blocks: int = 4, disk_blocks: int = 8, mode: str = "write_through", **kw) -> OffloadManager:
    return manager(cpu_blocks, disk_blocks=disk_blocks, disk_store_mode=mode, **kw)


def finish_jobs(m: OffloadManager, now_ms: float = 0.0, ok: bool = True) -> list[int]:
    """Hand out every queued job and complete it (planning may queue more: those too)."""
    done = []
    while m.state.queued:
        for job in m.plan_step(now_ms):
            m.job_result(job.job_id, ok=ok, error=None if ok else "EIO: input/output error")
            done.append(job.job_id)
    return done


def test_write_through_copies_each_stored_block_to_a_disk_slot_of_its_own() -> None:
    m = disk_manager()
    job = store(m, "a", [1, 2], [10, 11])
    copy = m.state.jobs[job + 1]
    assert (copy.direction, copy.hashes, copy.disk_slots) == (DISK_STORE, (1, 2), (0, 1))
    assert m.state.pin_count == {1: 1, 2: 1}  # its host slots are read: not evictable
    (transfer,) = m.plan_step(0.0)
    assert transfer.direction == DISK_STORE and transfer.disk_slots == (0, 1) and transfer.slots == (0, 1)
    m.job_result(transfer.job_id)
    assert m.state.disk is not None and m.state.disk.slot_of == {1: 0, 2: 1}
    assert m.state.pin_count == {} and m.state.disk.busy == {}
    consistent(m)


def test_a_lookup_that_misses_the_cpu_tier_loads_from_disk_then_hits() -> None:
    m = disk_manager(cpu_blocks=2)
    store(m, "a", [1, 2], [10, 11])
    finish_jobs(m)
    m.finish_request("a")
    assert m.evict(2) == 2  # gone from the CPU tier, still on disk
    assert m.lookup("b", [1, 2, 3], tokens(3)) == 0
    assert m.arriving([1, 2, 3], tokens(3)) == 2  # on their way from disk (a query: the same after a release)
    (load,) = m.state.jobs.values()
    assert (load.direction, load.hashes, load.disk_slots) == (DISK_LOAD, (1, 2), (0, 1))
    assert [m.state.block_state(h) for h in (1, 2)] == [BlockState.STORE_QUEUED] * 2
    m.accept_hits("b", [])
    assert m.arriving([1, 2, 3], tokens(3)) == 2
    finish_jobs(m)
    assert m.arriving([1, 2, 3], tokens(3)) == 0  # landed: resident hits now, nothing arriving
    assert m.lookup("b", [1, 2, 3], tokens(3)) == 2  # now CPU-tier hits
    assert list(m.state.disk.slot_of) == [1, 2]  # (loaded: the most recently used)
    consistent(m)


def test_spill_ahead_of_eviction_keeps_the_coldest_blocks_on_disk() -> None:
    m = disk_manager(cpu_blocks=16, mode="ahead_of_eviction")
    store(m, "a", list(range(1, 15)), list(range(10, 24)))  # 2 slots free: not fewer than 16 // 8
    m.finish_request("a")
    disk = m.state.disk
    assert disk is not None and disk.slot_of == {} and m.state.jobs == {}  # nothing due yet
    coldest = m.state.policy.victims(2, lambda h: False)
    assert m.blocks_computed("b", [15], [30]) is not None  # 1 slot free from now on
    store_job, spill = m.plan_step(0.0)  # planning sees the tier nearly full: its two coldest go
    assert spill.direction == DISK_STORE and list(spill.hashes) == coldest
    m.job_result(store_job.job_id)
    assert m.evict(1) == 1 and all(m.state.is_resident(h) for h in coldest)  # pinned: the next went
    m.job_result(spill.job_id)
    assert list(disk.slot_of) == coldest
    consistent(m)


def test_a_full_disk_evicts_its_least_recently_used_entries_never_one_in_use() -> None:
    m = disk_manager(cpu_blocks=4, disk_blocks=2)
    store(m, "a", [1, 2], [10, 11])
    finish_jobs(m)
    m.finish_request("a")
    disk = m.state.disk
    assert disk is not None and disk.slot_of == {1: 0, 2: 1}
    assert m.evict(2) == 2
    m.lookup("b", [1, 9], tokens(2))  # block 1 is loaded from disk slot 0: in use
    m.accept_hits("b", [])
    assert disk.busy == {0: 3}
    store(m, "c", [5], [12])  # its write-through needs a disk slot: only block 2's may go
    m.plan_step(0.0)
    m.job_result(4)  # the store of 5 lands, queuing its disk store
    events = [type(e).__name__ for e in m.log.events()]
    assert "DiskEvicted" in events
    evicted = [e for e in m.log.events() if type(e).__name__ == "DiskEvicted"]
    assert evicted[-1].hashes == (2,) and evicted[-1].disk_slots == (1,)
    consistent(m)


def test_F20_a_failed_disk_load_drops_its_blocks_from_the_index_and_never_loops() -> None:
    m = disk_manager(cpu_blocks=2)
    store(m, "a", [1, 2], [10, 11])
    finish_jobs(m)
    m.finish_request("a")
    assert m.evict(2) == 2
    m.lookup("b", [1, 2], tokens(2))
    m.accept_hits("b", [])
    (load,) = m.plan_step(0.0)
    m.job_result(load.job_id, ok=False, error="disk load failed on 1 of 2 blocks (block 1: checksum mismatch)")
    disk = m.state.disk
    assert disk is not None and disk.slot_of == {} and sorted(disk.free) == list(range(8))
    assert m.lookup("b", [1, 2], tokens(2)) == 0
    assert m.state.jobs == {}  # no second load of a bad entry
    consistent(m)


def test_a_timed_out_disk_store_keeps_its_disk_slots_until_its_copy_is_over() -> None:
    m = disk_manager(disk_blocks=2)
    job = store(m, "a", [1], [10])
    m.plan_step(0.0)
    m.job_result(job)
    m.plan_step(1.0)  # the disk store is handed out
    assert m.tick(1.0 + DEADLINE_MS + 1) == 1  # F15: timed out, its write may still run
    disk = m.state.disk
    assert disk is not None and 0 in disk.busy and 0 not in disk.free and disk.slot_of == {}
    consistent(m)
    m.job_result(job + 1)  # the late result: the write is over
    assert disk.busy == {} and 0 in disk.free
    consistent(m)


def test_a_reset_keeps_the_disk_index_and_fences_its_copies() -> None:
    m = disk_manager()
    store(m, "a", [1, 2], [10, 11])
    finish_jobs(m)
    m.finish_request("a")
    store(m, "b", [3], [12])
    m.plan_step(0.0)
    m.job_result(3)  # queues 3's disk store
    m.plan_step(0.0)
    m.reset()
    disk = m.state.disk
    assert disk is not None and list(disk.slot_of) == [1, 2]  # the disk's bytes are still good
    assert disk.busy  # the abandoned disk store's slot stays in use until it reports
    m.job_result(4)
    assert disk.busy == {} and list(disk.slot_of) == [1, 2]
    consistent(m)


def test_F22_a_warm_restart_indexes_what_the_journal_vouches_for() -> None:
    m = disk_manager()
    restored = [(3, name_of(100)), (5, name_of(101)), (5, name_of(102)), (6, name_of(100))]
    assert m.disk_restored(restored) == 2  # a slot or block once
    disk = m.state.disk
    assert disk is not None and disk.slot_of == {100: 3, 101: 5}
    assert 3 not in disk.free and 5 not in disk.free
    assert m.lookup("r", [100, 101], tokens(2)) == 0
    (load,) = m.state.jobs.values()
    assert load.disk_slots == (3, 5)
    with pytest.raises(Rejected):
        m.disk_restored([(8, name_of(1))])  # beyond the tier
    with pytest.raises(Rejected):
        disk_manager(disk_blocks=0).disk_restored([(0, name_of(1))])
    consistent(m)


def test_a_refused_restore_changes_nothing() -> None:
    m = disk_manager()
    before = m.state.digest()
    with pytest.raises(Rejected):
        m.disk_restored([(0, name_of(1)), (-1, name_of(2))])
    assert m.state.digest() == before and m.state.next_seq == 1


@pytest.mark.parametrize("field", ["disk_blocks", "disk_store_mode"])
def test_bad_disk_config_is_refused_in_one_line(field: str) -> None:
    bad = {"disk_blocks": -1, "disk_store_mode": "sometimes"}[field]
    with pytest.raises(ConfigError, match=field):
        Config(cpu_blocks=4, **{field: bad})  # type: ignore[arg-type]


def test_the_trace_header_names_the_disk_tier_only_when_there_is_one() -> None:
    assert "disk_blocks" not in Config(cpu_blocks=4).to_dict()
    with_disk = Config(cpu_blocks=4, disk_blocks=16, disk_store_mode="write_through")
    assert config_from_dict(with_disk.to_dict()) == with_disk


def test_a_trace_with_a_disk_tier_replays_and_redecides(tmp_path: Path) -> None:
    path = tmp_path / "disk.jsonl"
    config = Config(cpu_blocks=2, block_tokens=4, disk_blocks=5, disk_store_mode="write_through", job_deadline_ms=DEADLINE_MS)
    m = OffloadManager(config, log=TraceWriter(str(path), config, checkpoint_every=5))
    m.disk_restored([(2, name_of(50))])
    for i, chain in enumerate([[1, 2], [3, 4], [1, 2], [50, 3], [50, 3], [7, 8]]):
        rid = f"r{i}"
        hits = m.lookup(rid, chain, tokens(len(chain)))
        m.accept_hits(rid, [200 + k for k in range(hits)])
        if hits < len(chain):
            m.blocks_computed(rid, chain[hits:], [100 + i * 4 + k for k in range(len(chain) - hits)])
        finish_jobs(m, now_ms=float(i))
        m.finish_request(rid)
        finish_jobs(m, now_ms=float(i))
    m.tick(10.0)
    m.close()
    with TraceReader(str(path)) as reader:
        kinds = {type(r).__name__ for _, r in reader.records()}
    assert {"DiskRestored", "DiskIndexed", "DiskStoreQueued", "DiskLoadQueued", "DiskEvicted"} <= kinds
    for redecide in (False, True):
        result = replay(path, redecide=redecide)
        assert result.divergence is None, result.divergence
        assert result.state.digest() == m.state.digest()


def test_incidents_and_inspect_tell_what_happened_to_disk_jobs(tmp_path: Path) -> None:
    """A disk store the file system refused and a disk load that timed out, then reported late
    with a bad entry: each is an incident with its recovery; the state shows the disk tier."""
    from click.testing import CliRunner

    from kvflow.cli.main import main as kvflow_cli
    from kvflow.inspect.incidents import find_incidents

    path = tmp_path / "disk.jsonl"
    config = Config(cpu_blocks=4, block_tokens=4, disk_blocks=4, disk_store_mode="write_through", job_deadline_ms=DEADLINE_MS)
    m = OffloadManager(config, log=TraceWriter(str(path), config))
    job = store(m, "a", [1], [10])
    m.plan_step(0.0)
    m.job_result(job + 1, ok=False, error="disk store failed on 1 of 1 blocks (block 1: ENOSPC: No space left on device)")
    m.finish_request("a")
    m.disk_restored([(3, name_of(7))])
    m.lookup("b", [7, 8], tokens(2))
    m.accept_hits("b", [])
    m.plan_step(1.0)
    m.tick(1.0 + DEADLINE_MS)
    m.job_result(job + 2, ok=False, error="disk load failed on 1 of 1 blocks (block 7: checksum mismatch)")
    m.close()
    store_failure, load_timeout = find_incidents(path).incidents
    assert store_failure.recovery["entries_kept_resident"] == [1]
    assert load_timeout.recovery["hashes_never_visible"] == [7]
    assert load_timeout.recovery["dropped_from_disk_index"] == [7]
    assert load_timeout.fence_lifted is not None
    runner = CliRunner()
    shown = runner.invoke(kvflow_cli, ["incidents", str(path)], env={"COLUMNS": "240"})
    assert shown.exit_code == 0, shown.output
    flat = " ".join(shown.output.split())  # (the table wraps long cells)
    assert "disk_store failed" in flat and "disk_load timed out" in flat and "ENOSPC" in flat
    as_json = runner.invoke(kvflow_cli, ["incidents", str(path), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output)[1]["recovery"]["dropped_from_disk_index"] == [7]
    with TraceReader(str(path)) as reader:
        (indexed,) = [r.seq for _, r in reader.records() if type(r).__name__ == "DiskIndexed"]
    state = runner.invoke(kvflow_cli, ["inspect", str(path), "--at", str(indexed)], env={"COLUMNS": "240"})
    assert state.exit_code == 0, state.output
    assert "disk tier: 1 blocks" in state.output
    history = runner.invoke(kvflow_cli, ["inspect", str(path), "--block", "7"], env={"COLUMNS": "240"})
    assert history.exit_code == 0 and "disk_load job" in history.output and "restored" in history.output
