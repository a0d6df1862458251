"""Kill trace writers at random points and check what they leave (issue 11 item 3).

Each round starts a child process that runs an engine-like workload (``bench_core``'s requests
sharing prefixes, 5% failed copies) through an ``OffloadManager`` writing a trace, plain or gzip,
with the default flush policy or a write after every command, and SIGKILLs it after a random
delay. Then the trace must:

* read to its last complete record, without an error (a cut line or stream is a warning);
* hold exactly the first records of an uncut run of the same workload, byte for byte;
* replay clean, and re-decide clean (``--redecide`` stops at the last complete command);
* verify: every checkpoint on disk carries the right record digest.

Prints one line per failure (with the command that reproduces it) and a summary: kills, records
recovered (total, least, most), traces cut inside a line, and how many were still just the header.

``--flush-cost`` measures instead what the flush policy costs the writing engine: the same
run written with one write at the end, a write every 4,096 records (the default) and a write
after every command, interleaved, and the fsync at ``close()``.

Usage: python tools/crash_traces.py [--kills 120] [--seed 1] [--requests 4000] [--flush-cost]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

# The child: the workload of tools/bench_core.py writing a trace until it is killed (or ends).
CHILD = """
import sys
sys.path.insert(0, {tools!r})
from bench_core import engine_like_run
from kvflow.core.config import Config
from kvflow.log.writer import TraceWriter
from kvflow.engine.manager import OffloadManager
config = Config(cpu_blocks=512, block_tokens=16)
writer = TraceWriter(sys.argv[1], config, checkpoint_every=500, flush_records=int(sys.argv[4]))
manager = OffloadManager(config, log=writer)
print("started", flush=True)
engine_like_run(manager, int(sys.argv[2]), seed=int(sys.argv[3]))
manager.close()
"""


def run_child(path: str, requests: int, seed: int, flush: int, kill_after: float | None) -> float:
    """Run the writer; SIGKILL it ``kill_after`` seconds after it started writing. Returns how
    long it ran after starting to write."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(tools=str(ROOT / "tools")), path, str(requests), str(seed), str(flush)],
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    child.stdout.readline()  # the header is on disk from here on
    start = time.perf_counter()
    if kill_after is None:
        child.wait()
    else:
        try:
            child.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
    child.stdout.close()
    return time.perf_counter() - start


def plain_bytes(path: str) -> bytes:
    """The trace's text as far as it can be decompressed (all of it for a plain file)."""
    from kvflow.log.source import gzip_data

    with open(path, "rb") as raw:
        if not path.endswith(".gz"):
            return raw.read()
        out: list[bytes] = []
        try:
            for data in gzip_data(raw, 1 << 16):
                out.append(data)
        except EOFError:
            pass  # cut short: what came before is all there is
        return b"".join(out)


def check(path: str, reference: list[bytes]) -> tuple[int, bool, str | None]:
    """(records recovered, cut inside a line, problem or None) for a killed writer's trace."""
    from kvflow.core.errors import TraceError
    from kvflow.log.reader import TraceReader
    from kvflow.replay.fold import replay

    text = plain_bytes(path)
    whole = text[: text.rfind(b"\n") + 1].splitlines(keepends=True)
    rest = text[sum(map(len, whole)) :]
    cut = bool(rest)
    if cut and len(reference) > len(whole) and reference[len(whole)] == rest + b"\n":
        whole.append(reference[len(whole)])  # cut just before a newline: the record is whole
    if whole != reference[: len(whole)]:
        first = next(i for i, (a, b) in enumerate(zip(whole, reference)) if a != b)
        return 0, cut, f"line {first + 1} differs from the uncut run"
    try:
        with TraceReader(path) as reader:
            count = sum(1 for _ in reader.records())
        if reader.mismatch is not None:
            return count, cut, f"does not verify: {reader.mismatch}"
        if count != len(whole) - 1:
            return count, cut, f"read {count} records of {len(whole) - 1} complete lines"
        for redecide in (False, True):
            result = replay(path, redecide=redecide)
            if not result.ok:
                d = result.divergence
                assert d is not None
                return count, cut, f"replay{' --redecide' if redecide else ''}: {d.kind} at line {d.line}: {d.message}"
    except TraceError as exc:
        return 0, cut, f"unreadable: {exc}"
    return count, cut, None


