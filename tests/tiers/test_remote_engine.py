"""The engine with a remote tier on real Redis servers: real bytes from one instance's device
blocks through its host pool to Redis and back into another instance's device blocks; and the
engine's behaviour when the server evicts, dies or hangs. No mocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("xxhash")
from redis_servers import (  # noqa: E402
    redis_cluster,  # noqa: F401  (fixtures)
    redis_cluster_fresh,  # noqa: F401
    redis_fresh,  # noqa: F401
    redis_standalone,  # noqa: F401
)
from remote_rig import (  # noqa: E402
    CPU_BLOCKS,
    HASHES,
    MODEL,
    B,
    blocks_of,
    instance,
    load_prefix,
    random_kv,
    settle,
    store_prefix,
)
from tier_keys import tier_keys  # noqa: E402

from kvflow.core.config import Config  # noqa: E402
from kvflow.core.events import JobFailed, JobTimedOut
from kvflow.core.jobs import REMOTE_LOAD, REMOTE_STORE, TransferJob  # noqa: E402
from kvflow.core.names import name_of  # noqa: E402
from kvflow.core.state.invariants import check_invariants  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402
from kvflow.tiers.redis_store import redis_tier  # noqa: E402

RIG = Path(__file__).resolve().parents[1] / "remote_rig.py"


@pytest.fixture(params=["standalone", "cluster"])
def server(request):
    target = request.getfixturevalue(f"redis_{request.param}")
    yield target
    for node in getattr(target, "nodes", [target]):
        node.cli("FLUSHALL")


def is_cluster(target) -> bool:
    return hasattr(target, "nodes")


def remote_events(engine, kind):
    return [e for e in engine.manager.log.events() if type(e) is kind and e.direction in (REMOTE_LOAD, REMOTE_STORE)]


@pytest.mark.parametrize("connections", [1, 3])
def test_one_instance_stores_another_loads_the_same_bytes(server, connections) -> None:
    """With several connections, each job's blocks are split over them (3 parts of 4 blocks)."""
    writer, writer_kv = instance(server.url, is_cluster(server), seed=1, connections=connections)
    reader, reader_kv = instance(server.url, is_cluster(server), seed=2, connections=connections)
    try:
        store_prefix(writer, "w", (0, 1, 2, 3))
        assert writer.executor.stats["remote_stored_blocks"] == len(HASHES)
        assert list(writer.manager.state.remote) == list(HASHES)
        hits = load_prefix(reader, "r", (8, 9, 10, 11))
        assert hits == len(HASHES)
        assert reader.executor.stats["remote_loaded_blocks"] == len(HASHES)
        for a, b in zip(blocks_of(reader_kv, (8, 9, 10, 11)), blocks_of(writer_kv, (0, 1, 2, 3))):
            assert a.equal(b)
        for engine in (writer, reader):
            assert check_invariants(engine.manager.state) == []
    finally:
        writer.close()
        reader.close()


