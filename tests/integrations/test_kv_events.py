"""vLLM-compatible KV events derived from a manager's events (kvflow.integrations.vllm.kv_events).

The publisher is attached as a manager observer, as an engine would; at each step what it has
collected is compared with what the rule says (BlockStored only at a completed, non-abandoned
store; BlockRemoved at an eviction; AllBlocksCleared at a reset), and with ``kv_events`` over
the manager's whole log.
"""

from __future__ import annotations

import msgspec
import pytest

from kvflow.core.config import Config
from kvflow.core.events import BlocksEvicted, JobCompleted
from kvflow.core.state.invariants import check_invariants
from kvflow.engine.manager import OffloadManager
from kvflow.integrations.vllm.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    kv_event,
    kv_events,
)

B = 16


@pytest.fixture
def rig() -> tuple[OffloadManager, KVEventPublisher]:
    manager = OffloadManager(Config(cpu_blocks=4, block_tokens=B, job_deadline_ms=100.0), paranoid=True)
    publisher = KVEventPublisher(B)
    manager.subscribe(publisher)
    return manager, publisher


def store(manager: OffloadManager, rid: str, hashes: tuple[int, ...], blocks: tuple[int, ...]) -> int:
    manager.lookup(rid, hashes, len(hashes) * B + 1)
    job = manager.blocks_computed(rid, hashes, blocks)
    assert job is not None
    [submitted] = manager.plan_step(0.0)
    assert submitted.job_id == job
    return job


def kinds(events: list[object]) -> list[tuple[str, list[int]]]:
    out = []
    for e in events:
        hashes = getattr(e, "block_hashes", [])
        out.append((type(e).__name__, list(hashes)))
    return out


def test_F3_block_stored_only_when_the_store_completes(rig: tuple[OffloadManager, KVEventPublisher]) -> None:
    manager, pub = rig
    manager.lookup("A", (1, 2), 2 * B + 1)
    job = manager.blocks_computed("A", (1, 2), (0, 1))
    assert pub.take() == []  # queued: nothing readable yet
    manager.plan_step(0.0)
    assert pub.take() == []  # in flight: still nothing
    manager.job_result(job, ok=True)
    [event] = pub.take()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [1, 2]
    assert event.medium == MEDIUM_CPU and event.block_size == B
    completed = [e for e in manager.log.events() if isinstance(e, JobCompleted)]
    assert event.seq == completed[-1].seq  # points at the kvflow event that caused it
    assert pub.take() == []  # taken once


def test_F1_no_block_stored_for_a_failed_or_timed_out_store(rig: tuple[OffloadManager, KVEventPublisher]) -> None:
    manager, pub = rig
    failed = store(manager, "A", (1, 2), (0, 1))
    manager.job_result(failed, ok=False, error="copy failed")
    assert pub.take() == []
    store(manager, "B", (3,), (2,))
    assert manager.tick(1000.0) == 1
    assert pub.take() == []
    assert not any(manager.state.is_resident(h) for h in (1, 2, 3))


def test_no_block_stored_for_a_store_abandoned_by_reset(rig: tuple[OffloadManager, KVEventPublisher]) -> None:
    manager, pub = rig
    done = store(manager, "A", (1,), (0,))
    manager.job_result(done, ok=True)
    assert kinds(pub.take()) == [("BlockStored", [1])]
    in_flight = store(manager, "B", (2, 3), (1, 2))
    manager.lookup("C", (4,), B + 1)
    manager.blocks_computed("C", (4,), (3,))  # queued, never submitted: cancelled by the reset
    manager.reset()
    [cleared] = pub.take()
    assert isinstance(cleared, AllBlocksCleared)  # (vLLM's carries no medium: the publisher's)
    manager.job_result(in_flight, ok=True)  # the abandoned copy lands after the reset
    assert pub.take() == []
    assert not manager.state.is_resident(2)
    assert check_invariants(manager.state) == []


def test_block_removed_on_eviction_in_eviction_order(rig: tuple[OffloadManager, KVEventPublisher]) -> None:
    manager, pub = rig
    for rid, hashes, blocks in (("A", (1, 2), (0, 1)), ("B", (3, 4), (2, 3))):
        job = store(manager, rid, hashes, blocks)
        manager.job_result(job, ok=True)
        manager.finish_request(rid)
    assert kinds(pub.take()) == [("BlockStored", [1, 2]), ("BlockStored", [3, 4])]
    manager.touch((2, 1), reuse=False)  # A's chain most recent, head last
    job = store(manager, "C", (5, 6), (4, 5))  # a full tier of 4: evicts two
    evicted = [e for e in manager.log.events() if isinstance(e, BlocksEvicted)]
    assert len(evicted) == 1 and set(evicted[0].hashes) == {3, 4}
    [removed] = pub.take()
    assert isinstance(removed, BlockRemoved) and removed.medium == MEDIUM_CPU
    assert removed.block_hashes == list(evicted[0].hashes) and removed.seq == evicted[0].seq
    manager.job_result(job, ok=True)
    assert kinds(pub.take()) == [("BlockStored", [5, 6])]
    assert manager.evict(1) == 1  # explicit eviction is a removal too
    [explicit] = pub.take()
    assert isinstance(explicit, BlockRemoved) and len(explicit.block_hashes) == 1


