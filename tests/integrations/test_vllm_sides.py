"""The two halves of the vLLM connector without vLLM: configuration, hashes, and the scheduler
side's decisions for the call sequences vLLM makes (tests/integrations/test_vllm_connector.py runs them
inside the real engine)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvflow.core.commands import JobResult
from kvflow.core.errors import ConfigError
from kvflow.core.events import EVENT_TYPES, JobCompleted, JobFailed, LateResultIgnored
from kvflow.core.jobs import TransferJob
from kvflow.core.names import name_of
from kvflow.core.state.invariants import check_invariants
from kvflow.integrations.vllm.sides import (
    ConnectorConfig,
    SchedulerSide,
    StepPlan,
    WorkerSide,
    kvflow_hash,
)
from kvflow.log.reader import read_trace

B = 32


def test_capacity_in_blocks_bytes_or_gb() -> None:
    assert ConnectorConfig.from_extra({"cpu_blocks": 10}).blocks(4096) == 10
    assert ConnectorConfig.from_extra({"cpu_bytes": 10 * 4096 + 5}).blocks(4096) == 10
    assert ConnectorConfig.from_extra({"cpu_gb": 1}).blocks(1 << 20) == 1024


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "exactly one of"),
        ({"cpu_blocks": 4, "cpu_gb": 1}, "exactly one of"),
        ({"cpu_blocks": 0}, "cpu_blocks must be a whole number > 0"),
        ({"cpu_gb": float("nan")}, "cpu_gb must be a number > 0"),
        ({"cpu_blocks": 4, "polcy": "lru"}, "unknown key 'polcy'"),
        ({"cpu_blocks": 4, "store_mode": "lazy"}, "stores eagerly"),
        ({"cpu_blocks": 4, "disk_path": "/tmp/kv"}, "both disk_path and disk_gb"),
        ({"cpu_blocks": 4, "disk_gb": 1}, "both disk_path and disk_gb"),
        ({"cpu_blocks": 4, "disk_path": 3, "disk_gb": 1}, "disk_path must be a directory's path"),
        ({"cpu_blocks": 4, "disk_path": "/tmp/kv", "disk_gb": "1"}, "disk_gb must be a number > 0"),
        ({"cpu_blocks": 4, "disk_path": "/tmp/kv", "disk_gb": 0}, "disk_gb must be a number > 0"),
        ({"cpu_blocks": 4, "disk_path": "/tmp/kv", "disk_gb": 1, "disk_store_mode": "now", "disk_insecure_no_key": True},
         "disk_store_mode must be one of"),
        ({"cpu_blocks": 4, "disk_path": "/tmp/kv", "disk_gb": 1}, "the disk tier needs a key: disk_key_file"),
        ({"cpu_blocks": 4, "disk_path": "/tmp/kv", "disk_gb": 1, "disk_key_file": 3}, "disk_key_file must be a file's path"),
        ({"cpu_blocks": 4, "disk_path": "/tmp/kv", "disk_gb": 1, "disk_insecure_no_key": "yes"},
         "disk_insecure_no_key must be true or false"),
        # every value checked, none coerced: a string where a flag or a number belongs is an error
        ({"cpu_blocks": "8"}, "cpu_blocks must be a whole number > 0"),
        ({"cpu_blocks": True}, "cpu_blocks must be a whole number > 0"),
        ({"cpu_blocks": 4.5}, "cpu_blocks must be a whole number > 0"),
        ({"cpu_bytes": -1}, "cpu_bytes must be a whole number > 0"),
        ({"cpu_gb": "1"}, "cpu_gb must be a number > 0"),
        ({"cpu_gb": True}, "cpu_gb must be a number > 0"),
        ({"cpu_blocks": 4, "checksums": "false"}, "checksums must be true or false, got 'false'"),
        ({"cpu_blocks": 4, "checksums": 1}, "checksums must be true or false"),
        ({"cpu_blocks": 4, "job_deadline_ms": "30000"}, "job_deadline_ms must be a number of milliseconds > 0"),
        ({"cpu_blocks": 4, "job_deadline_ms": float("inf")}, "job_deadline_ms must be a number of milliseconds > 0"),
        ({"cpu_blocks": 4, "job_deadline_ms": 0}, "job_deadline_ms must be a number of milliseconds > 0"),
        ({"cpu_blocks": 4, "job_deadline_ms": False}, "job_deadline_ms must be a number of milliseconds > 0"),
        ({"cpu_blocks": 4, "trace_path": 5}, "trace_path must be a file's path"),
        ({"cpu_blocks": 4, "trace_path": ""}, "trace_path must be a file's path"),
        ({"cpu_blocks": 4, "policy": 5}, "policy"),
        ({"cpu_blocks": 4, "policy": "fifo"}, "policy"),
        ({"cpu_blocks": 4, "fail_job_ids": "3"}, "fail_job_ids must be a list of whole numbers >= 0"),
        ({"cpu_blocks": 4, "fail_job_ids": [1.5]}, "fail_job_ids must be a list of whole numbers >= 0"),
        ({"cpu_blocks": 4, "fail_job_ids": [True]}, "fail_job_ids must be a list of whole numbers >= 0"),
        ({"cpu_blocks": 4, "fail_ranks": [-1]}, "fail_ranks must be a list of whole numbers >= 0"),
        ({"cpu_blocks": 4, "fail_ranks": 1}, "fail_ranks must be a list of whole numbers >= 0"),
        ({"cpu_blocks": 4, "disk_path": "", "disk_gb": 1}, "disk_path must be a directory's path"),
        ({"cpu_blocks": 4, "disk_path": "/tmp/kv", "disk_gb": 1, "disk_key_file": ""}, "disk_key_file must be a file's path"),
        ({"cpu_blocks": 4, "disk_path": "/tmp/kv", "disk_gb": 1, "disk_store_mode": 1, "disk_insecure_no_key": True},
         "disk_store_mode must be one of"),
        # the remote tier: each value refused in one line naming its key
        ({"cpu_blocks": 4, "remote_mode": "write_through"}, "remote_mode needs remote_url"),
        ({"cpu_blocks": 4, "remote_url": "http://h:1", "remote_insecure_no_key": True},
         "remote_url must be a redis:// or rediss:// URL"),
        ({"cpu_blocks": 4, "remote_url": 6379, "remote_insecure_no_key": True}, "remote_url must be a redis:// or rediss://"),
        ({"cpu_blocks": 4, "remote_url": "redis://:6379", "remote_insecure_no_key": True}, "remote_url: remote url"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379"}, "the remote tier needs a key: remote_key_file"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_key_file": ""}, "remote_key_file must be a file's path"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_key_file": 3}, "remote_key_file must be a file's path"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": "true"}, "remote_insecure_no_key must be true or false"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": True, "remote_cluster": "false"},
         "remote_cluster must be true or false, got 'false'"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": True, "remote_mode": "lazy"}, "remote_mode must be one of"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": True, "remote_blocks": 0}, "remote_blocks must be a whole number"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": True, "remote_blocks": "10"}, "remote_blocks must be a whole number"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": True, "remote_blocks": 2**40}, "remote_blocks must be a whole number"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": True, "remote_encrypt": "false"},
         "remote_encrypt must be true or false"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": True, "remote_tls_ca_file": ""},
         "remote_tls_ca_file must be a file's path"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": True, "remote_tls_cert_file": 1},
         "remote_tls_cert_file must be a file's path"),
        ({"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:6379", "remote_insecure_no_key": True, "remote_tls_key_file": False},
         "remote_tls_key_file must be a file's path"),
    ],
)
def test_bad_extra_config_is_one_clear_error(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        ConnectorConfig.from_extra(extra)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("kv_connector_extra_config: ")


def test_good_values_are_taken_as_given() -> None:
    config = ConnectorConfig.from_extra(
        {"cpu_blocks": 4, "checksums": True, "job_deadline_ms": 500, "fail_job_ids": [3], "fail_ranks": [1],
         "trace_path": "t.jsonl", "policy": "arc"}
    )  # fmt: skip
    assert (config.checksums, config.job_deadline_ms, config.fail_job_ids, config.fail_ranks) == (True, 500.0, (3,), (1,))
    assert (config.trace_path, config.policy) == ("t.jsonl", "arc")


def test_a_capacity_below_one_block_is_refused() -> None:
    with pytest.raises(ConfigError, match="hold no block"):
        ConnectorConfig.from_extra({"cpu_bytes": 100}).blocks(4096)


def test_vllm_hashes_are_taken_whole() -> None:
    digest = bytes(range(32))
    assert kvflow_hash(digest) == int.from_bytes(digest, "big")  # all 256 bits of SHA-256
    assert kvflow_hash(2**70 + 5) == 2**70 + 5


def key(vllm_hash: bytes) -> int:
    """The key kvflow's decisions name a vLLM block by (no cache_salt)."""
    return name_of(kvflow_hash(vllm_hash)).key


