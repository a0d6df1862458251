"""The torch executor with real tensors: CPU always, CUDA when present (same code path)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvflow.core.errors import ConfigError, Rejected, UnknownJob  # noqa: E402
from kvflow.core.jobs import TransferJob  # noqa: E402
from kvflow.executors.torch import batch_copy, page_kernel  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402
from kvflow.executors.torch.host_pool import HostPool  # noqa: E402
from kvflow.executors.torch.layout import KVLayout  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
N_BLOCKS, LAYERS, BS, HEADS, DIM = 32, 3, 4, 2, 8


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def _rand(shape: tuple[int, ...], device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) * 4 + 0.5).to(torch.float16).to(device)  # never zero


def make_kv(kind: str, device: str, seed: int = 1) -> list[torch.Tensor] | torch.Tensor:
    page = (BS, HEADS, DIM)
    if kind == "separate":  # per layer K and V: 2*L tensors [N, ...]
        return [_rand((N_BLOCKS, *page), device, seed + i) for i in range(2 * LAYERS)]
    if kind == "stacked":  # per layer [2, N, ...]
        return [_rand((2, N_BLOCKS, *page), device, seed + i) for i in range(LAYERS)]
    if kind == "cross":  # one tensor [N, L, 2, ...]
        return _rand((N_BLOCKS, LAYERS, 2, *page), device, seed)
    raise AssertionError(kind)


def refill(kv: list[torch.Tensor] | torch.Tensor, seed: int) -> None:
    """Overwrite every device block with other random data."""
    tensors = [kv] if isinstance(kv, torch.Tensor) else kv
    for i, t in enumerate(tensors):
        t.copy_(_rand(tuple(t.shape), str(t.device), seed + 100 + i))


def pages(ex: TorchExecutor, blocks: list[int]) -> list[torch.Tensor]:
    """Every region's pages of ``blocks``, copied to the CPU."""
    idx = torch.tensor(blocks, device=ex.device)
    return [r.pages.index_select(0, idx).cpu() for r in ex.layout.regions]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def run(ex: TorchExecutor, jobs: list[TransferJob]) -> dict[int, object]:
    ex.submit(jobs)
    return {j.job_id: ex.wait(j.job_id, timeout_s=30) for j in jobs}


@pytest.mark.parametrize(
    "kind,path",
    [
        ("separate", "chunk"),
        ("stacked", "chunk"),
        ("cross", "chunk"),
        ("separate", "one-region-chunks"),
        ("stacked", "per-region-loop"),
    ],
)
def test_round_trip_into_different_blocks(device: str, kind: str, path: str) -> None:
    kv = make_kv(kind, device)
    regions = {"separate": 2 * LAYERS, "stacked": 2 * LAYERS, "cross": 1}[kind]
    staging = 1 if path == "one-region-chunks" else 256 << 20
    with TorchExecutor(kv, 16, staging_bytes=staging) as ex:
        ex._batched = path != "per-region-loop"
        assert ex.layout.num_regions == regions and ex.layout.num_blocks == N_BLOCKS
        src = [3, 17, 5, 20, 9]
        before = pages(ex, src)
        res = run(ex, [TransferJob(1, "store", tuple(src), (4, 5, 6, 7, 8))])
        assert res[1].ok, res[1]
        refill(kv, seed=7)
        assert not same(pages(ex, src), before)
        untouched = pages(ex, [0])
        dst = [1, 2, 30, 31, 4]
        res = run(ex, [TransferJob(2, "load", tuple(dst), (4, 5, 6, 7, 8))])
        assert res[2].ok, res[2]
        assert same(pages(ex, dst), before)
        assert same(pages(ex, [0]), untouched)
        block = ex.layout.block_bytes
        assert ex.stats["bytes_stored"] == 5 * block and ex.stats["bytes_loaded"] == 5 * block


