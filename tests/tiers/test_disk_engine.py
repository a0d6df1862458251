"""The engine with a disk tier on a real file system: real bytes from device blocks through the
host pool to the disk and back into other device blocks; a second engine on the same directory
(a warm restart, also after SIGKILL) serving the first one's blocks; and the file system failing
underneath (full, read-only, the file cut or deleted, I/O errors at the OS calls) with the CPU
tier serving on, the tier degraded and saying so, and never a wrong byte. No mocks of the disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from core_helpers import settle
from tier_keys import tier_keys

torch = pytest.importorskip("torch")
pytest.importorskip("xxhash")

from kvflow.core.config import Config  # noqa: E402
from kvflow.core.errors import ConfigError  # noqa: E402
from kvflow.core.state.invariants import check_invariants  # noqa: E402
from kvflow.engine.sync import SyncEngine  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402
from kvflow.tiers.disk_executor import disk_tier  # noqa: E402

LAYERS, NUM_BLOCKS, CPU_BLOCKS, DISK_BLOCKS, B = 2, 16, 4, 32, 16
MODEL = "disk-rig-model"
KEYS = tier_keys()


def random_kv(seed: int) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((NUM_BLOCKS, 2, 4, 8), generator=gen) for _ in range(LAYERS)]


def blocks_of(kv: list[Any], blocks: tuple[int, ...]) -> list[Any]:
    idx = torch.tensor(blocks)
    return [t.index_select(0, idx).clone() for t in kv]


def instance(path: Path, seed: int, *, mode: str = "write_through", **tier: Any) -> tuple[SyncEngine, list[Any]]:
    kv = random_kv(seed)
    config = Config(
        cpu_blocks=CPU_BLOCKS, block_tokens=B, disk_blocks=DISK_BLOCKS, disk_store_mode=mode, job_deadline_ms=5_000.0
    )
    tier.setdefault("keys", None if tier.get("insecure_no_key") else KEYS)
    executor = disk_tier(TorchExecutor(kv, CPU_BLOCKS, device="cpu"), config, path, model=MODEL, **tier)
    return SyncEngine(config, executor, keep_log=True), kv


def compute(engine: SyncEngine, rid: str, hashes: tuple[int, ...], device_blocks: tuple[int, ...]) -> None:
    engine.lookup(rid, hashes, len(hashes) * B + 1)
    engine.accept_hits(rid, [])
    engine.blocks_computed(rid, hashes, device_blocks)
    settle(engine)  # the CPU-tier store, then its copy to disk
    engine.finish_request(rid)
    settle(engine)


def load(engine: SyncEngine, rid: str, hashes: tuple[int, ...], device_blocks: tuple[int, ...]) -> int:
    """Look up until nothing more is on its way from disk, then load the CPU-tier hits."""
    n_tokens = len(hashes) * B + 1
    deadline = time.monotonic() + 20.0
    while True:
        hits = engine.lookup(rid, hashes, n_tokens)
        if not engine.arriving(hashes, n_tokens) or time.monotonic() > deadline:
            break
        engine.accept_hits(rid, [])
        settle(engine)
    if hits:
        engine.accept_hits(rid, device_blocks[:hits])
        settle(engine)
    engine.finish_request(rid)
    return hits


FIRST, SECOND = (11, 12, 13, 14), (21, 22, 23, 24)


def test_blocks_evicted_from_the_cpu_tier_come_back_from_disk_byte_for_byte(tmp_path: Path) -> None:
    engine, kv = instance(tmp_path / "disk", seed=1)
    try:
        compute(engine, "a", FIRST, (0, 1, 2, 3))
        compute(engine, "b", SECOND, (4, 5, 6, 7))  # the CPU tier (4 slots) now holds only SECOND
        assert not any(engine.manager.state.is_resident(h) for h in FIRST)
        assert engine.counters.disk_blocks_stored == 8
        assert load(engine, "c", FIRST, (8, 9, 10, 11)) == 4
        assert engine.counters.disk_blocks_loaded == 4
        for got, want in zip(blocks_of(kv, (8, 9, 10, 11)), blocks_of(kv, (0, 1, 2, 3))):
            assert got.equal(want)
        assert check_invariants(engine.manager.state) == []
    finally:
        engine.close()


def test_F22_a_second_engine_on_the_same_directory_serves_the_first_ones_blocks(tmp_path: Path) -> None:
    first, first_kv = instance(tmp_path / "disk", seed=1)
    compute(first, "a", FIRST, (0, 1, 2, 3))
    first.close()
    second, second_kv = instance(tmp_path / "disk", seed=2)
    try:
        assert second.counters.disk_blocks_restored == 4
        assert load(second, "r", FIRST, (8, 9, 10, 11)) == 4
        for got, want in zip(blocks_of(second_kv, (8, 9, 10, 11)), blocks_of(first_kv, (0, 1, 2, 3))):
            assert got.equal(want)
    finally:
        second.close()


def test_another_model_on_the_same_directory_starts_cold(tmp_path: Path) -> None:
    first, _ = instance(tmp_path / "disk", seed=1)
    compute(first, "a", FIRST, (0, 1, 2, 3))
    first.close()
    kv = random_kv(3)
    config = Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, disk_blocks=DISK_BLOCKS)
    other = SyncEngine(config, disk_tier(TorchExecutor(kv, CPU_BLOCKS, device="cpu"), config, tmp_path / "disk", model="another", keys=KEYS))
    try:
        assert other.counters.disk_blocks_restored == 0
        assert load(other, "r", FIRST, (8, 9, 10, 11)) == 0
    finally:
        other.close()


WRITER = """
import sys, time
sys.path[:0] = [{tests!r}, {helpers!r}]
from pathlib import Path
from test_disk_engine import instance, compute
engine, kv = instance(Path({path!r}), seed=1)
compute(engine, "a", (11, 12, 13, 14), (0, 1, 2, 3))
print("STORED", flush=True)
time.sleep(60)
"""


def test_F22_a_warm_restart_after_sigkill(tmp_path: Path) -> None:
    """The writer is killed without closing anything: what it reported stored is served by the
    next engine, byte for byte."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(tests=str(Path(__file__).parent), helpers=str(Path(__file__).parents[1]), path=str(tmp_path / "disk")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "STORED"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    second, kv = instance(tmp_path / "disk", seed=2)
    try:
        assert second.counters.disk_blocks_restored == 4
        assert load(second, "r", FIRST, (8, 9, 10, 11)) == 4
        for got, want in zip(blocks_of(kv, (8, 9, 10, 11)), blocks_of(random_kv(1), (0, 1, 2, 3))):
            assert got.equal(want)
    finally:
        second.close()


