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
  device staging rows, one copy-engine transfer per run of slots, and takes the page kernel
  for loads in groups and where the driver has no batched copies; ``"kernel"`` (``max_runs`` 0)
  copies every region's pages in ONE launch straight between the device cache and the pinned
  pool (``page_kernel``), optionally split into ``load_groups`` launches with one event each
  so an engine can start a layer once its pages landed; ``"batch"`` (CUDA 12.8+, the default
  for pages of 512 KiB and up) hands every page of the batch to the copy engines in one
  ``cuMemcpyBatchAsync`` call (``batch_copy``), with no gather or scatter on the device; ``"uva"`` (CUDA) lets torch kernels gather/scatter the pinned pool region by
  region through unified addressing; ``"host"`` (the fallback: NPU, CPU) stages in pinned host
  memory and gathers or scatters on the CPU region by region (stores scatter once their copy
  is over, in the thread that delivers their results; loads gather in the caller, each
  region's copy overlapping the next one's gather).
* With ``checksums``, a store records a per-slot checksum of what it copied and a load verifies
  it (a mismatch fails the job: the host copy is corrupt, recompute).

The host side that can only run once the copies are done (host scatter, checksum bookkeeping)
is returned as a ``Finish`` callable that the executor runs when it delivers the batch's
results (in the thread that found the copies over: ``poll`` or ``wait``). ``PageCopies`` is a
mixin of ``TorchExecutor``: the kernels read and set the executor's own attributes, which
benchmarks and tests also switch directly (``scatter``, ``_batched``, ``_uva_views``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvflow.executors.torch import page_kernel
from kvflow.executors.torch.copy_setup import CopySetup, Failures, Finish
from kvflow.executors.torch.streams import on_stream, pinned_empty, record_event, wait_for
from kvflow.executors.torch.transfer_plan import Plan

__all__ = ["PageCopies"]


class PageCopies(CopySetup):
    """Launches a batch's copies on a stream; returns the host-side ``Finish`` (or None)."""

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

    def _whole_blocks(self, both_ways: bool, grouped: bool) -> bool:
        """Whether a staged batch moves as whole blocks (device staging rows, then the copy
        engines) rather than through the page kernel: always where the kernel cannot run, and
        never for a load in groups (the kernel marks each group). Otherwise whenever the
        copy engines take batched calls, and while the other direction copies (``both_ways``)
        without them. The page kernel reads or writes pinned memory from every multiprocessor:
        it moved one direction at 0.89-0.93 of the link but slowed a concurrent decode step
        on the same GPU 1.8 to 6 times, against +5-6% on the copy engines at 0.87-0.92
        (tools/bench_copy_methods.py, docs/performance.md); with both directions at once
        kernels share the link badly."""
        if self.scatter != "staged":
            return False
        if self._tables is None:
            return True
        if grouped:
            return False
        return both_ways or (self._stage is not None and self._stage.engines)

    def _scattered(self, plan: Plan) -> bool:
        if self.scatter == "staged":  # a page-first pool: the per-region paths cannot slice it
            return True
        return self.scatter != "runs" and plan.num_runs > self.max_runs

    def _launch_store(
        self, stream: Any | None, plan: Plan, compute_done: Any, keep: list[Any],
        both_ways: bool = False,
    ) -> Finish | None:
        """``both_ways``: loads are copying meanwhile (see ``_whole_blocks``)."""
        slots, n = plan.slots, len(plan.slots)
        scattered = self._scattered(plan)
        runs = [] if scattered else plan.runs
        self._cs_valid[slots] = False  # the slots' content is about to change
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        cs_host = None
        with on_stream(stream, self.device):
            wait_for(stream, compute_done)
            whole_blocks = scattered and self._whole_blocks(both_ways, grouped=False)
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
        """``both_ways``: as for ``_launch_store``; a load in groups (``load_groups``) takes
        the page kernel, which marks each group with an event."""
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
            whole_blocks = scattered and self._whole_blocks(both_ways, self.load_groups > 1)
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
