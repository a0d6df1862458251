"""The staged copy path of the torch executor (``scatter="staged"``, a page-first host pool):
whole blocks move through device staging rows, gathered or scattered by the page kernel (or by
torch where it cannot run), and each run of consecutive slots is one copy-engine transfer
(``StagedCopies``, a mixin of ``TorchExecutor`` through ``PageCopies``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvflow.core.errors import ConfigError
from kvflow.executors.torch import batch_copy, page_kernel
from kvflow.executors.torch.host_pool import HostPool
from kvflow.executors.torch.layout import KVLayout
from kvflow.executors.torch.npu import DeviceTraits
from kvflow.executors.torch.transfer_plan import Plan, run_bounds
from kvflow.executors.torch.uva import device_alias


@dataclass(frozen=True)
class StageTables:
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


def stage_table(
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


class StagedCopies:
    """The staged path's buffers (``_init_staged``) and launches (``_staged``); it uses
    ``PageCopies``' ``_groups``, ``_landed`` and ``_to_device``."""

    # Set by TorchExecutor and CopySetup before _init_staged runs.
    layout: KVLayout
    device: torch.device
    traits: DeviceTraits
    pool: HostPool
    scatter: str
    copy_programs: int
    _tables: tuple[torch.Tensor, torch.Tensor] | None
    _stage: StageTables | None
    _max_words: int
    _pages: list[torch.Tensor]

    if TYPE_CHECKING:  # PageCopies' (the executor's class has both)

        def _groups(self) -> list[tuple[int, int]]: ...

        def _landed(self, stream: Any | None, end: int) -> None: ...

        def _to_device(self, array: np.ndarray) -> torch.Tensor: ...

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
        self._stage = StageTables(
            capacity=capacity,
            block_bytes=block,
            positions=torch.arange(capacity, dtype=torch.int64, device=self.device),
            rows=rows,
            tables=None
            if self._tables is None
            else {d: stage_table(*args, rows[d], offsets, pages, gather=d) for d in rows},
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
