"""Attacks on a shared Redis tier, by a second process (tests/attacker.py) that reaches the real
server with plain redis-py and knows everything public (kvflow's entry format and keys, the
model's shape, the prompts a victim will send) but none of the victim's keys.

Each attack: the victim's reader serves 0 bytes of the attacker's (or another tenant's, or
another deployment's) KV, its device blocks are untouched, and the refusal is counted by reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from redis_servers import redis_fresh, require_redis  # noqa: F401
from remote_rig import HASHES, MODEL, B, blocks_of, instance, load_prefix, random_kv, store_prefix
from tier_keys import KEY, NEW_KEY, tier_keys

from kvflow.core.names import name_of, tenant_id
from kvflow.engine.sync import SyncEngine

ATTACKER = Path(__file__).resolve().parents[1] / "attacker.py"
ROOT = Path(__file__).resolve().parents[2]
WRITER_BLOCKS, READER_BLOCKS = (0, 1, 2, 3), (8, 9, 10, 11)


@pytest.fixture(autouse=True)
def _needs_redis() -> None:
    require_redis()


def attack(url: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(ATTACKER), url, *args], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def store(engine: SyncEngine, request_id: str, tenant: str | None = None) -> None:
    store_prefix(engine, request_id, WRITER_BLOCKS, tenant)


def load(engine: SyncEngine, request_id: str, tenant: str | None = None, timeout_s: float = 1.0) -> int:
    return load_prefix(engine, request_id, READER_BLOCKS, timeout_s, tenant)


def served_nothing(reader: SyncEngine, kv: list[torch.Tensor], hits: int, tenant: str | None = None) -> None:
    """0 bytes of foreign KV served: no hit, the device blocks as they were, nothing on the tier."""
    assert hits == 0
    assert all(a.equal(b) for a, b in zip(blocks_of(kv, READER_BLOCKS), blocks_of(random_kv(2), READER_BLOCKS)))
    tid = tenant_id(tenant)
    assert not any(reader.manager.state.is_resident(name_of(h, tid).key) for h in HASHES)
    assert reader.executor.stats["remote_loaded_blocks"] == 0


@pytest.mark.parametrize(("action", "reason"), [("rewrite", "forged"), ("unkey", "unkeyed")])
def test_F20_entries_rewritten_by_an_attacker_serve_no_byte(redis_fresh, action: str, reason: str) -> None:  # noqa: F811
    """The attacker keeps each entry's head and puts its own payload, with the tag recomputed as
    an unkeyed entry's checksum ("rewrite": the head still says sealed) or the whole entry made a
    valid unkeyed one ("unkey"). A reader with keys refuses every one."""
    writer, _ = instance(redis_fresh.url, False, seed=1)
    reader, kv = instance(redis_fresh.url, False, seed=2, absent_ttl_s=0.0)
    try:
        store(writer, "w")
        assert attack(redis_fresh.url, action)["wrote"] == len(HASHES)
        served_nothing(reader, kv, load(reader, "r"))
        assert reader.executor.remote_rejected()[reason] == len(HASHES)
    finally:
        writer.close()
        reader.close()


def test_F20_entries_forged_ahead_of_the_victim_serve_no_byte(redis_fresh, tmp_path: Path) -> None:  # noqa: F811
    """Before anything is stored, the attacker writes entries for the hashes the victim will look
    up, built from public facts (the model's name and shape, the block size): unkeyed ones with a
    right checksum, and ones sealed with a key of the attacker's own."""
    reader, kv = instance(redis_fresh.url, False, seed=2, absent_ttl_s=0.0)
    try:
        pool = reader.executor.slots
        spec = {"model": MODEL, "page_bytes": list(pool.page_bytes), "block_tokens": B, "kv_dtype": reader.executor.kv_dtype}
        (tmp_path / "layout.json").write_text(json.dumps(spec))
        assert attack(redis_fresh.url, "prewrite", str(tmp_path / "layout.json"), *map(str, HASHES))["wrote"] == 4
        served_nothing(reader, kv, load(reader, "r"))
        rejected = reader.executor.remote_rejected()
        assert (rejected["unkeyed"], rejected["unknown key"]) == (2, 2)
    finally:
        reader.close()


def test_F21_a_tenants_entries_copied_under_another_tenants_keys_serve_no_byte(redis_fresh) -> None:  # noqa: F811
    """Same deployment, same keys: the attacker copies tenant alice's entries under the keys
    tenant mallory's requests look up. Mallory gets none of alice's KV; alice still does."""
    writer, _ = instance(redis_fresh.url, False, seed=1)
    mallory, kv = instance(redis_fresh.url, False, seed=2, absent_ttl_s=0.0)
    alice, alice_kv = instance(redis_fresh.url, False, seed=3)
    try:
        store(writer, "w", tenant="alice")
        copied = attack(redis_fresh.url, "copy", tenant_id("alice").hex(), tenant_id("mallory").hex())
        assert copied["wrote"] == len(HASHES)
        served_nothing(mallory, kv, load(mallory, "m", tenant="mallory"), tenant="mallory")
        assert mallory.executor.remote_rejected()["another tenant"] == len(HASHES)
        assert load(alice, "a", tenant="alice", timeout_s=20.0) == len(HASHES)  # (the copies' source serves its tenant)
        written = blocks_of(random_kv(1), WRITER_BLOCKS)
        assert all(a.equal(b) for a, b in zip(blocks_of(alice_kv, READER_BLOCKS), written))
    finally:
        writer.close()
        mallory.close()
        alice.close()


def test_F20_an_old_entry_replayed_after_its_key_was_retired_serves_no_byte(redis_fresh, tmp_path: Path) -> None:  # noqa: F811
    """The attacker saves the entries written under the old key; the operator rotates (the new
    key writes, the old one reads) and the blocks are stored again, then retires the old key; the
    attacker writes the saved entries back. A reader with the new key alone refuses them."""
    saved = str(tmp_path / "saved.json")
    old_writer, _ = instance(redis_fresh.url, False, seed=1, keys=tier_keys(KEY))
    new_writer, _ = instance(redis_fresh.url, False, seed=1, keys=tier_keys(NEW_KEY, KEY))
    control, control_kv = instance(redis_fresh.url, False, seed=2, keys=tier_keys(NEW_KEY))
    reader, kv = instance(redis_fresh.url, False, seed=2, keys=tier_keys(NEW_KEY), absent_ttl_s=0.0)
    try:
        store(old_writer, "w")
        assert attack(redis_fresh.url, "save", saved)["wrote"] == len(HASHES)
        # the old entries expire (else the rotated writer, which still reads them, finds them there
        # and does not store them again); its CPU tier is empty: it stores them under the new key
        redis_fresh.cli("FLUSHALL")
        store(new_writer, "w2")
        assert load(control, "c", timeout_s=20.0) == len(HASHES)  # the rotated entries serve
        assert attack(redis_fresh.url, "restore", saved)["wrote"] == len(HASHES)
        served_nothing(reader, kv, load(reader, "r"))
        assert reader.executor.remote_rejected()["unknown key"] == len(HASHES)
    finally:
        for engine in (old_writer, new_writer, control, reader):
            engine.close()


def test_F20_a_bfloat16_deployments_entries_copied_under_a_float16_ones_keys_serve_no_byte(redis_fresh) -> None:  # noqa: F811
    """Two deployments of one model share a keyspace and a key, one in bfloat16, one in float16
    (the same byte counts). The attacker copies the bf16 entries under the keys the fp16 reader
    looks up: refused as another layout, never values off by whole units."""
    from kvflow.core.config import Config
    from kvflow.executors.torch.executor import TorchExecutor
    from kvflow.tiers.redis_store import redis_tier

    def deployment(dtype: torch.dtype, seed: int) -> tuple[SyncEngine, list[torch.Tensor]]:
        kv = [t.to(dtype) for t in random_kv(seed)]
        config = Config(cpu_blocks=8, block_tokens=B, remote_blocks=1024, job_deadline_ms=2000.0)
        executor = redis_tier(
            TorchExecutor(kv, 8, device="cpu"), config, redis_fresh.url, model=MODEL, keys=tier_keys(), absent_ttl_s=0.0
        )  # fmt: skip
        return SyncEngine(config, executor, keep_log=True), kv

    writer, _ = deployment(torch.bfloat16, 1)
    reader, kv = deployment(torch.float16, 2)
    try:
        store(writer, "w")
        layouts = {key.split(b":")[1] for key in _keys(redis_fresh.url)}
        (bf16,) = layouts
        fp16 = reader.executor._open_store().key(name_of(HASHES[0])).split(b":")[1]
        assert fp16 != bf16
        assert attack(redis_fresh.url, "copy", bf16.decode(), fp16.decode())["wrote"] == len(HASHES)
        before = [t.clone() for t in blocks_of(kv, READER_BLOCKS)]
        assert load(reader, "r") == 0
        assert all(a.equal(b) for a, b in zip(blocks_of(kv, READER_BLOCKS), before))
        assert reader.executor.remote_rejected()["another layout"] == len(HASHES)
    finally:
        writer.close()
        reader.close()


def _keys(url: str) -> list[bytes]:
    import redis

    server = redis.Redis.from_url(url)
    try:
        return sorted(server.scan_iter(match=b"kvflow:*"))
    finally:
        server.close()
