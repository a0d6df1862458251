"""The engine: what a serving engine embeds. Decisions + an executor + a clock + a log.

``SyncEngine`` is the façade for synchronous schedulers (vLLM's is): call ``lookup`` /
``accept_hits`` / ``blocks_computed`` while scheduling, then ``step()`` once per engine step.
``Engine`` is the asyncio (anyio) version: one task group owns the completion pump, the
decisions and the trace writer; completions cross from the executor through one bounded
memory stream.

Guarantees to the embedding engine:

* it never raises because a transfer failed: executor exceptions (at submit or poll) become
  failed job results (F2), results for unknown jobs are logged and counted, and every job
  has a deadline driven by the engine's clock;
* every job is handed to the executor exactly once (F5), and its device blocks stay *held*
  until ``StepReport.released_device_blocks`` names them;
* logging goes through structlog with stable dotted event names (``kvflow.job_failed``)
  and bound ``job`` / ``request`` ids; the library never configures logging. When the
  application has not configured structlog (``structlog.is_configured()`` is false), only
  executor errors and memory kept too long (``kvflow.fence_held``, ``kvflow.pins_held``) are
  emitted, so an unconfigured embedding is not flooded; failed jobs are always visible in the
  counters, the step reports and the trace.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from kvflow.config import Config
from kvflow.errors import ConfigError, KvflowError, Rejected
from kvflow.events import (
    LOAD,
    STORE,
    TERMINAL_TYPES,
    BlocksEvicted,
    Event,
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobResult,
    JobsSubmitted,
    JobTimedOut,
    LateResultIgnored,
    PinsAcquired,
    Reset,
    StoreRejected,
    TransferJob,
    event_name,
)
from kvflow.log import MemoryLog, NullLog, TraceWriter
from kvflow.manager import Fence, LoadFailure, OffloadManager


class Executor(Protocol):
    """What the engine needs from an executor (torch, simulated, or a rank group).

    * ``submit`` accepts jobs (or raises: then none of them was accepted);
    * ``poll`` returns results; **every accepted job gets one result per rank once that
      rank's copy is over** — also after the job timed out in the engine: that late result
      is what lifts the job's fence (F15), so a copy still running never has its memory
      handed out again;
    * ``close`` returns only once no copy can run any more (the engine then ends every
      fence).

    An executor that owns a host pool exposes it as ``pool`` (its ``cpu_blocks`` must equal
    the config's, checked when the engine is built)."""

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any = None) -> None: ...

    def poll(self) -> list[JobResult]: ...

    def close(self) -> None: ...


def monotonic_ms() -> float:
    return time.monotonic() * 1000.0


