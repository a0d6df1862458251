"""Refused shared-tier entries end to end, on the real tiers (a real ``redis-server``, real
files, real keys) with an attacker writing the store with plain redis-py: each refusal is in the
engine's trace (a probe's too, although nothing was loaded), ``kvflow incidents`` lists it with
its tier, reason and block (and, for a load, the failed job), ``kvflow inspect --block`` shows
it, and the trace replays and re-decides unchanged. No mocks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402
from core_helpers import settle  # noqa: E402
from redis_servers import redis_standalone  # noqa: E402, F401  (a fixture)
from remote_rig import CPU_BLOCKS, HASHES, MODEL, B, random_kv  # noqa: E402
from tier_keys import KEY, NEW_KEY, tier_keys  # noqa: E402

from kvflow.cli.main import main  # noqa: E402
from kvflow.core.config import Config  # noqa: E402
from kvflow.core.events import EntriesRefused, JobFailed  # noqa: E402
from kvflow.core.jobs import DISK_LOAD, REMOTE_LOAD  # noqa: E402
from kvflow.core.names import name_of, tenant_id  # noqa: E402
from kvflow.engine.sync import SyncEngine  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402
from kvflow.inspect.incidents import find_incidents  # noqa: E402
from kvflow.log.reader import TraceReader  # noqa: E402
from kvflow.replay.fold import replay  # noqa: E402
from kvflow.tiers.disk_executor import disk_tier  # noqa: E402
from kvflow.tiers.redis_store import redis_tier  # noqa: E402

TOKENS = len(HASHES) * B + 1


def remote_engine(url: str, seed: int, trace: Path | None = None, **tier: Any) -> SyncEngine:
    config = Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, remote_blocks=1024, job_deadline_ms=2000.0)
    tier.setdefault("keys", tier_keys())
    executor = redis_tier(TorchExecutor(random_kv(seed), CPU_BLOCKS, device="cpu"), config, url, model=MODEL, **tier)
    return SyncEngine(config, executor, trace_path=None if trace is None else str(trace))


def disk_engine(path: Path, seed: int, trace: Path | None = None, **tier: Any) -> SyncEngine:
    config = Config(
        cpu_blocks=CPU_BLOCKS, block_tokens=B, disk_blocks=32, disk_store_mode="write_through", job_deadline_ms=5_000.0
    )
    executor = disk_tier(TorchExecutor(random_kv(seed), CPU_BLOCKS, device="cpu"), config, path, model=MODEL, **tier)
    return SyncEngine(config, executor, trace_path=None if trace is None else str(trace))


def compute(engine: SyncEngine, rid: str, tenant: str | None = None) -> None:
    """``HASHES`` computed from device blocks 0-3 and stored (down to the lower tier)."""
    engine.lookup(rid, HASHES, TOKENS, tenant=tenant)
    engine.accept_hits(rid, [])
    engine.blocks_computed(rid, HASHES, (0, 1, 2, 3), tenant=tenant)
    settle(engine)
    engine.finish_request(rid)
    settle(engine)


def look_up(engine: SyncEngine, rid: str, tenant: str | None = None, times: int = 20) -> int:
    """Look ``HASHES`` up ``times`` times, a step and a wait for the probes between: the most
    hits any lookup had."""
    best = 0
    for _ in range(times):
        best = max(best, engine.lookup(rid, HASHES, TOKENS, tenant=tenant))
        engine.accept_hits(rid, [])
        settle(engine)
        deadline = time.monotonic() + 5
        while getattr(engine.executor, "probing", lambda: False)():
            assert time.monotonic() < deadline
            time.sleep(0.001)
    engine.step()  # (what the last probe refused is recorded)
    engine.finish_request(rid)
    return best


def recorded(trace: Path, kind: type) -> list[Any]:
    with TraceReader(str(trace)) as reader:
        return [r for _, r in reader.records() if type(r) is kind]


def redecides(trace: Path) -> None:
    for redecide in (False, True):
        result = replay(trace, redecide=redecide)
        assert result.divergence is None, result.divergence


def test_F20_another_tenants_entry_copied_under_a_tenants_key_is_refused_by_its_probe_and_shown(
    redis_standalone, tmp_path: Path  # noqa: F811
) -> None:
    """The attacker copies tenant alice's entries under tenant bob's keys: bob's probes refuse
    them by their heads ("another tenant"), nothing is loaded and no job fails, yet every
    refusal is in bob's trace once, and ``kvflow incidents`` lists them."""
    import redis

    alice = remote_engine(redis_standalone.url, seed=1)
    trace = tmp_path / "bob.jsonl"
    bob = remote_engine(redis_standalone.url, seed=2, trace=trace, absent_ttl_s=0.0)
    raw = redis.Redis(host=redis_standalone.host, port=redis_standalone.port)
    try:
        compute(alice, "a", tenant="alice")
        store = alice.executor._open_store()
        for h in HASHES:
            value = raw.get(store.key(name_of(h, tenant_id("alice"))))
            assert value is not None
            raw.set(store.key(name_of(h, tenant_id("bob"))), value)
        assert look_up(bob, "b", tenant="bob") == 0
        assert bob.executor.remote_rejected()["another tenant"] == len(HASHES)
        keys = list(bob.manager.keys(HASHES, "bob"))
    finally:
        raw.close()
        alice.close()
        bob.close()
    (event,) = recorded(trace, EntriesRefused)  # each value once, though looked up 20 times
    assert (event.tier, sorted(event.hashes), set(event.reasons), set(event.job_ids)) == (
        "remote", sorted(keys), {"another tenant"}, {0}
    )
    assert not recorded(trace, JobFailed)
    report = find_incidents(trace)
    assert report.incidents == []
    assert sorted(r.block for r in report.refused) == sorted(keys)
    assert {(r.tier, r.reason, r.job_id) for r in report.refused} == {("remote", "another tenant", None)}
    runner = CliRunner()
    found = json.loads(runner.invoke(main, ["incidents", str(trace), "--json"]).stdout)
    assert [f["kind"] for f in found] == ["refused_entry"] * len(HASHES)
    text = " ".join(runner.invoke(main, ["incidents", str(trace)], env={"COLUMNS": "80"}).stdout.split())
    assert f"{len(HASHES)} incidents of 0 jobs ({len(HASHES)} refused entries)" in text
    assert f"remote entry refused: block {keys[0]}" in text and "refused by a probe" in text
    history = runner.invoke(main, ["inspect", str(trace), "--block", str(keys[0])]).stdout
    assert "remote tier REFUSED" in history and "another tenant, probe" in history
    redecides(trace)


