"""The engine with the REAL TorchExecutor: bytes go out to the host pool and come back.

CPU always; CUDA when present (same code path). Two rank processes (RankGroup) on the CPU
through a SyncEngine with world_size 2: few tests, since spawning ranks is slow.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvflow.core.config import Config  # noqa: E402
from kvflow.core.state.invariants import check_invariants  # noqa: E402
from kvflow.engine.notices import StepReport, merge_reports  # noqa: E402
from kvflow.engine.sync import SyncEngine  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402
from kvflow.executors.torch.ranks import RandomKV, RankGroup  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LAYERS, NUM_BLOCKS, CPU_BLOCKS, B = 4, 32, 12, 16
A_HASHES = (11, 12, 13)
A_BLOCKS = (0, 1, 2)
B_BLOCKS = (20, 21, 22)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def random_kv(device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((NUM_BLOCKS, 2, 16, 8), generator=gen).to(device) for _ in range(LAYERS)]


def overwrite(kv: list[torch.Tensor], seed: int) -> None:
    fresh = random_kv("cpu", seed)
    for t, f in zip(kv, fresh, strict=True):
        t.copy_(f.to(t.device))


def blocks_of(kv: list[torch.Tensor], blocks: tuple[int, ...]) -> list[torch.Tensor]:
    idx = torch.tensor(blocks, device=kv[0].device)
    return [t.index_select(0, idx).cpu() for t in kv]


def step_until_idle(engine: SyncEngine, timeout_s: float = 30.0) -> StepReport:
    """Step (real clock) until no job is live and no fence is left; every report merged.

    A job that failed on one rank while another rank still copies is no longer live, but it
    is fenced (F15): its device blocks come back only once the last rank reports. With two
    rank processes that order is up to the scheduler, so idle must wait for the fences too."""
    merged = engine.step()
    deadline = time.monotonic() + timeout_s
    while engine.has_live_jobs() or engine.fences():
        assert time.monotonic() < deadline, "jobs never finished or their fences never lifted"
        time.sleep(0.001)
        merge_reports(merged, engine.step())
    return merged


@pytest.fixture
def rig(device: str) -> Iterator[tuple[SyncEngine, TorchExecutor, list[torch.Tensor]]]:
    rigs: list[SyncEngine] = []

    def build(**executor: Any) -> tuple[SyncEngine, TorchExecutor, list[torch.Tensor]]:
        kv = random_kv(device, seed=1)
        ex = TorchExecutor(kv, CPU_BLOCKS, device=device, **executor)
        engine = SyncEngine(
            Config(cpu_blocks=CPU_BLOCKS, block_tokens=B), ex, bytes_per_block=ex.layout.block_bytes
        )
        rigs.append(engine)
        return engine, ex, kv

    yield build  # type: ignore[misc]
    for engine in rigs:
        engine.close()


def store_request_a(engine: SyncEngine) -> None:
    engine.lookup("A", A_HASHES, 3 * B + 1)
    job = engine.blocks_computed("A", A_HASHES, A_BLOCKS)
    assert job is not None
    first = engine.step()
    assert [j.job_id for j in first.submitted] == [job]
    drained = engine.drain(timeout_ms=30_000)
    assert not engine.has_live_jobs()
    assert drained.stores_finished == [job]
    assert sorted(drained.released_device_blocks) == list(A_BLOCKS)
    assert engine.counters.jobs_completed == 1 and engine.counters.blocks_stored == 3
    engine.finish_request("A")


def assert_clean(engine: SyncEngine) -> None:
    assert check_invariants(engine.manager.state) == []
    assert engine.held_device_blocks() == []
    assert not engine.has_live_jobs()


def test_stored_blocks_come_back_byte_for_byte_into_other_device_blocks(rig: Any) -> None:
    engine, ex, kv = rig()
    original = blocks_of(kv, A_BLOCKS)
    store_request_a(engine)
    assert ex.stats["bytes_stored"] == 3 * ex.layout.block_bytes

    overwrite(kv, seed=2)  # the device blocks are reused for other data
    assert not all(torch.equal(a, b) for a, b in zip(blocks_of(kv, A_BLOCKS), original, strict=True))
    before_b = blocks_of(kv, B_BLOCKS)

    assert engine.lookup("B", (*A_HASHES, 14), 3 * B + 7) == 3
    job = engine.accept_hits("B", B_BLOCKS)
    report = step_until_idle(engine)
    assert report.loads_finished == [("B", job)]
    assert report.loads_failed == []
    assert sorted(report.released_device_blocks) == list(B_BLOCKS)
    for got, want, was in zip(blocks_of(kv, B_BLOCKS), original, before_b, strict=True):
        assert torch.equal(got, want)
        assert not torch.equal(got, was)
    # nothing else was written
    untouched = tuple(b for b in range(NUM_BLOCKS) if b not in B_BLOCKS)
    assert all(
        torch.equal(x, y)
        for x, y in zip(blocks_of(kv, untouched), blocks_of(random_kv("cpu", 2), untouched), strict=True)
    )
    engine.finish_request("B")
    assert_clean(engine)
    assert engine.counters.bytes_loaded == 3 * ex.layout.block_bytes


def test_F1_an_injected_load_failure_reports_the_device_blocks_and_keeps_the_entries(rig: Any) -> None:
    engine, ex, kv = rig(fail_job_ids={2})  # job 1: A's store; job 2: B's load
    store_request_a(engine)
    assert engine.lookup("B", (*A_HASHES, 14), 3 * B + 7) == 3
    job = engine.accept_hits("B", B_BLOCKS)
    assert job == 2
    report = step_until_idle(engine)
    assert report.loads_finished == []
    [failure] = report.loads_failed
    assert (failure.request_id, failure.job_id, failure.device_blocks) == ("B", 2, B_BLOCKS)
    assert "injected fault" in failure.error
    assert sorted(report.released_device_blocks) == list(B_BLOCKS)
    state = engine.manager.state
    assert all(state.is_resident(h) and state.evictable(h) for h in A_HASHES)  # F1
    engine.finish_request("B")
    assert_clean(engine)
    # the entries are still good: a retry loads them
    original = blocks_of(random_kv("cpu", 1), A_BLOCKS)
    assert engine.lookup("C", (*A_HASHES, 14), 3 * B + 7) == 3
    engine.accept_hits("C", (25, 26, 27))
    assert len(step_until_idle(engine).loads_finished) == 1
    assert all(torch.equal(x, y) for x, y in zip(blocks_of(kv, (25, 26, 27)), original, strict=True))


def spin_until_over(event: Any) -> None:
    """Spin, as a busy scheduler does, until ``event`` has happened (None: on the CPU device
    the copy ended inside ``submit``)."""
    while event is not None and not event.query():
        pass


def test_F6_a_scheduler_spinning_on_step_learns_of_each_copy_at_its_next_step(rig: Any) -> None:
    """The engine's thread spins on ``step()`` and no other thread runs (a switch interval of
    60 s): the step after the one that submitted a copy reports it, once it is over."""
    engine, ex, kv = rig(fail_job_ids={2})  # job 1: A's store; job 2: B's load (fails)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        engine.lookup("A", A_HASHES, 3 * B + 1)
        store = engine.blocks_computed("A", A_HASHES, A_BLOCKS)
        submitted = engine.step()
        spin_until_over(ex.last_event("store"))
        stored = engine.step()
        engine.finish_request("A")
        assert engine.lookup("B", (*A_HASHES, 14), 3 * B + 7) == 3
        load = engine.accept_hits("B", B_BLOCKS)
        engine.step()
        spin_until_over(ex.last_event("load"))
        failed = engine.step()
    finally:
        sys.setswitchinterval(interval)
    assert [j.job_id for j in submitted.submitted] == [store] and submitted.stores_finished == []
    assert stored.stores_finished == [store]
    assert [(f.request_id, f.job_id) for f in failed.loads_failed] == [("B", load)]
    engine.finish_request("B")
    assert_clean(engine)


def test_F17_a_corrupted_host_slot_fails_the_load_and_leaves_the_tier(rig: Any) -> None:
    engine, ex, kv = rig(checksums=True)
    store_request_a(engine)
    slot = engine.manager.state.entries[A_HASHES[1]].slot
    region = ex.layout.regions[2]
    host = ex.pool.region(2, region.word_dtype)
    host[slot, 5] += 1  # one word of one page flips on the host
    engine.lookup("B", (*A_HASHES, 14), 3 * B + 7)
    engine.accept_hits("B", B_BLOCKS)
    report = step_until_idle(engine)
    [failure] = report.loads_failed
    assert failure.device_blocks == B_BLOCKS
    assert "checksum mismatch" in failure.error
    # F17: the corrupt entry left the tier (the good ones stay), so nothing offers it again
    state = engine.manager.state
    assert not state.is_resident(A_HASHES[1])
    assert state.is_resident(A_HASHES[0]) and state.is_resident(A_HASHES[2])
    engine.finish_request("B")
    assert_clean(engine)
    # the engine's recompute stores the block again (no dedupe against the bad copy) and a
    # later load of the whole prefix brings back the right bytes
    assert engine.lookup("C", (*A_HASHES, 14), 3 * B + 7) == 1
    engine.accept_hits("C", (30,))
    step_until_idle(engine)
    assert engine.blocks_computed("C", A_HASHES, A_BLOCKS) is not None
    step_until_idle(engine)
    engine.finish_request("C")
    assert engine.lookup("D", (*A_HASHES, 14), 3 * B + 7) == 3
    engine.accept_hits("D", (25, 26, 27))
    assert len(step_until_idle(engine).loads_finished) == 1
    assert all(torch.equal(x, y) for x, y in zip(blocks_of(kv, (25, 26, 27)), blocks_of(kv, A_BLOCKS), strict=True))
    engine.finish_request("D")
    assert_clean(engine)


# --- two ranks, two processes ----------------------------------------------------------------

FACTORY = RandomKV(num_layers=2, num_blocks=16, page_shape=(16, 8), dtype="float32", stacked=False, seed=3)


@pytest.fixture
def group() -> Iterator[RankGroup]:
    g = RankGroup(FACTORY, cpu_blocks=8, world_size=2, device_type="cpu", fail_job_ids={1: {3}})
    try:
        yield g
    finally:
        g.close()


def test_rank_group_through_the_engine(group: RankGroup) -> None:
    """Job 1 (store) completes only after both ranks; job 2 (load) puts each rank's shard
    back; job 3 (store) fails on rank 1 only, and that fails the job."""
    engine = SyncEngine(Config(cpu_blocks=8, block_tokens=B, world_size=2), group)
    engine.lookup("A", A_HASHES, 3 * B + 1)
    job = engine.blocks_computed("A", A_HASHES, (3, 4, 5))
    assert job == 1
    engine.step()
    results = group.wait(job, timeout_s=60)
    assert sorted(r.rank for r in results) == [0, 1] and all(r.ok for r in results)
    assert {r.job_id for r in group.poll()} == {job}  # the engine is fed by hand below
    half = engine.step(results=[r for r in results if r.rank == 0])
    assert half.stores_finished == [] and engine.has_live_jobs()
    assert engine.lookup("X", A_HASHES, 3 * B + 1) == 0
    full = engine.step(results=[r for r in results if r.rank == 1])
    assert full.stores_finished == [job]
    assert sorted(full.released_device_blocks) == [3, 4, 5]
    engine.finish_request("A")
    engine.finish_request("X")

    # a load through the normal polling path: each rank's shard lands in its own device
    assert engine.lookup("B", (*A_HASHES, 14), 3 * B + 7) == 3
    job_b = engine.accept_hits("B", (10, 11, 12))
    report = step_until_idle(engine, timeout_s=60)
    assert report.loads_finished == [("B", job_b)]
    for rank in (0, 1):
        want = [t[3:6] for t in FACTORY.build(rank, torch.device("cpu"))]
        got = group.read_device_pages(rank, [10, 11, 12])
        assert got == b"".join(w.contiguous().numpy().tobytes() for w in want)
    engine.finish_request("B")

    # rank 1 fails job 3; rank 0 succeeds: the job fails, nothing becomes visible
    engine.lookup("C", (31, 32), 2 * B + 1)
    job_c = engine.blocks_computed("C", (31, 32), (6, 7))
    assert job_c == 3
    report = step_until_idle(engine, timeout_s=60)
    assert report.stores_finished == []
    [(failed, error)] = report.stores_failed
    assert failed == 3 and "injected fault" in error
    assert sorted(report.released_device_blocks) == [6, 7]
    assert engine.lookup("D", (31, 32), 2 * B + 1) == 0
    engine.finish_request("C")
    engine.finish_request("D")
    assert_clean(engine)
    assert len(engine.manager.state.free_slots) == 8 - 3
    assert engine.counters.jobs_failed == 1 and engine.counters.jobs_completed == 2
    engine.manager.close()


class ManualClock:
    """Engine time that moves only when the test says (the copies run on real time)."""

    def __init__(self) -> None:
        self.now_ms = 0.0

    def __call__(self) -> float:
        return self.now_ms


def test_F15_a_load_that_outlives_its_deadline_never_writes_into_blocks_the_engine_got_back(
    device: str,
) -> None:
    """F15 with real copies. The load times out while its copy may still run (on CUDA a
    1 GiB load takes ~20 ms; the engine's clock jumps past the deadline right after the
    submission): the request learns at once (fenced failure), its device blocks stay held,
    and they come back only once the executor reported the copy over. Then the copy has fully
    landed, and a write the engine makes into them right away is never overwritten later."""
    cuda = device == "cuda"
    layers, blocks, width = (16, 1024, 1024) if cuda else (4, 64, 8)  # 1 GiB load vs 64 KiB
    n = blocks // 2
    gen = torch.Generator().manual_seed(7)
    kv = [torch.randn((blocks, 2, 16, width), generator=gen).to(device) for _ in range(layers)]
    clock = ManualClock()
    ex = TorchExecutor(kv, n, device=device)
    engine = SyncEngine(Config(cpu_blocks=n, block_tokens=B, job_deadline_ms=5.0), ex, clock=clock)
    try:
        hashes = tuple(range(1000, 1000 + n))
        source = tuple(range(n))
        engine.lookup("A", hashes, n * B + 1)
        engine.blocks_computed("A", hashes, source)
        while engine.has_live_jobs():  # the store lands (the clock stands still: no timeout)
            engine.step()
            time.sleep(0.001)
        engine.finish_request("A")
        expected = blocks_of(kv, source)

        target = tuple(range(n, 2 * n))
        assert engine.lookup("B", (*hashes, 9999), (n + 1) * B) == n
        job = engine.accept_hits("B", target)
        assert [j.job_id for j in engine.step().submitted] == [job]
        clock.now_ms += 1000.0  # the deadline passes before any result is looked at
        timed_out = engine.step(results=[])
        assert [(f.job_id, f.fenced) for f in timed_out.loads_failed] == [(job, True)]
        assert timed_out.released_device_blocks == []
        assert sorted(engine.held_device_blocks()) == list(target)

        released: list[int] = []
        deadline = time.monotonic() + 60
        while not released:
            assert time.monotonic() < deadline, "the late copy never reported"
            released = engine.step().released_device_blocks
            time.sleep(0.0005)
        assert sorted(released) == list(target) and engine.fences() == []
        # the late copy had fully landed before its blocks came back (the fence held)...
        landed = blocks_of(kv, target)
        assert all(torch.equal(a, b) for a, b in zip(landed, expected, strict=True))
        # ...and the engine reuses them at once, on its own stream
        for t in kv:
            t[list(target)] = 7.0
        got = blocks_of(kv, target)  # (waits for the engine's write)
        time.sleep(0.05)
        if cuda:
            torch.cuda.synchronize()  # every stream: a rogue copy would have landed by now
        after = blocks_of(kv, target)
        assert all(bool((g == 7.0).all()) for g in got), "the engine's write was lost"
        assert all(bool((a == 7.0).all()) for a in after), "a late copy overwrote reused blocks"
        assert engine.counters.fences_lifted == 1
    finally:
        engine.close()
    assert_clean(engine)
