"""The types of the embedding API: what the engine needs from an executor, and what it hands
back (step reports, running counters, job latencies)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from kvflow.core.commands import JobResult
from kvflow.core.jobs import LOAD, TransferJob
from kvflow.engine.notices import NOTICE_FIELDS, LoadFailure


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
    # the remote tier (kvflow.tiers): blocks and bytes its completed jobs moved
    remote_blocks_stored: int = 0
    remote_blocks_loaded: int = 0
    remote_bytes_stored: int = 0
    remote_bytes_loaded: int = 0

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
        if self.listeners:  # (most have none: no loop set up then)
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


class StepReport(msgspec.Struct):
    """What one ``step()`` did and what the engine must act on."""

    # A msgspec Struct, not a dataclass: the engine builds one every step, and this builds in
    # a quarter of the time. Each report gets its own empty lists (msgspec copies ``[]``).
    now_ms: float
    submitted: list[TransferJob] = []
    loads_finished: list[tuple[str, int]] = []
    loads_failed: list[LoadFailure] = []
    stores_finished: list[int] = []
    stores_failed: list[tuple[int, str]] = []
    released_device_blocks: list[int] = []
    timed_out: int = 0
    rejected_store_blocks: int = 0  # blocks a store could not take (tier full of pinned / in-flight)
    all_blocks_cleared: bool = False  # a reset cleared the tier (vLLM's AllBlocksCleared)


def merge_reports(into: StepReport, report: StepReport) -> None:
    """Add ``report`` to ``into`` (the merged report of several steps): lists are joined,
    counts added, flags or-ed."""
    into.submitted.extend(report.submitted)
    into.timed_out += report.timed_out
    for name in NOTICE_FIELDS:
        mine, theirs = getattr(into, name), getattr(report, name)
        if isinstance(mine, list):
            mine.extend(theirs)
        elif isinstance(mine, bool):
            setattr(into, name, mine or theirs)
        else:
            setattr(into, name, mine + theirs)