def test_F21_a_cache_salt_keeps_a_requests_blocks_apart() -> None:
    side = SchedulerSide(ConnectorConfig(cpu_blocks=8), B, 4096)
    assert side.matched_tokens("a", hashes(1, 2), 2 * B + 1, 0, "salt-a") == 0
    side.allocated("a", [1, 2, 3], 0)
    plan = side.step([("a", 2 * B + 1, None, False)], [])
    assert [j.direction for j in plan.jobs] == ["store"]
    side.results([JobResult(job_id=plan.jobs[0].job_id)])
    side.finished("a")
    assert side.matched_tokens("b", hashes(1, 2), 2 * B + 1, 0, "salt-b") == 0
    assert side.matched_tokens("c", hashes(1, 2), 2 * B + 1, 0) == 0
    assert side.matched_tokens("d", hashes(1, 2), 2 * B + 1, 0, "salt-a") == 2 * B


def hashes(*ids: int) -> list[bytes]:
    return [i.to_bytes(8, "big") + bytes(24) for i in ids]


def test_a_load_goes_into_the_blocks_after_vllms_own_prefix_hits() -> None:
    """vLLM's prefix cache has block 0; kvflow's tier blocks 1 and 2: the load must target
    the request's 2nd and 3rd blocks, whatever ``request.num_computed_tokens`` says when the
    blocks are allocated (vLLM updates it afterwards)."""
    side = SchedulerSide(ConnectorConfig(cpu_blocks=8), B, 4096)
    side.matched_tokens("w", hashes(1, 2, 3), 3 * B + 1, 0)
    side.allocated("w", [10, 11, 12], 0)
    plan = side.step([("w", 3 * B + 1, None, False)], [])
    assert [(j.direction, j.device_blocks) for j in plan.jobs] == [("store", (10, 11, 12))]
    side.results([JobResult(job_id=plan.jobs[0].job_id)])
    assert side.finished("w") is False
    assert side.matched_tokens("r", hashes(1, 2, 3, 4), 4 * B + 1, B) == 2 * B  # after 1 device hit
    side.allocated("r", [20, 21, 22, 23], 2 * B)
    plan = side.step([("r", 4 * B + 1, None, False)], [])
    loads = [j for j in plan.jobs if j.direction == "load"]
    assert [j.device_blocks for j in loads] == [(21, 22)]
    stores = [j for j in plan.jobs if j.direction == "store"]
    assert [j.device_blocks for j in stores] == [(23,)]  # the block vLLM computes itself