def test_F20_a_forged_remote_entry_is_refused_at_its_load_and_the_failed_load_is_named(
    redis_standalone, tmp_path: Path  # noqa: F811
) -> None:
    """The attacker alters one stored payload, keeping its head: the probe offers it, the load
    refuses it ("forged") and fails; the trace holds the refusal naming that load, which
    ``kvflow incidents`` links to the job's failure."""
    import redis

    writer = remote_engine(redis_standalone.url, seed=1)
    trace = tmp_path / "reader.jsonl"
    reader = remote_engine(redis_standalone.url, seed=2, trace=trace, absent_ttl_s=0.0)
    raw = redis.Redis(host=redis_standalone.host, port=redis_standalone.port)
    try:
        compute(writer, "w")
        key = writer.executor._open_store().key(name_of(HASHES[1]))
        good = raw.get(key)
        raw.set(key, good[:-1] + bytes([good[-1] ^ 1]))
        assert look_up(reader, "r") < len(HASHES)
        assert reader.executor.remote_rejected()["forged"] == 1
    finally:
        raw.close()
        writer.close()
        reader.close()
    (event,) = recorded(trace, EntriesRefused)
    (failed,) = [e for e in recorded(trace, JobFailed) if e.direction == REMOTE_LOAD]
    assert (event.tier, event.hashes, event.reasons, event.job_ids) == (
        "remote", (HASHES[1],), ("forged",), (failed.job_id,)
    )
    report = find_incidents(trace)
    (job,) = report.incidents
    (entry,) = report.refused
    assert (entry.block, entry.reason, entry.job_id, entry.job_seq) == (HASHES[1], "forged", job.job_id, job.seq)
    assert job.recovery["dropped_from_remote_index"] == list(failed.hashes)
    text = CliRunner().invoke(main, ["incidents", str(trace)], env={"COLUMNS": "200"}).stdout
    assert "1 failed, 1 refused entry" in text and "forged" in text
    redecides(trace)