def test_F20_a_damaged_entry_is_a_miss_dropped_once_and_the_request_computes(tmp_path: Path) -> None:
    first, _ = instance(tmp_path / "disk", seed=1)
    compute(first, "a", FIRST, (0, 1, 2, 3))
    first.close()
    data = tmp_path / "disk" / "data"
    with open(data, "r+b") as f:  # flip a payload byte of every slot the first run wrote
        size = os.path.getsize(data) // DISK_BLOCKS
        for slot in range(4):
            f.seek(slot * size + 4096 + 7)
            byte = f.read(1)
            f.seek(slot * size + 4096 + 7)
            f.write(bytes([byte[0] ^ 0xFF]))
    second, _ = instance(tmp_path / "disk", seed=2)
    try:
        assert load(second, "r", FIRST, (8, 9, 10, 11)) == 0  # never a wrong byte
        failed = [e for e in second.manager.log.events() if type(e).__name__ == "JobFailed"]
        assert len(failed) == 1 and "forged" in failed[0].error
        assert second.executor.disk_rejected()["forged"] == 4
        assert second.manager.state.disk is not None and FIRST[0] not in second.manager.state.disk.slot_of
        assert load(second, "r2", FIRST, (8, 9, 10, 11)) == 0
        assert len([e for e in second.manager.log.events() if type(e).__name__ == "JobFailed"]) == 1  # not again
    finally:
        second.close()