def test_a_finished_request_keeps_its_blocks_while_its_store_runs() -> None:
    side = SchedulerSide(ConnectorConfig(cpu_blocks=8), B, 4096)
    side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0)
    side.allocated("r", [5, 6, 7], 0)
    plan = side.step([("r", 2 * B + 1, None, False)], [])
    assert side.finished("r") is True  # vLLM must not free blocks 5 and 6 yet
    nxt = side.step([], [])
    assert nxt.delayed_free == ["r"] and nxt.jobs == []
    side.results([JobResult(job_id=plan.jobs[0].job_id)])
    assert side.manager.state.jobs == {}


def test_a_request_whose_load_failed_is_offered_nothing_again() -> None:
    """vLLM recomputes the failed blocks and asks again: kvflow answers 0 for that request, so
    a load that keeps failing cannot loop; other requests still hit."""
    side = SchedulerSide(ConnectorConfig(cpu_blocks=8), B, 4096)
    side.matched_tokens("w", hashes(1, 2), 2 * B + 1, 0)
    side.allocated("w", [1, 2, 3], 0)
    plan = side.step([("w", 2 * B + 1, None, False)], [])
    side.results([JobResult(job_id=plan.jobs[0].job_id)])
    side.finished("w")
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) == 2 * B
    side.allocated("r", [5, 6, 7], 2 * B)
    load = side.step([], []).jobs[0]
    side.results([JobResult(job_id=load.job_id, ok=False, error="copy failed")])
    assert side.loads_failed == 1
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) == 0  # recompute
    assert side.matched_tokens("s", hashes(1, 2), 2 * B + 1, 0) == 2 * B  # the entries are fine


