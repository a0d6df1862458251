"""Benchmark of the pure core on one core (issue 2's performance targets).

Prints, measured in this one run:
  * fold speed: block state changes applied per second by ``fold`` (``evolve`` over a log) (target >= 1,500,000/s);
  * trace replay: events per second for decode + fold + checkpoint checks (state digest and
    record digest, ``kvflow replay``'s plain fold; target >= 300,000/s);
  * decision overhead: µs per block for an engine step of 256 requests / 4,096 blocks
    (lookup, accept, stores, plan, results, finish; target <= 1 µs per block).

kvflow has one core, in Python. The engine step runs an ``OffloadManager`` with its default
in-memory log. (Side-by-side figures against vLLM's own bookkeeping: tools/bench_vs_vllm.py.)

Usage: python tools/bench_core.py [--requests N] [--quick] [--only fold|replay|step]
       python tools/bench_core.py --against DIR [--rounds 5] [--only ...]

``--against DIR`` measures another checkout of kvflow (e.g. ``git worktree add /tmp/base v1``)
side by side with this one: each measure runs in a fresh interpreter per side, the sides
alternating ``--rounds`` times, and the medians and their ratio are printed. The absolute
figures move by 1.3x or more with the machine's load within a day; the ratio of two sides
measured in turn is what shows a change.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from kvflow.core.commands import JobResult
from kvflow.core.config import Config
from kvflow.core.events import (
    BlocksEvicted,
    BlocksTouched,
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    LoadQueued,
    PinsAcquired,
    PinsReleased,
    StoreQueued,
)
from kvflow.core.state.apply import fold
from kvflow.core.state.model import State
from kvflow.engine.manager import OffloadManager
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay


def block_changes(events: list, store_jobs: dict[int, int]) -> int:
    """How many per-block state changes the events carry (each block named once per change)."""
    n = 0
    for e in events:
        t = type(e)
        if t is StoreQueued:
            store_jobs[e.job_id] = len(e.hashes)
            n += len(e.hashes)
        elif t is JobsSubmitted:
            n += sum(store_jobs.get(j, 0) for j in e.job_ids)  # STORE_QUEUED -> STORING
        elif t in (JobCompleted, JobFailed, JobTimedOut, BlocksEvicted, BlocksTouched, PinsAcquired, PinsReleased, LoadQueued):
            n += len(e.hashes)
    return n


def engine_like_run(manager: OffloadManager, requests: int, seed: int, blocks_per_request: int = 16) -> None:
    """Requests sharing prefixes (a few system prompts + conversations) with 5% failures."""
    rng = random.Random(seed)
    next_device = 0
    roots = [[rng.getrandbits(60) for _ in range(8)] for _ in range(16)]
    convs: list[list[int]] = []
    now = 0.0
    for i in range(requests):
        if convs and rng.random() < 0.6:
            conv = rng.choice(convs)
            conv.extend(rng.getrandbits(60) for _ in range(rng.randint(1, 4)))
        else:
            conv = list(rng.choice(roots)) + [rng.getrandbits(60) for _ in range(rng.randint(1, 8))]
            convs.append(conv)
            if len(convs) > 64:
                convs.pop(0)
        hashes = conv[:blocks_per_request * 4]
        rid = f"r{i}"
        tokens = len(hashes) * 16 + 5
        hits = manager.lookup(rid, hashes, tokens)
        if hits:
            manager.accept_hits(rid, range(next_device, next_device + hits))
            next_device += hits
        manager.blocks_computed(rid, hashes, range(next_device, next_device + len(hashes)))
        next_device += len(hashes)
        now += 1.0
        for job in manager.plan_step(now):
            manager.job_result(job.job_id, ok=rng.random() > 0.05, error="bench failure")
        manager.finish_request(rid)  # (kvflow touches the request's chain, deepest first)


def bench_fold(requests: int) -> tuple[float, int, int]:
    config = Config(cpu_blocks=4096, block_tokens=16)
    manager = OffloadManager(config)
    engine_like_run(manager, requests, seed=1)
    events = manager.log.events()
    changes = block_changes(events, {})
    best = float("inf")
    for _ in range(5):
        state = State(config)
        t0 = time.perf_counter()
        fold(state, events)
        best = min(best, time.perf_counter() - t0)
    assert state.digest() == manager.state.digest(), "fold must rebuild the live state"
    return changes / best, changes, len(events)


def bench_replay(requests: int) -> tuple[float, int, int]:
    config = Config(cpu_blocks=4096, block_tokens=16)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.jsonl")
        writer = TraceWriter(path, config, checkpoint_every=10_000)
        manager = OffloadManager(config, log=writer)
        engine_like_run(manager, requests, seed=2)
        manager.close()
        size = os.path.getsize(path)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            result = replay(path)
            best = min(best, time.perf_counter() - t0)
            assert result.ok, result.divergence
        return result.events / best, result.events, size


def bench_step(
    steps: int, requests_per_step: int = 256, blocks_per_request: int = 16
) -> tuple[float, int]:
    """µs of decision time per block for a full engine step."""
    config = Config(cpu_blocks=64 * 1024, block_tokens=16)
    manager = OffloadManager(config)
    rng = random.Random(3)
    next_device = 0
    pool = [rng.getrandbits(60) for _ in range(requests_per_step * blocks_per_request * 2)]
    per_block: list[float] = []
    blocks_involved = 0
    for step in range(steps):
        reqs = []
        for r in range(requests_per_step):
            start = rng.randrange(0, len(pool) - blocks_per_request)
            reqs.append((f"s{step}r{r}", pool[start : start + blocks_per_request]))
        t0 = time.perf_counter()
        blocks_involved = 0
        for rid, hashes in reqs:
            hits = manager.lookup(rid, hashes, blocks_per_request * 16 + 1)
            if hits:
                manager.accept_hits(rid, range(next_device, next_device + hits))
                next_device += hits
            manager.blocks_computed(rid, hashes, range(next_device, next_device + blocks_per_request))
            next_device += blocks_per_request
            blocks_involved += blocks_per_request
        jobs = manager.plan_step(float(step))
        manager.job_results([JobResult(job_id=job.job_id) for job in jobs])
        for rid, _ in reqs:
            manager.finish_request(rid)
        manager.take_notices()
        elapsed = time.perf_counter() - t0
        per_block.append(elapsed / blocks_involved * 1e6)
    return statistics.median(per_block[1:] or per_block), blocks_involved


MEASURES = ("fold", "replay", "step")


def measure(requests: int, steps: int, only: str | None = None) -> list[tuple[str, str, str, float, float, str]]:
    rows = []
    if only in (None, "fold"):
        rate, changes, events = bench_fold(requests)
        rows.append(
            ("fold", f"{rate:,.0f} block changes/s", f"({changes:,} changes in {events:,} events)", 1_500_000, rate, ">=")
        )
    if only in (None, "replay"):
        rrate, revents, size = bench_replay(requests)
        rows.append(
            ("trace replay", f"{rrate:,.0f} events/s", f"({revents:,} events, {size / 1e6:.1f} MB)", 300_000, rrate, ">=")
        )
    if only in (None, "step"):
        us_per_block, blocks = bench_step(steps)
        rows.append(
            ("engine step", f"{us_per_block:.3f} µs/block", f"(256 requests, {blocks:,} blocks)", 1.0, us_per_block, "<=")
        )
    return rows


def side_by_side(other: str, requests: int, steps: int, only: str | None, rounds: int) -> int:
    """Each measure of this checkout and of ``other``, in turn, each run in a fresh interpreter
    whose ``kvflow`` is that checkout's (this file's workload either way)."""
    if not os.path.isfile(os.path.join(other, "kvflow", "__init__.py")):
        print(f"bench_core: --against {other}: not a kvflow checkout (no kvflow/__init__.py there)", file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = {"this": here, "other": os.path.abspath(other)}
    print(f"kvflow bench_core side by side · python {sys.version.split()[0]} · {rounds} rounds, alternating")
    print(f"  this:  {sides['this']}\n  other: {sides['other']}")
    for name in (only,) if only else MEASURES:
        values: dict[str, list[float]] = {side: [] for side in sides}
        unit = ""
        for r in range(rounds):
            for side in sides if r % 2 == 0 else reversed(list(sides)):
                path = os.pathsep.join(filter(None, (sides[side], os.environ.get("PYTHONPATH"))))
                env = dict(os.environ, PYTHONPATH=path)  # (its kvflow first on the path)
                cmd = [sys.executable, os.path.abspath(__file__), "--only", name, "--child"]
                cmd += ["--requests", str(requests), "--steps", str(steps)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=sides[side])
                if done.returncode != 0:
                    print(f"bench_core: {name} failed on {side} ({sides[side]}): {done.stderr.strip()[-400:]}", file=sys.stderr)
                    return 1
                row = json.loads(done.stdout.strip().splitlines()[-1])
                if os.path.realpath(row["kvflow"]) != os.path.realpath(sides[side]):  # (an installed kvflow won)
                    print(f"bench_core: the {side} side imported kvflow from {row['kvflow']}, not {sides[side]}", file=sys.stderr)
                    return 1
                values[side].append(row["value"])
                unit = row["unit"]
        this, that = statistics.median(values["this"]), statistics.median(values["other"])
        better = this / that if name != "step" else that / this  # > 1: this checkout is faster
        print(
            f"{name:<7} this {this:>12,.3f} {unit:<20} other {that:>12,.3f}   "
            f"this is {better:.3f}x as fast (medians of {rounds})"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=12, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--only", choices=MEASURES, help="run one measure")
    parser.add_argument("--against", metavar="DIR", help="another kvflow checkout, measured side by side")
    parser.add_argument("--rounds", type=int, default=5, help="with --against: rounds per side (default 5)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one side of --against
    args = parser.parse_args()
    requests = 1_000 if args.quick else args.requests
    steps = 3 if args.quick else args.steps
    if args.against:
        return side_by_side(args.against, requests, steps, args.only, args.rounds)
    rows = measure(requests, steps, args.only)
    if args.child:
        (_name, _result, _detail, _target, value, _cmp), = rows
        unit = {"fold": "block changes/s", "replay": "events/s", "step": "µs/block"}[args.only or ""]
        import kvflow

        print(json.dumps({"value": value, "unit": unit, "kvflow": os.path.dirname(os.path.dirname(kvflow.__file__))}))
        return 0
    print(f"kvflow bench_core · python {sys.version.split()[0]} · one core")
    print(f"{'measure':<14} {'result':<28} {'target':<14} {'ratio':>7}  detail")
    ok = True
    for name, result, detail, target, value, cmp in rows:
        ratio = value / target if cmp == ">=" else target / value
        ok &= ratio >= 1.0
        verdict = "PASS" if ratio >= 1.0 else "MISS"
        print(f"{name:<14} {result:<28} {cmp + ' ' + format(target, ','):<14} {ratio:>6.2f}x  {detail} {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
