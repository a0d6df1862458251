"""tools/make_big_trace.py writes a valid trace of the size asked for, and
tools/bench_trace_verbs.py runs every trace verb on it and reports each one's time and peak
memory; on a small trace here (the measurement on a 1 GB one: docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from kvflow.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def tool(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], check=True, capture_output=True, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    return done.stdout


def test_a_big_trace_is_valid_and_every_verb_is_measured_on_it(tmp_path: Path) -> None:
    trace = tmp_path / "big.jsonl"
    tool("tools/make_big_trace.py", str(trace), "--mb", "2")
    assert 2 << 20 <= trace.stat().st_size < 12 << 20  # (the writer hands records over 4,096 at a time)
    replayed = CliRunner().invoke(main, ["replay", str(trace), "--json"], catch_exceptions=False)
    assert replayed.exit_code == 0 and replayed.stderr == "", replayed.output
    assert json.loads(replayed.stdout)["checkpoints_verified"] >= 2
    found = json.loads(CliRunner().invoke(main, ["incidents", str(trace), "--json"]).stdout)
    assert found  # (its faults give the incident verbs something to find)

    rows = json.loads(tool("tools/bench_trace_verbs.py", str(trace), "--json"))
    verbs = {row["verb"].split()[0] for row in rows}
    assert {"replay", "incidents", "inspect", "kv-events", "report", "export"} <= verbs
    for row in rows:
        assert row["exit"] == 0, row
        assert row["seconds"] > 0 and 10 < row["peak_rss_mib"] < 1024, row
    table = tool("tools/bench_trace_verbs.py", str(trace), "--verbs", "replay,kv-events")
    assert "peak RSS MiB" in table and len(table.strip().splitlines()) == 2 + 3  # (replay: plain and --redecide)
