"""Load: a long run of the engine with faults, in bounded memory.

    python tools/bench_load.py [--jobs 1000000] [--fault-rate 0.1] [--slow-rate 0.02] [--seed 0]

Requests with shared prefixes go through ``SyncEngine`` + ``SimulatedExecutor`` on a virtual
clock: each looks up its prefix, loads the hits, stores the rest, and finishes; ``fault_rate``
of the jobs fail, ``slow_rate`` outlive their deadline (they time out, stay fenced, and report
late). Prints jobs/s and the peak RSS as the job count grows (flat = bounded memory), and checks
at the end that every job ended, nothing is held and the state is consistent.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time

from kvflow.core.config import Config
from kvflow.core.state.invariants import check_invariants
from kvflow.engine.sync import SyncEngine
from kvflow.executors.simulated import SimulatedExecutor, TransferModel, VirtualClock


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--fault-rate", type=float, default=0.1)
    ap.add_argument("--slow-rate", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    clock = VirtualClock()
    deadline = 5.0
    # which submissions are slow is drawn up front by ordinal (the executor's own fault dice
    # decide the failures); a set of ~2% of the ordinals is the only per-job memory here
    slow = {i for i in range(1, args.jobs + 1) if rng.random() < args.slow_rate}
    ex = SimulatedExecutor(
        clock, TransferModel(bytes_per_block=1 << 20), fault_rate=args.fault_rate, seed=args.seed,
        slow_jobs=slow, slow_by_ms=3 * deadline,
    )
    # (fences of slow copies last 3 deadlines: warn only about one that lasts far longer)
    engine = SyncEngine(
        Config(cpu_blocks=4096, block_tokens=16, job_deadline_ms=deadline), ex, clock=clock, fence_warn_ms=100 * deadline
    )
    prefixes = [[rng.getrandbits(63) for _ in range(8)] for _ in range(200)]
    start, marks, request = time.perf_counter(), [], 0
    next_mark = 1
    while ex.stats.jobs < args.jobs:
        request += 1
        rid = f"r{request}"
        chain = [*rng.choice(prefixes), *(rng.getrandbits(63) for _ in range(4))]
        blocks = list(range(request * 16 % (1 << 30), request * 16 % (1 << 30) + len(chain)))
        hits = engine.lookup(rid, chain, len(chain) * 16 + 1)
        if hits:
            engine.accept_hits(rid, blocks[:hits])
        engine.blocks_computed(rid, chain[hits:], blocks[hits:])
        engine.step()
        while engine.has_live_jobs():
            due = ex.next_completion_ms()
            nxt = engine.manager.next_deadline_ms()
            clock.advance_to(min(t for t in (due, nxt) if t is not None))
            engine.step()
        engine.touch(chain[::-1], reuse=False)
        engine.finish_request(rid)
        if ex.stats.jobs >= next_mark:
            marks.append((ex.stats.jobs, time.perf_counter() - start, rss_mib()))
            next_mark *= 2
    # the late copies report; then nothing may be left
    while engine.fences() and ex.next_completion_ms() is not None:
        clock.advance_to(ex.next_completion_ms())  # type: ignore[arg-type]
        engine.step()
    seconds = time.perf_counter() - start
    c = engine.counters
    print(f"{ex.stats.jobs:,} jobs ({c.jobs_failed:,} failed, {c.jobs_timed_out:,} timed out and fenced, "
          f"{c.fences_lifted:,} fences lifted by late copies) in {seconds:.1f} s: {ex.stats.jobs / seconds:,.0f} jobs/s")
    print("jobs so far -> peak RSS:")
    for jobs, at, mib in marks:
        if jobs >= 1000:
            print(f"  {jobs:>10,} jobs  {at:7.1f} s  {mib:7.1f} MiB")
    print(f"  {ex.stats.jobs:>10,} jobs  {seconds:7.1f} s  {rss_mib():7.1f} MiB (end)")
    state = engine.manager.state
    clean = not state.jobs and not state.held and not state.fenced_slots and not check_invariants(state)
    print(f"end state: {len(state.jobs)} jobs, {len(state.held)} held device blocks, {len(state.fenced_slots)} fenced slots, "
          f"{len(state.requests)} requests; consistent: {clean}")
    engine.close()
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
