"""Prometheus metrics of an engine, for an operator to scrape.

``PrometheusMetrics(engine)`` exposes the engine's running totals as counters (with the shared
tiers' refusals by reason: ``kvflow_remote_rejected_total{reason}``,
``kvflow_disk_rejected_total{reason}``), the CPU tier's use as gauges and every job's submit-to-terminal time as a histogram, named by Prometheus'
conventions (``kvflow_`` prefix, ``_total`` on counters, units in names). The totals are read
from ``engine.counters`` when scraped (a custom collector: nothing is counted twice); the
histogram is fed as jobs end. Register it in a registry the host application owns
(``registry=``), or in its own one served on an HTTP port (``serve(port)``).

``prometheus-client`` is an optional dependency (``pip install 'kvflow[metrics]'``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvflow.core.errors import ConfigError

# (counter attribute, metric name without _total, help): the engine's totals
_COUNTERS = (
    ("lookups", "kvflow_lookups", "Lookups asked of the CPU tier"),
    ("lookup_tokens", "kvflow_lookup_tokens", "Tokens of the prompts looked up"),
    ("hit_tokens", "kvflow_hit_tokens", "Tokens loaded from the CPU tier (loads that landed)"),
    ("jobs_submitted", "kvflow_jobs_submitted", "Transfer jobs handed to the executor"),
    ("jobs_completed", "kvflow_jobs_completed", "Transfer jobs completed on every rank"),
    ("jobs_failed", "kvflow_jobs_failed", "Transfer jobs failed (a rank failed, or cancelled)"),
    ("jobs_timed_out", "kvflow_jobs_timed_out", "Transfer jobs past their deadline"),
    ("jobs_fenced", "kvflow_jobs_fenced", "Jobs whose memory was fenced while a copy might still run"),
    ("fences_lifted", "kvflow_fences_lifted", "Fences ended (the copy reported over, or the executor closed)"),
    ("fences_overdue", "kvflow_fences_overdue", "Fences held longer than the warning threshold"),
    ("pins_overdue", "kvflow_pins_overdue", "Requests holding lookup hits longer than the warning threshold"),
    ("late_results", "kvflow_late_results", "Executor results for jobs already ended"),
    ("unknown_results", "kvflow_unknown_results", "Executor results refused (unknown job or rank)"),
    ("executor_errors", "kvflow_executor_errors", "Executor exceptions turned into failed jobs"),
    ("blocks_stored", "kvflow_stored_blocks", "Blocks stored to the CPU tier"),
    ("blocks_loaded", "kvflow_loaded_blocks", "Blocks loaded from the CPU tier"),
    ("blocks_evicted", "kvflow_evicted_blocks", "Blocks evicted from the CPU tier"),
    ("blocks_rejected", "kvflow_rejected_blocks", "Blocks a store could not admit (tier full)"),
    ("bytes_stored", "kvflow_stored_bytes", "Bytes stored to the CPU tier"),
    ("bytes_loaded", "kvflow_loaded_bytes", "Bytes loaded from the CPU tier"),
    ("disk_blocks_stored", "kvflow_disk_stored_blocks", "Blocks copied to the disk tier"),
    ("disk_blocks_loaded", "kvflow_disk_loaded_blocks", "Blocks loaded from the disk tier into host slots"),
    ("disk_blocks_restored", "kvflow_disk_restored_blocks", "Blocks a warm restart found on the disk tier"),
    ("disk_degraded", "kvflow_disk_degraded", "Times the disk tier turned degraded"),
)

# seconds; a pinned copy of one block takes tens of µs, a big job up to its deadline
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ConfigError("metrics need prometheus-client: pip install 'kvflow[metrics]'") from None
    return prometheus_client


class PrometheusMetrics:
    """The metrics of one engine (a ``SyncEngine`` or ``Engine``)."""

    def __init__(self, engine: Any, registry: Any = None, *, buckets: tuple[float, ...] = _BUCKETS) -> None:
        prom = _prometheus()
        self._engine = engine
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self._latency = prom.Histogram(
            "kvflow_transfer_duration_seconds",
            "Submit-to-terminal time of transfer jobs",
            ["direction"],
            registry=self.registry,
            buckets=buckets,
        )
        engine.latencies.listeners.append(self._observe)
        self.registry.register(self)

    def _observe(self, direction: str, latency_ms: float) -> None:
        self._latency.labels(direction=direction).observe(latency_ms / 1000.0)

    def collect(self) -> Iterator[Any]:
        """Called by the registry at each scrape."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counters = self._engine.counters
        for attribute, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(counters, attribute))
        state = self._engine.manager.state
        yield GaugeMetricFamily("kvflow_cpu_tier_capacity_blocks", "Slots of the CPU tier", value=state.capacity)
        storing = len(state.pending)
        owned = set(state.slot_of.values()) if state.fenced_slots else ()
        fenced = sum(1 for s in state.fenced_slots if s not in owned)
        tier = GaugeMetricFamily("kvflow_cpu_tier_blocks", "Slots of the CPU tier by what holds them", labels=["state"])
        tier.add_metric(["resident"], len(state.slot_of) - storing)
        tier.add_metric(["storing"], storing)
        tier.add_metric(["fenced"], fenced)
        tier.add_metric(["free"], len(state.free_slots))
        yield tier
        jobs = GaugeMetricFamily("kvflow_jobs", "Jobs kvflow holds now", labels=["state"])
        live = sum(1 for j in state.jobs.values() if not j.fenced)
        jobs.add_metric(["live"], live)
        jobs.add_metric(["fenced"], len(state.jobs) - live)
        yield jobs
        yield GaugeMetricFamily("kvflow_pinned_blocks", "Blocks pinned by lookups and loads", value=len(state.pin_count))
        disk = state.disk
        if disk is not None:
            on_disk = GaugeMetricFamily("kvflow_disk_tier_blocks", "Slots of the disk tier by what holds them", labels=["state"])
            on_disk.add_metric(["indexed"], len(disk.slot_of))
            on_disk.add_metric(["free"], len(disk.free))
            on_disk.add_metric(["in_use"], len(disk.busy))
            yield on_disk
            yield GaugeMetricFamily(
                "kvflow_disk_tier_degraded", "1 while the disk tier reports a problem (full, read-only, failing)",
                value=int(self._engine.watch.disk_problem is not None),
            )  # fmt: skip
        executor = self._engine.executor
        for shared in ("remote", "disk"):
            # (tiers stack: each wrapper answers for the executors it wraps)
            rejected = getattr(executor, f"{shared}_rejected", None)
            if rejected is not None:
                family = CounterMetricFamily(
                    f"kvflow_{shared}_rejected", f"Values the {shared} tier refused to serve, by reason", labels=["reason"]
                )
                for reason, count in rejected().items():
                    family.add_metric([reason], count)
                yield family

    def describe(self) -> list[Any]:
        return []  # (the families are known only at scrape time; no up-front registration check)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (port 0: a free one);
        returns the port."""
        prom = _prometheus()
        server, _thread = prom.start_http_server(port, addr, registry=self.registry)
        return int(server.server_port)


__all__ = ["PrometheusMetrics"]