def test_the_data_file_deleted_underneath_degrades_the_tier_and_the_cpu_tier_serves_on(
    tmp_path: Path, restore_structlog: None
) -> None:
    from structlog.testing import capture_logs

    engine, kv = instance(tmp_path / "disk", seed=1)
    try:
        compute(engine, "a", FIRST, (0, 1, 2, 3))
        (tmp_path / "disk" / "data").unlink()
        with capture_logs() as logs:
            compute(engine, "b", SECOND, (4, 5, 6, 7))  # its copy to disk fails
            engine.step()
        assert engine.watch.disk_problem is not None and "deleted" in engine.watch.disk_problem
        assert engine.counters.disk_degraded == 1
        assert any(e["event"] == "kvflow.disk_degraded" for e in logs)
        assert load(engine, "c", SECOND, (8, 9, 10, 11)) == 4  # the CPU tier still serves
        assert load(engine, "d", FIRST, (12, 13, 14, 15)) == 0  # the disk does not: a miss, computed
        assert check_invariants(engine.manager.state) == []
    finally:
        engine.close()


def test_a_config_and_a_tier_of_different_sizes_are_refused(tmp_path: Path) -> None:
    kv = random_kv(1)
    config = Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, disk_blocks=DISK_BLOCKS)
    executor = disk_tier(TorchExecutor(kv, CPU_BLOCKS, device="cpu"), config, tmp_path / "disk", model=MODEL, keys=KEYS)
    try:
        with pytest.raises(ConfigError, match="disk_blocks=64"):
            SyncEngine(Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, disk_blocks=64), executor)
        with pytest.raises(ConfigError, match="serves a disk tier"):
            SyncEngine(Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, disk_blocks=8), TorchExecutor(kv, CPU_BLOCKS, device="cpu"))
    finally:
        executor.close()


def test_a_load_does_not_wait_behind_a_slow_spill(tmp_path: Path) -> None:
    """Stores and loads run in threads of their own: a disk load submitted while a disk store
    is still writing (held up at the file's seam) finishes first."""
    import threading

    from kvflow.core.jobs import DISK_LOAD, DISK_STORE, TransferJob
    from kvflow.core.names import name_of

    engine, kv = instance(tmp_path / "disk", seed=1)
    compute(engine, "a", FIRST, (0, 1, 2, 3))  # on disk in slots 0-3
    tier = engine.executor
    release = threading.Event()
    real_store = tier.disk.store

    def slow_store(items):  # type: ignore[no-untyped-def]
        release.wait(10.0)
        return real_store(items)

    tier.disk.store = slow_store
    try:
        disk_slot = engine.manager.state.disk.slot_of[FIRST[0]]
        tier.submit([TransferJob(job_id=9001, direction=DISK_STORE, device_blocks=(), slots=(0,), hashes=(77,), disk_slots=(20,), names=(name_of(77),))])
        tier.submit([TransferJob(job_id=9002, direction=DISK_LOAD, device_blocks=(), slots=(1,), hashes=(FIRST[0],), disk_slots=(disk_slot,), names=(name_of(FIRST[0]),))])
        deadline = time.monotonic() + 10.0
        done: list[Any] = []
        while not done and time.monotonic() < deadline:
            done = [r for r in tier.poll() if r.job_id in (9001, 9002)]
            time.sleep(0.005)
        assert [r.job_id for r in done] == [9002] and done[0].ok  # the load, while the store waits
    finally:
        release.set()
        engine.close()


