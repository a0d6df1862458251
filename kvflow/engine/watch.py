"""What the engine observes of the applied events: counters, latencies and logs, and memory
kept too long (fences and lookup pins held past their warning thresholds)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.core.config import Config
from kvflow.core.events import (
    TERMINAL_TYPES,
    BlocksEvicted,
    Event,
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    LateResultIgnored,
    PinsAcquired,
    Reset,
    StoreRejected,
    event_name,
)
from kvflow.core.jobs import DISK_STORE, LOAD, REMOTE_LOAD, REMOTE_STORE, STORE
from kvflow.engine.manager import OffloadManager


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
    # the remote tier (kvflow.tiers): blocks and bytes its completed jobs moved
    remote_blocks_stored: int = 0
    remote_blocks_loaded: int = 0
    remote_bytes_stored: int = 0
    remote_bytes_loaded: int = 0
    # the disk tier: blocks and bytes its completed jobs moved, blocks a warm restart brought
    # back, and the times it turned degraded (a full or read-only file system, a file gone...)
    disk_blocks_stored: int = 0
    disk_blocks_loaded: int = 0
    disk_bytes_stored: int = 0
    disk_bytes_loaded: int = 0
    disk_blocks_restored: int = 0
    disk_degraded: int = 0

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


class EngineWatch:
    """Subscribed to the manager's applied events: keeps the engine's counters and latencies,
    logs through structlog, and warns once about each fence or pin held too long."""

    def __init__(
        self,
        manager: OffloadManager,
        config: Config,
        clock: Callable[[], float],
        *,
        logger: Any,
        debug: bool,
        bytes_per_block: int,
        fence_warn_ms: float,
        pin_warn_ms: float,
    ) -> None:
        self.manager = manager
        self.config = config
        self.clock = clock
        self.log = logger
        self.debug = debug
        self.bytes_per_block = bytes_per_block
        self.counters = Counters()
        self.latencies = Latencies()
        self._submitted_at: dict[int, float] = {}
        # fenced job -> when it was fenced (engine clock); the overdue ones were warned about
        self.fenced_at: dict[int, float] = {}
        self._overdue: set[int] = set()
        self.fence_warn_ms = fence_warn_ms
        # request -> when its lookups started holding hits it has not accepted or released
        self.pinned_since: dict[str, float] = {}
        self.disk_problem: str | None = None  # what is wrong with the disk tier now
        self._pins_warned: set[str] = set()
        self.pin_warn_ms = pin_warn_ms
        self._subscribe()

    # -- memory kept too long ------------------------------------------------------------

    def watch_fences(self, now: float) -> None:
        """A fence held past ``fence_warn_ms`` is counted and warned about once (F15: an
        executor that never reports a copy over keeps the memory, visibly)."""
        overdue = [j for j, t in self.fenced_at.items() if now - t > self.fence_warn_ms and j not in self._overdue]
        if not overdue:
            return
        by_id = {f.job_id: f for f in self.manager.fences()}
        for job_id in overdue:
            self._overdue.add(job_id)
            self.counters.fences_overdue += 1
            fence = by_id.get(job_id)
            if fence is not None:
                self.log.warning(
                    "kvflow.fence_held",
                    job=job_id,
                    request=fence.request_id,
                    direction=fence.direction,
                    held_ms=now - self.fenced_at[job_id],
                    device_blocks=len(fence.device_blocks),
                    slots=len(fence.slots),
                    ranks_pending=list(fence.ranks_pending),
                )

    def watch_pins(self, now: float) -> None:
        """Hits a lookup pinned stay pinned until ``accept_hits`` (an empty list releases
        them) or the request's finish; a request that keeps them past ``pin_warn_ms`` is
        counted and warned about once, with how many blocks it keeps from eviction."""
        requests = self.manager.state.requests
        for rid, since in list(self.pinned_since.items()):
            req = requests.get(rid)
            if req is None or not req.offered:
                del self.pinned_since[rid]
                self._pins_warned.discard(rid)
            elif now - since > self.pin_warn_ms and rid not in self._pins_warned:
                self._pins_warned.add(rid)
                self.counters.pins_overdue += 1
                self.log.warning(
                    "kvflow.pins_held",
                    request=rid,
                    blocks=len(req.offered),
                    held_ms=now - since,
                    hint="release with accept_hits(request_id, []) when the request is not scheduled",
                )

    # -- observation: counters, latencies, logs ------------------------------------------

    def _subscribe(self) -> None:
        on = self.manager.subscribe
        on(self._on_submitted, (JobsSubmitted,))
        on(self._on_completed, (JobCompleted,))
        on(self._on_ended, tuple(t for t in TERMINAL_TYPES if t is not JobCompleted))
        on(self._on_evicted, (BlocksEvicted,))
        on(self._on_rejected, (StoreRejected,))
        on(self._on_late, (LateResultIgnored,))
        on(self._on_fence_event, (FenceLifted, Reset))
        on(self._on_pins, (PinsAcquired,))
        if self.debug:
            on(self._log_event)

    def _on_submitted(self, event: JobsSubmitted) -> None:
        """The jobs go to the executor at the event's time: their latency counts from there."""
        self.counters.jobs_submitted += len(event.job_ids)
        submitted_at, now = self._submitted_at, event.now_ms
        for job_id in event.job_ids:
            submitted_at[job_id] = now

    def _on_pins(self, event: PinsAcquired) -> None:
        if event.hashes and event.request_id not in self.pinned_since:
            self.pinned_since[event.request_id] = self.clock()

    def _fence(self, job_id: int) -> None:
        if job_id not in self.fenced_at:
            self.fenced_at[job_id] = self.clock()
            self.counters.jobs_fenced += 1

    def _on_fence_event(self, event: FenceLifted | Reset) -> None:
        if isinstance(event, Reset):
            for job_id in event.abandoned_job_ids:
                self._fence(job_id)
        else:
            self._unfence(event.job_id)

    def _unfence(self, job_id: int) -> None:
        if self.fenced_at.pop(job_id, None) is not None:
            self.counters.fences_lifted += 1
            self._overdue.discard(job_id)

    def _on_completed(self, event: JobCompleted) -> None:
        started = self._submitted_at.pop(event.job_id, None)
        if event.abandoned:
            self._unfence(event.job_id)  # every rank of the abandoned job reported
            return  # a reset already told the engine; only the holds end now
        c = self.counters
        c.jobs_completed += 1
        n = len(event.hashes)
        direction = event.direction
        if direction == STORE:
            c.blocks_stored += n
            c.bytes_stored += n * self.bytes_per_block
        elif direction == LOAD:
            c.blocks_loaded += n
            c.bytes_loaded += n * self.bytes_per_block
            c.hit_tokens += n * self.config.block_tokens  # only loads that landed
        else:  # the lower tiers' jobs (no device copy: no latency sample)
            moved = n * self.bytes_per_block
            if direction == REMOTE_STORE:
                c.remote_blocks_stored += n
                c.remote_bytes_stored += moved
            elif direction == REMOTE_LOAD:
                c.remote_blocks_loaded += n
                c.remote_bytes_loaded += moved
            elif direction == DISK_STORE:
                c.disk_blocks_stored += n
                c.disk_bytes_stored += moved
            else:
                c.disk_blocks_loaded += n
                c.disk_bytes_loaded += moved
            return
        if started is not None:
            self.latencies.add(direction, self.clock() - started)

    def _on_ended(self, event: JobFailed | JobTimedOut) -> None:
        """A job failed or timed out."""
        started = self._submitted_at.pop(event.job_id, None)
        if event.fenced:
            self._fence(event.job_id)
        elif event.abandoned:
            self._unfence(event.job_id)  # every rank of the abandoned job reported
        if event.abandoned:
            return  # a reset already told the engine; only the holds end now
        c = self.counters
        if isinstance(event, JobFailed):
            c.jobs_failed += 1
            error = event.error
        else:
            c.jobs_timed_out += 1
            error = "deadline passed"
        if self.debug:
            self.log.warning(
                f"kvflow.{event_name(event)}",
                job=event.job_id,
                request=event.request_id,
                direction=event.direction,
                blocks=len(event.hashes),
                error=error,
            )
        if started is not None:
            self._latency(event.direction, started)

    def _latency(self, direction: str, started: float) -> None:
        if direction == STORE or direction == LOAD:  # (device copies only)
            self.latencies.add(direction, self.clock() - started)

    def watch_disk(self, problem: str | None) -> None:
        """The disk tier's health, read at every step: turning degraded is counted and
        logged once (``kvflow.disk_degraded``), recovering is logged (``kvflow.disk_recovered``).
        Meanwhile its jobs fail and the CPU tier serves on its own."""
        if problem == self.disk_problem:
            return
        if problem is not None:
            if self.disk_problem is None:
                self.counters.disk_degraded += 1
            self.log.warning("kvflow.disk_degraded", problem=problem)
        else:
            self.log.info("kvflow.disk_recovered", was=self.disk_problem)
        self.disk_problem = problem

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
        self.log.debug(f"kvflow.{event_name(event)}", **fields)