def test_F20_a_disk_entry_under_a_retired_key_is_refused_at_its_load_and_shown(tmp_path: Path) -> None:
    """Written under a key since retired: the load refuses every entry ("unknown key"), the
    disk load fails, the blocks leave the disk index; the trace names each refusal and its
    load, and they are not refused again (nothing loads them again)."""
    first = disk_engine(tmp_path / "disk", seed=1, keys=tier_keys(KEY))
    compute(first, "a")
    first.close()
    trace = tmp_path / "retired.jsonl"
    retired = disk_engine(tmp_path / "disk", seed=3, trace=trace, keys=tier_keys(NEW_KEY))
    try:
        assert retired.counters.disk_blocks_restored == len(HASHES)
        assert look_up(retired, "r", times=5) == 0
        assert retired.executor.disk_rejected()["unknown key"] == len(HASHES)
        disk = retired.manager.state.disk
        assert disk is not None and not set(HASHES) & disk.slot_of.keys()
    finally:
        retired.close()
    (event,) = recorded(trace, EntriesRefused)
    (failed,) = [e for e in recorded(trace, JobFailed) if e.direction == DISK_LOAD]
    assert (event.tier, sorted(event.hashes), set(event.reasons), set(event.job_ids)) == (
        "disk", sorted(HASHES), {"unknown key"}, {failed.job_id}
    )
    report = find_incidents(trace)
    assert [(r.block, r.job_seq) for r in report.refused] == [(h, report.incidents[0].seq) for h in event.hashes]
    found = json.loads(CliRunner().invoke(main, ["incidents", str(trace), "--json"]).stdout)
    assert [f["kind"] for f in found] == ["job"] + ["refused_entry"] * len(HASHES)
    assert found[0]["recovery"]["dropped_from_disk_index"] == list(failed.hashes)
    assert {(f["tier"], f["reason"], f["job_id"]) for f in found[1:]} == {("disk", "unknown key", failed.job_id)}
    redecides(trace)


def test_a_tier_stacked_on_another_hands_over_both_tiers_refusals(redis_standalone, tmp_path: Path) -> None:  # noqa: F811
    """A remote tier wrapping a disk tier: one ``take_refused`` gives the disk's refusals, then
    the remote's, each once."""
    kv = random_kv(1)
    config = Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, remote_blocks=64, disk_blocks=8, job_deadline_ms=2000.0)
    disk = disk_tier(TorchExecutor(kv, CPU_BLOCKS, device="cpu"), config, tmp_path / "d", model=MODEL, keys=tier_keys())
    stacked = redis_tier(disk, config, redis_standalone.url, model=MODEL, keys=tier_keys())
    try:
        from kvflow.tiers.entry import Miss

        disk._refusals.add([(11, "forged", 3)])
        stacked._refuse(name_of(22), Miss("another tenant", seen=b"head"), 0)
        (from_disk, from_remote) = stacked.take_refused()
        assert (from_disk.tier, from_disk.block_hashes, from_disk.reasons, from_disk.job_ids) == (
            "disk", (11,), ("forged",), (3,)
        )
        assert (from_remote.tier, from_remote.block_hashes, from_remote.job_ids) == ("remote", (22,), (0,))
        stacked._refuse(name_of(22), Miss("another tenant", seen=b"head"), 0)  # the same value again
        assert stacked.take_refused() == []
    finally:
        stacked.close()
