"""Write a large, valid kvflow trace fast: the sequential simulation (``kvflow.simulate``, the real
decision code) recording an endless synthetic workload until the trace reaches a size. Every
record, seq and checkpoint is the writer's own, so the trace folds, verifies and re-decides like
any recorded one; failed jobs (``--fault-rate``) give the incident verbs something to find.

The workload: conversations that resend a growing history after a shared system prompt, many
small blocks a request (so most bytes are block hashes, the bulk of a production trace), and a
CPU tier smaller than the working set (so blocks are stored, loaded and evicted throughout).

Usage: python tools/make_big_trace.py OUT.jsonl --mb 1024 [--seed 1] [--fault-rate 0.01]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Iterator

from kvflow.simulate.run import SimOptions, Simulation
from kvflow.simulate.workload import WorkloadRequest

BLOCK_TOKENS = 16
CPU_BLOCKS = 4_096


def workload(seed: int) -> Iterator[WorkloadRequest]:
    """Requests without end: 8 system prompts of 32 blocks, 64 conversations at a time, each
    turn its history plus 4-24 new blocks, a conversation ending after 6-12 turns."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    systems = [fresh(32) for _ in range(8)]
    talks: list[tuple[list[int], int]] = []
    line = 0
    while True:
        while len(talks) < 64:
            talks.append((list(rng.choice(systems)), rng.randint(6, 12)))
        k = rng.randrange(len(talks))
        history, turns = talks[k]
        history = history + fresh(rng.randint(4, 24))
        talks[k] = (history, turns - 1)
        if turns <= 1 or len(history) > 600:
            talks.pop(k)
        line += 1
        tokens = len(history) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS)
        yield WorkloadRequest(line, float(line), tokens, 16, tuple(history))


def make(out: str, mb: float, seed: int, fault_rate: float) -> int:
    """Record until ``out`` holds at least ``mb`` MiB; returns the requests run."""
    options = SimOptions(
        cpu_blocks=CPU_BLOCKS, block_tokens=BLOCK_TOKENS, fault_rate=fault_rate, seed=seed, record=out
    )
    sim = Simulation(options)
    target = int(mb * (1 << 20))
    done = 0
    try:
        for req in workload(seed):
            sim._sequential_request(req)
            done += 1
            if done % 200 == 0 and os.path.getsize(out) >= target:
                break
    finally:
        sim.engine.close()
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--mb", type=float, default=1024.0, help="size to reach, MiB (default 1024)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fault-rate", type=float, default=0.01)
    args = parser.parse_args()
    start = time.perf_counter()
    requests = make(args.out, args.mb, args.seed, args.fault_rate)
    size = os.path.getsize(args.out)
    took = time.perf_counter() - start
    print(f"{args.out}: {size / (1 << 20):,.1f} MiB, {requests:,} requests, {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