def test_a_disk_tier_from_the_connector_config() -> None:
    config = ConnectorConfig.from_extra({"cpu_blocks": 8, "disk_path": "/tmp/kv", "disk_gb": 1, "disk_insecure_no_key": True})
    assert config.disk_blocks(1 << 20) == 1024 and config.disk_store_mode == "ahead_of_eviction"
    side = SchedulerSide(config, B, 1 << 20)
    assert side.config.disk_blocks == 1024
    assert ConnectorConfig.from_extra({"cpu_blocks": 8}).disk_blocks(4096) == 0


def disk_side(world_size: int = 1) -> SchedulerSide:
    config = ConnectorConfig.from_extra(
        {"cpu_blocks": 4, "disk_path": "/tmp/unused", "disk_gb": 8 * 4096 / (1 << 30), "disk_store_mode": "write_through",
         "disk_insecure_no_key": True}
    )
    return SchedulerSide(config, B, 4096, world_size=world_size)


def test_a_warm_restart_indexes_what_every_rank_holds_then_waits_for_the_disk_load() -> None:
    """Each rank's disk tier sends what it held; the entries all ranks hold join the index. A
    request whose prefix is on disk is asked about again (None) until its disk load landed,
    then hits on the CPU tier."""
    side = disk_side(world_size=2)
    h1, h2 = kvflow_hash(hashes(1)[0]), kvflow_hash(hashes(2)[0])
    k1 = name_of(h1).key
    assert side.matched_tokens("early", hashes(1, 2), 2 * B + 1, 0) is None  # what the disks hold is not known yet
    side.disk_entries({0: [(0, name_of(h1)), (1, name_of(h2))]})
    assert side.manager.state.disk is not None and side.manager.state.disk.slot_of == {}  # rank 1 not yet
    side.disk_entries({1: [(0, name_of(h1)), (5, name_of(h2))]})
    assert side.disk_restored == 1 and side.manager.state.disk.slot_of == {k1: 0}
    side.disk_entries({0: [(1, name_of(h2))], 1: [(1, name_of(h2))]})  # (sent once: later lists change nothing)
    assert side.manager.state.disk.slot_of == {k1: 0}
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) is None  # its disk load runs
    plan = side.step([], [])
    (disk_load,) = plan.jobs
    assert disk_load.direction == "disk_load" and disk_load.disk_slots == (0,)
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) is None  # still on its way
    side.results([JobResult(job_id=disk_load.job_id, rank=0), JobResult(job_id=disk_load.job_id, rank=1)])
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) == B  # now a CPU-tier hit
    assert check_invariants(side.manager.state) == []


def test_a_disk_load_that_fails_lets_the_request_go_on_without_it() -> None:
    side = disk_side()
    h1 = kvflow_hash(hashes(1)[0])
    side.disk_entries({0: [(2, name_of(h1))]})
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) is None
    (disk_load,) = side.step([], []).jobs
    side.results([JobResult(job_id=disk_load.job_id, ok=False, error="disk load failed (block 1: checksum mismatch)")])
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) == 0  # computed, never asked to wait again
    assert side.manager.state.disk is not None and side.manager.state.disk.slot_of == {}


# --- tensor parallelism: one worker per rank ---------------------------------------------------


def kv_shard(seed: int) -> dict[str, Any]:
    """One rank's shard of a two-layer KV cache, laid out as vLLM's CPU build lays it out."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn((16, 2, 4, 8), generator=gen) for i in range(2)}


def run_on(workers: list[WorkerSide], plan: StepPlan) -> list[list[JobResult]]:
    """Each worker runs the step's jobs (loads before the forward pass, stores after it) to
    their end; every worker's results, by rank."""
    for worker in workers:
        worker.bind(plan)
        worker.start_loads()
        worker.start_stores()
    for worker in workers:
        for job in plan.jobs:
            worker.executor.wait(job.job_id, timeout_s=30)
        worker.poll()
    return [worker.take_results() for worker in workers]