def test_separate_instance_processes_share_a_3_node_cluster(redis_cluster) -> None:  # noqa: F811
    """Scale-out: two kvflow processes, each with its own CPU tier, one Redis Cluster."""

    def run(role: str) -> dict:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(RIG.parent), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run(
            [sys.executable, str(RIG), role, redis_cluster.url, "cluster"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    try:
        wrote = run("writer")
        assert wrote["remote_stored_blocks"] == len(HASHES)
        read = run("reader")
        assert read == {**read, "hits": len(HASHES), "same": True, "remote_loaded_blocks": len(HASHES)}
    finally:
        for node in redis_cluster.nodes:
            node.cli("FLUSHALL")


@pytest.mark.parametrize("connections", [1, 4])
def test_an_evicted_key_fails_its_load_once_and_is_dropped(redis_standalone, connections) -> None:  # noqa: F811
    """With 4 connections the load's 4 blocks go one per connection: the one part that misses
    fails the whole job (once, reported for the job, not per part)."""
    writer, _ = instance(redis_standalone.url, False, seed=1, connections=connections)
    reader, _ = instance(redis_standalone.url, False, seed=2, connections=connections)
    try:
        store_prefix(writer, "w", (0, 1, 2, 3))
        # the reader learns of the blocks, then the server loses one (eviction, flush, restart)
        reader.lookup("r", HASHES, len(HASHES) * 16 + 1)
        reader.accept_hits("r", [])
        deadline = time.monotonic() + 10
        while len(reader.manager.state.remote) < len(HASHES):
            assert time.monotonic() < deadline
            reader.step()
            time.sleep(0.002)
        redis_standalone.cli("DEL", reader.executor._open_store().key(name_of(HASHES[0])).decode())
        assert reader.lookup("r", HASHES, len(HASHES) * 16 + 1) == 0  # queues the remote load
        reader.accept_hits("r", [])
        settle(reader)
        (failed,) = remote_events(reader, JobFailed)
        assert "absent" in failed.error
        assert HASHES[0] not in reader.manager.state.remote  # dropped on the first failure
        jobs_before = reader.manager.state.last_job_id
        for _ in range(3):  # no lookup -> load -> fail loop: nothing more is queued for it
            assert reader.lookup("r", HASHES, len(HASHES) * 16 + 1) == 0
            reader.accept_hits("r", [])
            settle(reader)
        assert reader.manager.state.last_job_id == jobs_before
        assert check_invariants(reader.manager.state) == []
    finally:
        writer.close()
        reader.close()


def test_killed_server_fails_remote_jobs_engine_serves_from_cpu_and_reconnects(redis_fresh) -> None:  # noqa: F811
    engine, kv = instance(redis_fresh.url, False, seed=1, deadline_ms=1000.0)
    try:
        redis_fresh.stop()
        store_prefix(engine, "w", (0, 1, 2, 3))  # the CPU-tier store lands; the remote one fails
        (failed,) = remote_events(engine, JobFailed)
        assert "unavailable" in failed.error.lower() or "connection" in failed.error.lower()
        assert engine.manager.state.remote == {}
        # the CPU tier keeps serving: the prefix hits and loads with the server down
        assert load_prefix(engine, "r", (8, 9, 10, 11)) == len(HASHES)
        for a, b in zip(blocks_of(kv, (8, 9, 10, 11)), blocks_of(random_kv(1), (0, 1, 2, 3))):
            assert a.equal(b)
        # the server comes back (empty): the next write-through reconnects by itself
        redis_fresh.start()
        engine.lookup("w2", (201, 202), 2 * 16 + 1)
        engine.blocks_computed("w2", (201, 202), (4, 5))
        settle(engine)
        assert list(engine.manager.state.remote) == [201, 202]
        assert check_invariants(engine.manager.state) == []
    finally:
        engine.close()


def test_hung_server_times_out_remote_jobs_without_blocking_the_step(redis_fresh) -> None:  # noqa: F811
    # a step that waited on the network would last at least one socket timeout (0.5 s)
    engine, _ = instance(redis_fresh.url, False, seed=1, deadline_ms=1000.0, timeout_s=0.5)
    try:
        redis_fresh.pause()
        engine.lookup("w", HASHES, len(HASHES) * 16 + 1)
        engine.blocks_computed("w", HASHES, (0, 1, 2, 3))
        slowest = 0.0
        deadline = time.monotonic() + 10
        while not remote_events(engine, JobTimedOut) and not remote_events(engine, JobFailed):
            assert time.monotonic() < deadline
            started = time.perf_counter()
            engine.step()
            slowest = max(slowest, time.perf_counter() - started)
            time.sleep(0.002)
        assert slowest < 0.25, slowest  # the network never stalls the engine's step
        redis_fresh.resume()
        settle(engine)
        # the timed-out job stays fenced (not live: settle does not wait for it) until its copy
        # reports over, which it does once the server answers again (F15)
        deadline = time.monotonic() + 10
        while engine.fences():
            assert time.monotonic() < deadline, "the timed-out remote job's fence never lifted"
            engine.step()
            time.sleep(0.002)
        assert engine.manager.state.fenced_slots == {}
        assert engine.manager.state.remote == {}
        assert all(engine.manager.state.is_resident(h) for h in HASHES)  # the CPU tier is intact
        assert check_invariants(engine.manager.state) == []
    finally:
        redis_fresh.resume()
        engine.close()


def test_a_block_absent_everywhere_is_probed_once_per_ttl_not_every_step(redis_standalone) -> None:  # noqa: F811
    redis_standalone.cli("FLUSHALL")
    engine, _ = instance(redis_standalone.url, False, seed=1, absent_ttl_s=60.0)
    try:
        for _ in range(20):  # a waiting request looks its prefix up every step
            assert engine.lookup("r", HASHES, len(HASHES) * 16 + 1) == 0
            engine.accept_hits("r", [])
            settle(engine)
            while engine.executor.probing():
                time.sleep(0.001)
        assert engine.executor.stats["probed_blocks"] == len(HASHES)
        assert engine.manager.state.remote == {} and engine.manager.state.last_job_id == 0
    finally:
        engine.close()


def test_oom_on_the_server_fails_the_remote_store_and_indexes_nothing(redis_fresh) -> None:  # noqa: F811
    info = redis_fresh.cli("INFO", "memory")
    used = int(next(line for line in info.splitlines() if line.startswith("used_memory:"))[12:])
    redis_fresh.cli("CONFIG", "SET", "maxmemory", str(used + 1024))  # full at the first block
    redis_fresh.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
    engine, _ = instance(redis_fresh.url, False, seed=1)
    try:
        store_prefix(engine, "w", (0, 1, 2, 3))
        (failed,) = remote_events(engine, JobFailed)
        assert "OutOfMemoryError" in failed.error and failed.direction == REMOTE_STORE
        assert engine.manager.state.remote == {}  # never visible remotely
        assert all(engine.manager.state.is_resident(h) for h in HASHES)  # the CPU tier holds them
        assert engine.manager.state.pin_count == {}
    finally:
        engine.close()


def test_a_cluster_node_killed_mid_run_fails_remote_jobs_and_the_cpu_tier_serves(redis_cluster_fresh) -> None:  # noqa: F811
    cluster = redis_cluster_fresh
    engine, kv = instance(cluster.url, True, seed=1, deadline_ms=1000.0)
    try:
        store_prefix(engine, "w", (0, 1, 2, 3))
        assert list(engine.manager.state.remote) == list(HASHES)
        cluster.nodes[1].stop()
        engine.lookup("w2", (301, 302, 303), 3 * 16 + 1)
        engine.blocks_computed("w2", (301, 302, 303), (4, 5, 6))
        settle(engine)  # the remote store fails or times out, within its deadline
        ends = [e for e in engine.manager.log.events() if type(e) in (JobFailed, JobTimedOut)]
        assert [e.direction for e in ends] == [REMOTE_STORE]
        assert not {301, 302, 303} & set(engine.manager.state.remote)
        assert load_prefix(engine, "r", (8, 9, 10, 11)) == len(HASHES)  # from the CPU tier
        for a, b in zip(blocks_of(kv, (8, 9, 10, 11)), blocks_of(random_kv(1), (0, 1, 2, 3))):
            assert a.equal(b)
        assert check_invariants(engine.manager.state) == []
    finally:
        engine.close()


@pytest.mark.parametrize("damage", ["payload", "header"])
def test_a_bad_entry_is_loaded_at_most_once_until_rewritten(redis_standalone, damage) -> None:  # noqa: F811
    """An invalid value that stays under a block's key costs one failed load at most (a damaged
    payload under a good header), or none (a header or length that cannot be this block's),
    over 30 requests; once a writer rewrites the key, the block is offered and loads again."""
    from kvflow.tiers.entry import HEADER_BYTES

    writer, _ = instance(redis_standalone.url, False, seed=1)
    reader, reader_kv = instance(redis_standalone.url, False, seed=2, absent_ttl_s=0.0)
    try:
        store_prefix(writer, "w", (0, 1, 2, 3))
        key = writer.executor._open_store().key(name_of(HASHES[2]))
        import redis

        raw = redis.Redis(host=redis_standalone.host, port=redis_standalone.port)
        good = raw.get(key)
        if damage == "payload":  # the head fits, the tag does not prove the bytes
            raw.set(key, good[:-1] + bytes([good[-1] ^ 1]))
        else:
            raw.set(key, b"XXXX" + good[4:])
        for i in range(30):
            reader.lookup(f"r{i}", HASHES, len(HASHES) * 16 + 1)
            reader.accept_hits(f"r{i}", [])
            settle(reader)
            while reader.executor.probing():
                time.sleep(0.001)
            reader.finish_request(f"r{i}")
        failed = [e for e in remote_events(reader, JobFailed) if e.direction == REMOTE_LOAD]
        assert len(failed) == (1 if damage == "payload" else 0), [e.error for e in failed]
        assert reader.executor.remote_rejected()["forged"] == (1 if damage == "payload" else 0)
        assert HASHES[2] not in reader.manager.state.remote
        assert all(reader.manager.state.is_resident(h) for h in HASHES[:2])  # the good ones loaded
        assert check_invariants(reader.manager.state) == []
        # rewritten (another writer stores the same block again): offered and loaded
        from kvflow.tiers.redis_store import RedisBlockStore, connect

        other = RedisBlockStore(connect(redis_standalone.url), writer.executor._open_store().codec)
        plain = [bytes(p) for p in writer.executor.slots.read(writer.manager.state.slot_of[HASHES[2]])]
        assert other.put([(name_of(HASHES[2]), plain)], time.monotonic() + 5) == [None]
        other.close()
        hits = 0
        for i in range(30, 40):
            hits = reader.lookup(f"r{i}", HASHES, len(HASHES) * 16 + 1)
            reader.accept_hits(f"r{i}", [])
            settle(reader)
            while reader.executor.probing():
                time.sleep(0.001)
            reader.finish_request(f"r{i}")
            if reader.manager.state.is_resident(HASHES[2]):
                break
        assert reader.manager.state.is_resident(HASHES[2]), hits
        assert len(good) > HEADER_BYTES
        raw.close()
    finally:
        writer.close()
        reader.close()


def test_F20_a_bfloat16_and_a_float16_deployment_of_one_model_share_no_entries(server) -> None:
    """Same model name, same page sizes: the KV's element type is part of the layout identity, so
    an fp16 reader never finds (nor loads) what a bf16 writer stored in the same keyspace."""
    import torch

    from kvflow.core.config import Config
    from kvflow.engine.sync import SyncEngine
    from kvflow.executors.torch.executor import TorchExecutor
    from kvflow.tiers.redis_store import redis_tier

    def engine_of(dtype: torch.dtype, seed: int) -> SyncEngine:
        kv = [t.to(dtype) for t in random_kv(seed)]
        config = Config(cpu_blocks=8, block_tokens=16, remote_blocks=1024, job_deadline_ms=2000.0)
        executor = redis_tier(
            TorchExecutor(kv, 8, device="cpu"), config, server.url, model="rig-model", cluster=is_cluster(server),
            keys=tier_keys(),
        )  # fmt: skip
        return SyncEngine(config, executor, keep_log=True)

    writer, reader = engine_of(torch.bfloat16, 1), engine_of(torch.float16, 2)
    try:
        store_prefix(writer, "w", (0, 1, 2, 3))
        assert writer.executor.stats["remote_stored_blocks"] == len(HASHES)
        assert load_prefix(reader, "r", (8, 9, 10, 11), timeout_s=1.0) == 0
        assert reader.executor.stats["remote_loaded_blocks"] == 0
        same = engine_of(torch.bfloat16, 3)  # positive control: another bf16 reader finds them
        try:
            assert load_prefix(same, "s", (8, 9, 10, 11)) == len(HASHES)
        finally:
            same.close()
    finally:
        writer.close()
        reader.close()


def test_F20_after_rotation_a_retired_keys_entries_are_refused_counted_and_logged_once(
    redis_standalone, restore_structlog: None  # noqa: F811
) -> None:
    """Written under the old key; a reader with the new key first and the old one still there
    is served; once the old key is retired the entries are refused ("unknown key"), each counted
    and logged once however often it is looked up, and the key material is in no log line."""
    from structlog.testing import capture_logs
    from tier_keys import KEY, NEW_KEY

    writer, _ = instance(redis_standalone.url, False, seed=1, keys=tier_keys(KEY))
    rotated, rotated_kv = instance(redis_standalone.url, False, seed=2, keys=tier_keys(NEW_KEY, KEY))
    retired, _ = instance(redis_standalone.url, False, seed=3, keys=tier_keys(NEW_KEY), absent_ttl_s=0.0)
    try:
        store_prefix(writer, "w", (0, 1, 2, 3))
        assert load_prefix(rotated, "r", (8, 9, 10, 11)) == len(HASHES)
        for a, b in zip(blocks_of(rotated_kv, (8, 9, 10, 11)), blocks_of(random_kv(1), (0, 1, 2, 3))):
            assert a.equal(b)
        with capture_logs() as logs:
            for i in range(3):
                assert load_prefix(retired, f"x{i}", (8, 9, 10, 11), timeout_s=0.3) == 0
        assert retired.executor.remote_rejected()["unknown key"] == len(HASHES)
        assert retired.executor.stats["remote_loaded_blocks"] == 0
        rejected = [e for e in logs if e["event"] == "kvflow.remote_entry_rejected"]
        assert len(rejected) == len(HASHES) and {e["reason"] for e in rejected} == {"unknown key"}
        assert all(k.hex() not in str(logs) for k in (KEY, NEW_KEY))
        assert not remote_events(retired, JobFailed)  # refused by its head: no load was tried
    finally:
        writer.close()
        rotated.close()
        retired.close()


def test_F20_an_attackers_rewritten_entries_serve_no_byte(redis_standalone) -> None:  # noqa: F811
    """An attacker with plain redis-py rewrites every stored entry: keeps its head, puts its own
    payload and (for an unkeyed entry) recomputes the checksum, or plants unkeyed entries for
    blocks not stored yet. The reader loads none of it; each refusal is counted."""
    import redis
    import xxhash

    from kvflow.tiers.entry import HEADER_BYTES

    writer, _ = instance(redis_standalone.url, False, seed=1)
    reader, reader_kv = instance(redis_standalone.url, False, seed=2, absent_ttl_s=0.0)
    raw = redis.Redis(host=redis_standalone.host, port=redis_standalone.port)
    try:
        store_prefix(writer, "w", (0, 1, 2, 3))
        for key in raw.keys("kvflow:*"):
            value = bytearray(raw.get(key))
            value[HEADER_BYTES:] = os.urandom(len(value) - HEADER_BYTES)
            head = bytes(value[: HEADER_BYTES - 16])
            value[HEADER_BYTES - 16 : HEADER_BYTES] = xxhash.xxh3_128_digest(head + bytes(value[HEADER_BYTES:]))
            raw.set(key, bytes(value))
        before = [t.clone() for t in blocks_of(reader_kv, (8, 9, 10, 11))]
        assert load_prefix(reader, "r", (8, 9, 10, 11), timeout_s=1.0) == 0
        assert reader.executor.remote_rejected()["forged"] == len(HASHES)
        for a, b in zip(blocks_of(reader_kv, (8, 9, 10, 11)), before):
            assert a.equal(b)  # no device block took a byte of it
        assert not any(reader.manager.state.is_resident(h) for h in HASHES)
    finally:
        raw.close()
        writer.close()
        reader.close()


def test_full_width_hashes_of_a_tenant_are_probed_and_loaded_by_name_and_never_for_another_tenant(
    redis_standalone,  # noqa: F811
) -> None:
    """Derived keys: the engine names the blocks of its probes and jobs itself (the tier
    cannot derive a tenant's names from keys)."""
    import hashlib
    from typing import Any

    from core_helpers import settle

    wide = [int.from_bytes(hashlib.sha256(b"wide %d" % i).digest(), "big") for i in range(4)]
    tokens = len(wide) * 16 + 1
    writer, writer_kv = instance(redis_standalone.url, False, seed=1)
    reader, reader_kv = instance(redis_standalone.url, False, seed=2)
    try:
        writer.lookup("w", wide, tokens, tenant="t")
        writer.blocks_computed("w", wide, (0, 1, 2, 3), tenant="t")
        settle(writer)
        assert writer.executor.stats["remote_stored_blocks"] == 4

        def look(tenant: str, until: Any) -> int:
            deadline = time.monotonic() + 2.0
            while not until(hits := reader.lookup(tenant, wide, tokens, tenant=tenant)) and time.monotonic() < deadline:
                reader.accept_hits(tenant, [])
                reader.step()
                time.sleep(0.002)
            return hits

        # another tenant: probed (by the names the engine gave), never found
        assert look("u", lambda _: reader.executor.stats["probed_blocks"] >= 4) == 0
        reader.accept_hits("u", [])
        assert look("t", lambda hits: hits == 4) == 4
        reader.accept_hits("t", (8, 9, 10, 11))
        settle(reader)
        assert reader.executor.stats["remote_loaded_blocks"] == 4
        for a, b in zip(blocks_of(reader_kv, (8, 9, 10, 11)), blocks_of(writer_kv, (0, 1, 2, 3))):
            assert a.equal(b)
    finally:
        writer.close()
        reader.close()


def test_a_probe_answers_every_key_it_was_asked_and_a_tier_reports_for_its_ranks_alone(redis_standalone) -> None:  # noqa: F811
    """``take_probed``: the keys each probe is over for and those it found; a key answered
    absent a moment ago is answered at once, without asking the server. A tier built for one
    rank of a world (each rank with a pool of its own) reports its jobs for that rank alone."""
    redis_standalone.cli("FLUSHALL")
    writer, _ = instance(redis_standalone.url, False, seed=1)
    try:
        store_prefix(writer, "w", (0, 1, 2, 3))
    finally:
        writer.close()
    kv = random_kv(2)
    config = Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, remote_blocks=64, world_size=2)
    tier = redis_tier(
        TorchExecutor(kv, CPU_BLOCKS, device="cpu"), config, redis_standalone.url, model=MODEL, keys=tier_keys(),
        ranks=(1,), absent_ttl_s=60.0,
    )  # fmt: skip
    try:
        absent = 999
        tier.probe([*HASHES, absent])
        deadline = time.monotonic() + 10
        while tier.probing():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        probed, found = tier.take_probed()
        assert sorted(probed) == sorted([*HASHES, absent]) and sorted(found) == sorted(HASHES)
        asked = tier.stats["probed_blocks"]
        tier.probe([absent])  # answered absent a moment ago: at once, the server not asked
        assert tier.take_probed() == ([absent], []) and tier.stats["probed_blocks"] == asked
        assert tier.take_found() == []
        job = TransferJob(job_id=1, direction=REMOTE_LOAD, hashes=(HASHES[0],), slots=(0,), device_blocks=())
        tier.submit([job])
        results: list = []
        while not results:
            assert time.monotonic() < deadline
            results = tier.poll()
            time.sleep(0.001)
        assert [(r.job_id, r.rank, r.ok) for r in results] == [(1, 1, True)]  # for rank 1 only
    finally:
        tier.close()