def test_F20_a_bfloat16_and_a_float16_deployment_of_one_model_never_read_each_others_blocks(tmp_path: Path) -> None:
    """Same model name, same page sizes (2 bytes an element either way): the KV's element type is
    part of the layout identity, so the fp16 engine starts the bf16 one's directory cold."""
    def engine_of(dtype: Any, seed: int) -> tuple[SyncEngine, list[Any]]:
        kv = [t.to(dtype) for t in random_kv(seed)]
        config = Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, disk_blocks=DISK_BLOCKS, disk_store_mode="write_through")
        return SyncEngine(config, disk_tier(TorchExecutor(kv, CPU_BLOCKS, device="cpu"), config, tmp_path / "disk", model=MODEL, keys=KEYS)), kv

    bf16, _ = engine_of(torch.bfloat16, 1)
    compute(bf16, "a", FIRST, (0, 1, 2, 3))
    bf16.close()
    fp16, _ = engine_of(torch.float16, 2)
    try:
        assert fp16.executor.disk.restart_note.startswith("cold") and "bfloat16" in fp16.executor.disk.restart_note
        assert fp16.counters.disk_blocks_restored == 0
        assert load(fp16, "r", FIRST, (8, 9, 10, 11)) == 0
    finally:
        fp16.close()


def test_a_disk_tier_needs_a_key_or_the_opt_out_by_name(tmp_path: Path) -> None:
    kv = random_kv(1)
    config = Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, disk_blocks=DISK_BLOCKS)
    inner = TorchExecutor(kv, CPU_BLOCKS, device="cpu")
    try:
        with pytest.raises(ConfigError) as err:
            disk_tier(inner, config, tmp_path / "disk", model=MODEL)
        assert str(err.value) == (
            "the disk tier needs a key: keys=TierKeys.from_file(PATH) or TierKeys.from_env(NAME); "
            "insecure_no_key=True for a private single-tenant deployment"
        )
        assert not (tmp_path / "disk").exists()  # refused before anything was made
        with pytest.raises(ConfigError, match="^disk tier: shard must be"):
            disk_tier(inner, config, tmp_path / "disk", model=MODEL, keys=KEYS, shard=(1, 1))
    finally:
        inner.close()
    engine, _ = instance(tmp_path / "disk", seed=1, insecure_no_key=True)
    try:
        compute(engine, "a", FIRST, (0, 1, 2, 3))
        assert engine.counters.disk_blocks_stored == 4
    finally:
        engine.close()


def test_F20_after_rotation_a_retired_keys_disk_entries_are_refused_counted_and_dropped(tmp_path: Path) -> None:
    from tier_keys import KEY, NEW_KEY

    first, first_kv = instance(tmp_path / "disk", seed=1, keys=tier_keys(KEY))
    compute(first, "a", FIRST, (0, 1, 2, 3))
    first.close()
    rotated, rotated_kv = instance(tmp_path / "disk", seed=2, keys=tier_keys(NEW_KEY, KEY))
    try:
        assert load(rotated, "r", FIRST, (8, 9, 10, 11)) == 4
        for got, want in zip(blocks_of(rotated_kv, (8, 9, 10, 11)), blocks_of(first_kv, (0, 1, 2, 3))):
            assert got.equal(want)
        compute(rotated, "b", SECOND, (4, 5, 6, 7))  # written under the new key
    finally:
        rotated.close()
    retired, _ = instance(tmp_path / "disk", seed=3, keys=tier_keys(NEW_KEY))
    try:
        assert retired.counters.disk_blocks_restored == 8  # the journal vouches for both eras
        from structlog.testing import capture_logs

        with capture_logs() as logged:
            assert load(retired, "r", FIRST, (8, 9, 10, 11)) == 0  # the old key's: refused
            assert load(retired, "r2", FIRST, (8, 9, 10, 11)) == 0
        assert retired.executor.disk_rejected()["unknown key"] == 4
        assert retired.manager.state.disk is not None and FIRST[0] not in retired.manager.state.disk.slot_of
        rejected = [e for e in logged if e["event"] == "kvflow.disk_entry_rejected"]
        assert len(rejected) == 4 and {e["reason"] for e in rejected} == {"unknown key"}  # logged once each
        assert not any(k.hex() in repr(logged) for k in (KEY, NEW_KEY))
        assert retired.executor.disk_rejected()["unknown key"] == 4  # dropped: not tried again
        assert load(retired, "s", SECOND, (8, 9, 10, 11)) == 4  # the new key's: served
    finally:
        retired.close()