def test_F15_a_load_that_fails_on_one_rank_fails_and_is_fenced_until_every_rank_reported(tmp_path: Path) -> None:
    """vLLM with tensor parallelism 2: two workers, each copying its own shard. The store of
    a request lands on both ranks (one job, two results: no result is late). A later load of
    it fails on rank 1 only, while rank 0's copy is still to report: the job fails at once
    (its blocks named for recompute, once), stays fenced while rank 0's copy may still write
    the device blocks, and is released when rank 0 reports. Nothing is left behind."""
    trace = tmp_path / "tp2.jsonl"
    config = ConnectorConfig(cpu_blocks=8, trace_path=str(trace))
    workers = [WorkerSide(config, rank=0), WorkerSide(replace(config, fail_job_ids=(2,)), rank=1)]
    block_bytes = {worker.register(kv_shard(worker.rank)) for worker in workers}
    side = SchedulerSide(config, B, block_bytes.pop(), world_size=2)
    assert side.manager.config.world_size == 2

    side.matched_tokens("w", hashes(1, 2), 2 * B + 1, 0)
    side.allocated("w", [1, 2, 3], 0)
    plan = side.step([("w", 2 * B + 1, None, False)], [])
    [store] = plan.jobs
    both = run_on(workers, plan)
    assert [[(r.job_id, r.rank, r.ok) for r in rank] for rank in both] == [[(store.job_id, 0, True)], [(store.job_id, 1, True)]]
    side.results([*both[0], *both[1]])  # (vLLM aggregates the workers' metadata in rank order)
    assert side.finished("w") is False and side.manager.state.jobs == {}

    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) == 2 * B
    side.allocated("r", [5, 6, 7], 2 * B)
    plan = side.step([("r", 2 * B + 1, None, False)], [])
    [load] = plan.jobs
    assert (load.job_id, load.direction, load.device_blocks) == (2, "load", (5, 6))
    rank0, rank1 = run_on(workers, plan)
    assert [(r.rank, r.ok) for r in rank0] == [(0, True)] and [(r.rank, r.ok) for r in rank1] == [(1, False)]

    side.results(rank1)  # rank 1's failure arrives while rank 0's copy has not reported
    assert side.loads_failed == 1 and side.loads_landed == 0
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) == 0  # vLLM recomputes
    [fence] = side.manager.fences()
    assert (fence.job_id, fence.ranks_pending, fence.device_blocks) == (load.job_id, (0,), (5, 6))
    assert sorted(side.manager.held_device_blocks()) == [5, 6]  # rank 0 may still write them
    # vLLM unions the workers' load errors: the load's blocks are named to it once
    assert workers[0].take_load_errors() | workers[1].take_load_errors() == {5, 6}
    # and counts a request's load over when every worker said so
    assert [worker.finished()[1] for worker in workers] == [{"r"}, {"r"}]

    side.results(rank0)  # rank 0's copy is over: the fence lifts
    assert side.manager.fences() == [] and side.manager.held_device_blocks() == []
    assert side.loads_failed == 1 and side.loads_landed == 0  # told once
    assert side.finished("r") is False
    state = side.manager.state
    assert state.jobs == {} and state.requests == {}
    assert all(state.entries[key(x)].pins == 0 for x in hashes(1, 2))
    assert len(state.free_slots) == 8 - 2  # the stored blocks only
    check_invariants(state)
    side.close()
    for worker in workers:
        worker.close()

    reader, records = read_trace(trace)
    assert reader.config.world_size == 2
    events = [record for _, record in records if isinstance(record, EVENT_TYPES)]
    late = [(e.job_id, e.rank) for e in events if isinstance(e, LateResultIgnored)]
    assert late == [(load.job_id, 0)]  # only the report that lifts the fence
    assert [e.job_id for e in events if isinstance(e, JobCompleted)] == [store.job_id]
    assert [(e.job_id, e.rank, e.fenced) for e in events if isinstance(e, JobFailed)] == [(load.job_id, 1, True)]


