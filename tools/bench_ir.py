"""Instructions per request of kvflow's side of ``tools/bench_vs_vllm.py``, counted by valgrind.

Wall-clock ratios on a shared 2-core VM move by 10-30% between runs, which hides any change
worth less than that. An instruction count does not move: valgrind's callgrind counts what
one pass of kvflow's side (``run_kvflow``: SyncEngine + SimulatedExecutor over the first
``--requests`` Mooncake requests) executes, minus a run that only does the setup, so two
commits can be compared exactly (``PYTHONHASHSEED=0``; a difference of 0.1% is real). It is a
proxy: a C-level dict operation and a bytecode count alike per instruction, not per
nanosecond. With ``--trace`` it prints the engine's thread apart: the trace writer hashes and
writes on its own thread, which runs beside the engine's where a core is free. Needs
``valgrind`` and what ``bench_vs_vllm.py`` needs (the anchor and the trace of ``../shared``;
vLLM itself is not imported).

``--vllm-src DIR`` (an unpacked vLLM 0.33.0 sdist, as for bench_vs_vllm.py) also counts vLLM's
side, the anchor's ``CPUOffloadingManager`` pass over the same requests, and prints kvflow /
vLLM in instructions. That ratio sits below the one of times: per instruction kvflow misses the
first-level caches about twice as often (docs/performance.md says why).

``--cache-sim`` runs cachegrind's cache and branch simulation instead of callgrind (slower)
and prints, per request, the instructions, the first-level data-cache misses and the
mispredicted branches of each side (every thread counted) and their ratios: what the
instruction ratio leaves out. The
simulated caches are cachegrind's model of this machine's, so the figures compare two sides or
two commits, not machines.

Usage: python tools/bench_ir.py [--policy lru|arc] [--requests 1500] [--trace] [--vllm-src DIR] [--cache-sim]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent

# one pass of kvflow's side over the first N requests (N = 0: the setup alone)
_PASS = """
import gc, sys
sys.path.insert(0, {tools!r})
import bench_vs_vllm as b
anchor = b.load_anchor(b.DEFAULT_ANCHOR)
trace = anchor.load_trace(b.DEFAULT_TRACE, b.BLOCK_TOKENS, None)
reqs = b.kvflow_requests(trace)[:{n}]
gc.collect(); gc.freeze()
b.run_kvflow({policy!r}, reqs, {path!r})
"""

# one pass of vLLM's side (the anchor's run_clean, as bench_vs_vllm.py times it) over the first
# N requests; every request is built in both runs, so the subtraction leaves the pass alone
_VLLM_PASS = """
import gc, sys
sys.path.insert(0, {tools!r})
import bench_vs_vllm as b
anchor = b.load_anchor(b.DEFAULT_ANCHOR)
vllm, base, manager_mod = anchor.import_vllm({src!r}, shim=True)
trace = anchor.load_trace(b.DEFAULT_TRACE, b.BLOCK_TOKENS, None)
reqs = anchor.build_requests(trace, b.BLOCK_TOKENS, True, base)[:{n}]
gc.collect(); gc.freeze()
mgr = manager_mod.CPUOffloadingManager(num_chunks=b.CAPACITY, cache_policy={policy!r}, enable_events=True)
anchor.run_clean(mgr, reqs, False, True, base.LookupResult.HIT)
"""


def instructions(code: str, tmp: str) -> tuple[int, int]:
    """(instructions of every thread, of the main thread: the engine's) of one pass."""
    out = os.path.join(tmp, "callgrind.out")
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
         sys.executable, "-c", code],
        capture_output=True, text=True, env=env,
    )
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"valgrind run failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}")
    main_thread = re.search(r"^(?:summary|totals): (\d+)", Path(out + "-01").read_text(), re.MULTILINE)
    if main_thread is None:
        raise SystemExit(f"{out}-01: no instruction total in callgrind's output for the main thread")
    return int(found.group(1)), int(main_thread.group(1))


# cachegrind's event names: what --cache-sim prints per request
_CACHE_EVENTS = {"D1 misses": ("D1mr", "D1mw"), "mispredicted branches": ("Bcm", "Bim")}


