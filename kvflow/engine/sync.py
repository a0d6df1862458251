"""``SyncEngine``: decisions, an executor, a clock and a log behind one synchronous step API
(the façade for synchronous schedulers). The guarantees it gives the embedding engine are
listed in :mod:`kvflow.engine`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from kvflow.core.commands import JobResult
from kvflow.core.config import Config
from kvflow.core.jobs import TransferJob
from kvflow.engine.manager import OffloadManager
from kvflow.engine.notices import Fence, StepReport, merge_reports
from kvflow.engine.protocols import (
    Executor,
    KeepsTime,
    KnowsBlockBytes,
    ProbesRemoteTier,
    RefusesEntries,
    ServesDiskTier,
    check_executor,
)
from kvflow.engine.watch import EngineWatch
from kvflow.log.memory import MemoryLog, NullLog
from kvflow.log.protocol import Log
from kvflow.log.writer import TraceWriter


def monotonic_ms() -> float:
    """The engine's default clock: monotonic time in milliseconds."""
    return time.monotonic() * 1000.0


class SyncEngine:
    """Decisions, executor and clock behind one synchronous step API."""

    def __init__(
        self,
        config: Config,
        executor: Executor,
        *,
        clock: Callable[[], float] | None = None,
        trace_path: str | None = None,
        trace_meta: dict[str, Any] | None = None,
        bytes_per_block: int = 0,
        logger: Any = None,
        checkpoint_every: int = 10_000,
        keep_log: bool = False,
        fence_warn_ms: float | None = None,
        pin_warn_ms: float | None = None,
        _auto_flush: bool = True,
    ) -> None:
        """``trace_path`` records a trace file while running; without it the engine keeps no
        log (``keep_log=True`` keeps one in memory, for tests and short runs: it grows with
        every event). A fence held longer than ``fence_warn_ms`` (default: the job deadline)
        is counted in ``fences_overdue`` and logged once as ``kvflow.fence_held``; a request
        that holds the hits of its lookups longer than ``pin_warn_ms`` (default: the job
        deadline) without accepting or releasing them is counted in ``pins_overdue`` and
        logged once as ``kvflow.pins_held`` (those pinned blocks cannot be evicted).

        The executor's abilities are checked here, once (``ConfigError``, naming what is
        missing): its host pool must have ``config.cpu_blocks`` slots, and a config with a
        remote tier needs an executor that probes it. ``bytes_per_block`` defaults to the
        executor's own ``block_bytes`` when it knows it, and ``clock`` (milliseconds) to the
        executor's own clock when it keeps one (a ``SimulatedExecutor``'s virtual clock), else
        to monotonic time."""
        check_executor(config, executor)
        self.config = config
        self._executor = executor
        # the remote tier's prober (None without a remote tier)
        self._prober = executor if config.remote and isinstance(executor, ProbesRemoteTier) else None
        # the shared tiers' refusals, recorded at every step (None: no tier that refuses)
        self._refuser = executor if isinstance(executor, RefusesEntries) else None
        if clock is None:  # (a simulated executor's copies run on its own clock: so do deadlines)
            clock = executor.clock if isinstance(executor, KeepsTime) else monotonic_ms
        self.clock = clock
        if not bytes_per_block and isinstance(executor, KnowsBlockBytes):
            bytes_per_block = executor.block_bytes
        self.bytes_per_block = bytes_per_block
        self.writer: TraceWriter | None = None
        log: Log
        if trace_path is not None:
            log = self.writer = TraceWriter(
                trace_path, config, meta=trace_meta, checkpoint_every=checkpoint_every, auto_flush=_auto_flush
            )
        else:
            log = MemoryLog(config) if keep_log else NullLog()
        # every event is logged at debug level for a logger given, or a structlog configured
        debug = logger is not None or structlog.is_configured()
        logger = logger if logger is not None else structlog.get_logger("kvflow")
        self.manager = OffloadManager(config, log=log, logger=logger)
        self.watch = EngineWatch(
            self.manager,
            config,
            clock,
            logger=logger,
            debug=debug,
            bytes_per_block=bytes_per_block,
            fence_warn_ms=config.job_deadline_ms if fence_warn_ms is None else float(fence_warn_ms),
            pin_warn_ms=config.job_deadline_ms if pin_warn_ms is None else float(pin_warn_ms),
        )
        self.counters = self.watch.counters
        self.latencies = self.watch.latencies
        self.closed = False
        # the disk tier (None without one): what it held at start is indexed now (a warm
        # restart), and what goes wrong with it is watched at every step
        self._disk = executor if config.disk and isinstance(executor, ServesDiskTier) else None
        if self._disk is not None:
            restored = self._disk.disk_entries()
            if restored:
                self.counters.disk_blocks_restored += self.manager.disk_restored(restored)

    @property
    def executor(self) -> Executor:
        """The executor (fixed: its abilities were checked when the engine was built)."""
        return self._executor

    # -- scheduling-time calls (forwarded; Rejected propagates: it is the caller's bug) ---

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        num_tokens: int,
        device_hit_blocks: int = 0,
        tenant: str | None = None,
    ) -> int:
        """How many of the request's blocks after its first ``device_hit_blocks`` (those the
        device cache already holds) the CPU tier can load, counted in blocks. Those hits are
        pinned for the request until ``accept_hits`` takes them into a load, or releases them
        (``accept_hits(request_id, [])``), or the request finishes. ``block_hashes`` are the
        request's full-block hashes in prefix order; at most ``num_tokens - 1`` tokens hit.

        A block hash is an int of up to 256 bits (vLLM's SHA-256 whole): the shared tiers key
        their entries by all of it. ``tenant`` (vLLM's ``cache_salt``) keeps a tenant's
        blocks apart: a block stored for one tenant never hits for another, in any tier;
        every call naming blocks takes it."""
        if self._prober is None:
            hits = self.manager.lookup(request_id, block_hashes, num_tokens, device_hit_blocks, tenant)
        else:
            # the remote tier is asked (in its executor's thread) about the blocks past the
            # hits that neither tier is known to hold; what it finds is recorded at the next step
            hits, wanted, names = self.manager.lookup_and_probe(
                request_id, block_hashes, num_tokens, device_hit_blocks, tenant
            )
            if wanted:
                self._prober.probe(wanted, names)
        self.counters.lookups += 1
        self.counters.lookup_tokens += num_tokens
        return hits

    def arriving(
        self, block_hashes: Sequence[int], num_tokens: int, device_hit_blocks: int = 0, tenant: str | None = None
    ) -> int:
        """How many of a request's blocks right after its CPU-tier hits a lower tier (disk,
        remote) is loading into the CPU tier now (a lookup queued their load). An engine that
        can hold the request back waits for them (a few steps, bounded by the job deadline),
        then looks up again and hits them."""
        return self.manager.arriving(block_hashes, num_tokens, device_hit_blocks, tenant)

    def accept_hits(self, request_id: str, device_blocks: Sequence[int]) -> int | None:
        """The engine allocated ``device_blocks`` for the first ``len(device_blocks)`` hits of
        the last lookup: queue their load (its job id, or None for none). The rest of the
        hits are unpinned; ``[]`` releases them all (a request the engine does not schedule
        now). The loaded hits are touched deepest first (``Config.chain_recency``). The device
        blocks stay held until a report names them released."""
        return self.manager.accept_hits(request_id, device_blocks)

    def blocks_computed(
        self,
        request_id: str | None,
        block_hashes: Sequence[int],
        device_blocks: Sequence[int],
        tenant: str | None = None,
    ) -> int | None:
        """Eager mode: these full blocks were computed, ``block_hashes[i]`` in
        ``device_blocks[i]``, in prefix order. The ones not on the tier are stored (job id,
        or None); the rest are deduplicated (F3). A store never evicts the request's own
        chain (F16); what does not fit is counted in ``rejected_store_blocks``."""
        return self.manager.blocks_computed(request_id, block_hashes, device_blocks, tenant)

    def device_blocks_evicting(
        self, block_hashes: Sequence[int], device_blocks: Sequence[int], tenant: str | None = None
    ) -> int | None:
        """Lazy mode: the device cache is about to drop these blocks; store the missing ones
        (the job id, or None). Keep the device blocks until a report releases them."""
        return self.manager.device_blocks_evicting(block_hashes, device_blocks, tenant)

    def touch(self, block_hashes: Sequence[int], reuse: bool = True, tenant: str | None = None) -> int:
        """Extra recency for the blocks on the tier among ``block_hashes``, in this order (the
        last is the most recent); returns how many were on the tier. Not needed for a
        request's own chain: with ``Config.chain_recency`` (the default) ``accept_hits`` and
        ``finish_request`` apply it. ``reuse=False`` only reorders: under ARC ``reuse=True``
        counts a second use and promotes every fresh block to T2."""
        return self.manager.touch(block_hashes, reuse, tenant)

    def finish_request(self, request_id: str, preempted: bool = False) -> bool:
        """The request finished (or was preempted): its unaccepted hits are unpinned now; its
        live jobs finish on their own. A finish (not a preemption) touches the request's chain
        on the tier deepest first, ``reuse=False`` (F14, ``Config.chain_recency``). False,
        changing nothing, for a request kvflow does not know (never seen, or already
        forgotten)."""
        return self.manager.finish_request(request_id, preempted)

    def invalidate(self, block_hashes: Sequence[int], tenant: str | None = None) -> int:
        """The engine learned these blocks' bytes are bad: evict the resident, unpinned ones
        (F17) so they are never offered again; returns how many."""
        return self.manager.invalidate(block_hashes, tenant)

    def reset(self) -> None:
        """Clear the tier (vLLM's reset_prefix_cache): queued jobs are cancelled, in-flight
        ones abandoned and fenced until their copies report over; requests stay known, and
        their abandoned loads are reported failed (fenced) in the next step's report."""
        self.manager.reset()

    def held_device_blocks(self) -> list[int]:
        """Device blocks the engine must not reuse yet: named by a live or fenced job."""
        return self.manager.held_device_blocks()

    def has_live_jobs(self) -> bool:
        """Whether a queued or in-flight job's outcome is still to come (fences excluded)."""
        return self.manager.has_live_jobs()

    def fences(self) -> list[Fence]:
        """Jobs whose outcome is known but whose copy may still run (F15), oldest first."""
        return self.manager.fences()

    # -- the step ------------------------------------------------------------------------

    def step(self, compute_done: Any = None, results: Sequence[JobResult] | None = None) -> StepReport:
        """One engine step: the executor's results (``results``, else ``poll()``) applied,
        jobs past their deadline timed out, the queued jobs handed to the executor (after
        ``compute_done``, an event the copies wait for), and the report of what the engine
        must act on: loads finished or failed, stores finished or failed, device blocks
        released (the scheduler half is ``OffloadManager.step``)."""
        now = self.clock()
        if results is None:
            results = self.poll_executor()
        found = self._prober.take_found() if self._prober is not None else ()
        refusals = self._refuser.take_refused() if self._refuser is not None else ()
        jobs, report = self.manager.step(now, results, found=found, refusals=refusals)
        if jobs:
            try:
                self._executor.submit(jobs, compute_done)
            except Exception as exc:  # F2: a failed outcome for every job of the batch
                self._submit_failed(jobs, exc)
                merge_reports(report, self.manager.take_notices())
        self.counters.unknown_results += report.refused_results
        watch = self.watch
        if watch.fenced_at:
            watch.watch_fences(now)
        if watch.pinned_since:
            watch.watch_pins(now)
        if self._disk is not None:
            watch.watch_disk(self._disk.disk_problem())
        return report

    def apply_results(self, results: Sequence[JobResult]) -> None:
        """Feed executor outcomes to the decisions outside a step; never raises for a bad
        result (it is counted in ``counters.unknown_results`` and logged)."""
        self.counters.unknown_results += self.manager.apply_results(results)

    def poll_executor(self) -> list[JobResult]:
        """The executor's results; never raises (F2: a failing poll is counted and logged,
        and its results come at a later poll)."""
        try:
            return self._executor.poll()
        except Exception as exc:  # an executor bug must not kill the engine (F2)
            self.counters.executor_errors += 1
            self.watch.log.error("kvflow.executor_poll_failed", error=repr(exc))
            return []

    def _submit_failed(self, jobs: list[TransferJob], exc: Exception) -> None:
        """The executor refused the batch: every job of it fails, on every rank (no rank's
        copy runs, so nothing is fenced)."""
        self.counters.executor_errors += 1
        self.watch.log.error("kvflow.executor_submit_failed", jobs=len(jobs), error=repr(exc))
        error = f"submit failed: {exc!r}"
        ranks = range(self.config.world_size)
        failures = [JobResult(job_id=j.job_id, rank=r, ok=False, error=error) for j in jobs for r in ranks]
        self.apply_results(failures)

    # -- teardown ------------------------------------------------------------------------

    def drain(
        self, timeout_ms: float | None = None, sleep: Callable[[float], None] = time.sleep
    ) -> StepReport:
        """Step until no job is live (or ``timeout_ms`` of the engine's clock passes); the
        merged report of every step taken, so nothing that finished meanwhile is lost (F4)."""
        start = self.clock()
        merged = StepReport(now_ms=start)
        while self.manager.has_live_jobs():
            merge_reports(merged, self.step())
            if timeout_ms is not None and self.clock() - start > timeout_ms:
                break
            if self.manager.has_live_jobs():
                sleep(0.0005)
        merged.now_ms = self.clock()
        return merged

    def close(self) -> None:
        """Close the executor (its copies stop), then end every fence (F15: no copy can touch
        the memory any more) and close the trace. Idempotent. If the executor's close raises,
        the fences stay: its copies may still run."""
        if self.closed:
            return
        self.closed = True
        try:
            self._executor.close()
            self.manager.end_fences()
        finally:
            self.manager.close()

