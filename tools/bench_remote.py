"""Remote tier throughput on loopback, against ``redis-benchmark`` on the same server in one run.

    python tools/bench_remote.py [--url redis://127.0.0.1:6379] [--payload-kib 64,256,1024]
                                 [--total-mib 256] [--pipeline 16] [--repeat 3]

For each block payload size: ``redis-benchmark`` SET and GET of values of the entry's size (one
connection, the same pipeline depth, distinct keys), then kvflow's ``RedisBlockStore`` storing
and loading the same number of blocks from and into a host buffer (framing, checksum, every reply
checked, the payload copied into its slot). Prints GB/s of each and kvflow's fraction of
redis-benchmark's, plus the CPU time per block spent in the thread that runs the store (what the
remote executor's thread pays; the engine's own thread only decides and logs). Best of
``--repeat``. Without ``--url`` a throw-away ``redis-server`` is started on loopback.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent


def redis_benchmark(host: str, port: int, test: str, size: int, n: int, pipeline: int) -> float:
    """Requests per second of ``redis-benchmark -t test`` (one client, pipelined)."""
    out = subprocess.run(
        ["redis-benchmark", "-h", host, "-p", str(port), "-t", test, "-d", str(size),
         "-n", str(n), "-r", str(n), "-P", str(pipeline), "-c", "1", "--csv"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    rows = list(csv.reader(io.StringIO(out)))
    return float(next(r for r in rows if r and r[0].upper() == test.upper())[1])


def measure(store, payload: int, blocks: int, pipeline: int) -> dict[str, float]:
    from kvflow.tiers.entry import Miss

    host = bytearray(payload * blocks)  # the "host slots": one payload per block
    view = memoryview(host)
    for i in range(blocks):  # distinct, non-trivial contents
        view[i * payload : i * payload + 8] = i.to_bytes(8, "little")
    hashes = list(range(blocks))
    far = time.monotonic() + 3600

    wall, cpu = time.perf_counter(), time.thread_time()
    for start in range(0, blocks, pipeline):
        batch = [(h, [view[h * payload : (h + 1) * payload]]) for h in hashes[start : start + pipeline]]
        assert store.put(batch, far) == [None] * len(batch)
    store_s, store_cpu = time.perf_counter() - wall, time.thread_time() - cpu

    wall, cpu = time.perf_counter(), time.thread_time()
    for start in range(0, blocks, pipeline):
        batch_hashes = hashes[start : start + pipeline]
        for h, got in zip(batch_hashes, store.get(batch_hashes, far)):
            assert not isinstance(got, Miss), got
            view[h * payload : (h + 1) * payload] = got  # into its host slot
    load_s, load_cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return {
        "store_gbs": payload * blocks / store_s / 1e9,
        "load_gbs": payload * blocks / load_s / 1e9,
        "store_cpu_us": store_cpu / blocks * 1e6,
        "load_cpu_us": load_cpu / blocks * 1e6,
    }


def engine_thread_cost(url: str, payload: int, requests: int, blocks: int) -> dict[str, float]:
    """CPU time of the engine's own thread (``time.thread_time``: the remote tier's I/O thread
    is not counted) per block, for the same stores and lookups with and without the remote
    tier: the difference is what each remote block costs the engine."""
    import numpy as np

    from kvflow.core.config import Config
    from kvflow.engine.sync import SyncEngine
    from kvflow.executors.simulated import SimulatedExecutor, TransferModel, VirtualClock
    from kvflow.tiers.entry import Layout
    from kvflow.tiers.host_slots import SlotPages
    from kvflow.tiers.redis_store import RedisBlockStore, connect
    from kvflow.tiers.remote_executor import RemoteTierExecutor

    cpu_blocks = requests * blocks
    slots = SlotPages([np.zeros((cpu_blocks, payload), np.uint8)])
    layout = Layout(model="bench-engine", page_bytes=(payload,), block_tokens=16)

    def build(remote: bool) -> tuple[SyncEngine, VirtualClock]:
        clock = VirtualClock()
        executor: object = SimulatedExecutor(clock, TransferModel(payload, 50.0, 5.0))
        if remote:
            executor = RemoteTierExecutor(
                executor,
                lambda: RedisBlockStore(connect(url, timeout_s=10.0), layout, timeout_s=10.0),
                slots,
                job_deadline_ms=60_000.0,
            )
        config = Config(cpu_blocks=cpu_blocks, block_tokens=16, remote_blocks=cpu_blocks if remote else 0,
                        job_deadline_ms=60_000.0)  # fmt: skip
        return SyncEngine(config, executor, clock=clock, bytes_per_block=payload), clock

    def settle(engine: SyncEngine, clock: VirtualClock) -> None:
        probing = getattr(engine.executor, "probing", lambda: False)
        while probing():
            time.sleep(0.0005)
        engine.step()
        while engine.has_live_jobs():
            due = getattr(engine.executor, "inner", engine.executor).next_completion_ms()
            if due is not None:
                clock.advance_to(due)
            else:  # a remote job: its thread works while this one waits (no CPU, no idle steps)
                engine.executor.wait_results(10.0)  # type: ignore[attr-defined]
            engine.step()

    def chain(r: int) -> list[int]:
        return [r * blocks + i + 1 for i in range(blocks)]

    tokens = blocks * 16 + 1
    out: dict[str, float] = {}
    for remote in (False, True):
        writer, clock = build(remote)
        store_connection = RedisBlockStore(connect(url), layout)
        store_connection.client.flushall()  # the reader must find only what this writer stored
        store_connection.close()
        cpu = time.thread_time()
        for r in range(requests):
            writer.lookup(f"w{r}", chain(r), tokens)
            writer.blocks_computed(f"w{r}", chain(r), list(range(r * blocks, (r + 1) * blocks)))
            settle(writer, clock)
            writer.finish_request(f"w{r}")
        out["store_remote" if remote else "store_local"] = (time.thread_time() - cpu) / cpu_blocks * 1e6
        reader, rclock = build(remote)  # a second instance: its CPU tier is empty
        cpu = time.thread_time()
        for r in range(requests):
            for _ in range(4):  # probe, remote load, then the hit (without a remote tier: misses)
                reader.lookup(f"r{r}", chain(r), tokens)
                reader.accept_hits(f"r{r}", [])
                settle(reader, rclock)
            reader.finish_request(f"r{r}")
        out["load_remote" if remote else "load_local"] = (time.thread_time() - cpu) / cpu_blocks * 1e6
        if remote:
            out["remote_loaded"] = reader.counters.remote_blocks_loaded
        writer.close()
        reader.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server; default: start one")
    parser.add_argument("--payload-kib", default="64,256,1024")
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--pipeline", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engine-requests", type=int, default=64,
                        help="requests (of 32 blocks of 64 KiB) for the engine-thread cost")  # fmt: skip
    args = parser.parse_args()

    from kvflow.tiers.entry import HEADER_BYTES, Layout
    from kvflow.tiers.redis_store import RedisBlockStore, connect

    server = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from redis_servers import RedisServer

        server = RedisServer()
        url = server.url
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    try:
        print(f"server {url}, pipeline {args.pipeline}, one connection, best of {args.repeat}")
        print(f"{'payload':>8} {'blocks':>6} | {'SET GB/s':>8} {'store':>6} {'ratio':>5} "
              f"{'cpu us':>6} | {'GET GB/s':>8} {'load':>6} {'ratio':>5} {'cpu us':>6}")  # fmt: skip
        for kib in (int(k) for k in args.payload_kib.split(",")):
            payload = kib * 1024
            blocks = max(args.pipeline, args.total_mib * 1024 * 1024 // payload)
            layout = Layout(model="bench", page_bytes=(payload,), block_tokens=16)
            store = RedisBlockStore(connect(url, timeout_s=30.0), layout, timeout_s=30.0)
            best: dict[str, float] = {}
            for _ in range(args.repeat):
                store.client.flushall()
                size = payload + HEADER_BYTES
                set_rps = redis_benchmark(host, port, "set", size, blocks, args.pipeline)
                get_rps = redis_benchmark(host, port, "get", size, blocks, args.pipeline)
                store.client.flushall()
                got = measure(store, payload, blocks, args.pipeline)
                got["set_gbs"] = set_rps * payload / 1e9  # payload bytes, as kvflow's figure
                got["get_gbs"] = get_rps * payload / 1e9
                for key, value in got.items():
                    better = min if key.endswith("_us") else max
                    best[key] = better(best.get(key, value), value)
            store.client.flushall()
            store.close()
            print(
                f"{kib:>5}KiB {blocks:>6} | {best['set_gbs']:>8.2f} {best['store_gbs']:>6.2f} "
                f"{best['store_gbs'] / best['set_gbs']:>5.2f} {best['store_cpu_us']:>6.0f} | "
                f"{best['get_gbs']:>8.2f} {best['load_gbs']:>6.2f} "
                f"{best['load_gbs'] / best['get_gbs']:>5.2f} {best['load_cpu_us']:>6.0f}"
            )
        if args.engine_requests:
            engine_thread_cost(url, 64 * 1024, 4, 32)  # warm-up: imports, first connections
            runs = [engine_thread_cost(url, 64 * 1024, args.engine_requests, 32) for _ in range(args.repeat)]
            cost = {key: min(run[key] for run in runs) for key in runs[0]}
            assert cost["remote_loaded"] == args.engine_requests * 32, cost
            print(
                "engine thread CPU per block (us), 64 KiB blocks: "
                f"store {cost['store_local']:.1f} without the remote tier, {cost['store_remote']:.1f} with it "
                f"(+{cost['store_remote'] - cost['store_local']:.1f} per write-through block); "
                f"lookups of another instance {cost['load_local']:.1f} without, {cost['load_remote']:.1f} with "
                f"(probe + remote load + hit: +{cost['load_remote'] - cost['load_local']:.1f} per remote block)"
            )
    finally:
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