@pytest.mark.parametrize(
    "scatter,max_runs", [("runs", 16), ("host", 1), ("uva", 1), ("batch", 0), ("auto", 1)]
)
def test_scattered_slots(device: str, scatter: str, max_runs: int) -> None:
    if scatter == "uva" and device != "cuda":
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            TorchExecutor(make_kv("stacked", device), 24, scatter="uva")
        return
    if scatter == "batch" and not batch_copy.available(device):
        with pytest.raises(ConfigError, match="cuMemcpyBatchAsync"):
            TorchExecutor(make_kv("stacked", device), 24, scatter="batch")
        return
    kv = make_kv("stacked", device)
    with TorchExecutor(kv, 24, scatter=scatter, max_runs=max_runs, checksums=True) as ex:
        if scatter == "auto":
            expected = "host" if device == "cpu" else "staged" if page_kernel.available(ex.device) else "uva"
            assert ex.scatter == expected
        src, slots = [8, 1, 30, 12, 4, 22], (11, 2, 7, 19, 0, 5)
        before = pages(ex, src)
        assert run(ex, [TransferJob(1, "store", tuple(src), slots)])[1].ok
        refill(kv, seed=3)
        dst = [29, 3, 14, 0, 9, 17]
        assert run(ex, [TransferJob(2, "load", tuple(dst), slots)])[2].ok
        assert same(pages(ex, dst), before)


