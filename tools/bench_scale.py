"""Tiers of millions of entries: does a step, a checkpoint digest or a debugging verb cost more
when the CPU tier holds more?

For each tier size (10 k, 1 M, 10 M entries by default) a fresh process fills the tier through
the real engine (``OffloadManager`` with a null log: stores of large batches, each planned and
completed, every entry a distinct 64-bit hash) and then runs the same request mix against it:
each request looks up a chain of blocks of which the first half is on the tier, loads its hits,
stores the rest (the tier is full: each store evicts), completes its jobs and finishes. It
reports the median µs per request ("step"), the median µs of a checkpoint's state digest taken
with requests in flight, the resident memory the filled index costs per entry (RSS before and
after the fill) and the process's peak RSS. Then the debugging verbs (``incidents``, ``inspect
--slot``, ``replay``) run on a golden trace whose header claims each tier size.

The last line is::

    scale: step 10M/10k = <ratio>, digest 10M/10k = <ratio>, bytes/entry at 10M = <n>, peak RSS <n> MiB

Usage: python tools/bench_scale.py [--sizes 10000,1000000,10000000] [--requests 400]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAIN = 16  # blocks a request names; the first half are hits
BATCH = 100_000  # blocks per fill store


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one_size(cpu_blocks: int, requests: int, seed: int) -> dict[str, float]:
    """Fill a tier of ``cpu_blocks`` and time the request mix (run in its own process)."""
    import gc

    from kvflow.core.config import Config
    from kvflow.engine.manager import OffloadManager
    from kvflow.log.memory import NullLog

    rng = random.Random(seed)
    m = OffloadManager(Config(cpu_blocks=cpu_blocks, chain_recency=True), log=NullLog())
    gc.collect()
    base = rss_bytes()
    hashes: list[int] = []
    t0 = time.perf_counter()
    filled = 0
    while filled < cpu_blocks:
        n = min(BATCH, cpu_blocks - filled)
        batch = [rng.getrandbits(64) for _ in range(n)]
        job = m.blocks_computed(f"fill-{filled}", batch, range(n))
        assert job is not None
        m.plan_step(0.0)
        m.job_result(job)
        m.finish_request(f"fill-{filled}")
        m.take_notices()  # (an engine drains them every step)
        hashes.extend(batch[:: max(1, n // 1000)])  # a sample of the tier, for the hits
        filled += n
    fill_s = time.perf_counter() - t0
    gc.collect()
    per_entry = (rss_bytes() - base) / cpu_blocks
    state = m.state
    assert len(state.slot_of) == cpu_blocks and len(state.free_slots) == 0

    # the request mix: the same for every size (its hits are drawn from the tier's sample)
    step_us: list[float] = []
    device = 0
    for i in range(requests):
        rid = f"req-{i}"
        hits = [hashes[rng.randrange(len(hashes))] for _ in range(CHAIN // 2)]
        chain = list(dict.fromkeys(hits)) + [rng.getrandbits(64) for _ in range(CHAIN // 2)]
        t = time.perf_counter()
        found = m.lookup(rid, chain, len(chain) * 16)
        if found:
            m.accept_hits(rid, list(range(device, device + found)))
        job = m.blocks_computed(rid, chain[found:], list(range(device + found, device + len(chain))))
        for planned in m.plan_step(float(i)):
            m.job_result(planned.job_id)
        m.finish_request(rid)
        m.take_notices()
        step_us.append((time.perf_counter() - t) * 1e6)
        device = (device + len(chain)) % 100_000
        assert job is not None
    # a checkpoint's digest with eight requests' loads and stores in flight
    for k in range(8):
        rid = f"live-{k}"
        chain = hashes[k * 4 : k * 4 + 4] + [rng.getrandbits(64) for _ in range(4)]
        found = m.lookup(rid, chain, len(chain) * 16)
        if found:
            m.accept_hits(rid, list(range(200_000 + 16 * k, 200_000 + 16 * k + found)))
        m.blocks_computed(rid, chain[found:], list(range(300_000 + 16 * k, 300_000 + 16 * k + len(chain) - found)))
    m.plan_step(float(requests))
    digest_us = []
    for _ in range(50):
        t = time.perf_counter()
        state.digest()
        digest_us.append((time.perf_counter() - t) * 1e6)
    return {
        "cpu_blocks": cpu_blocks,
        "fill_s": fill_s,
        "step_us": statistics.median(step_us),
        "digest_us": statistics.median(digest_us),
        "bytes_per_entry": per_entry,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def verbs(sizes: list[int]) -> list[dict[str, float]]:
    """``incidents``, ``inspect --slot 5`` and ``replay`` on traces/store_failures.jsonl with its
    header claiming each tier size (the events fold the same: a bigger tier hands out the same
    slots while it has room); seconds and tracemalloc's peak."""
    import tracemalloc

    from kvflow.inspect.history import Selector, inspect_trace
    from kvflow.inspect.incidents import find_incidents
    from kvflow.replay.fold import replay

    lines = (ROOT / "traces" / "store_failures.jsonl").read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    out = []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            header["config"]["cpu_blocks"] = size
            path = Path(tmp) / f"{size}.jsonl"
            path.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(lines[1:]))
            row: dict[str, float] = {"cpu_blocks": size}
            for name, run in (
                ("incidents", lambda: find_incidents(path)),
                ("inspect_slot", lambda: inspect_trace(path, Selector(slot=5))),
                ("replay", lambda: replay(path)),
            ):
                tracemalloc.start()
                t = time.perf_counter()
                run()
                row[f"{name}_s"] = time.perf_counter() - t
                row[f"{name}_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
                tracemalloc.stop()
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000,10000000")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # (a child: one size, JSON out)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one_size(args.one, args.requests, args.seed)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        child = subprocess.run(
            [sys.executable, __file__, "--one", str(size), "--requests", str(args.requests), "--seed", str(args.seed)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print("| entries | fill s | µs per request | µs per digest | bytes per entry | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['cpu_blocks']:,} | {r['fill_s']:.1f} | {r['step_us']:.1f} | {r['digest_us']:.1f} "
            f"| {r['bytes_per_entry']:.0f} | {r['peak_rss_mib']:.0f} |"
        )
    print()
    print("verbs on traces/store_failures.jsonl (16 incidents, 702 events), the header claiming each tier:")
    print("| header cpu_blocks | incidents s / MiB | inspect --slot 5 s / MiB | replay s / MiB |")
    print("|---|---|---|---|")
    for v in verbs(sizes):
        print(
            f"| {v['cpu_blocks']:,} | {v['incidents_s']:.2f} / {v['incidents_mib']:.1f} "
            f"| {v['inspect_slot_s']:.2f} / {v['inspect_slot_mib']:.1f} | {v['replay_s']:.2f} / {v['replay_mib']:.1f} |"
        )
    small, big = rows[0], rows[-1]
    peak = max(r["peak_rss_mib"] for r in rows)
    print(
        f"scale: step {label(big)}/{label(small)} = {big['step_us'] / small['step_us']:.2f}, "
        f"digest {label(big)}/{label(small)} = {big['digest_us'] / small['digest_us']:.2f}, "
        f"bytes/entry at {label(big)} = {big['bytes_per_entry']:.0f}, peak RSS {peak:.0f} MiB"
    )
    return 0


def label(row: dict[str, float]) -> str:
    n = int(row["cpu_blocks"])
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)


if __name__ == "__main__":
    sys.exit(main())
