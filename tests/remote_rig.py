"""A kvflow instance with a remote tier on a real Redis: a SyncEngine over the real
TorchExecutor (CPU device, real bytes) wrapped in the Redis tier. Used by the tests in-process
and, as ``python tests/remote_rig.py ROLE URL CLUSTER``, as a separate instance process."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from core_helpers import settle
from tier_keys import tier_keys

from kvflow.core.config import Config
from kvflow.engine.sync import SyncEngine
from kvflow.executors.torch.executor import TorchExecutor
from kvflow.tiers.redis_store import redis_tier

LAYERS, NUM_BLOCKS, CPU_BLOCKS, B = 2, 16, 8, 16
HASHES = (101, 102, 103, 104)
MODEL = "rig-model"


def random_kv(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((NUM_BLOCKS, 2, 4, 8), generator=gen) for _ in range(LAYERS)]


def blocks_of(kv: list[torch.Tensor], blocks: tuple[int, ...]) -> list[torch.Tensor]:
    idx = torch.tensor(blocks)
    return [t.index_select(0, idx).clone() for t in kv]


def instance(url: str, cluster: bool, seed: int, *, deadline_ms: float = 2000.0, **tier: Any) -> tuple[SyncEngine, list[torch.Tensor]]:
    kv = random_kv(seed)
    if "keys" not in tier and not tier.get("insecure_no_key"):
        tier["keys"] = tier_keys()
    config = Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, remote_blocks=1024, job_deadline_ms=deadline_ms)
    executor = redis_tier(TorchExecutor(kv, CPU_BLOCKS, device="cpu"), config, url, model=MODEL, cluster=cluster, **tier)
    return SyncEngine(config, executor, keep_log=True), kv


def store_prefix(
    engine: SyncEngine, request_id: str, device_blocks: tuple[int, ...], tenant: str | None = None
) -> None:
    """Compute-and-store ``HASHES`` from ``device_blocks``; the write-through lands remotely."""
    engine.lookup(request_id, HASHES, len(HASHES) * B + 1, tenant=tenant)
    engine.blocks_computed(request_id, HASHES, device_blocks, tenant=tenant)
    settle(engine)  # the CPU-tier store, then its write-through remote store
    engine.finish_request(request_id)


def load_prefix(
    engine: SyncEngine,
    request_id: str,
    device_blocks: tuple[int, ...],
    timeout_s: float = 20.0,
    tenant: str | None = None,
) -> int:
    """Look the prefix up until the CPU tier offers all of it (a probe finds it remotely, a
    remote load brings it to the CPU tier) or ``timeout_s`` passed, then load what hit into
    ``device_blocks``; the hits."""
    n_tokens = len(HASHES) * B + 1
    deadline = time.monotonic() + timeout_s
    while True:
        hits = engine.lookup(request_id, HASHES, n_tokens, tenant=tenant)
        if hits == len(HASHES) or time.monotonic() > deadline:
            break
        engine.accept_hits(request_id, [])
        engine.step()
        time.sleep(0.002)
    if hits:
        engine.accept_hits(request_id, device_blocks[:hits])
        settle(engine)
    else:
        engine.accept_hits(request_id, [])
    return hits


def main() -> int:
    role, url, cluster = sys.argv[1], sys.argv[2], sys.argv[3] == "cluster"
    engine, kv = instance(url, cluster, seed=1 if role == "writer" else 2)
    try:
        if role == "writer":
            store_prefix(engine, "w", (0, 1, 2, 3))
            print(json.dumps(engine.executor.stats))
        else:
            hits = load_prefix(engine, "r", (8, 9, 10, 11))
            loaded = blocks_of(kv, (8, 9, 10, 11))
            expected = blocks_of(random_kv(1), (0, 1, 2, 3))  # the writer's KV
            same = all(torch.equal(a, b) for a, b in zip(loaded, expected))
            print(json.dumps({"hits": hits, "same": same, **engine.executor.stats}))
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
