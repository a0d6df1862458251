"""Remote tier throughput on loopback, against ``redis-benchmark`` on the same server in one run.

    python tools/bench_remote.py [--url redis://127.0.0.1:6379] [--sizes-kib 256,2048,4096]
                                 [--modes none,mac,encrypt] [--total-mib 256] [--batch 16]
                                 [--connections N] [--repeat 3] [--engine-requests 64] [--engine-blocks 32]
                                 [--quick] [--profile]

For each value size and protection mode: ``redis-benchmark`` SET and GET of values of the
entry's size (``-c`` the tier's connections, ``-P`` the job's blocks, distinct keys, every key
set before the GETs), then kvflow's
remote tier, built by ``redis_tier`` over a ``TorchExecutor`` on the CPU with host slots of that
size, storing and loading the same number of blocks in remote jobs of ``--batch`` blocks (every
job submitted at once, as a busy engine would; framing, protection, every reply checked, each
payload copied into its slot; the loaded bytes compared with the stored ones). Prints GB/s of
payload each way and kvflow's fraction of redis-benchmark's, best of ``--repeat``.

Then the engine thread's CPU per remote block (``time.thread_time`` of the thread that runs a
real ``SyncEngine``; the tiers' own threads are not counted): one instance computes and stores
requests of 32 blocks (written through to the remote tier), a second one looks them up (probe,
remote load, hit, load to the device), against the same calls without a remote tier.

A protection mode is a set of extra ``redis_tier`` arguments (``MODES``). Without ``--url`` a throw-away ``redis-server`` is
started on loopback. ``--quick``: small sizes and counts (a test runs it).
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import io
import pstats
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 4  # host regions per slot (a block's payload is one page of each)
ENGINE_PAGE_KIB = 16  # the engine-thread measure: requests of --engine-blocks blocks of 64 KiB

# redis_tier's extra arguments per protection mode: "none" an unkeyed checksum (opted out by
# name), "mac" authenticated in the clear, "encrypt" encrypted and authenticated
MODES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "none": lambda _: {"insecure_no_key": True},
    "mac": lambda d: {"keys": _tier_keys(d), "encrypt": False},
    "encrypt": lambda d: {"keys": _tier_keys(d), "encrypt": True},
}


def _tier_keys(where: Path) -> Any:
    import os

    from kvflow.tiers.keys import TierKeys

    path = where / "bench.key"
    if not path.exists():
        path.write_text(os.urandom(32).hex() + "\n")
        path.chmod(0o600)
    return TierKeys.from_file(path)


def redis_benchmark(host: str, port: int, test: str, size: int, n: int, pipeline: int, clients: int) -> float:
    """Requests per second of ``redis-benchmark -t test``."""
    out = subprocess.run(
        ["redis-benchmark", "-h", host, "-p", str(port), "-t", test, "-d", str(size),
         "-n", str(n), "-r", str(n), "-P", str(pipeline), "-c", str(clients), "--csv"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    rows = list(csv.reader(io.StringIO(out)))
    return float(next(r for r in rows if r and r[0].upper() == test.upper())[1])


def tier(
    url: str, payload: int, blocks: int, connections: int | None, extra: dict[str, Any]
) -> tuple[Any, Any]:
    """A remote tier over a CPU TorchExecutor whose host slots hold ``payload`` bytes each."""
    import torch

    from kvflow.core.config import Config
    from kvflow.executors.torch.executor import TorchExecutor
    from kvflow.tiers.redis_store import redis_tier

    kv = [torch.zeros((2, payload // LAYERS // 2), dtype=torch.float16) for _ in range(LAYERS)]
    cfg = Config(cpu_blocks=blocks, block_tokens=16, remote_blocks=1 << 20, job_deadline_ms=60_000.0)
    if connections is not None:
        extra = {**extra, "connections": connections}
    return cfg, redis_tier(TorchExecutor(kv, blocks, device="cpu"), cfg, url, model="bench", timeout_s=30.0, **extra)


def measure(executor: Any, payload: int, blocks: int, batch: int, base_id: int) -> dict[str, float]:
    """Store every slot's block in jobs of ``batch`` blocks, then load them back; GB/s."""
    import numpy as np

    from kvflow.core.jobs import REMOTE_LOAD, REMOTE_STORE, TransferJob
    from kvflow.core.names import name_of

    regions = executor.slots.regions
    rng = np.random.default_rng(base_id)
    for region in regions:  # distinct contents in every slot
        region[:, :64] = rng.integers(0, 256, (blocks, 64), dtype=np.uint8)
    expected = [region[:, :64].copy() for region in regions]

    def run(direction: str, first_id: int) -> float:
        jobs = []
        for n, start in enumerate(range(0, blocks, batch)):
            slots = tuple(range(start, min(blocks, start + batch)))
            hashes = tuple(1000 + s for s in slots)
            jobs.append(TransferJob(job_id=first_id + n, direction=direction, device_blocks=(), slots=slots,
                                    hashes=hashes, names=tuple(name_of(h) for h in hashes)))  # fmt: skip
        started = time.perf_counter()
        executor.submit(jobs)
        done = 0
        while done < len(jobs):
            executor.wait_results(30.0)
            for result in executor.poll():
                assert result.ok, result.error
                done += 1
        return time.perf_counter() - started

    store_s = run(REMOTE_STORE, base_id)
    for region in regions:
        region[:, :64] = 0
    load_s = run(REMOTE_LOAD, base_id + blocks)
    for region, want in zip(regions, expected):
        assert np.array_equal(region[:, :64], want), "a loaded block differs from the stored one"
    return {"store_gbs": payload * blocks / store_s / 1e9, "load_gbs": payload * blocks / load_s / 1e9}


