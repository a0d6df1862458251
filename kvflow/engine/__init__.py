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

The modules: ``api`` (the Executor protocol, StepReport, Counters, Latencies), ``sync``
(SyncEngine), ``watch`` (counters, latencies and logs from the applied events; fences and pins
held too long), ``async_engine`` (Engine).
"""

from kvflow.engine.api import (
    Counters,
    Executor,
    Latencies,
    StepReport,
    merge_reports,
    monotonic_ms,
    percentile,
)
from kvflow.engine.async_engine import Engine
from kvflow.engine.sync import SyncEngine
from kvflow.errors import KvflowError
from kvflow.manager import Fence

__all__ = [
    "Engine",
    "SyncEngine",
    "StepReport",
    "Counters",
    "Latencies",
    "Executor",
    "Fence",
    "percentile",
    "merge_reports",
    "monotonic_ms",
    "KvflowError",
]
