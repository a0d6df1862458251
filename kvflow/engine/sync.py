"""``SyncEngine``: decisions, an executor, a clock and a log behind one synchronous step API
(the façade for synchronous schedulers, vLLM's included). The guarantees it gives the
embedding engine are listed in :mod:`kvflow.engine`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from kvflow.core.commands import JobResult
from kvflow.core.config import Config
from kvflow.core.errors import ConfigError, Rejected
from kvflow.core.jobs import TransferJob
from kvflow.engine.api import Executor, StepReport, merge_reports, monotonic_ms
from kvflow.engine.manager import OffloadManager
from kvflow.engine.notices import Fence
from kvflow.engine.watch import EngineWatch
from kvflow.log.memory import MemoryLog, NullLog
from kvflow.log.writer import TraceWriter


class SyncEngine:
    """Decisions, executor and clock behind one synchronous step API."""

    def __init__(
        self,
        config: Config,
        executor: Executor,
        *,
        clock: Callable[[], float] = monotonic_ms,
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
        logged once as ``kvflow.pins_held`` (those pinned blocks cannot be evicted)."""
        self.config = config
        self._remote = config.remote  # (read on every step)
        self.executor = executor
        self.clock = clock
        pool = getattr(executor, "pool", None)  # an executor with a host pool exposes it (F11)
        pool_slots = getattr(pool, "cpu_blocks", None)
        if pool_slots is not None and pool_slots != config.cpu_blocks:
            raise ConfigError(
                f"config cpu_blocks={config.cpu_blocks} but the executor's host pool has {pool_slots} "
                "slots: build both from the same number"
            )
        if not bytes_per_block:  # a torch executor knows its KV layout; a simulated one its model
            layout = getattr(executor, "layout", None)
            model = getattr(executor, "model", None)
            bytes_per_block = int(
                getattr(layout, "block_bytes", 0) or getattr(model, "bytes_per_block", 0) or 0
            )
        self.bytes_per_block = bytes_per_block
        self.writer: TraceWriter | None = None
        if trace_path is not None:
            self.writer = TraceWriter(
                trace_path, config, meta=trace_meta, checkpoint_every=checkpoint_every, auto_flush=_auto_flush
            )
        log: Any = self.writer
        if log is None:
            log = MemoryLog(config) if keep_log else NullLog()
        self.manager = OffloadManager(config, log=log)
        self.watch = EngineWatch(
            self.manager,
            config,
            clock,
            logger=logger if logger is not None else structlog.get_logger("kvflow"),
            debug=logger is not None or structlog.is_configured(),
            bytes_per_block=bytes_per_block,
            fence_warn_ms=config.job_deadline_ms if fence_warn_ms is None else float(fence_warn_ms),
            pin_warn_ms=config.job_deadline_ms if pin_warn_ms is None else float(pin_warn_ms),
        )
        self.counters = self.watch.counters
        self.latencies = self.watch.latencies
        self.closed = False

    # -- scheduling-time calls (forwarded; Rejected propagates: it is the caller's bug) ---

    def lookup(
        self, request_id: str, block_hashes: Sequence[int], num_tokens: int, device_hit_blocks: int = 0
    ) -> int:
        """How many of the request's blocks after its first ``device_hit_blocks`` (those the
        device cache already holds) the CPU tier can load, counted in blocks. Those hits are
        pinned for the request until ``accept_hits`` takes them into a load, or releases them
        (``accept_hits(request_id, [])``), or the request finishes. ``block_hashes`` are the
        request's full-block hashes in prefix order; at most ``num_tokens - 1`` tokens hit."""
        hits = self.manager.lookup(request_id, block_hashes, num_tokens, device_hit_blocks)
        if self._remote:
            self._probe_remote(block_hashes, num_tokens, device_hit_blocks, hits)
        self.counters.lookups += 1
        self.counters.lookup_tokens += num_tokens
        return hits

    def _probe_remote(self, block_hashes: Sequence[int], num_tokens: int, device_hit_blocks: int, hits: int) -> None:
        """Ask the remote tier (in its executor's thread) about the blocks past the hits that
        neither tier is known to hold; what it finds is recorded at the next step."""
        probe = getattr(self.executor, "probe", None)
        if probe is not None:
            wanted = self.manager.remote_probe_candidates(block_hashes, num_tokens, device_hit_blocks, hits)
            if wanted:
                probe(wanted)

    def accept_hits(self, request_id: str, device_blocks: Sequence[int]) -> int | None:
        """The engine allocated ``device_blocks`` for the first ``len(device_blocks)`` hits of
        the last lookup: queue their load (its job id, or None for none). The rest of the
        hits are unpinned; ``[]`` releases them all (a request the engine does not schedule
        now). The loaded hits are touched deepest first (``Config.chain_recency``). The device
        blocks stay held until a report names them released."""
        return self.manager.accept_hits(request_id, device_blocks)

    def blocks_computed(
        self, request_id: str | None, block_hashes: Sequence[int], device_blocks: Sequence[int]
    ) -> int | None:
        """Eager mode: these full blocks were computed, ``block_hashes[i]`` in
        ``device_blocks[i]``, in prefix order. The ones not on the tier are stored (job id,
        or None); the rest are deduplicated (F3). A store never evicts the request's own
        chain (F16); what does not fit is counted in ``rejected_store_blocks``."""
        return self.manager.blocks_computed(request_id, block_hashes, device_blocks)

    def device_blocks_evicting(self, block_hashes: Sequence[int], device_blocks: Sequence[int]) -> int | None:
        """Lazy mode: the device cache is about to drop these blocks; store the missing ones
        (the job id, or None). Keep the device blocks until a report releases them."""
        return self.manager.device_blocks_evicting(block_hashes, device_blocks)

    def touch(self, block_hashes: Sequence[int], reuse: bool = True) -> int:
        """Extra recency for the blocks on the tier among ``block_hashes``, in this order (the
        last is the most recent); returns how many were on the tier. Not needed for a
        request's own chain: with ``Config.chain_recency`` (the default) ``accept_hits`` and
        ``finish_request`` apply it. ``reuse=False`` only reorders: under ARC ``reuse=True``
        counts a second use and promotes every fresh block to T2."""
        return self.manager.touch(block_hashes, reuse)

    def finish_request(self, request_id: str, preempted: bool = False) -> bool:
        """The request finished (or was preempted): its unaccepted hits are unpinned now; its
        live jobs finish on their own. A finish (not a preemption) touches the request's chain
        on the tier deepest first, ``reuse=False`` (F14, ``Config.chain_recency``). False,
        changing nothing, for a request kvflow does not know (never seen, or already
        forgotten)."""
        return self.manager.finish_request(request_id, preempted)

    def invalidate(self, block_hashes: Sequence[int]) -> int:
        """The engine learned these blocks' bytes are bad: evict the resident, unpinned ones
        (F17) so they are never offered again; returns how many."""
        return self.manager.invalidate(block_hashes)

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

    def apply_results(self, results: Sequence[JobResult]) -> None:
        """Feed executor outcomes to the decisions; never raises for a bad result."""
        if not results:
            return
        try:
            self.manager.job_results(results)
        except Rejected:
            self._apply_one_by_one(results)

    def _apply_one_by_one(self, results: Sequence[JobResult]) -> None:
        """A batch the decisions refused: isolate the bad result(s), apply the others."""
        for result in results:
            try:
                # (with its integrity report: dropping it left a bad host copy on offer, F17)
                self.manager.job_result(
                    result.job_id, result.rank, result.ok, result.error, getattr(result, "corrupt", ())
                )
            except Rejected as exc:
                self.counters.unknown_results += 1
                self.watch.log.warning("kvflow.result_rejected", job=result.job_id, rank=result.rank, error=str(exc))

    def step(self, compute_done: Any = None, results: Sequence[JobResult] | None = None) -> StepReport:
        """One engine step: apply the executor's results (``results``, else ``poll()``),
        time out jobs past their deadline, hand the queued jobs to the executor (after
        ``compute_done``, an event the copies wait for), and report what the engine must act
        on: loads finished or failed, stores finished or failed, device blocks released."""
        # (the executor calls and the batch of results are inlined here rather than calling
        # _poll / apply_results / a submit helper: this runs several times per request)
        now = self.clock()
        if results is None:
            try:
                results = self.executor.poll()
            except Exception as exc:  # an executor bug must not kill the engine (F2)
                results = self._poll_failed(exc)
        manager = self.manager
        if results:
            try:
                manager.job_results(results)
            except Rejected:
                self._apply_one_by_one(results)
        if self._remote:
            self._take_remote_found()
        timed_out, jobs = manager.advance(now)
        if jobs:
            # (the watch times each job from its JobsSubmitted event, applied just now)
            try:
                self.executor.submit(jobs, compute_done)
            except Exception as exc:  # F2: becomes a failed outcome for every job of the batch
                self._submit_failed(jobs, exc)
        watch = self.watch
        if watch.fenced_at:
            watch.watch_fences(now)
        if watch.pinned_since:
            watch.watch_pins(now)
        book = manager.notice_book
        notices = book.notices
        if notices is None:  # (nothing happened: not even a Notices was started)
            return StepReport(now_ms=now, submitted=jobs, timed_out=timed_out)
        book.notices = None  # (taken: ``manager.take_notices()``, without its call)
        return StepReport(
            now_ms=now,
            submitted=jobs,
            loads_finished=notices.loads_finished,
            loads_failed=notices.loads_failed,
            stores_finished=notices.stores_finished,
            stores_failed=notices.stores_failed,
            released_device_blocks=notices.released_device_blocks,
            timed_out=timed_out,
            rejected_store_blocks=notices.rejected_store_blocks,
            all_blocks_cleared=notices.all_blocks_cleared,
        )

    def _take_remote_found(self) -> None:
        """What the remote tier's probes found since the last step goes to the decisions."""
        take_found = getattr(self.executor, "take_found", None)
        if take_found is not None:
            found = take_found()
            if found:
                self.manager.remote_found(found)

    def _poll(self) -> list[JobResult]:
        """The executor's results; never raises (F2). (For the async engine's pump; ``step``
        inlines it.)"""
        try:
            return self.executor.poll()
        except Exception as exc:  # an executor bug must not kill the engine (F2)
            return self._poll_failed(exc)

    def _poll_failed(self, exc: Exception) -> list[JobResult]:
        self.counters.executor_errors += 1
        self.watch.log.error("kvflow.executor_poll_failed", error=repr(exc))
        return []

    def _submit_failed(self, jobs: list[TransferJob], exc: Exception) -> None:
        """The executor refused the batch: every job of it fails (one failed rank fails the
        job, whatever the world size)."""
        self.counters.executor_errors += 1
        self.watch.log.error("kvflow.executor_submit_failed", jobs=len(jobs), error=repr(exc))
        failures = [JobResult(job_id=j.job_id, rank=0, ok=False, error=f"submit failed: {exc!r}") for j in jobs]
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
            self.executor.close()
            self.manager.end_fences()
        finally:
            self.manager.close()