def test_auto_moves_large_pages_straight_on_the_copy_engines(device: str) -> None:
    """Pages of BATCH_MIN_PAGE and up: ``auto`` takes one batched copy-engine call per batch
    where the driver has it (no staging rows), a single run of slots and both directions at
    once too; the pages land bit for bit."""
    from kvflow.executors.torch.copy_setup import BATCH_MIN_PAGE

    kv = [_rand((N_BLOCKS, BATCH_MIN_PAGE // 2), device, 5)]  # one region of fp16 pages
    with TorchExecutor(kv, 24, checksums=True) as ex:
        if batch_copy.available(device):
            assert ex.scatter == "batch" and ex.max_runs == 0 and ex._stage is None
        src, slots = [8, 1, 30, 12, 4, 22], (11, 2, 7, 19, 0, 5)
        before = pages(ex, src)
        assert run(ex, [TransferJob(1, "store", tuple(src), slots)])[1].ok
        assert run(ex, [TransferJob(2, "store", (16, 17), (20, 21))])[2].ok  # one run
        two = pages(ex, [16, 17])
        refill(kv, seed=3)
        again = pages(ex, [9, 10])
        results = run(ex, [
            TransferJob(3, "load", (29, 3, 14, 0, 9, 17), slots),
            TransferJob(4, "load", (5, 6), (20, 21)),
            TransferJob(5, "store", (9, 10), (22, 23)),
        ])
        assert all(r.ok for r in results.values())
        assert same(pages(ex, [29, 3, 14, 0]), [t[:4] for t in before])
        assert same(pages(ex, [5, 6]), two)
        assert run(ex, [TransferJob(6, "load", (1, 2), (22, 23))])[6].ok
        assert same(pages(ex, [1, 2]), again)


def test_multi_job_batching_and_both_directions_in_one_submit(device: str) -> None:
    kv = make_kv("separate", device)
    with TorchExecutor(kv, 16) as ex:
        a, b, c = [0, 1, 2], [10, 11], [20]
        want = {k: pages(ex, blk) for k, blk in (("a", a), ("b", b), ("c", c))}
        ex.submit(
            [
                TransferJob(1, "store", tuple(a), (0, 1, 2)),
                TransferJob(2, "store", tuple(b), (3, 4)),
                TransferJob(3, "store", tuple(c), (9,)),
            ]
        )
        assert [r.ok for r in (ex.wait(1), ex.wait(2), ex.wait(3))] == [True] * 3
        assert ex.stats["submissions"] == 1
        refill(kv, seed=11)
        snapshot = pages(ex, [5, 6])
        # One submit: load a and c back, and store two fresh blocks, in both directions at once.
        ex.submit(
            [
                TransferJob(4, "load", (25, 26, 27), (0, 1, 2)),
                TransferJob(5, "store", (5, 6), (12, 13)),
                TransferJob(6, "load", (31,), (9,)),
            ]
        )
        results = {i: ex.wait(i, timeout_s=30) for i in (4, 5, 6)}
        assert all(r.ok for r in results.values()), results
        assert same(pages(ex, [25, 26, 27]), want["a"]) and same(pages(ex, [31]), want["c"])
        refill(kv, seed=12)
        assert run(ex, [TransferJob(7, "load", (7, 8), (12, 13))])[7].ok
        assert same(pages(ex, [7, 8]), snapshot)
        polled = ex.poll()
        assert sorted(r.job_id for r in polled) == [1, 2, 3, 4, 5, 6, 7]  # each exactly once
        assert ex.poll() == []


def test_F2_bad_jobs_fail_alone_and_the_executor_keeps_serving(device: str) -> None:
    kv = make_kv("stacked", device)
    with TorchExecutor(kv, 8) as ex:
        ex.submit(
            [
                TransferJob(1, "store", (1, 2), (0, 1)),
                TransferJob(2, "store", (3,), (99,)),
                TransferJob(3, "store", (N_BLOCKS,), (2,)),
                TransferJob(4, "store", (4, 5), (3,)),
                TransferJob(5, "store", (6,), (0,)),  # slot 0 also written by job 1
            ]
        )
        res = {i: ex.wait(i, timeout_s=30) for i in range(1, 6)}
        assert res[1].ok
        assert not res[2].ok and "slot 99 out of range [0, 8)" in res[2].error
        assert not res[3].ok and f"device block {N_BLOCKS} out of range" in res[3].error
        assert not res[4].ok and "2 device blocks but 1 slots" in res[4].error
        assert not res[5].ok and "slot 0" in res[5].error
        assert ex.jobs_failed == 4 and ex.jobs_completed == 1
        assert run(ex, [TransferJob(6, "load", (7, 8), (0, 1))])[6].ok


def test_F2_a_copy_that_raises_becomes_a_failed_result(device: str) -> None:
    kv = make_kv("stacked", device)
    with TorchExecutor(kv, 8, fail_job_ids={2}) as ex:
        assert run(ex, [TransferJob(1, "store", (1,), (0,))])[1].ok
        res = run(ex, [TransferJob(2, "load", (5,), (0,))])[2]
        assert (
            not res.ok
            and "injected fault for job 2" in res.error
            and "load launch failed" in res.error
        )
        assert run(ex, [TransferJob(3, "load", (5,), (0,))])[3].ok  # still serving


def test_F6_a_copy_that_is_over_reaches_the_next_poll_of_a_spinning_caller(device: str) -> None:
    """An engine's scheduler spins on ``step()``: its thread keeps the GIL for the interpreter's
    whole switch interval, so no other thread of the process runs meanwhile. A copy that is
    over must reach that thread's next ``poll`` without another thread running first (none
    can here: the switch interval is 60 s): a store, a load and a failed copy (F2), each once."""
    kv = make_kv("separate", device)
    with TorchExecutor(kv, 16, fail_job_ids={3}) as ex:
        assert run(ex, [TransferJob(9, "store", (0,), (0,))])[9].ok  # (warm-up)
        assert [r.job_id for r in ex.poll()] == [9]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(60.0)
        try:
            ex.submit([TransferJob(1, "store", (1, 2), (1, 2)), TransferJob(2, "load", (5,), (0,))])
            ex.submit([TransferJob(3, "store", (3,), (3,))])  # its copy raises (fail_job_ids)
            events = [ex.last_event(d) for d in ("store", "load")]
            while not all(e is None or e.query() for e in events):  # spin until the copies end
                pass
            first = ex.poll()
            again = ex.poll()
        finally:
            sys.setswitchinterval(interval)
    assert sorted(r.job_id for r in first) == [1, 2, 3]
    assert [r.job_id for r in first if not r.ok] == [3] and again == []
    assert "injected fault for job 3" in next(r.error for r in first if r.job_id == 3)


def test_F12_waiting_on_an_unknown_job_or_submitting_one_twice_is_refused(device: str) -> None:
    kv = make_kv("stacked", device)
    with TorchExecutor(kv, 8) as ex:
        with pytest.raises(UnknownJob, match="never submitted"):
            ex.wait(42)
        assert run(ex, [TransferJob(1, "store", (1,), (0,))])[1].ok
        assert ex.wait(1).ok  # a finished job can still be waited for
        with pytest.raises(Rejected, match="job 1 was already submitted"):
            ex.submit([TransferJob(1, "store", (2,), (1,))])
        with pytest.raises(Rejected, match="job 2 was already submitted"):
            ex.submit([TransferJob(2, "store", (2,), (1,)), TransferJob(2, "store", (3,), (2,))])
        assert ex.stats["jobs_submitted"] == 1  # the rejected calls launched nothing


def test_F17_a_checksum_mismatch_fails_the_load_and_names_the_bad_block(device: str) -> None:
    kv = make_kv("separate", device)
    with TorchExecutor(kv, 8, checksums=True) as ex:
        assert run(ex, [TransferJob(1, "store", (1, 2, 3), (0, 1, 2))])[1].ok
        assert run(ex, [TransferJob(2, "load", (10, 11, 12), (0, 1, 2))])[2].ok
        raw = ex.pool.region(3)  # uint8 view of one region
        raw[1, 5] ^= 0x5A  # corrupt one byte of slot 1
        ex.submit([TransferJob(3, "load", (20,), (0,)), TransferJob(4, "load", (21, 22), (2, 1), hashes=(70, 71))])
        ok, bad = ex.wait(3, timeout_s=30), ex.wait(4, timeout_s=30)
        assert ok.ok
        assert not bad.ok and "checksum mismatch: slot 1 -> device block 22" in bad.error
        assert bad.corrupt == (71,)  # the block whose host copy is bad, by hash (F17)
        never = run(ex, [TransferJob(5, "load", (23,), (7,))])[5]
        assert not never.ok and "no checksum recorded for slot 7" in never.error


def test_F11_zero_cpu_blocks_disables_offload_in_the_executor(device: str) -> None:
    with TorchExecutor(make_kv("stacked", device), 0) as ex:
        assert not ex.pool.enabled
        with pytest.raises(ConfigError, match="offload is disabled"):
            ex.submit([TransferJob(1, "store", (1,), (0,))])


def test_F9_a_store_on_cuda_waits_for_the_compute_done_event() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA events")
    kv = make_kv("stacked", "cuda")
    with TorchExecutor(kv, 8) as ex:
        want = torch.full_like(kv[0][0, 3], 3.0)
        # The engine writes block 3 on its compute stream after long kernels; the store sees it.
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            big = big @ big / 64
        kv[0][0, 3].fill_(3.0)
        done = torch.Event(device="cuda")
        done.record(torch.accelerator.current_stream())
        ex.submit([TransferJob(1, "store", (3,), (0,))], compute_done=done)
        assert ex.wait(1, timeout_s=30).ok
        host = ex.pool.region(0, ex.layout.regions[0].word_dtype)[0]
        assert torch.equal(host.view(torch.float16).view_as(want).cpu(), want.cpu())


# --- layout ----------------------------------------------------------------------------------


def test_layout_detects_and_validates() -> None:
    t = torch.zeros(2, 10, 4, 8, dtype=torch.float16)
    lay = KVLayout.from_caches([t, t.clone()])
    assert lay.num_regions == 4 and lay.num_blocks == 10 and lay.page_bytes == (64,) * 4
    assert KVLayout.from_caches({"l0": t}, block_dim=0).num_blocks == 2  # explicit wins
    assert KVLayout.from_caches(t, num_blocks=10).num_regions == 2
    with pytest.raises(ConfigError, match="page is not contiguous"):
        KVLayout.from_caches(torch.zeros(10, 4, 16)[:, :, :8])
    with pytest.raises(ConfigError, match="disagree on num_blocks"):
        KVLayout.from_caches([torch.zeros(10, 8), torch.zeros(12, 8)])
    with pytest.raises(ConfigError, match="pages overlap"):
        KVLayout.from_caches(torch.zeros(16).as_strided((8, 4), (1, 1)))
    with pytest.raises(ConfigError, match="page is not contiguous"):
        KVLayout.from_caches(torch.zeros(8, 10).t())  # block dim transposed


def test_layout_sizes_pages_from_shape_not_storage() -> None:
    big = torch.arange(40 * 6, dtype=torch.float32).view(40, 6)
    view = big[5:25]  # 20 blocks inside a larger storage
    lay = KVLayout.from_caches(view)
    assert lay.num_blocks == 20 and lay.page_bytes == (24,)
    first, last = big[5].clone(), big[24].clone()
    with TorchExecutor(view, 4) as ex:
        assert run(ex, [TransferJob(1, "store", (0, 19), (0, 1))])[1].ok
        host = ex.pool.region(0).view(torch.float32)
        assert torch.equal(host[0], first) and torch.equal(host[1], last)
        outside = big[25:].clone()
        assert run(ex, [TransferJob(2, "load", (19, 18), (0, 1))])[2].ok
        assert torch.equal(view[19], first) and torch.equal(view[18], last)
        assert torch.equal(big[25:], outside)  # nothing beyond the view was written


# --- host pool -------------------------------------------------------------------------------


def test_F11_host_pool_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="cpu_blocks must be >= 0"):
        HostPool.create([64], -1)
    with pytest.raises(ConfigError, match="cannot allocate host pool"):
        HostPool.create([1 << 30], 1 << 30)
    with pytest.raises(ConfigError, match="shared host pool needs"):
        HostPool.create([1 << 30], 1 << 30, shared=True)


@pytest.mark.parametrize("shared", [False, True])
def test_every_pool_page_starts_on_a_page_boundary(device: str, shared: bool) -> None:
    """A pool page that straddled one more 4 KiB page than it needs cost the page kernel
    6-7% of the link (each access crossing a page is split)."""
    pool = HostPool.create([16 << 10, 4096, 96], 8, device=device, shared=shared)
    try:
        for r, page in enumerate((16 << 10, 4096)):
            first = pool.region(r).data_ptr()
            assert first % 4096 == 0, (r, first % 4096)
            assert all((first + k * page) % 4096 == 0 for k in range(8))
    finally:
        pool.close()


def test_F10_the_host_pool_keeps_its_memory_for_the_executor_s_life() -> None:
    """Sized once when the executor is built; every slot filled and read back again and again
    never moves or resizes it (a worker that mapped it keeps seeing the same memory)."""
    with TorchExecutor(make_kv("stacked", "cpu"), 8) as ex:
        pool = ex.pool
        regions = range(ex.layout.num_regions)
        where, size = [pool.region(r).data_ptr() for r in regions], pool.nbytes
        for n in range(24):  # three rounds over every slot, both directions
            store, load = 2 * n + 1, 2 * n + 2
            jobs = [TransferJob(store, "store", (n,), (n % 8,))]
            assert run(ex, jobs)[store].ok
            assert run(ex, [TransferJob(load, "load", (N_BLOCKS - 1 - n,), (n % 8,))])[load].ok
        assert ex.pool is pool and (pool.nbytes, pool.cpu_blocks) == (size, 8)
        assert [pool.region(r).data_ptr() for r in regions] == where


def test_F10_a_shared_pool_is_one_memory_with_a_fixed_layout() -> None:
    pool = HostPool.create([64, 128], 4, shared=True)
    try:
        assert pool.path is not None and pool.nbytes == 2 * 4096
        other = HostPool.attach(pool.spec, first_region=1, num_regions=1)
        other.region(0)[2].fill_(7)
        assert int(pool.region(1)[2].sum()) == 7 * 128
        assert pool.region(0).shape == (4, 64) and int(pool.region(0).sum()) == 0
        assert torch.equal(pool.for_rank(1, 1).region(0), other.region(0))  # rank 1's view
        other.close()
    finally:
        path = pool.path
        pool.close()
    import os

    assert not os.path.exists(path)


# --- capacity and ordering (issue 9, item 7) ---------------------------------------------


class _BrokenComputeDone:
    """A compute-done event whose wait raises (a failed device, a destroyed stream)."""

    def synchronize(self) -> None:
        raise RuntimeError("device lost while waiting for compute")


class _ComputeDoneOnCpu:
    """The engine's compute-done event on the CPU device, where the copy waits on it before it
    starts: the compute it stands for happens when the copy waits (``synchronize``), so a copy
    that did not wait, or copied first, is seen."""

    def __init__(self, at_wait: Any) -> None:
        self.at_wait, self.waits = at_wait, 0

    def synchronize(self) -> None:
        self.waits += 1
        self.at_wait()


def test_F9_both_directions_wait_for_the_compute_done_event() -> None:
    kv = make_kv("stacked", "cpu")
    with TorchExecutor(kv, 8) as ex:
        # a store: the forward writes block 3 until the event; the store must copy what it wrote
        def forward_writes_block_3() -> None:
            for layer in kv:
                layer[:, 3].fill_(3.0)

        written = _ComputeDoneOnCpu(forward_writes_block_3)
        ex.submit([TransferJob(1, "store", (3,), (0,))], compute_done=written)
        assert ex.wait(1, timeout_s=30).ok and written.waits == 1
        assert run(ex, [TransferJob(2, "load", (9,), (0,))])[2].ok
        assert same(pages(ex, [9]), pages(ex, [3]))

        # a load: an earlier forward still reads block 7 until the event; the load must not
        # have written it by then
        before = pages(ex, [7])
        seen: list[list[torch.Tensor]] = []
        read = _ComputeDoneOnCpu(lambda: seen.append(pages(ex, [7])))
        ex.submit([TransferJob(3, "load", (7,), (0,))], compute_done=read)
        assert ex.wait(3, timeout_s=30).ok and read.waits == 1
        assert same(seen[0], before) and same(pages(ex, [7]), pages(ex, [3]))


def test_F9_a_compute_done_wait_that_raises_fails_the_batch_and_copies_nothing() -> None:
    kv = make_kv("stacked", "cpu")
    with TorchExecutor(kv, 8) as ex:
        host = ex.pool.region(0, ex.layout.regions[0].word_dtype)
        before = host.clone()
        ex.submit([TransferJob(1, "store", (3,), (0,))], compute_done=_BrokenComputeDone())
        result = ex.wait(1, timeout_s=30)
        assert not result.ok and "device lost while waiting for compute" in result.error
        assert torch.equal(host, before)  # nothing was copied out of order


def test_F10_the_engine_refuses_a_config_whose_cpu_blocks_differ_from_the_pool() -> None:
    from kvflow.core.config import Config
    from kvflow.engine.sync import SyncEngine

    with TorchExecutor(make_kv("stacked", "cpu"), 64) as ex:
        with pytest.raises(ConfigError, match="cpu_blocks=128 but the executor's host pool has 64 slots"):
            SyncEngine(Config(cpu_blocks=128, block_tokens=4), ex)
        SyncEngine(Config(cpu_blocks=64, block_tokens=4), ex).close()


# --- the page kernel (one launch for every region) and grouped loads ------------------------


@pytest.fixture
def kernel_device(device: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The device to run the Triton page kernel on: CUDA natively, the CPU device through
    Triton's interpreter (TRITON_INTERPRET=1); skipped where Triton is not installed."""
    pytest.importorskip("triton")
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return device


@pytest.mark.parametrize("groups", [1, 4])
def test_kernel_moves_every_region_of_scattered_batches(kernel_device: str, groups: int) -> None:
    kv = make_kv("stacked", kernel_device)
    with TorchExecutor(kv, 24, scatter="kernel", checksums=True, load_groups=groups) as ex:
        assert ex.max_runs == 0 and ex._tables is not None
        src_a, slots_a = [8, 1, 30, 12], (11, 2, 7, 19)
        src_b, slots_b = [4, 22], (0, 23)
        before = pages(ex, src_a + src_b)
        res = run(
            ex,
            [
                TransferJob(1, "store", tuple(src_a), slots_a),
                TransferJob(2, "store", tuple(src_b), slots_b),
            ],
        )
        assert res[1].ok and res[2].ok, res
        refill(kv, seed=3)
        untouched = pages(ex, [5])
        dst = [29, 3, 14, 0, 9, 17]
        res = run(ex, [TransferJob(3, "load", tuple(dst), slots_a + slots_b)])
        assert res[3].ok, res[3]
        assert same(pages(ex, dst), before)
        assert same(pages(ex, [5]), untouched)  # nothing else written
        events = ex.load_events()
        if groups > 1:  # one event per group of consecutive regions (6 regions in 4 groups)
            assert [end for end, _ in events] == [1, 3, 4, 6]
        else:
            assert events == []


def _staged_scenario(ex: TorchExecutor, kv: list[torch.Tensor] | torch.Tensor) -> None:
    """Runs of 2-4 slots and single ones, a load reading one slot twice, a store and a load in
    one submit; the pool holds each stored page at its slot, slot by slot."""
    assert ex.pool.spec.page_first and ex.max_runs == 0
    src, slots = [8, 1, 30, 12, 4, 22, 5], (11, 2, 3, 4, 19, 0, 23)
    before = pages(ex, src)
    assert run(ex, [TransferJob(1, "store", tuple(src), slots)])[1].ok
    for r, region in enumerate(ex.layout.regions):
        view = ex.pool.region(r, region.word_dtype)
        assert torch.equal(view[torch.tensor(slots)].cpu(), before[r])
    refill(kv, seed=5)
    moved = pages(ex, [9, 10])
    dst = [29, 3, 14, 0, 7, 17, 13, 31]  # slot 2 loaded into two blocks
    res = run(
        ex,
        [TransferJob(2, "store", (9, 10), (20, 21)), TransferJob(3, "load", tuple(dst), (*slots, 2))],
    )
    assert res[2].ok and res[3].ok, res
    assert same(pages(ex, dst), [torch.cat((p, p[1:2])) for p in before])
    assert run(ex, [TransferJob(4, "load", (1, 2), (20, 21))])[4].ok
    assert same(pages(ex, [1, 2]), moved)


@pytest.mark.parametrize("kind", ["separate", "cross"])
@pytest.mark.parametrize("staging_blocks,groups", [(64, 1), (2, 1), (3, 3)])
@pytest.mark.parametrize("both_ways", [True, False])
def test_staged_path_moves_whole_blocks_through_runs(
    kernel_device: str, kind: str, staging_blocks: int, groups: int, both_ways: bool
) -> None:
    """Page-first pool with the page kernel: with the other direction busy (``both_ways``)
    every batch takes the copy engines in chunks of a few staging rows, else the page kernel;
    both read and write the same page-first pool."""
    kv = make_kv(kind, kernel_device)
    block = KVLayout.from_caches(kv).block_bytes
    with TorchExecutor(
        kv, 24, scatter="staged", checksums=True, staging_bytes=staging_blocks * block,
        load_groups=groups,
    ) as ex:
        assert ex._stage is not None and ex._stage.tables is not None
        if both_ways:  # as if the other direction always had copies in flight
            ex._copying = lambda lane: True  # type: ignore[method-assign]
        _staged_scenario(ex, kv)


@pytest.mark.parametrize("staging_blocks,groups", [(64, 1), (2, 3)])
def test_staged_path_without_the_kernel_gathers_region_by_region(
    device: str, staging_blocks: int, groups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the page kernel cannot run (the NPU, no Triton) torch gathers and scatters the
    staging rows region by region; grouped loads still mark each group."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kv = make_kv("stacked", device)
    block = KVLayout.from_caches(kv).block_bytes
    with TorchExecutor(
        kv, 24, scatter="staged", checksums=True, staging_bytes=staging_blocks * block,
        load_groups=groups,
    ) as ex:
        if ex._stage is not None and ex._stage.tables is not None:  # CUDA: as if no Triton
            ex._tables = None
            ex._stage = dataclasses.replace(ex._stage, tables=None)
        _staged_scenario(ex, kv)
        events = ex.load_events()
        assert [end for end, _ in events] == ([2, 4, 6] if groups == 3 else [])


def test_page_first_pool_views_agree_with_its_blocks() -> None:
    pool = HostPool.create([64, 32, 128], 5, page_first=True)
    try:
        assert pool.spec.block_bytes == 224 and pool.blocks().shape == (5, 224)
        for r, (off, page) in enumerate(zip(pool.spec.offsets, (64, 32, 128), strict=True)):
            view = pool.region(r, torch.int64)
            assert view.shape == (5, page // 8)
            view[3].fill_(r + 1)
            raw = pool.blocks()[3, off : off + page].view(torch.int64)
            assert bool((raw == r + 1).all())
        with pytest.raises(ConfigError, match="shared host pool is laid out region by region"):
            HostPool.create([64], 4, shared=True, page_first=True)
    finally:
        pool.close()
    with pytest.raises(ConfigError, match="needs a page-first pool"):
        HostPool.create([64], 4).blocks()


def test_F17_a_kernel_load_of_a_corrupted_slot_fails_its_checksum(kernel_device: str) -> None:
    kv = make_kv("separate", kernel_device)
    with TorchExecutor(kv, 16, scatter="kernel", checksums=True) as ex:
        assert run(ex, [TransferJob(1, "store", (3, 9, 1), (2, 7, 12), hashes=(31, 32, 33))])[1].ok
        ex._host_views[4][7, 0] += 1  # one word of slot 7 in region 4
        res = run(ex, [TransferJob(2, "load", (20, 21, 22), (2, 7, 12), hashes=(31, 32, 33))])[2]
        assert not res.ok and "checksum mismatch: slot 7" in (res.error or "")
        assert res.corrupt == (32,)


def test_auto_picks_the_kernel_for_small_pages_and_the_copy_engines_for_large_ones() -> None:
    from kvflow.executors.torch.copy_setup import BATCH_MIN_PAGE, KERNEL_MAX_PAGE, auto_scatter

    def pick(page: int, kernel: bool = True, uva: bool = True, batch: bool = False) -> str:
        return auto_scatter(kernel=kernel, uva=uva, batch=batch, page_bytes=page)

    assert auto_scatter(kernel=True, uva=True, batch=True, page_bytes=16 << 10, staged=True) == "staged"
    assert auto_scatter(kernel=True, uva=True, batch=True, page_bytes=2 << 20, staged=True) == "batch"
    assert auto_scatter(kernel=True, uva=True, batch=False, page_bytes=2 << 20, staged=True) == "staged"
    assert pick(32 << 10) == "kernel"
    assert pick(64 << 10, batch=True) == "kernel"  # the driver's cost per copy would bound it
    assert pick(BATCH_MIN_PAGE, batch=True) == "batch"
    assert pick(2 << 20, batch=True) == "batch"
    assert pick(KERNEL_MAX_PAGE) == "uva"
    assert pick(2 << 20, uva=False) == "host"
    assert pick(16 << 10, kernel=False) == "uva"
    assert pick(16 << 10, kernel=False, uva=False) == "host"


def test_batch_descriptors_name_every_page_of_every_region() -> None:
    from kvflow.executors.torch.batch_copy import RegionAddresses

    addr = RegionAddresses([1000, 5000], [64, 128], [90000, 70000], [64, 32], [64, 32])
    blocks, slots = np.array([3, 0]), np.array([1, 4])
    dst, src, sizes = addr.descriptors(blocks, slots, 0, 2, store=True)
    assert src.tolist() == [1000 + 3 * 64, 1000, 5000 + 3 * 128, 5000]  # device pages
    assert dst.tolist() == [90000 + 64, 90000 + 4 * 64, 70000 + 32, 70000 + 4 * 32]  # pool slots
    assert sizes.tolist() == [64, 64, 32, 32]
    dst, src, sizes = addr.descriptors(blocks, slots, 1, 1, store=False)  # region 1 alone
    assert dst.tolist() == [5000 + 3 * 128, 5000] and src.tolist() == [70000 + 32, 70000 + 4 * 32]
    assert sizes.tolist() == [32, 32]


def test_kernel_mode_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="scatter='kernel' needs Triton"):
        TorchExecutor(make_kv("stacked", "cpu"), 8, scatter="kernel")
    with pytest.raises(ConfigError, match="load_groups must be >= 1 and copy_programs >= 0"):
        TorchExecutor(make_kv("stacked", "cpu"), 8, load_groups=0)
    with TorchExecutor(make_kv("stacked", "cpu"), 8) as ex:  # auto on CPU: host staging
        assert ex.scatter == "host" and ex.max_runs == 16


@pytest.mark.parametrize(
    "scatter,slots",
    [
        ("runs", (4, 5, 6, 7)),  # one run: the batched copy-engine path
        ("runs", (2, 3, 9, 10)),  # two runs: the per-region loop
        ("host", (11, 2, 19, 0)),  # scattered: host staging
        ("batch", (11, 2, 19, 0)),  # scattered: one copy-engine call per group (CUDA)
    ],
)
def test_every_load_path_marks_its_groups(device: str, scatter: str, slots: tuple[int, ...]) -> None:
    if scatter == "batch" and not batch_copy.available(device):
        pytest.skip("cuMemcpyBatchAsync needs a CUDA driver of 12.8 or later")
    kv = make_kv("stacked", device)  # 6 regions
    with TorchExecutor(kv, 24, scatter=scatter, max_runs=1, load_groups=3, checksums=True) as ex:
        src = [8, 1, 30, 12]
        before = pages(ex, src)
        assert run(ex, [TransferJob(1, "store", tuple(src), slots)])[1].ok
        refill(kv, seed=9)
        dst = [29, 3, 14, 0]
        assert run(ex, [TransferJob(2, "load", tuple(dst), slots)])[2].ok
        assert same(pages(ex, dst), before)
        events = ex.load_events()
        assert [end for end, _ in events] == [2, 4, 6]
        for _, event in events:  # on CUDA each event has happened once the job reported ok
            assert event is None if device == "cpu" else event.query()
