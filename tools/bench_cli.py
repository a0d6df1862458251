"""Benchmark of the kvflow CLI (issue 4's performance targets), measured in one run:

  * start-up: ``kvflow --version`` wall time, median of 10 runs (target < 0.5 s, no torch);
  * replay: ``kvflow replay`` of a trace of >= 1,000,000 events (target >= 300,000 events/s);
  * simulate throughput: requests/s of ``kvflow simulate`` on the Mooncake synthetic trace
    (``../shared/traces``) in sequential and timed mode, and on the bundled example.

Usage: python tools/bench_cli.py [--events N] [--keep TRACE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
EXAMPLE = ROOT / "kvflow" / "simulate" / "example.jsonl"


def kvflow_cmd() -> list[str]:
    exe = shutil.which("kvflow", path=str(Path(sys.executable).parent)) or shutil.which("kvflow")
    return [exe] if exe else [sys.executable, "-m", "kvflow.cli.main"]


def bench_startup(runs: int = 10) -> tuple[float, bool]:
    cmd = kvflow_cmd() + ["--version"]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, kvflow.cli.main; print('torch' in sys.modules)"],
        check=True,
        capture_output=True,
        text=True,
    )
    return statistics.median(times), probe.stdout.strip() == "False"


def make_trace(path: str, min_events: int) -> int:
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_core import engine_like_run

    from kvflow.core.config import Config
    from kvflow.engine.manager import OffloadManager
    from kvflow.log.writer import TraceWriter

    config = Config(cpu_blocks=4096, block_tokens=16)
    writer = TraceWriter(path, config, checkpoint_every=10_000)
    manager = OffloadManager(config, log=writer)
    seed = 0
    while manager.state.last_seq < min_events:
        engine_like_run(manager, 5_000, seed=seed)
        seed += 1
    manager.close()
    return manager.state.last_seq


def bench_replay(path: str) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    out = subprocess.run(kvflow_cmd() + ["replay", path, "--json"], capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"replay failed ({out.returncode}): {out.stderr.strip()}")
    result = json.loads(out.stdout)
    return result["events"] / elapsed, result["events"], elapsed


def bench_simulate(workload: Path, extra: list[str]) -> tuple[float, int, float]:
    cmd = kvflow_cmd() + ["simulate", str(workload), "--json", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"simulate failed ({out.returncode}): {out.stderr.strip()}")
    summary = json.loads(out.stdout)
    return summary["requests"] / elapsed, summary["requests"], elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keep", default=None, help="keep the generated trace at this path")
    args = parser.parse_args()
    rows: list[tuple[str, str, str, str]] = []
    ok = True

    startup, no_torch = bench_startup()
    passed = startup < 0.5 and no_torch
    ok &= passed
    rows.append(("start-up", f"{startup * 1000:.0f} ms (torch imported: {not no_torch})", "< 500 ms", "PASS" if passed else "MISS"))

    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or os.path.join(tmp, "million.jsonl")
        t0 = time.perf_counter()
        events = make_trace(path, args.events)
        made = time.perf_counter() - t0
        size = os.path.getsize(path)
        rate, replayed, elapsed = bench_replay(path)
        passed = rate >= 300_000 and replayed >= args.events
        ok &= passed
        rows.append(
            (
                "replay",
                f"{rate:,.0f} events/s ({replayed:,} events, {size / 1e6:.0f} MB, {elapsed:.1f} s wall)",
                ">= 300,000/s",
                "PASS" if passed else "MISS",
            )
        )
        rows.append(("  (trace written by the engine)", f"{events / made:,.0f} events/s while recording", "", ""))

    workloads = [(SHARED_TRACE, "mooncake synthetic")] if SHARED_TRACE.exists() else []
    workloads.append((EXAMPLE, "bundled example"))
    for workload, name in workloads:
        for mode in ("sequential", "timed"):
            rps, n, elapsed = bench_simulate(workload, ["--cpu-blocks", "2000", "--device-blocks", "500", "--mode", mode, "--fault-rate", "0.01", "--seed", "1"])
            rows.append((f"simulate {mode}", f"{rps:,.0f} requests/s ({n:,} requests of the {name} in {elapsed:.2f} s)", "", ""))

    print(f"kvflow bench_cli · python {sys.version.split()[0]}")
    width = max(len(r[0]) for r in rows)
    for name, result, target, status in rows:
        print(f"{name:<{width}}  {result:<70} {target:<14} {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