def engine_thread_cost(
    url: str, requests: int, remote: bool, profile: cProfile.Profile | None = None, blocks: int = 32
) -> dict[str, float]:
    """CPU time of the engine's own thread per block: one instance stores ``requests`` requests
    of ``blocks`` blocks (written through to the remote tier when ``remote``), another looks them up
    (with a remote tier: probe, remote load, then the hit and its load to the device). The
    device copies are simulated (done when a virtual clock reaches them), so that what is
    measured is the engine's and the remote tier's cost, not the device executor's."""
    from kvflow.core.config import Config
    from kvflow.engine.sync import SyncEngine
    from kvflow.executors.simulated import SimulatedExecutor, TransferModel, VirtualClock

    cpu_blocks = requests * blocks
    payload = ENGINE_PAGE_KIB * 1024 * LAYERS

    def build() -> tuple[SyncEngine, VirtualClock]:
        clock = VirtualClock()
        device = SimulatedExecutor(clock, TransferModel(payload, 50.0, 5.0))
        if not remote:
            config = Config(cpu_blocks=cpu_blocks, block_tokens=16, job_deadline_ms=60_000.0)
            return SyncEngine(config, device, clock=clock, bytes_per_block=payload), clock
        config, executor = tier(url, payload, cpu_blocks, None, {"insecure_no_key": True})
        executor.inner.close()
        executor.inner = device  # (the remote tier's host slots are the CPU executor's pool)
        return SyncEngine(config, executor, clock=clock, bytes_per_block=payload), clock

    def settle(engine: SyncEngine, clock: VirtualClock) -> None:
        """Step until no job is live, waiting (no CPU) for each outcome rather than stepping
        idly: an engine steps once per forward pass, not in a loop."""
        executor: Any = engine.executor
        while remote and executor.probing():
            time.sleep(0.0002)
        engine.step()
        while engine.has_live_jobs():
            due = getattr(executor, "inner", executor).next_completion_ms()
            if due is not None:
                clock.advance_to(due)
            else:  # a remote job: its thread works while this one waits
                executor.wait_results(30.0)
            engine.step()

    def chain(r: int) -> list[int]:
        return [r * blocks + i + 1 for i in range(blocks)]

    tokens = blocks * 16 + 1
    device = list(range(blocks))
    out: dict[str, float] = {}
    writer, clock = build()
    try:
        cpu = time.thread_time()
        for r in range(requests):
            writer.lookup(f"w{r}", chain(r), tokens)
            writer.blocks_computed(f"w{r}", chain(r), device)
            settle(writer, clock)
            writer.finish_request(f"w{r}")
        out["store"] = (time.thread_time() - cpu) / cpu_blocks * 1e6
    finally:
        writer.close()
    reader, clock = build()  # a second instance: its CPU tier is empty
    try:
        if profile is not None:
            profile.enable()
        cpu = time.thread_time()
        for r in range(requests):
            for _ in range(3):  # probe, remote load, then the hit (without a remote tier: misses)
                hits = reader.lookup(f"r{r}", chain(r), tokens)
                reader.accept_hits(f"r{r}", device[:hits])
                settle(reader, clock)
            reader.finish_request(f"r{r}")
        out["load"] = (time.thread_time() - cpu) / cpu_blocks * 1e6
        if profile is not None:
            profile.disable()
        out["remote_loaded"] = reader.counters.remote_blocks_loaded
    finally:
        reader.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server; default: start one")
    parser.add_argument("--sizes-kib", default="256,2048,4096", help="block payload sizes")
    parser.add_argument("--modes", default="none,mac,encrypt", help=f"of {', '.join(MODES)}")
    parser.add_argument("--total-mib", type=int, default=256, help="payload moved per size each way")
    parser.add_argument("--batch", type=int, default=16, help="blocks per remote job")
    parser.add_argument("--connections", type=int, default=None, help="the tier's (default: redis_tier's)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engine-requests", type=int, default=64, help="requests for the engine-thread measure (0: skip)")
    parser.add_argument("--engine-blocks", type=int, default=32, help="blocks per request there (its commands are per request)")
    parser.add_argument("--quick", action="store_true", help="small sizes and counts (a smoke test)")
    parser.add_argument("--profile", action="store_true", help="cProfile of the engine thread's lookups")
    args = parser.parse_args()
    if args.quick:
        args.sizes_kib, args.total_mib, args.repeat, args.engine_requests = "256", 8, 1, 4

    import tempfile

    from kvflow.tiers.entry import HEADER_BYTES

    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode {unknown[0]!r}: one of {', '.join(MODES)}")
    server = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from redis_servers import RedisServer

        server = RedisServer()
        url = server.url
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    keydir = Path(tempfile.mkdtemp(prefix="kvflow-bench-"))
    try:
        _, probe_tier = tier(url, 4096, 1, args.connections, {"insecure_no_key": True})
        connections = getattr(probe_tier, "connections", 1)
        probe_tier.close()
        print(f"server {url}; {args.batch} blocks per job, {connections} connection(s) (redis-benchmark: "
              f"-P {args.batch} -c {connections}); GB/s of payload, best of {args.repeat}")  # fmt: skip
        print(f"{'value':>8} {'mode':>8} {'blocks':>6} | {'SET':>6} {'store':>6} {'ratio':>5} | "
              f"{'GET':>6} {'load':>6} {'ratio':>5}")  # fmt: skip
        job_ids = 1
        for kib in (int(k) for k in args.sizes_kib.split(",")):
            payload = kib * 1024
            blocks = max(args.batch, args.total_mib * 1024 * 1024 // payload)
            size = payload + HEADER_BYTES
            for mode in modes:
                _, executor = tier(url, payload, blocks, args.connections, MODES[mode](keydir))
                best: dict[str, float] = {}
                try:
                    for _ in range(args.repeat):
                        _flush(url)
                        got = {"set_gbs": redis_benchmark(host, port, "set", size, blocks, args.batch, connections) * payload / 1e9}
                        _fill(url, blocks, size)  # (so that every GET finds its value)
                        got["get_gbs"] = redis_benchmark(host, port, "get", size, blocks, args.batch, connections) * payload / 1e9
                        _flush(url)
                        got |= measure(executor, payload, blocks, args.batch, job_ids)
                        job_ids += 2 * blocks
                        for key, value in got.items():
                            best[key] = max(best.get(key, value), value)
                finally:
                    executor.close()
                print(
                    f"{kib:>5}KiB {mode:>8} {blocks:>6} | {best['set_gbs']:>6.2f} {best['store_gbs']:>6.2f} "
                    f"{best['store_gbs'] / best['set_gbs']:>5.2f} | {best['get_gbs']:>6.2f} {best['load_gbs']:>6.2f} "
                    f"{best['load_gbs'] / best['get_gbs']:>5.2f}"
                )
        _flush(url)
        if args.engine_requests:
            engine_thread_cost(url, 2, True)  # warm-up: imports, first connections
            profile = cProfile.Profile(time.thread_time) if args.profile else None
            cost: dict[bool, dict[str, float]] = {}
            for _ in range(args.repeat):
                for remote in (False, True):
                    _flush(url)
                    run = engine_thread_cost(url, args.engine_requests, remote, profile if remote else None, args.engine_blocks)
                    cost[remote] = {k: min(v, cost.get(remote, run)[k]) for k, v in run.items()}
            assert cost[True]["remote_loaded"] == args.engine_requests * args.engine_blocks, cost
            print(
                f"engine thread CPU per block (us), {args.engine_blocks}-block requests of "
                f"{ENGINE_PAGE_KIB * LAYERS} KiB blocks, best of {args.repeat}: compute + store "
                f"{cost[False]['store']:.1f} without a remote tier, {cost[True]['store']:.1f} with it "
                f"(write-through); lookups by another instance {cost[False]['load']:.1f} without "
                f"(misses), {cost[True]['load']:.1f} with it (probe + remote load + hit + load to the device)"
            )
            if profile is not None:
                pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    finally:
        if server is not None:
            server.close()
    return 0


def _fill(url: str, blocks: int, size: int) -> None:
    """A value of ``size`` bytes under each key ``redis-benchmark -r blocks`` draws from
    (``key:`` and 12 digits): its random keys repeat, so its SET leaves about a third of them
    unset, and a GET of those would move no value at all."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        value = b"x" * size
        for start in range(0, blocks, 16):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(blocks, start + 16)):
                pipe.set(b"key:%012d" % i, value)
            pipe.execute()
        assert client.dbsize() >= blocks
    finally:
        client.close()


def _flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