def test_a_worker_reports_under_its_rank_even_when_its_submit_fails() -> None:
    """A worker whose executor refuses a batch fails its jobs under its own rank, so the
    other rank's report still completes the picture (no rank is reported twice, none never)."""
    config = ConnectorConfig(cpu_blocks=8)
    worker = WorkerSide(config, rank=1)
    worker.register(kv_shard(1))
    worker.executor.close()  # a closed executor refuses every submit
    job = TransferJob(job_id=1, direction="store", device_blocks=(1,), slots=(0,), hashes=(5,), request_id="w")
    worker.bind(StepPlan(jobs=[job]))
    worker.start_stores()
    [result] = worker.take_results()
    assert (result.job_id, result.rank, result.ok) == (1, 1, False) and "submit failed" in (result.error or "")


def test_F2_a_bad_result_among_the_workers_costs_only_itself(restore_structlog: None) -> None:
    """A result the decisions refuse (a rank outside vLLM's world) is logged and dropped; the
    other results of the step are applied (the manager's step isolates it, as SyncEngine's)."""
    side = SchedulerSide(ConnectorConfig(cpu_blocks=8), B, 4096, world_size=2)
    side.matched_tokens("w", hashes(1, 2), 2 * B + 1, 0)
    side.allocated("w", [1, 2, 3], 0)
    [store] = side.step([("w", 2 * B + 1, None, False)], []).jobs
    with capture_logs() as logs:
        side.results([JobResult(job_id=store.job_id, rank=0), JobResult(job_id=store.job_id, rank=2),
                      JobResult(job_id=store.job_id, rank=1)])  # fmt: skip
    assert [(e["event"], e["rank"]) for e in logs if e["log_level"] == "warning"] == [("kvflow.result_rejected", 2)]
    assert side.manager.state.jobs == {}  # ranks 0 and 1 completed the store
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) == 2 * B


def test_a_disk_tier_with_hashes_seeded_per_process_is_refused_saying_what_to_set() -> None:
    from kvflow.integrations.vllm.sides import check_shared_hashes

    disk = ConnectorConfig.from_extra({"cpu_blocks": 8, "disk_path": "/tmp/kv", "disk_gb": 1, "disk_insecure_no_key": True})
    with pytest.raises(ConfigError, match="set PYTHONHASHSEED") as refused:
        check_shared_hashes(disk, "xxhash", {})
    assert "\n" not in str(refused.value)
    check_shared_hashes(disk, "xxhash", {"PYTHONHASHSEED": "0"})  # a fixed seed: every process agrees
    check_shared_hashes(disk, "sha256", {})  # vLLM seeds SHA-256 hashes alike in every process
    check_shared_hashes(ConnectorConfig(cpu_blocks=8), "xxhash", {})  # no tier outlives the process


# --- the disk tier's refusals ---------------------------------------------------------------


def run_until_reported(worker: WorkerSide, plan: StepPlan, timeout_s: float = 30.0) -> list[JobResult]:
    """The worker runs the step's jobs (a disk tier's in its threads); its results once every
    job reported."""
    import time

    worker.bind(plan)
    worker.start_loads()
    worker.start_stores()
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < len(plan.jobs):
        assert time.monotonic() < deadline, "jobs never reported"
        worker.poll()
        results += worker.take_results()
        time.sleep(0.002)
    return results