def cache_counts(code: str, tmp: str) -> dict[str, int]:
    """Instructions, first-level data-cache misses and mispredicted branches of one pass (every
    thread), from cachegrind's summary line."""
    out = os.path.join(tmp, "cachegrind.out")
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=yes", "--branch-sim=yes", f"--cachegrind-out-file={out}",
         sys.executable, "-c", code],
        capture_output=True, text=True, env=env,
    )
    text = Path(out).read_text() if proc.returncode == 0 and os.path.exists(out) else ""
    names = re.search(r"^events: (.+)$", text, re.MULTILINE)
    totals = re.search(r"^summary: (.+)$", text, re.MULTILINE)
    if names is None or totals is None:
        raise SystemExit(f"valgrind run failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}")
    by_name = dict(zip(names.group(1).split(), map(int, totals.group(1).split())))
    counts = {"instructions": by_name["Ir"]}
    for label, events in _CACHE_EVENTS.items():
        counts[label] = sum(by_name[e] for e in events)
    return counts


def per_request_counts(passes: list[str], n: int, tmp: str) -> dict[str, float]:
    """cache_counts of the pass over ``n`` requests minus that of the setup alone, per request."""
    base, full = (cache_counts(code, tmp) for code in passes)
    return {k: (full[k] - base[k]) / n for k in full}


def print_cache_sim(args: argparse.Namespace, tmp: str, path: str | None) -> None:
    n = args.requests
    passes = [_PASS.format(tools=str(TOOLS), n=k, policy=args.policy, path=path) for k in (0, n)]
    ours = per_request_counts(passes, n, tmp)
    theirs = None
    if args.vllm_src is not None:
        vllm_passes = [_VLLM_PASS.format(tools=str(TOOLS), n=k, policy=args.policy, src=args.vllm_src) for k in (0, n)]
        theirs = per_request_counts(vllm_passes, n, tmp)
    print(f"{args.policy}{' + trace' if args.trace else ''}: per request (first {n:,} requests, cachegrind's "
          "cache and branch simulation, setup subtracted, every thread)")
    print(f"  {'':<36}{'kvflow':>12}" + (f"{'vLLM':>12}{'kvflow / vLLM':>15}" if theirs else ""))
    for label, value in ours.items():
        row = f"  {label:<36}{value:>12,.0f}"
        if theirs:
            row += f"{theirs[label]:>12,.0f}{value / theirs[label]:>15.3f}"
        print(row)
    for label in _CACHE_EVENTS:
        row = f"  {label + ' per 1,000 instructions':<36}{1000 * ours[label] / ours['instructions']:>12.1f}"
        if theirs:
            row += f"{1000 * theirs[label] / theirs['instructions']:>12.1f}"
        print(row)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", choices=["lru", "arc"], default="lru")
    p.add_argument("--requests", type=int, default=1500, help="first N requests of the trace")
    p.add_argument("--trace", action="store_true", help="with the trace file being written")
    p.add_argument("--vllm-src", help="also count vLLM's side (an unpacked vLLM 0.33.0 sdist)")
    p.add_argument("--cache-sim", action="store_true", help="count data-cache misses and mispredicted branches too (cachegrind)")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    if args.requests <= 0:
        raise SystemExit("--requests must be > 0")
    if args.vllm_src is not None and not os.path.isdir(os.path.join(args.vllm_src, "vllm")):
        raise SystemExit(f"{args.vllm_src}: no vllm/ package there (pass an unpacked vLLM 0.33.0 sdist)")
    n = args.requests
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl") if args.trace else None
        if args.cache_sim:
            print_cache_sim(args, tmp, path)
            return 0
        passes = [_PASS.format(tools=str(TOOLS), n=k, policy=args.policy, path=path) for k in (0, n)]
        base, base_main = instructions(passes[0], tmp)
        full, full_main = instructions(passes[1], tmp)
        if args.vllm_src is not None:
            theirs = [_VLLM_PASS.format(tools=str(TOOLS), n=k, policy=args.policy, src=args.vllm_src) for k in (0, n)]
            vllm_per = (instructions(theirs[1], tmp)[0] - instructions(theirs[0], tmp)[0]) / n
    per, per_main = (full - base) / n, (full_main - base_main) / n
    print(f"{args.policy}{' + trace' if args.trace else ''}: {per:,.0f} instructions per request "
          f"(first {n:,} requests, callgrind, setup subtracted)")
    if per_main != per:
        print(f"  of which the engine's thread {per_main:,.0f}, the trace writer's thread {per - per_main:,.0f}")
    if args.vllm_src is not None:
        print(f"vLLM {args.policy}: {vllm_per:,.0f} instructions per request; kvflow / vLLM {per / vllm_per:.3f} "
              f"(the engine's thread: {per_main / vllm_per:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