def flush_cost(requests: int, repeat: int = 5) -> None:
    """Print what writing costs under three flush policies, plain and gzip: the time spent
    handing records to the file (``write_bytes``: the write calls, and the compression of a
    gzip trace), per record; and the fsync at ``close()``."""
    import statistics

    from bench_core import engine_like_run

    from kvflow.core.config import Config
    from kvflow.engine.manager import OffloadManager
    from kvflow.log.writer import TraceWriter

    config = Config(cpu_blocks=512, block_tokens=16)
    policies = {"one write at close": 1 << 62, "every 4,096 records": 4096, "every command": 1}
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:  # on the repository's disk, not tmpfs
        for suffix in (".jsonl", ".jsonl.gz"):
            path = os.path.join(tmp, "t" + suffix)
            spent: dict[str, list[float]] = {name: [] for name in policies}
            writes: dict[str, int] = {}
            syncs: list[float] = []
            records = 0
            for _ in range(repeat):
                for name, every in policies.items():
                    writer = TraceWriter(path, config, checkpoint_every=10_000, flush_records=every)
                    clock = [0.0, 0]
                    write = writer.write_bytes

                    def timed(blob: bytes, write=write, clock=clock) -> None:  # type: ignore[no-untyped-def]
                        t0 = time.perf_counter()
                        write(blob)
                        clock[0] += time.perf_counter() - t0
                        clock[1] += 1

                    writer.write_bytes = timed  # type: ignore[method-assign]
                    manager = OffloadManager(config, log=writer)
                    engine_like_run(manager, requests, seed=1)
                    writer.checkpoint(manager.state)
                    writer.flush()
                    t1 = time.perf_counter()
                    manager.close()  # nothing left to write: the fsync
                    syncs.append(time.perf_counter() - t1)
                    records = writer_records(path)
                    spent[name].append(clock[0])
                    writes[name] = int(clock[1])
            print(f"{suffix}: {requests} requests, {records:,} records, medians of {repeat}:")
            for name, values in spent.items():
                per = statistics.median(values) * 1e6 / records
                print(f"  {name:<22} {writes[name]:>6,} writes, {per:6.3f} µs per record writing")
            print(f"  fsync at close         {statistics.median(syncs) * 1e3:6.2f} ms")


def writer_records(path: str) -> int:
    from kvflow.log.reader import TraceReader

    with TraceReader(path) as reader:
        return sum(1 for _ in reader.records())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=120)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--flush-cost", action="store_true", help="measure the flush policy instead")
    args = parser.parse_args()
    if args.flush_cost:
        flush_cost(args.requests)
        return 0
    rng = random.Random(args.seed)
    recovered: list[int] = []
    failures = cut_lines = header_only = 0
    with tempfile.TemporaryDirectory() as tmp:
        references: dict[tuple[int, str], tuple[list[bytes], float]] = {}
        for i in range(args.kills):
            suffix = ".jsonl.gz" if i % 2 else ".jsonl"
            # the default policy (a write every 4,096 records), and a write after every command
            # (what the vLLM connector does each step): kills then land inside writes more often
            flush = 4096 if i % 4 < 2 else 1
            workload = rng.randrange(3)  # three workloads, each run once uncut as the reference
            if (workload, suffix) not in references:
                full = os.path.join(tmp, f"full{workload}{suffix}")
                took = run_child(full, args.requests, workload, 4096, None)
                references[(workload, suffix)] = (plain_bytes(full).splitlines(keepends=True), took)
            reference, took = references[(workload, suffix)]
            path = os.path.join(tmp, f"kill{i}{suffix}")
            run_child(path, args.requests, workload, flush, rng.uniform(0, took))
            count, cut, problem = check(path, reference)
            recovered.append(count)
            cut_lines += cut
            header_only += count == 0 and problem is None
            if problem is not None:
                failures += 1
                print(f"FAIL kill {i} ({suffix}, workload {workload}, flush every {flush}): {problem}")
                print(f"  reproduce: python tools/crash_traces.py --kills {i + 1} --seed {args.seed} --requests {args.requests}")
            os.remove(path)
    kills = len(recovered)
    print(
        f"{kills} writers killed (plain and gzip, a write every 4,096 records or every command): "
        f"{failures} failed; records recovered "
        f"{sum(recovered):,} in all, {min(recovered):,} to {max(recovered):,} a trace; "
        f"{cut_lines} cut inside a line, {header_only} still only the header"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