def test_a_workers_disk_tier_refusals_reach_the_scheduler_sides_trace(tmp_path: Path) -> None:
    """A worker's disk tier refuses entries written under a key since retired: its disk load
    fails, and the refusals cross to the scheduler side with the results (the worker's
    metadata), which records them in its trace naming that load."""
    from tier_keys import KEY, NEW_KEY, keys_file

    from kvflow.core.events import EntriesRefused

    def era(keys: bytes, trace: Path) -> tuple[WorkerSide, SchedulerSide]:
        config = ConnectorConfig.from_extra(
            {"cpu_blocks": 8, "disk_path": str(tmp_path / "disk"), "disk_gb": 16 * 512 / (1 << 30),
             "disk_store_mode": "write_through", "disk_key_file": str(keys_file(tmp_path, keys, name=f"{keys.hex()}.keys")),
             "trace_path": str(trace)}
        )  # fmt: skip
        worker = WorkerSide(config, rank=0, model="m", block_tokens=B)
        side = SchedulerSide(config, B, worker.register(kv_shard(1)))
        side.disk_entries({0: worker.take_disk_entries() or []})
        return worker, side

    worker, side = era(KEY, tmp_path / "first.jsonl")
    side.matched_tokens("w", hashes(1, 2), 2 * B + 1, 0)
    side.allocated("w", [1, 2, 3], 0)
    side.results(run_until_reported(worker, side.step([("w", 2 * B + 1, None, False)], [])))  # the CPU tier
    side.results(run_until_reported(worker, side.step([], [])))  # the write-through to disk
    assert side.manager.state.disk is not None and len(side.manager.state.disk.slot_of) == 2
    side.close()
    worker.close()

    worker, side = era(NEW_KEY, tmp_path / "retired.jsonl")
    assert side.disk_restored == 2  # the journal vouches for them; their seals are checked on load
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) is None  # their disk load runs
    plan = side.step([], [])
    (load,) = plan.jobs
    results = run_until_reported(worker, plan)
    assert [r.ok for r in results] == [False]
    refused = worker.take_refused()
    side.results(results, refusals=refused)
    assert worker.take_refused() == []  # each refusal handed over once
    assert side.manager.state.disk.slot_of == {}
    side.close()
    worker.close()
    _, records = read_trace(tmp_path / "retired.jsonl")
    (event,) = [r for _, r in records if isinstance(r, EntriesRefused)]
    assert (event.tier, set(event.hashes), event.reasons, event.job_ids) == (
        "disk", set(load.hashes), ("unknown key",) * 2, (load.job_id,) * 2
    )


# --- the remote tier: probes across the scheduler -> worker metadata ------------------------------


def test_a_remote_tier_from_the_connector_config() -> None:
    config = ConnectorConfig.from_extra(
        {"cpu_blocks": 8, "remote_url": "rediss://h:6380", "remote_cluster": True, "remote_mode": "ahead_of_eviction",
         "remote_key_file": "k", "remote_encrypt": False, "remote_tls_ca_file": "ca.pem",
         "remote_tls_cert_file": "c.pem", "remote_tls_key_file": "c.key"}
    )  # fmt: skip
    assert (config.remote_url, config.remote_cluster, config.remote_blocks) == ("rediss://h:6380", True, 1_000_000)
    assert (config.remote_key_file, config.remote_encrypt) == ("k", False)
    assert dict(config.remote_tls) == {"ssl_ca_certs": "ca.pem", "ssl_certfile": "c.pem", "ssl_keyfile": "c.key"}
    side = SchedulerSide(config, B, 4096)
    assert (side.config.remote_blocks, side.config.remote_store_mode) == (1_000_000, "ahead_of_eviction")
    assert SchedulerSide(ConnectorConfig(cpu_blocks=8), B, 4096).config.remote_blocks == 0


def test_a_remote_tier_with_hashes_seeded_per_process_is_refused() -> None:
    from kvflow.integrations.vllm.sides import check_shared_hashes

    remote = ConnectorConfig.from_extra({"cpu_blocks": 8, "remote_url": "redis://h:1", "remote_insecure_no_key": True})
    with pytest.raises(ConfigError, match="the remote tier needs block hashes .* set PYTHONHASHSEED"):
        check_shared_hashes(remote, "xxhash_cbor", {})
    check_shared_hashes(remote, "sha256", {})


def remote_side(world_size: int = 1, deadline_ms: float = 30_000.0) -> SchedulerSide:
    config = ConnectorConfig.from_extra(
        {"cpu_blocks": 4, "remote_url": "redis://127.0.0.1:1", "remote_insecure_no_key": True,
         "job_deadline_ms": deadline_ms}
    )  # fmt: skip
    return SchedulerSide(config, B, 4096, world_size=world_size)


