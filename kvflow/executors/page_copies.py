"""The copy kernels of the torch executor: how one batch of KV pages moves, per direction.

What one direction's share of a ``submit`` launches (``Plan``: all of its jobs' pairs together,
sorted by slot, see ``transfer_plan``):

* **store**: the store stream waits on the engine's compute-done event (F9); per KV region one
  device gather (``index_select``) of the pages into a staging buffer, then one copy per run of
  consecutive slots straight into the pool's range.
* **load**: the load stream waits on the compute-done event (F9); per region one copy per run
  into a device staging buffer, then one ``index_copy_`` into the engine's device blocks.
* Slots that do not form a few runs (``max_runs``) go through ``scatter``: ``"staged"`` (CUDA
  with Triton, the default there; every batch) moves whole blocks of a page-first pool through
  device staging rows, one copy-engine transfer per run of slots, while both directions copy,
  and takes the page kernel when one direction copies alone; ``"kernel"`` (``max_runs`` 0)
  copies every region's pages in ONE launch straight between the device cache and the pinned
  pool (``page_kernel``), optionally split into ``load_groups`` launches with one event each
  so an engine can start a layer once its pages landed; ``"batch"`` (CUDA 12.8+, the default
  without Triton for pages of 512 KiB and up) hands every page of the batch to the copy
  engines in one ``cuMemcpyBatchAsync`` call (``batch_copy``); ``"uva"`` (CUDA) lets torch kernels gather/scatter the pinned pool region by
  region through unified addressing; ``"host"`` (the fallback: NPU, CPU) stages in pinned host
  memory and gathers or scatters on the CPU region by region (stores scatter in the completion
  thread, loads gather in the caller, each region's copy overlapping the next one's gather).
* With ``checksums``, a store records a per-slot checksum of what it copied and a load verifies
  it (a mismatch fails the job: the host copy is corrupt, recompute).

The host side that can only run once the copies are done (host scatter, checksum bookkeeping)
is returned as a ``Finish`` callable that the executor's completion thread runs. ``PageCopies``
is a mixin of ``TorchExecutor``: the kernels read and set the executor's own attributes, which
benchmarks and tests also switch directly (``scatter``, ``_batched``, ``_uva_views``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from kvflow.errors import ConfigError
from kvflow.executors import batch_copy, page_kernel
from kvflow.executors.host_pool import HostPool
from kvflow.executors.layout import KVLayout, word_bytes
from kvflow.executors.npu import DeviceTraits
from kvflow.executors.streams import on_stream, pinned_empty, record_event, wait_for
from kvflow.executors.transfer_plan import Plan, run_bounds
from kvflow.executors.uva import device_alias

ScatterMode = Literal["auto", "runs", "host", "uva", "kernel", "batch", "staged"]
# What a batch's host-side finish reports: job id -> (error, hashes whose host copy is bad)
Failures = dict[int, tuple[str, tuple[int, ...]]]
Finish = Callable[[], Failures]


KERNEL_MAX_PAGE = 512 << 10  # bytes; at larger pages the copy engines move a page faster
BATCH_MIN_PAGE = 512 << 10  # bytes; below, the driver's cost per page copy bounds ``batch``


def auto_scatter(
    *, kernel: bool, uva: bool, batch: bool, page_bytes: int, staged: bool = False
) -> ScatterMode:
    """What ``scatter="auto"`` picks for batches of several runs, from what this executor can
    use and its largest page.

    Measured on an H200 replaying a churned tier (tools/bench_churn_results.md) and with one
    1 GiB submit (tools/bench_transfer_results.md): ``staged`` (a page-first pool; the page
    kernel for one direction alone, whole blocks on the copy engines while both directions
    copy) moves 0.91-0.95 of the link each way and 0.86-0.91 both ways at 16 KiB - 2 MiB
    pages. Without it: the page kernel (0.90-0.95 each way, 0.69-0.78 both ways) below 512 KiB;
    above, ``batch`` (each page a copy-engine transfer, 0.97; the driver costs the host about
    1 us a page, 0.5-4 us at small pages, so it is no choice below) or the UVA kernels. Host
    staging (a CPU gather per byte) is the portable fallback: NPU, CPU, unpinned pools.
    """
    if staged:
        return "staged"
    if batch and page_bytes >= BATCH_MIN_PAGE:
        return "batch"
    if kernel and page_bytes < KERNEL_MAX_PAGE:
        return "kernel"
    return "uva" if uva else "host"


@dataclass(frozen=True)
class _StageTables:
    """The staged path's device buffers and the page kernel's tables over them."""

    capacity: int  # staging rows (blocks) per chunk
    block_bytes: int
    positions: torch.Tensor  # arange(capacity) on the device: row i of a chunk is its pair i
    rows: dict[bool, torch.Tensor]  # store (True) / load (False): [capacity, block_bytes]
    # the page kernel's tables (store: device pages -> rows; load: rows -> device pages), or
    # None where it cannot run (NPU, no Triton): torch gathers and scatters region by region
    tables: dict[bool, torch.Tensor] | None
    views: dict[bool, list[torch.Tensor]]  # per direction, each region's [capacity, words]
    host_blocks: torch.Tensor  # the pool as [cpu_blocks, block_bytes]
    engines: bool  # batched copy-engine call available


def _stage_table(
    device_pages: Sequence[torch.Tensor],
    device_strides: Sequence[int],
    rows: torch.Tensor,
    offsets: Sequence[int],
    page_bytes: Sequence[int],
    *,
    gather: bool,
) -> torch.Tensor:
    """The page kernel's ``[5, R]`` table between the device pages and staging rows laid out
    as the pool's blocks (region ``r`` at ``offsets[r]`` of each row)."""
    dev = [p.data_ptr() for p in device_pages]
    stage = [rows.data_ptr() + o for o in offsets]
    block = [rows.stride(0)] * len(offsets)
    words = [pb // 8 for pb in page_bytes]
    table = (
        [dev, list(device_strides), stage, block, words]
        if gather
        else [stage, block, dev, list(device_strides), words]
    )
    return torch.tensor(table, dtype=torch.int64).to(rows.device)


class PageCopies:
    """Launches a batch's copies on a stream; returns the host-side ``Finish`` (or None)."""

    # Set by TorchExecutor.__init__ before it calls _init_copies.
    layout: KVLayout
    device: torch.device
    traits: DeviceTraits
    pool: HostPool
    checksums: bool
    max_runs: int
    scatter: ScatterMode
    load_groups: int
    copy_programs: int

    def _init_copies(self, staging_bytes: int, max_runs: int | None) -> None:
        """The pool's views per region, the scatter mode, checksum tables, batching tables."""
        pool = self.pool
        self._host_views: list[torch.Tensor] = []
        self._uva_views: list[torch.Tensor] = []
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._addresses: batch_copy.RegionAddresses | None = None
        self._stage: _StageTables | None = None
        self._load_events: list[tuple[int, Any]] = []
        if pool.enabled:
            self._host_views = [
                pool.region(i, r.word_dtype) for i, r in enumerate(self.layout.regions)
            ]
            self._init_kernel()
            self._init_batch()
            self._init_staged(staging_bytes)
            if self.scatter == "uva" or (
                self.scatter == "auto" and self.device.type == "cuda" and pool.pinned
            ):
                try:
                    self._uva_views = [device_alias(v, self.device) for v in self._host_views]
                except ConfigError:
                    if self.scatter == "uva":
                        raise
        if pool.spec.page_first and self.scatter not in ("auto", "staged", "kernel"):
            raise ConfigError(
                f"scatter={self.scatter!r} copies region by region: it needs a host pool laid "
                "out region by region (page_first=False)"
            )
        if self.scatter == "auto":
            self.scatter = auto_scatter(
                kernel=self._tables is not None,
                uva=bool(self._uva_views),
                batch=self._addresses is not None,
                page_bytes=max(r.page_bytes for r in self.layout.regions),
                staged=self._stage is not None,
            )
        # The page kernel moves every batch in one launch, a single run too (0.93-0.95 of the
        # link, as the copy engines; one launch where one copy per region cost 3 ms of host
        # time at 64 regions). The batched copy engines take every batch of two runs or more:
        # a single run is one copy per region already.
        self.max_runs = int(max_runs) if max_runs is not None else (
            0 if self.scatter in ("kernel", "staged") else 1 if self.scatter == "batch" else 16
        )
        self._cs_mult = None
        self._cs_table = np.zeros(max(pool.cpu_blocks, 0), dtype=np.int64)
        self._cs_valid = np.zeros(max(pool.cpu_blocks, 0), dtype=bool)
        if self.checksums:
            mult = torch.arange(1, 2 * self.layout.num_regions, 2, dtype=torch.int64)
            self._cs_mult = mult.view(-1, 1).to(self.device)

        # Batched single-run path: regions of one word type and page size are handled a chunk
        # at a time (one staging tensor, one _foreach_copy_), which halves the Python calls per
        # region; chunks keep device staging under staging_bytes.
        self._batched = True
        self.staging_bytes = int(staging_bytes)
        self._pages = [r.pages for r in self.layout.regions]
        self._words = [int(r.pages.shape[1]) for r in self.layout.regions]
        self._dtypes = [r.word_dtype for r in self.layout.regions]
        self._wbytes = [word_bytes(d) for d in self._dtypes]

    def _init_kernel(self) -> None:
        """The page kernel's region tables, when this device and mode can use it."""
        wanted = self.scatter in ("kernel", "staged") or (
            self.scatter == "auto" and self.device.type == "cuda" and self.pool.pinned
        )
        if not wanted:
            return
        if not page_kernel.available(self.device):
            if self.scatter == "kernel":
                raise ConfigError(
                    "scatter='kernel' needs Triton and a CUDA device (or TRITON_INTERPRET=1 "
                    "on the CPU device)"
                )
            return
        regions = self.layout.regions
        self._tables = page_kernel.region_table(
            [r.pages for r in regions],
            [r.block_stride_bytes for r in regions],
            self._host_views,
            [r.page_bytes for r in regions],
            self.device,
        )
        if self._tables is None and self.scatter == "kernel":
            raise ConfigError(
                "scatter='kernel' needs pages of whole 8-byte words in every region"
            )
        self._max_words = max(r.page_bytes for r in regions) // 8

    def _init_staged(self, staging_bytes: int) -> None:
        """What the staged path needs: a page-first pool (and the page kernel where it runs)."""
        wanted = self.scatter == "staged" or (self.scatter == "auto" and self.pool.spec.page_first)
        if not wanted:
            return
        usable = self.device.type == "cpu" or (self.pool.pinned and self.traits.has_streams)
        if not (self.pool.spec.page_first and usable):
            if self.scatter == "auto":
                return
            raise ConfigError(
                "scatter='staged' needs a pinned page-first host pool on a device with streams"
            )
        regions = self.layout.regions
        block = self.pool.spec.block_bytes
        capacity = max(1, min(self.pool.cpu_blocks, staging_bytes // block))
        rows = {
            d: torch.empty((capacity, block), dtype=torch.uint8, device=self.device)
            for d in (True, False)
        }
        args = (
            [r.pages for r in regions],
            [r.block_stride_bytes for r in regions],
        )
        offsets, pages = self.pool.spec.offsets, [r.page_bytes for r in regions]
        self._stage = _StageTables(
            capacity=capacity,
            block_bytes=block,
            positions=torch.arange(capacity, dtype=torch.int64, device=self.device),
            rows=rows,
            tables=None
            if self._tables is None
            else {d: _stage_table(*args, rows[d], offsets, pages, gather=d) for d in rows},
            views={
                d: [
                    rows[d][:, o : o + r.page_bytes].view(r.word_dtype)
                    for o, r in zip(offsets, regions, strict=True)
                ]
                for d in rows
            },
            host_blocks=self.pool.blocks(),
            engines=batch_copy.available(self.device.type),
        )
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)  # written before any lane reads them

    def _staged(
        self, stream: Any, plan: Plan, idx: torch.Tensor, store: bool, keep: list[Any]
    ) -> None:
        """Whole blocks through device staging rows, a chunk of ``capacity`` blocks at a time: a
        store gathers the batch's pages of every region into rows laid out as the pool's slots
        (one page-kernel launch, or a gather per region where the kernel cannot run), then
        copies each run of consecutive slots in one copy-engine transfer; a load does the
        reverse. The copy engines move both directions at once at the link's speed, which
        kernels reading or writing pinned memory do not (``batch_copy``). Each direction has its
        own rows, reused chunk after chunk in its stream's order. A grouped load (torch
        scatters) marks each group of regions once its last chunk is scattered."""
        st = self._stage
        assert st is not None
        rows, views = st.rows[store], st.views[store]
        n = len(plan.slots)
        for a in range(0, n, st.capacity):
            b = min(n, a + st.capacity)
            here, chunk = st.positions[: b - a], idx[a:b]
            if store and st.tables is not None:
                page_kernel.copy_pages(st.tables[True], chunk, here, self._max_words,
                                       programs=self.copy_programs)
            elif store:
                for region, view in zip(self._pages, views, strict=True):
                    torch.index_select(region, 0, chunk, out=view[: b - a])
            self._run_copies(stream, rows[: b - a], plan.slots[a:b], store, keep)
            if not store and st.tables is not None:
                page_kernel.copy_pages(st.tables[False], here, chunk, self._max_words,
                                       programs=self.copy_programs)
            elif not store:
                ends = {g for _, g in self._groups()} if b == n else set()
                for r, (region, view) in enumerate(zip(self._pages, views, strict=True)):
                    region.index_copy_(0, chunk, view[: b - a])
                    if r + 1 in ends:
                        self._landed(stream, r + 1)

    def _host_index(self, array: np.ndarray, keep: list[Any]) -> torch.Tensor:
        """A store's device block ids for the page kernel to read from pinned host memory
        (UVA): uploading them on the copy engines would queue them behind the loads' transfers
        (one engine per direction moves every host-to-device copy in order), and the store
        would wait for the loads: both directions at once fell to 0.71-0.73 of the link."""
        if self.device.type != "cuda":
            return self._to_device(array)
        host = torch.from_numpy(array).pin_memory()
        keep.append(host)  # until the batch is over: the kernel reads it in place
        return device_alias(host, self.device)

    def _run_copies(
        self, stream: Any, staging: torch.Tensor, slots: np.ndarray, to_host: bool,
        keep: list[Any],
    ) -> None:
        """One transfer per run of consecutive slots between staging rows and pool slots: all
        in one batched call where the driver has it, else one ``copy_`` each."""
        st = self._stage
        assert st is not None
        starts, lengths = run_bounds(slots)
        if st.engines and stream is not None:
            block = np.uint64(st.block_bytes)
            rows = np.uint64(staging.data_ptr()) + starts.astype(np.uint64) * block
            host = np.uint64(st.host_blocks.data_ptr()) + slots[starts].astype(np.uint64) * block
            sizes = lengths.astype(np.uint64) * block
            dst, src = (host, rows) if to_host else (rows, host)
            batch_copy.copy(dst, src, sizes, stream.native_handle)
            keep.extend((dst, src, sizes))
            return
        for a, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            s0 = int(slots[a])
            if to_host:
                st.host_blocks[s0 : s0 + length].copy_(staging[a : a + length], non_blocking=True)
            else:
                staging[a : a + length].copy_(st.host_blocks[s0 : s0 + length], non_blocking=True)

    def _init_batch(self) -> None:
        """The region addresses the batched copy-engine path builds its descriptors from, when
        this device and mode can use it."""
        wanted = self.scatter == "batch" or (
            self.scatter == "auto" and self.device.type == "cuda" and self.pool.pinned
        )
        if not wanted:
            return
        if not (batch_copy.available(self.device.type) and self.pool.pinned):
            if self.scatter == "auto":
                return
            raise ConfigError(
                "scatter='batch' needs a CUDA driver with cuMemcpyBatchAsync (12.8 or later) "
                "and a pinned pool"
            )
        regions = self.layout.regions
        self._addresses = batch_copy.RegionAddresses(
            [r.pages.data_ptr() for r in regions],
            [r.block_stride_bytes for r in regions],
            [v.data_ptr() for v in self._host_views],
            [v.stride(0) * v.element_size() for v in self._host_views],
            [r.page_bytes for r in regions],
        )

    def _batch_copy(
        self, stream: Any, plan: Plan, first: int, count: int, store: bool, keep: list[Any]
    ) -> None:
        """Every page of regions [first, first+count) of the batch in one copy-engine call."""
        assert self._addresses is not None and stream is not None
        arrays = self._addresses.descriptors(
            plan.device_blocks, plan.slots, first, count, store=store
        )
        batch_copy.copy(*arrays, stream.native_handle)
        keep.extend(arrays)  # the driver reads them at the call; kept until the batch is over

    def load_events(self) -> list[tuple[int, Any]]:
        """``(end region, event)`` per group of the last load batch (``load_groups`` > 1), in
        region order: once an event has happened, regions before its end have landed (the
        event is None on the CPU device, where copies are done when ``submit`` returns).
        Empty when loads are not grouped: wait for the batch (``last_event``) then."""
        return list(self._load_events)

    def _landed(self, stream: Any | None, end: int) -> None:
        """Regions before ``end`` are enqueued: mark it with an event when loads are grouped."""
        if self.load_groups > 1:
            self._load_events.append((end, record_event(stream, self.device)))

    def _groups(self) -> list[tuple[int, int]]:
        """``load_groups`` ranges [a, b) of consecutive regions, as even as they divide."""
        count = self.layout.num_regions
        g = max(1, min(self.load_groups, count))
        bounds = [count * k // g for k in range(g + 1)]
        return [(bounds[k], bounds[k + 1]) for k in range(g)]

    def _device_sums(self, idx: torch.Tensor, sums: torch.Tensor) -> None:
        """Per region, the int64 sum of each page's words (what the staging paths sum)."""
        for r, region in enumerate(self.layout.regions):
            torch.sum(region.pages.index_select(0, idx), 1, dtype=torch.int64, out=sums[r])

    def _chunks(self, n: int, lo: int = 0, hi: int | None = None) -> Iterator[tuple[int, int]]:
        """Ranges [a, b) of regions in [lo, hi) with one word type and size, each within
        staging_bytes."""
        a, count = lo, len(self._pages) if hi is None else hi
        while a < count:
            per_region = n * self._words[a] * self._wbytes[a]
            limit = max(1, self.staging_bytes // max(1, per_region))
            b = a + 1
            while (
                b < count
                and b - a < limit
                and self._words[b] == self._words[a]
                and self._dtypes[b] == self._dtypes[a]
            ):
                b += 1
            yield a, b
            a = b

    def _regions_unbatched(self, single: bool, scattered: bool) -> Sequence[Any]:
        """The regions the per-region loop still has to do (none when the batched path ran)."""
        return () if (single and not scattered and self._batched) else self.layout.regions

    def _launch_indices(
        self, plan: Plan, scattered: bool
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        """Device-side index tensors of a batch (on the current stream): device blocks, the
        slots when GPU kernels address the pinned pool directly, and a checksum buffer."""
        slot_idx = None
        if scattered and self.scatter == "batch":  # addresses, not indices: only checksums
            idx = self._to_device(plan.device_blocks) if self.checksums else None
        elif scattered and self.scatter in ("uva", "kernel", "staged"):  # one host-to-device copy
            both = np.stack((plan.device_blocks, plan.slots))
            idx, slot_idx = self._to_device(both).unbind(0)
        else:
            idx = self._to_device(plan.device_blocks)
        return idx, slot_idx, self._sums_buffer(len(plan.slots))

    def _sums_buffer(self, n: int) -> torch.Tensor | None:
        """Per region and pair, the checksum words (with ``checksums``)."""
        if not self.checksums:
            return None
        return torch.empty((self.layout.num_regions, n), dtype=torch.int64, device=self.device)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A batch's index array on the device, through pinned memory where copies are async:
        a copy from pageable memory first waits for the stream's earlier work (CUDA syncs the
        stream before such a copy), so the next submit could not be enqueued before the last
        batch's copies were over and the link idled between batches."""
        host = torch.from_numpy(array)
        if self.traits.has_streams and self.traits.pin_strategy != "none":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _scattered(self, plan: Plan) -> bool:
        if self.scatter == "staged":  # a page-first pool: the per-region paths cannot slice it
            return True
        return self.scatter != "runs" and plan.num_runs > self.max_runs

    def _launch_store(
        self, stream: Any | None, plan: Plan, compute_done: Any, keep: list[Any],
        both_ways: bool = False,
    ) -> Finish | None:
        """``both_ways``: loads are copying meanwhile; the staged path then takes the copy
        engines (whole blocks), which share the link between directions better than kernels,
        and the page kernel otherwise (one direction alone: 0.93-0.95 of the link against
        0.85-0.90 staged, whose gather and transfer run one after the other)."""
        slots, n = plan.slots, len(plan.slots)
        scattered = self._scattered(plan)
        runs = [] if scattered else plan.runs
        self._cs_valid[slots] = False  # the slots' content is about to change
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        cs_host = None
        with on_stream(stream, self.device):
            wait_for(stream, compute_done)
            whole_blocks = (
                scattered and self.scatter == "staged" and (both_ways or self._tables is None)
            )
            if whole_blocks:
                idx, slot_idx = self._host_index(plan.device_blocks, keep), None
                sums = self._sums_buffer(n)
            else:
                idx, slot_idx, sums = self._launch_indices(plan, scattered)
            single = len(runs) == 1
            kernel = scattered and self.scatter in ("kernel", "staged") and not whole_blocks
            dma = scattered and self.scatter == "batch"
            if whole_blocks:
                if sums is not None:
                    self._device_sums(idx, sums)
                self._staged(stream, plan, idx, True, keep)
            elif dma:
                if sums is not None:
                    self._device_sums(idx, sums)
                self._batch_copy(stream, plan, 0, self.layout.num_regions, True, keep)
            elif kernel:
                assert self._tables is not None and slot_idx is not None
                if sums is not None:
                    self._device_sums(idx, sums)
                page_kernel.copy_pages(
                    self._tables[0], idx, slot_idx, self._max_words,
                    programs=self.copy_programs or page_kernel.store_programs(self.device),
                )
            elif single and not scattered and self._batched:
                s0 = runs[0][2]
                for a, b in self._chunks(n):
                    staging = torch.empty(
                        (b - a, n, self._words[a]), dtype=self._dtypes[a], device=self.device
                    )
                    parts = staging.unbind(0)
                    for k in range(a, b):
                        torch.index_select(self._pages[k], 0, idx, out=parts[k - a])
                    if sums is not None:
                        torch.sum(staging, 2, dtype=torch.int64, out=sums[a:b])
                    dst = [self._host_views[k][s0 : s0 + n] for k in range(a, b)]
                    torch._foreach_copy_(dst, parts, non_blocking=True)
            for r, region in enumerate(
                () if kernel or dma or whole_blocks else self._regions_unbatched(single, scattered)
            ):
                staging = torch.index_select(region.pages, 0, idx)
                if sums is not None:
                    torch.sum(staging, 1, dtype=torch.int64, out=sums[r])
                host = self._host_views[r]
                if not scattered:
                    if single:
                        s0 = runs[0][2]
                        host[s0 : s0 + n].copy_(staging, non_blocking=True)
                    else:
                        for a, length, s in runs:
                            host[s : s + length].copy_(staging[a : a + length], non_blocking=True)
                elif self.scatter == "uva":
                    assert slot_idx is not None
                    self._uva_views[r].index_copy_(0, slot_idx, staging)
                else:
                    pinned = pinned_empty(tuple(staging.shape), staging.dtype, self.traits)
                    pinned.copy_(staging, non_blocking=True)
                    staged.append((host, pinned))
            if sums is not None:
                assert self._cs_mult is not None
                cs = (sums * self._cs_mult).sum(0)
                cs_host = pinned_empty((n,), torch.int64, self.traits)
                cs_host.copy_(cs, non_blocking=True)
        keep.extend(p for _, p in staged)

        def finish() -> Failures:
            if staged:
                slot_t = torch.from_numpy(slots)
                for host, pinned in staged:
                    host.index_copy_(0, slot_t, pinned)
            if cs_host is not None:
                self._cs_table[slots] = cs_host.numpy()
                self._cs_valid[slots] = True
            return {}

        return finish if (staged or cs_host is not None) else None

    def _launch_load(
        self, stream: Any | None, plan: Plan, compute_done: Any, after: Any, keep: list[Any],
        both_ways: bool = False,
    ) -> Finish | None:
        """``both_ways``: as for ``_launch_store``; a load in groups (``load_groups``) always
        takes the page kernel, which marks each group with an event."""
        slots, n = plan.slots, len(plan.slots)
        scattered = self._scattered(plan)
        runs = [] if scattered else plan.runs
        expected = valid = None
        if self.checksums:
            expected, valid = self._cs_table[slots].copy(), self._cs_valid[slots].copy()
        cs_host = None
        slot_cpu = torch.from_numpy(slots) if scattered and self.scatter == "host" else None
        self._load_events = []
        with on_stream(stream, self.device):
            wait_for(stream, compute_done)
            wait_for(stream, after)
            idx, slot_idx, sums = self._launch_indices(plan, scattered)
            single = len(runs) == 1
            whole_blocks = scattered and self.scatter == "staged" and (
                self._tables is None or (self.load_groups == 1 and both_ways)
            )
            kernel = scattered and (
                self.scatter == "kernel" or (self.scatter == "staged" and not whole_blocks)
            )
            dma = scattered and self.scatter == "batch"
            if whole_blocks:
                self._staged(stream, plan, idx, False, keep)
                if sums is not None:
                    self._device_sums(idx, sums)
            elif dma:
                for a, b in self._groups():
                    self._batch_copy(stream, plan, a, b - a, False, keep)
                    self._landed(stream, b)
                if sums is not None:
                    self._device_sums(idx, sums)
            elif kernel:
                assert self._tables is not None and slot_idx is not None
                for a, b in self._groups():
                    page_kernel.copy_pages(
                        self._tables[1], slot_idx, idx, self._max_words,
                        first=a, count=b - a, programs=self.copy_programs,
                    )
                    self._landed(stream, b)
                if sums is not None:
                    self._device_sums(idx, sums)
            elif single and not scattered and self._batched:
                s0 = runs[0][2]
                for ga, gb in self._groups():
                    for a, b in self._chunks(n, ga, gb):
                        staging = torch.empty(
                            (b - a, n, self._words[a]), dtype=self._dtypes[a], device=self.device
                        )
                        parts = staging.unbind(0)
                        torch._foreach_copy_(
                            parts,
                            [self._host_views[k][s0 : s0 + n] for k in range(a, b)],
                            non_blocking=True,
                        )
                        if sums is not None:
                            torch.sum(staging, 2, dtype=torch.int64, out=sums[a:b])
                        for k in range(a, b):
                            self._pages[k].index_copy_(0, idx, parts[k - a])
                    self._landed(stream, gb)
            ends = {b for _, b in self._groups()}
            for r, region in enumerate(
                () if kernel or dma or whole_blocks else self._regions_unbatched(single, scattered)
            ):
                host = self._host_views[r]
                if not scattered:
                    if single:
                        s0 = runs[0][2]
                        staging = host[s0 : s0 + n].to(self.device, non_blocking=True)
                    else:
                        staging = torch.empty(
                            (n, host.shape[1]), dtype=host.dtype, device=self.device
                        )
                        for a, length, s in runs:
                            staging[a : a + length].copy_(host[s : s + length], non_blocking=True)
                elif self.scatter == "uva":
                    assert slot_idx is not None
                    staging = torch.index_select(self._uva_views[r], 0, slot_idx)
                else:
                    assert slot_cpu is not None
                    pinned = pinned_empty((n, host.shape[1]), host.dtype, self.traits)
                    torch.index_select(host, 0, slot_cpu, out=pinned)
                    keep.append(pinned)
                    staging = pinned.to(self.device, non_blocking=True)
                if sums is not None:
                    torch.sum(staging, 1, dtype=torch.int64, out=sums[r])
                region.pages.index_copy_(0, idx, staging)
                if r + 1 in ends:
                    self._landed(stream, r + 1)
            if sums is not None:
                assert self._cs_mult is not None
                cs = (sums * self._cs_mult).sum(0)
                cs_host = pinned_empty((n,), torch.int64, self.traits)
                cs_host.copy_(cs, non_blocking=True)
        if cs_host is None:
            return None
        assert expected is not None and valid is not None

        def finish() -> Failures:
            got = cs_host.numpy()
            bad = np.flatnonzero((got != expected) | ~valid)
            errors: dict[int, str] = {}
            corrupt: dict[int, list[int]] = {}
            for pos in bad.tolist():
                job = plan.jobs[int(plan.owner[pos])]
                slot, block = int(slots[pos]), int(plan.device_blocks[pos])
                if job.hashes:  # name the block whose host copy cannot be trusted (F17)
                    corrupt.setdefault(job.job_id, []).append(job.hashes[job.slots.index(slot)])
                if job.job_id in errors:
                    continue
                errors[job.job_id] = (
                    f"checksum mismatch: slot {slot} -> device block {block} "
                    "(host copy corrupted; recompute)"
                    if valid[pos]
                    else f"no checksum recorded for slot {slot}: never stored by this executor"
                )
            return {j: (e, tuple(dict.fromkeys(corrupt.get(j, ())))) for j, e in errors.items()}

        return finish
