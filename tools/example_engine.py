"""How a serving engine embeds kvflow: a tiny vLLM-like loop on the CPU device (or CUDA).

Request A computes 4 blocks and kvflow stores them to the host tier. The engine then reuses
A's device blocks for something else. Request B shares A's prefix: kvflow finds the hits on the
CPU tier, the engine allocates *other* device blocks, kvflow loads into them, and B's device
blocks hold exactly A's KV again.

Run: python tools/example_engine.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvflow.core.config import Config
from kvflow.engine.sync import SyncEngine
from kvflow.executors import TorchExecutor

BLOCK_TOKENS = 16
NUM_DEVICE_BLOCKS = 64
LAYERS = 4


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    # The engine's paged KV cache: per layer [num_blocks, 2 (K/V), block_tokens, head_dim].
    kv_caches = [
        torch.randn(NUM_DEVICE_BLOCKS, 2, BLOCK_TOKENS, 64, device=device) for _ in range(LAYERS)
    ]
    config = Config(cpu_blocks=32, block_tokens=BLOCK_TOKENS, policy="lru", store_mode="eager")
    executor = TorchExecutor(kv_caches, config.cpu_blocks, device=device)
    engine = SyncEngine(config, executor)  # the engine's clock: time.monotonic by default

    prefix = [101, 102, 103, 104]  # block hashes of the shared prompt prefix
    tokens = len(prefix) * BLOCK_TOKENS + 5

    # --- request A: nothing on the tier yet; its 4 full blocks are computed in blocks 0..3
    assert engine.lookup("A", prefix, tokens) == 0
    engine.blocks_computed("A", prefix, [0, 1, 2, 3])
    report = engine.step()  # plans and submits the store job (one batched copy)
    print(f"step 1: submitted {[(j.direction, j.job_id) for j in report.submitted]}")
    engine.drain()  # a real engine just keeps stepping; drain() steps until idle
    engine.finish_request("A")
    original = [layer[0:4].clone() for layer in kv_caches]

    # the engine reuses device blocks 0..3 for other work
    for layer in kv_caches:
        layer[0:4] = torch.randn_like(layer[0:4])

    # --- request B: same prefix; F13 caps the hit at (tokens - 1) // BLOCK_TOKENS blocks
    hits = engine.lookup("B", prefix, tokens)  # pinned until loaded (F7)
    print(f"request B: {hits} blocks can be loaded from the CPU tier")
    engine.accept_hits("B", [40, 41, 42, 43][:hits])  # the engine allocated these blocks
    loads_done: list[tuple[str, int]] = []
    while engine.has_live_jobs():
        report = engine.step()
        loads_done += report.loads_finished
        for failure in report.loads_failed:  # never raised: the engine recomputes these
            print(f"load failed, recompute device blocks {failure.device_blocks}: {failure.error}")
    engine.finish_request("B")
    print(f"loads finished: {loads_done}")

    same = all(torch.equal(layer[40:44], orig) for layer, orig in zip(kv_caches, original))
    print(f"B's device blocks hold A's KV again: {same}")
    print(f"counters: {engine.counters.as_dict()}")
    engine.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