@dataclass
class Counters:
    """Running totals, readable at any time from Python (``engine.counters``)."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    jobs_submitted: int = 0
    jobs_completed: int = 0
    jobs_failed: int = 0
    jobs_timed_out: int = 0
    late_results: int = 0
    jobs_fenced: int = 0  # outcome known while a copy may still run (F15)
    fences_lifted: int = 0  # of those, the copies reported over (or the executor closed)
    fences_overdue: int = 0  # fences held past ``fence_warn_ms`` (each warned about once)
    pins_overdue: int = 0  # requests holding lookup hits past ``pin_warn_ms`` (F18)
    unknown_results: int = 0
    executor_errors: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    blocks_evicted: int = 0
    blocks_rejected: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class Latencies:
    """Submit-to-terminal time of recent jobs, in ms, by direction (the last ``window`` to
    ``2 * window`` samples of each, so a long-running engine's memory stays bounded)."""

    load_ms: list[float] = field(default_factory=list)
    store_ms: list[float] = field(default_factory=list)
    window: int = 100_000
    # called with (direction, latency_ms) for every sample (e.g. a Prometheus histogram)
    listeners: list[Callable[[str, float], None]] = field(default_factory=list)

    def add(self, direction: str, latency_ms: float) -> None:
        for listener in self.listeners:
            listener(direction, latency_ms)
        values = self.load_ms if direction == LOAD else self.store_ms
        values.append(latency_ms)
        if len(values) > 2 * self.window:
            del values[: len(values) - self.window]

    def summary(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, values in (("load", self.load_ms), ("store", self.store_ms)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_ms"] = percentile(values, q)
        return out


@dataclass
class StepReport:
    """What one ``step()`` did and what the engine must act on."""

    now_ms: float
    submitted: list[TransferJob] = field(default_factory=list)
    loads_finished: list[tuple[str, int]] = field(default_factory=list)
    loads_failed: list[LoadFailure] = field(default_factory=list)
    stores_finished: list[int] = field(default_factory=list)
    stores_failed: list[tuple[int, str]] = field(default_factory=list)
    released_device_blocks: list[int] = field(default_factory=list)
    timed_out: int = 0
    rejected_store_blocks: int = 0  # blocks a store could not take (tier full of pinned / in-flight)
    all_blocks_cleared: bool = False  # a reset cleared the tier (vLLM's AllBlocksCleared)


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
        self.counters = Counters()
        self.latencies = Latencies()
        self._submitted_at: dict[int, float] = {}
        # fenced job -> when it was fenced (engine clock); the overdue ones were warned about
        self._fenced_at: dict[int, float] = {}
        self._overdue: set[int] = set()
        self.fence_warn_ms = config.job_deadline_ms if fence_warn_ms is None else float(fence_warn_ms)
        # request -> when its lookups started holding hits it has not accepted or released
        self._pinned_since: dict[str, float] = {}
        self._pins_warned: set[str] = set()
        self.pin_warn_ms = config.job_deadline_ms if pin_warn_ms is None else float(pin_warn_ms)
        self._log = logger if logger is not None else structlog.get_logger("kvflow")
        self._debug = logger is not None or structlog.is_configured()
        self._subscribe()
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
        self.counters.lookups += 1
        self.counters.lookup_tokens += num_tokens
        return hits

    def accept_hits(self, request_id: str, device_blocks: Sequence[int]) -> int | None:
        """The engine allocated ``device_blocks`` for the first ``len(device_blocks)`` hits of
        the last lookup: queue their load (its job id, or None for none). The rest of the
        hits are unpinned; ``[]`` releases them all (a request the engine does not schedule
        now). The device blocks stay held until a report names them released."""
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
        """Recency for the resident blocks among ``block_hashes``, in this order (the last is
        the most recent); returns how many were resident. At a request's finish, touch its
        chain with ``reuse=False`` (ordering only): under ARC ``reuse=True`` counts a second
        use and promotes every fresh block to T2."""
        return self.manager.touch(block_hashes, reuse)

    def finish_request(self, request_id: str, preempted: bool = False) -> bool:
        """The request finished (or was preempted): its unaccepted hits are unpinned now; its
        live jobs finish on their own. False, changing nothing, for a request kvflow does not
        know (never seen, or already forgotten)."""
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
            return
        except Rejected:
            pass  # isolate the bad result(s): apply one by one
        for result in results:
            try:
                # (with its integrity report: dropping it left a bad host copy on offer, F17)
                self.manager.job_result(
                    result.job_id, result.rank, result.ok, result.error, getattr(result, "corrupt", ())
                )
            except Rejected as exc:
                self.counters.unknown_results += 1
                self._log.warning("kvflow.result_rejected", job=result.job_id, rank=result.rank, error=str(exc))

    def step(self, compute_done: Any = None, results: Sequence[JobResult] | None = None) -> StepReport:
        """One engine step: apply the executor's results (``results``, else ``poll()``),
        time out jobs past their deadline, hand the queued jobs to the executor (after
        ``compute_done``, an event the copies wait for), and report what the engine must act
        on: loads finished or failed, stores finished or failed, device blocks released."""
        now = self.clock()
        if results is None:
            results = self._poll()
        self.apply_results(results)
        timed_out = self.manager.tick(now)
        jobs = self.manager.plan_step(now)
        if jobs:
            self._submit(jobs, compute_done, now)
        if self._fenced_at:
            self._watch_fences(now)
        if self._pinned_since:
            self._watch_pins(now)
        if not self.manager.has_notices():
            return StepReport(now_ms=now, submitted=jobs, timed_out=timed_out)
        notices = self.manager.take_notices()
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

    def _watch_fences(self, now: float) -> None:
        """A fence held past ``fence_warn_ms`` is counted and warned about once (F15: an
        executor that never reports a copy over keeps the memory, visibly)."""
        overdue = [j for j, t in self._fenced_at.items() if now - t > self.fence_warn_ms and j not in self._overdue]
        if not overdue:
            return
        by_id = {f.job_id: f for f in self.manager.fences()}
        for job_id in overdue:
            self._overdue.add(job_id)
            self.counters.fences_overdue += 1
            fence = by_id.get(job_id)
            if fence is not None:
                self._log.warning(
                    "kvflow.fence_held",
                    job=job_id,
                    request=fence.request_id,
                    direction=fence.direction,
                    held_ms=now - self._fenced_at[job_id],
                    device_blocks=len(fence.device_blocks),
                    slots=len(fence.slots),
                    ranks_pending=list(fence.ranks_pending),
                )

    def _watch_pins(self, now: float) -> None:
        """Hits a lookup pinned stay pinned until ``accept_hits`` (an empty list releases
        them) or the request's finish; a request that keeps them past ``pin_warn_ms`` is
        counted and warned about once, with how many blocks it keeps from eviction."""
        requests = self.manager.state.requests
        for rid, since in list(self._pinned_since.items()):
            req = requests.get(rid)
            if req is None or not req.offered:
                del self._pinned_since[rid]
                self._pins_warned.discard(rid)
            elif now - since > self.pin_warn_ms and rid not in self._pins_warned:
                self._pins_warned.add(rid)
                self.counters.pins_overdue += 1
                self._log.warning(
                    "kvflow.pins_held",
                    request=rid,
                    blocks=len(req.offered),
                    held_ms=now - since,
                    hint="release with accept_hits(request_id, []) when the request is not scheduled",
                )

    def _poll(self) -> list[JobResult]:
        try:
            return self.executor.poll()
        except Exception as exc:  # an executor bug must not kill the engine (F2)
            self.counters.executor_errors += 1
            self._log.error("kvflow.executor_poll_failed", error=repr(exc))
            return []

    def _submit(self, jobs: list[TransferJob], compute_done: Any, now: float) -> None:
        for job in jobs:
            self._submitted_at[job.job_id] = now
        try:
            self.executor.submit(jobs, compute_done)
        except Exception as exc:  # F2: becomes a failed outcome for every job of the batch
            self.counters.executor_errors += 1
            self._log.error("kvflow.executor_submit_failed", jobs=len(jobs), error=repr(exc))
            # one failed rank fails the job, whatever the world size
            failures = [
                JobResult(job_id=j.job_id, rank=0, ok=False, error=f"submit failed: {exc!r}") for j in jobs
            ]
            self.apply_results(failures)

    # -- observation: counters, latencies, logs ------------------------------------------

    def _subscribe(self) -> None:
        on = self.manager.subscribe
        on(self._on_submitted, (JobsSubmitted,))
        on(self._on_terminal, TERMINAL_TYPES)
        on(self._on_evicted, (BlocksEvicted,))
        on(self._on_rejected, (StoreRejected,))
        on(self._on_late, (LateResultIgnored,))
        on(self._on_fence_event, (FenceLifted, Reset))
        on(self._on_pins, (PinsAcquired,))
        if self._debug:
            on(self._log_event)

    def _on_submitted(self, event: JobsSubmitted) -> None:
        self.counters.jobs_submitted += len(event.job_ids)

    def _on_pins(self, event: PinsAcquired) -> None:
        if event.hashes and event.request_id not in self._pinned_since:
            self._pinned_since[event.request_id] = self.clock()

    def _fence(self, job_id: int) -> None:
        if job_id not in self._fenced_at:
            self._fenced_at[job_id] = self.clock()
            self.counters.jobs_fenced += 1

    def _on_fence_event(self, event: FenceLifted | Reset) -> None:
        if type(event) is Reset:
            for job_id in event.abandoned_job_ids:  # type: ignore[union-attr]
                self._fence(job_id)
        else:
            self._unfence(event.job_id)  # type: ignore[union-attr]

    def _unfence(self, job_id: int) -> None:
        if self._fenced_at.pop(job_id, None) is not None:
            self.counters.fences_lifted += 1
            self._overdue.discard(job_id)

    def _on_terminal(self, event: JobCompleted | JobFailed | JobTimedOut) -> None:
        started = self._submitted_at.pop(event.job_id, None)
        fenced = type(event) is not JobCompleted and event.fenced  # type: ignore[union-attr]
        if fenced:
            self._fence(event.job_id)
        elif event.abandoned:
            self._unfence(event.job_id)  # every rank of the abandoned job reported
        if event.abandoned:
            return  # a reset already told the engine; only the holds end now
        c = self.counters
        n = len(event.hashes)
        kind = type(event)
        if kind is JobCompleted:
            c.jobs_completed += 1
            if event.direction == STORE:
                c.blocks_stored += n
                c.bytes_stored += n * self.bytes_per_block
            else:
                c.blocks_loaded += n
                c.bytes_loaded += n * self.bytes_per_block
                c.hit_tokens += n * self.config.block_tokens  # only loads that landed
        else:
            if kind is JobFailed:
                c.jobs_failed += 1
            else:
                c.jobs_timed_out += 1
            if self._debug:
                self._log.warning(
                    f"kvflow.{event_name(event)}",
                    job=event.job_id,
                    request=event.request_id,
                    direction=event.direction,
                    blocks=n,
                    error=getattr(event, "error", "deadline passed"),
                )
        if started is not None:
            self.latencies.add(event.direction, self.clock() - started)

    def _on_evicted(self, event: BlocksEvicted) -> None:
        self.counters.blocks_evicted += len(event.hashes)

    def _on_rejected(self, event: StoreRejected) -> None:
        self.counters.blocks_rejected += len(event.hashes)

    def _on_late(self, event: LateResultIgnored) -> None:
        self.counters.late_results += 1

    def _log_event(self, event: Event) -> None:
        """Every applied event at debug level (only when structlog is configured)."""
        fields: dict[str, Any] = {"seq": event.seq}
        job = getattr(event, "job_id", None)
        if job is not None:
            fields["job"] = job
        request = getattr(event, "request_id", None)
        if request is not None:
            fields["request"] = request
        if type(event) is PinsAcquired:
            fields["hits"] = len(event.hashes)
        self._log.debug(f"kvflow.{event_name(event)}", **fields)

    # -- teardown ------------------------------------------------------------------------

    def drain(
        self, timeout_ms: float | None = None, sleep: Callable[[float], None] = time.sleep
    ) -> StepReport:
        """Step until no job is live (or ``timeout_ms`` of the engine's clock passes); the
        merged report of every step taken, so nothing that finished meanwhile is lost (F4)."""
        start = self.clock()
        merged = StepReport(now_ms=start)
        while self.manager.has_live_jobs():
            _merge(merged, self.step())
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


def _forward(name: str) -> Any:
    """A method of Engine that calls the same method of its SyncEngine (``self.core``)."""
    target = getattr(SyncEngine, name)

    def method(self: Engine, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.core, name)(*args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"Engine.{name}"
    method.__doc__ = target.__doc__
    return method


class Engine(AbstractAsyncContextManager["Engine"]):
    """The asyncio engine: ``async with Engine(config, executor) as engine: ...``.

    A task group owns a completion pump (polls the executor, sends results through a bounded
    memory stream) and, when recording, a trace writer that writes from a worker thread.
    All decisions run on the event loop, in the caller's task, in call order.
    """

    def __init__(
        self,
        config: Config,
        executor: Executor,
        *,
        clock: Callable[[], float] = monotonic_ms,
        trace_path: str | None = None,
        trace_meta: dict[str, Any] | None = None,
        bytes_per_block: int = 0,
        poll_interval_s: float = 0.0005,
        flush_interval_s: float = 0.05,
        logger: Any = None,
    ) -> None:
        self.core = SyncEngine(
            config,
            executor,
            clock=clock,
            trace_path=trace_path,
            trace_meta=trace_meta,
            bytes_per_block=bytes_per_block,
            logger=logger,
            _auto_flush=False,
        )
        self.poll_interval_s = poll_interval_s
        self.flush_interval_s = flush_interval_s
        self._tg: Any = None
        self._send: Any = None
        self._recv: Any = None
        self._progress: Any = None

    # convenient pass-throughs
    @property
    def counters(self) -> Counters:
        return self.core.counters

    @property
    def latencies(self) -> Latencies:
        return self.core.latencies

    @property
    def manager(self) -> OffloadManager:
        return self.core.manager

    # The scheduling-time calls are the SyncEngine's, run on the caller's task.
    lookup = _forward("lookup")
    accept_hits = _forward("accept_hits")
    blocks_computed = _forward("blocks_computed")
    device_blocks_evicting = _forward("device_blocks_evicting")
    touch = _forward("touch")
    finish_request = _forward("finish_request")
    invalidate = _forward("invalidate")
    reset = _forward("reset")
    fences = _forward("fences")
    held_device_blocks = _forward("held_device_blocks")

    async def __aenter__(self) -> Engine:
        import anyio

        self._send, self._recv = anyio.create_memory_object_stream[list[JobResult]](max_buffer_size=256)
        self._progress = anyio.Event()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._pump)
            if self.core.writer is not None:
                await self._tg.start(self._flusher)
        except BaseException:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        import anyio

        # The body's own exception is not the task group's business: cancel the group's
        # tasks, let them finish, and let the body's exception propagate unchanged (not
        # wrapped in an ExceptionGroup). A failure of the group's own tasks still surfaces.
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                self._send.close()
                self._recv.close()
                writer = self.core.writer
                if writer is not None and not writer.closed:
                    blob = writer.take_pending()
                    await anyio.to_thread.run_sync(writer.write_bytes, blob)
                self.core.close()
        return None

    async def _pump(self, *, task_status: Any) -> None:
        import anyio

        task_status.started()
        while True:
            results = self.core._poll()
            if results:
                await self._send.send(results)
                self._progress.set()
            await anyio.sleep(self.poll_interval_s)

    async def _flusher(self, *, task_status: Any) -> None:
        import anyio

        writer = self.core.writer
        assert writer is not None
        task_status.started()
        while True:
            await anyio.sleep(self.flush_interval_s)
            blob = writer.take_pending()
            if blob:
                await anyio.to_thread.run_sync(writer.write_bytes, blob)

    def _drain_stream(self) -> list[JobResult]:
        import anyio

        out: list[JobResult] = []
        while True:
            try:
                out.extend(self._recv.receive_nowait())
            except anyio.WouldBlock:
                return out

    async def step(self, compute_done: Any = None) -> StepReport:
        """One engine step: apply completions that arrived, time out, submit queued jobs."""
        return self.core.step(compute_done, results=self._drain_stream())

    async def wait_idle(self, timeout_s: float = 30.0) -> StepReport:
        """Step until no job is live; the merged report of every step taken."""
        import anyio

        merged = StepReport(now_ms=self.core.clock())
        with anyio.move_on_after(timeout_s):
            while True:
                report = await self.step()
                _merge(merged, report)
                if not self.core.has_live_jobs():
                    break
                self._progress = anyio.Event()
                with anyio.move_on_after(max(self.poll_interval_s * 4, 0.001)):
                    await self._progress.wait()
        merged.now_ms = self.core.clock()
        return merged


def _merge(into: StepReport, report: StepReport) -> None:
    into.submitted.extend(report.submitted)
    into.loads_finished.extend(report.loads_finished)
    into.loads_failed.extend(report.loads_failed)
    into.stores_finished.extend(report.stores_finished)
    into.stores_failed.extend(report.stores_failed)
    into.released_device_blocks.extend(report.released_device_blocks)
    into.timed_out += report.timed_out
    into.rejected_store_blocks += report.rejected_store_blocks
    into.all_blocks_cleared = into.all_blocks_cleared or report.all_blocks_cleared


__all__ = [
    "Engine",
    "SyncEngine",
    "StepReport",
    "Counters",
    "Latencies",
    "Executor",
    "Fence",
    "percentile",
    "KvflowError",
]