def test_a_probe_goes_to_every_worker_and_a_block_is_found_only_where_every_rank_found_it() -> None:
    """The lookup's missing blocks go to the workers with the next plan; the request waits
    (None) while they are asked; a block every rank found is loaded from the remote tier, one
    a rank did not find is absent (and not asked about again for a while)."""
    side = remote_side(world_size=2)
    k1, k2 = key(hashes(1)[0]), key(hashes(2)[0])
    t = 1000.0
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0, now_ms=t) is None  # being asked
    plan = side.step([], [], now_ms=t)
    assert [n.key for n in plan.probes] == [k1, k2] and all(n.full for n in plan.probes)
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0, now_ms=t) is None  # (asked once)
    assert side.step([], [], now_ms=t).probes == []
    side.results([], now_ms=t, probes={0: ([k1, k2], [k1, k2])})
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0, now_ms=t) is None  # rank 1 has not answered
    side.results([], now_ms=t, probes={1: ([k1, k2], [k1])})  # rank 1 lacks block 2
    assert side.remote_found == 1 and set(side.manager.state.remote) == {k1}
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0, now_ms=t) is None  # its remote load runs
    plan = side.step([], [], now_ms=t)
    (remote_load,) = plan.jobs
    assert remote_load.direction == "remote_load" and remote_load.hashes == (k1,) and plan.probes == []
    side.results([JobResult(job_id=remote_load.job_id, rank=0), JobResult(job_id=remote_load.job_id, rank=1)], now_ms=t)
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0, now_ms=t) == B  # block 1 hits; block 2 is absent
    assert side.step([], [], now_ms=t).probes == []  # not asked again within the absent TTL
    side.finished("r")
    assert side.matched_tokens("s", hashes(1, 2), 2 * B + 1, 0, now_ms=t + 2000) is None  # asked again later
    assert [n.key for n in side.step([], [], now_ms=t + 2000).probes] == [k2]
    assert check_invariants(side.manager.state) == []


def test_a_request_waits_for_a_probe_no_longer_than_the_job_deadline() -> None:
    side = remote_side(deadline_ms=500.0)
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0, now_ms=0.0) is None
    side.step([], [], now_ms=0.0)  # the workers never answer
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0, now_ms=499.0) is None
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0, now_ms=500.0) == 0  # computed, not held again
    side.step([], [], now_ms=500.0)  # the unanswered probe is forgotten
    assert side.matched_tokens("q", hashes(1, 2), 2 * B + 1, 0, now_ms=600.0) is None  # asked afresh
    assert [n.key for n in side.step([], [], now_ms=600.0).probes] == [key(hashes(1)[0]), key(hashes(2)[0])]


def test_answers_of_a_rank_outside_the_world_or_of_keys_never_asked_are_ignored() -> None:
    side = remote_side()
    k1 = key(hashes(1)[0])
    side.results([], now_ms=0.0, probes={0: ([k1], [k1]), 3: ([k1], [k1])})
    assert side.remote_found == 0 and not side.manager.state.remote


def test_a_tier_refused_when_a_worker_builds_it_is_one_line_naming_the_config(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra(
        {"cpu_blocks": 8, "disk_path": str(tmp_path / "disk"), "disk_gb": 0.001, "disk_key_file": str(tmp_path / "none.keys")}
    )
    with pytest.raises(ConfigError) as refused:
        WorkerSide(config, rank=0, model="m", block_tokens=B).register(kv_shard(1))
    text = str(refused.value)
    assert text.startswith("kv_connector_extra_config: keys file ") and "\n" not in text


class _RefusingTiers:
    """What a worker's stacked tiers answer for their refusals: totals by reason, since built
    (``RemoteTierExecutor.remote_rejected``, ``DiskTierExecutor.disk_rejected``)."""

    def __init__(self) -> None:
        self.remote = {"forged": 0, "another tenant": 0}
        self.disk = {"corrupt": 0}

    def remote_rejected(self) -> dict[str, int]:
        return dict(self.remote)

    def disk_rejected(self) -> dict[str, int]:
        return dict(self.disk)


def test_a_workers_stats_carry_its_shared_tiers_refusals_since_the_last_call() -> None:
    worker = WorkerSide(ConnectorConfig.from_extra({"cpu_blocks": 4}))
    tiers = _RefusingTiers()
    worker.executor = tiers
    assert worker.take_stats() == {}
    tiers.remote["forged"] = 3
    tiers.disk["corrupt"] = 1
    assert worker.take_stats() == {"remote_rejected:forged": 3, "disk_rejected:corrupt": 1}
    assert worker.take_stats() == {}  # each refusal once
    tiers.remote.update({"forged": 4, "another tenant": 2})
    assert worker.take_stats() == {"remote_rejected:forged": 1, "remote_rejected:another tenant": 2}
