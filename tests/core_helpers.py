"""Helpers shared by the core's tests (test_failure_rules.py, test_scenarios.py, the trace
writer's tests) and by the lower tiers' engine tests (``settle``)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from kvflow.core.config import Config
from kvflow.core.state.apply import fold
from kvflow.core.state.invariants import check_invariants
from kvflow.core.state.model import State
from kvflow.engine.manager import OffloadManager

BT = 4  # tokens per block
DEADLINE_MS = 1000.0


def config(cpu_blocks: int = 4, **kw: Any) -> Config:
    kw.setdefault("job_deadline_ms", DEADLINE_MS)
    return Config(cpu_blocks=cpu_blocks, block_tokens=BT, **kw)


def manager(cpu_blocks: int = 4, log: Any = None, **kw: Any) -> OffloadManager:
    return OffloadManager(config(cpu_blocks, **kw), log=log)


def tokens(num_blocks: int) -> int:
    """A prompt one token longer than ``num_blocks`` blocks: all of them may hit (F13)."""
    return num_blocks * BT + 1


def store(
    m: OffloadManager, request_id: str | None, hashes: list[int], device_blocks: list[int]
) -> int:
    """Store and complete on every rank; returns the job id."""
    job_id = m.blocks_computed(request_id, hashes, device_blocks)
    assert job_id is not None
    m.plan_step(0.0)
    for rank in range(m.config.world_size):
        m.job_result(job_id, rank=rank)
    return job_id


def consistent(m: OffloadManager) -> None:
    """Invariants hold and folding the log rebuilds the live state exactly."""
    assert check_invariants(m.state) == []
    assert fold(State(m.config), m.log.events()).digest() == m.state.digest()


def mixed_run(
    m: OffloadManager, requests: int, seed: int, after: Callable[[], None] = lambda: None
) -> None:
    """An engine-like run over a small tier: shared prefixes (hits, loads), stores, one result in
    five failed, every request finished; ``after`` runs after each request."""
    rng = random.Random(seed)
    device = 0
    for i in range(requests):
        rid = f"req-{i}"
        hashes = [rng.randrange(12) * 1000 + k for k in range(rng.randint(1, 4))]
        hits = m.lookup(rid, hashes, len(hashes) * 16 + 1)
        if hits:
            m.accept_hits(rid, range(device, device + hits))
            device += hits
        m.blocks_computed(rid, hashes[hits:], range(device, device + len(hashes) - hits))
        device += len(hashes)
        for job in m.plan_step(float(i)):
            m.job_result(job.job_id, ok=rng.random() > 0.2, error="copy failed")
        m.finish_request(rid)
        after()


def settle(engine: Any, timeout_s: float = 20.0) -> Any:
    """Step a ``SyncEngine`` until no job is live (its copies run in threads); the merged report."""
    from kvflow.engine.notices import StepReport, merge_reports

    merged = StepReport(now_ms=0.0)
    deadline = time.monotonic() + timeout_s
    while True:
        merge_reports(merged, engine.step())
        if not engine.has_live_jobs():
            return merged
        assert time.monotonic() < deadline, "jobs never finished"
        time.sleep(0.002)
