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

Usage: python tools/bench_ir.py [--policy lru|arc] [--requests 1500] [--trace]
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


def instructions(policy: str, n: int, trace_path: str | None, tmp: str) -> tuple[int, int]:
    """(instructions of every thread, of the main thread: the engine's) of one pass."""
    out = os.path.join(tmp, f"callgrind.{n}")
    code = _PASS.format(tools=str(TOOLS), n=n, policy=policy, path=trace_path)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", choices=["lru", "arc"], default="lru")
    p.add_argument("--requests", type=int, default=1500, help="first N requests of the trace")
    p.add_argument("--trace", action="store_true", help="with the trace file being written")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    if args.requests <= 0:
        raise SystemExit("--requests must be > 0")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl") if args.trace else None
        base, base_main = instructions(args.policy, 0, path, tmp)
        full, full_main = instructions(args.policy, args.requests, path, tmp)
    per, per_main = (full - base) / args.requests, (full_main - base_main) / args.requests
    print(f"{args.policy}{' + trace' if args.trace else ''}: {per:,.0f} instructions per request "
          f"(first {args.requests:,} requests, callgrind, setup subtracted)")
    if per_main != per:
        print(f"  of which the engine's thread {per_main:,.0f}, the trace writer's thread {per - per_main:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