def test_loads_pins_and_touches_are_not_kv_events(rig: tuple[OffloadManager, KVEventPublisher]) -> None:
    manager, pub = rig
    job = store(manager, "A", (1, 2), (0, 1))
    manager.job_result(job, ok=True)
    manager.finish_request("A")
    pub.take()
    assert manager.lookup("B", (1, 2, 9), 3 * B) == 2
    load = manager.accept_hits("B", (7, 8))
    manager.plan_step(0.0)
    manager.job_result(load, ok=False, error="load failed")  # F1: entries stay, no removal
    manager.touch((2, 1))
    manager.finish_request("B")
    assert pub.take() == []
    assert all(manager.state.is_resident(h) for h in (1, 2))


def test_the_publisher_sees_what_kv_events_derives_from_the_log(rig: tuple[OffloadManager, KVEventPublisher]) -> None:
    manager, pub = rig
    seen = []
    for i in range(6):  # cycle a 4-block tier: stores, evictions, a failure, a reset
        hashes = (10 * i + 1, 10 * i + 2)
        job = store(manager, f"r{i}", hashes, (2 * i, 2 * i + 1))
        manager.job_result(job, ok=(i != 3), error=None if i != 3 else "boom")
        manager.finish_request(f"r{i}")
        seen += pub.take()
        if i == 4:
            manager.reset()
    seen += pub.take()
    derived = kv_events(manager.log.events(), B)
    assert seen == derived
    assert [type(e).__name__ for e in derived].count("AllBlocksCleared") == 1
    assert sum(isinstance(e, BlockRemoved) for e in derived) >= 1
    # every derived event is one kv_event of one kvflow event, in log order
    assert [e.seq for e in derived] == sorted(e.seq for e in derived)
    assert all(kv_event(e, B) is None or kv_event(e, B) in derived for e in manager.log.events())


def test_kv_events_encode_with_vllm_field_names() -> None:
    stored = BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None, medium="CPU", lora_name=None
    )
    as_json = msgspec.json.decode(msgspec.json.encode(stored))
    assert as_json == {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    removed = msgspec.json.decode(msgspec.json.encode(BlockRemoved(block_hashes=[3], medium="CPU", seq=9)))
    assert removed == {"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU", "seq": 9}


def test_each_tier_reports_in_its_own_medium() -> None:
    """A store lands on the CPU tier (CPU), is written through to disk (DISK) and to the remote
    tier (REMOTE); a disk entry evicted leaves DISK; a remote load that fails leaves REMOTE."""
    from kvflow.core.jobs import REMOTE_LOAD
    from kvflow.integrations.vllm.kv_events import MEDIUM_DISK, MEDIUM_REMOTE

    config = Config(cpu_blocks=2, block_tokens=B, disk_blocks=1, disk_store_mode="write_through", remote_blocks=8)
    manager = OffloadManager(config, paranoid=True)
    pub = KVEventPublisher(B)
    manager.subscribe(pub)
    job = manager.blocks_computed("A", (1,), (0,))
    manager.plan_step(0.0)
    manager.job_result(job)
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in pub.take()] == [("BlockStored", MEDIUM_CPU, [1])]
    for copy in manager.plan_step(0.0):  # its copies to disk and to the remote tier
        manager.job_result(copy.job_id)
    assert sorted((e.medium, e.block_hashes[0]) for e in pub.take()) == [(MEDIUM_DISK, 1), (MEDIUM_REMOTE, 1)]
    job = manager.blocks_computed("B", (2,), (1,))  # the disk's one slot goes to block 2
    for copy in manager.plan_step(0.0):
        manager.job_result(copy.job_id)
    for copy in manager.plan_step(0.0):
        manager.job_result(copy.job_id)
    removed = [e for e in pub.take() if isinstance(e, BlockRemoved)]
    assert [(e.medium, e.block_hashes) for e in removed] == [(MEDIUM_DISK, [1])]
    manager.remote_found([9])
    manager.lookup("C", (9,), B + 1)
    (load,) = manager.plan_step(0.0)
    assert load.direction == REMOTE_LOAD
    manager.job_result(load.job_id, ok=False, error="remote miss: absent")
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in pub.take()] == [
        ("BlockRemoved", MEDIUM_CPU, [1]),  # (the load's slot: the CPU tier holds two blocks)
        ("BlockRemoved", MEDIUM_REMOTE, [9]),
    ]
    assert check_invariants(manager.state) == []


def test_a_warm_restart_announces_what_the_disk_holds() -> None:
    from kvflow.core.names import name_of
    from kvflow.integrations.vllm.kv_events import MEDIUM_DISK

    manager = OffloadManager(Config(cpu_blocks=2, block_tokens=B, disk_blocks=4), paranoid=True)
    pub = KVEventPublisher(B)
    manager.subscribe(pub)
    manager.disk_restored([(0, name_of(7)), (3, name_of(8))])
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in pub.take()] == [("BlockStored", MEDIUM_DISK, [7, 8])]
