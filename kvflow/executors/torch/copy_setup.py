"""How the torch executor's copies are set up: which path (scatter mode) a batch of several
runs takes on this device, and the tables and views each path needs (``CopySetup``, a mixin of
``TorchExecutor`` through ``PageCopies``). What the paths launch is in ``page_copies`` and,
for the staged path, ``staged_copies``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from kvflow.core.errors import ConfigError
from kvflow.executors.torch import batch_copy, page_kernel
from kvflow.executors.torch.host_pool import HostPool
from kvflow.executors.torch.layout import KVLayout, word_bytes
from kvflow.executors.torch.npu import DeviceTraits
from kvflow.executors.torch.staged_copies import StagedCopies, StageTables
from kvflow.executors.torch.transfer_plan import Plan
from kvflow.executors.torch.uva import device_alias

ScatterMode = Literal["auto", "runs", "host", "uva", "kernel", "batch", "staged"]
# What a batch's host-side finish reports: job id -> (error, hashes whose host copy is bad)
Failures = dict[int, tuple[str, tuple[int, ...]]]
Finish = Callable[[], Failures]


KERNEL_MAX_PAGE = 512 << 10  # bytes; at larger pages the copy engines move a page faster
BATCH_MIN_PAGE = 512 << 10  # bytes; below, the driver's host time per page copy bounds ``batch``


def batch_pages(batch: bool, page_bytes: int) -> bool:
    """Whether ``scatter="auto"`` hands every page straight to the copy engines (``batch``):
    where the driver takes batched copies and pages are large enough that its host time per
    page does not bound the link. Whole 2 MiB pages moved that way at 0.97-0.98 of one
    contiguous copy each way and slowed a concurrent decode step as much as that copy did
    (+0.8-0.9% stores, +2.2-2.3% loads), where the staged path's device gather and scatter
    cost it about 4 points more (docs/performance.md, "Copy methods side by side")."""
    return batch and page_bytes >= BATCH_MIN_PAGE


def auto_scatter(
    *, kernel: bool, uva: bool, batch: bool, page_bytes: int, staged: bool = False
) -> ScatterMode:
    """What ``scatter="auto"`` picks for batches of several runs, from what this executor can
    use and its largest page.

    Measured on an H200 (docs/performance.md, "Copies on the GPU" and "Copy methods side by
    side"): pages of 512 KiB and up take ``batch`` where the driver has it (``batch_pages``).
    Below, the driver's host time per page bounds ``batch`` (0.40-0.79 of the link at 32 KiB),
    and ``staged`` (a page-first pool; whole blocks on the copy engines, the page kernel for
    loads in groups and where the driver has no batched copies) moves 0.88-0.93 of the link
    each way and 0.88-0.92 both ways at 32 KiB pages; its device gather and scatter cost a
    concurrent decode step 4 to 7.5 points more than the copy itself, and the page kernel straight
    over the pinned pool costs it more still, even with 8 programs (+20% for stores at 0.93,
    and loads fall to 0.48 of the link). Without either: the page kernel (0.90-0.95 each way,
    0.69-0.78 both ways) below 512 KiB, the UVA kernels above. Host staging (a CPU gather per
    byte) is the portable fallback: NPU, CPU, unpinned pools.
    """
    if batch_pages(batch, page_bytes):
        return "batch"
    if staged:
        return "staged"
    if kernel and page_bytes < KERNEL_MAX_PAGE:
        return "kernel"
    return "uva" if uva else "host"


class CopySetup(StagedCopies):
    """The executor's copy tables, built once by ``_init_copies``."""

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
        largest = max(r.page_bytes for r in self.layout.regions)
        self._host_views: list[torch.Tensor] = []
        self._uva_views: list[torch.Tensor] = []
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._addresses: batch_copy.RegionAddresses | None = None
        self._stage: StageTables | None = None
        self._load_events: list[tuple[int, Any]] = []
        if pool.enabled:
            self._host_views = [
                pool.region(i, r.word_dtype) for i, r in enumerate(self.layout.regions)
            ]
            self._init_kernel()
            self._init_batch()
            if not (self.scatter == "auto" and batch_pages(self._addresses is not None, largest)):
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
                page_bytes=largest,
                staged=self._stage is not None,
            )
        # The page kernel, the staged path and the batched copy engines move every batch in
        # one launch or call, a single run too: the per-region path would gather the pages on
        # the device first (index_select), and take the host a copy call per region.
        self.max_runs = int(max_runs) if max_runs is not None else (
            0 if self.scatter in ("kernel", "staged", "batch") else 16
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
