"""Peak memory and time of every ``kvflow`` verb that reads a trace, run on one trace (each verb
in a process of its own; its peak resident set from the kernel's accounting of that process).

A verb that streams stays within about the same peak whatever the trace's size; one that holds
the trace grows with it. ``tools/make_big_trace.py`` writes a large trace to run this on.

Usage: python tools/bench_trace_verbs.py TRACE [--verbs replay,incidents,...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# What each verb is given beyond the trace, so that it reads the whole trace ({out}: a file in a
# scratch folder; {job}: a job id the trace has). A verb of the group missing here is run with
# the trace alone.
VERB_ARGS: dict[str, list[list[str]]] = {
    "replay": [[], ["--redecide"]],
    "incidents": [["--json"]],
    "inspect": [["--job", "{job}"]],
    "kv-events": [[]],
    "report": [["--html", "{out}/report.html"]],
    "export": [["--chrome-trace", "{out}/trace.json"]],
    "explain": [["--all"]],
    "what-if": [[]],
}


def trace_verbs() -> list[str]:
    """The verbs of the ``kvflow`` group that take a TRACE argument."""
    import click

    from kvflow.cli.main import main

    ctx = click.Context(main)
    out = []
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        if command is not None and any(p.name == "trace" for p in command.params):
            out.append(name)
    return out


def run_one(args: list[str]) -> dict[str, Any]:
    """Run ``kvflow ARGS`` (output to /dev/null): exit status, seconds, peak RSS in MiB."""
    exe = [sys.executable, "-m", "kvflow.cli.main", *args]
    start = time.perf_counter()
    with open(os.devnull, "wb") as devnull:
        proc = subprocess.Popen(exe, stdout=devnull, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
    took = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "args": args,
        "exit": proc.returncode,
        "seconds": round(took, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # (Linux: KiB)
        "stderr": err.decode(errors="replace").strip().splitlines()[-1:] if proc.returncode else [],
    }


def first_job(trace: str) -> int:
    from kvflow.log.reader import TraceReader

    with TraceReader(trace) as reader:
        for _, rec in reader.records():
            job = getattr(rec, "job_id", None)
            if job is not None:
                return int(job)
    return 1


def bench(trace: str, verbs: list[str] | None = None) -> list[dict[str, Any]]:
    rows = []
    job = first_job(trace)
    with tempfile.TemporaryDirectory() as out:
        for verb in verbs or trace_verbs():
            for extra in VERB_ARGS.get(verb, [[]]):
                args = [verb, trace, *(a.format(out=out, job=job) for a in extra)]
                shown = " ".join([verb, *(a.format(out="OUT", job=job) for a in extra)])
                rows.append({"verb": shown, **run_one(args)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--verbs", help="comma-separated verbs (default: every verb taking a TRACE)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = bench(args.trace, args.verbs.split(",") if args.verbs else None)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    size = Path(args.trace).stat().st_size / (1 << 20)
    print(f"{args.trace}: {size:,.1f} MiB")
    print(f"{'verb':<40} {'exit':>4} {'seconds':>8} {'peak RSS MiB':>13}")
    for row in rows:
        print(f"{row['verb']:<40} {row['exit']:>4} {row['seconds']:>8.2f} {row['peak_rss_mib']:>13,.1f}")
        for line in row["stderr"]:
            print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
