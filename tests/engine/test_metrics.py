"""Prometheus metrics of a real engine run: what a scrape shows is what the engine counted."""

from __future__ import annotations

import urllib.request

import pytest

prom = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvflow.core.config import Config  # noqa: E402
from kvflow.engine.metrics import PrometheusMetrics  # noqa: E402
from kvflow.engine.sync import SyncEngine  # noqa: E402
from kvflow.executors.simulated import SimulatedExecutor, TransferModel, VirtualClock  # noqa: E402

B = 16


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def busy_engine() -> SyncEngine:
    clock = VirtualClock()
    ex = SimulatedExecutor(clock, TransferModel(bytes_per_block=1000), fail_jobs=[3], hang_jobs=[4])
    engine = SyncEngine(Config(cpu_blocks=16, block_tokens=B, job_deadline_ms=50.0), ex, clock=clock)
    for i, request in enumerate(("a", "b", "c", "d")):
        hashes = [100 * i + k for k in range(3)]
        engine.lookup(request, hashes, 3 * B + 1)
        engine.blocks_computed(request, hashes, [10 * i + k for k in range(3)])
        engine.step()
        clock.advance_to(clock.now_ms + 1.0)
        engine.step()
        engine.finish_request(request)
    assert engine.lookup("e", [0, 1, 2, 3], 4 * B + 1) == 3
    engine.accept_hits("e", [90, 91, 92])
    engine.step()
    clock.advance_to(clock.now_ms + 100.0)  # the hung store times out: fenced
    engine.step()
    return engine


def test_a_scrape_shows_the_engines_totals_tier_and_latencies() -> None:
    engine = busy_engine()
    metrics = PrometheusMetrics(engine)
    got = scrape(prom.generate_latest(metrics.registry).decode())
    c = engine.counters
    assert c.jobs_failed == 1 and c.jobs_timed_out == 1 and c.jobs_fenced == 1  # the run did all that
    assert got[("kvflow_jobs_completed_total", ())] == c.jobs_completed
    assert got[("kvflow_jobs_failed_total", ())] == 1
    assert got[("kvflow_jobs_timed_out_total", ())] == 1
    assert got[("kvflow_jobs_fenced_total", ())] == 1
    assert got[("kvflow_stored_blocks_total", ())] == c.blocks_stored
    assert got[("kvflow_loaded_bytes_total", ())] == c.bytes_loaded == 3000
    assert got[("kvflow_hit_tokens_total", ())] == 3 * B
    state = engine.manager.state
    tier = {s: got[("kvflow_cpu_tier_blocks", (("state", s),))] for s in ("resident", "storing", "fenced", "free")}
    assert sum(tier.values()) == got[("kvflow_cpu_tier_capacity_blocks", ())] == 16
    assert tier["fenced"] == 3 and tier["free"] == len(state.free_slots)
    assert got[("kvflow_jobs", (("state", "fenced"),))] == 1
    # a histogram sample for every job that ended after the metrics were attached
    before = got.get(("kvflow_transfer_duration_seconds_count", (("direction", "store"),)), 0.0)
    engine.lookup("f", [500], B + 1)
    engine.blocks_computed("f", [500], [80])
    engine.step()
    engine.executor.clock.advance_to(engine.executor.clock.now_ms + 1.0)
    engine.step()
    after = scrape(prom.generate_latest(metrics.registry).decode())
    assert after[("kvflow_transfer_duration_seconds_count", (("direction", "store"),))] == before + 1


def test_the_metrics_go_into_the_host_applications_registry_and_over_http() -> None:
    registry = prom.CollectorRegistry()
    engine = busy_engine()
    metrics = PrometheusMetrics(engine, registry=registry)
    port = metrics.serve(0, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert scrape(text)[("kvflow_jobs_submitted_total", ())] == engine.counters.jobs_submitted
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            assert family.name.startswith("kvflow_")


def test_the_shared_tiers_refusals_are_counted_by_reason(tmp_path) -> None:
    """A disk tier (real files) whose entries were written under a key since retired: the
    scrape counts its refusals under ``kvflow_disk_rejected_total{reason}``."""
    pytest.importorskip("torch")
    pytest.importorskip("cryptography")
    import torch
    from core_helpers import settle
    from tier_keys import KEY, NEW_KEY, tier_keys

    from kvflow.core.config import Config
    from kvflow.engine.sync import SyncEngine
    from kvflow.executors.torch.executor import TorchExecutor
    from kvflow.tiers.disk_executor import disk_tier

    def engine_of(keys):  # type: ignore[no-untyped-def]
        kv = [torch.randn((8, 2, 4, 8)) for _ in range(2)]
        config = Config(cpu_blocks=2, block_tokens=B, disk_blocks=8, disk_store_mode="write_through")
        return SyncEngine(config, disk_tier(TorchExecutor(kv, 2, device="cpu"), config, tmp_path, model="m", keys=keys))

    first = engine_of(tier_keys(KEY))
    first.lookup("a", [1, 2], 2 * B + 1)
    first.blocks_computed("a", [1, 2], [0, 1])
    settle(first)
    first.close()
    second = engine_of(tier_keys(NEW_KEY))
    try:
        metrics = PrometheusMetrics(second)
        second.lookup("b", [1, 2], 2 * B + 1)
        second.accept_hits("b", [])
        settle(second)
        got = scrape(prom.generate_latest(metrics.registry).decode())
        assert got[("kvflow_disk_rejected_total", (("reason", "unknown key"),))] == 2
        assert got[("kvflow_disk_rejected_total", (("reason", "forged"),))] == 0
        assert ("kvflow_remote_rejected_total", (("reason", "forged"),)) not in got  # no remote tier
    finally:
        second.close()
