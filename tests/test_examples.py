"""The tools the documentation points at keep working (its examples run in tests/test_docs.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_core_quick_runs_and_prints_every_measure() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_core.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # exit 1 only means a target was missed on this (shared, small) machine
    assert out.returncode in (0, 1), out.stderr
    for measure in ("fold", "trace replay", "engine step"):
        assert measure in out.stdout


def test_bench_core_side_by_side_measures_both_checkouts_in_turn(tmp_path: Path) -> None:
    # this checkout against itself: both sides run, each imports the kvflow it was given
    bench = str(ROOT / "tools" / "bench_core.py")
    out = subprocess.run(
        [sys.executable, bench, "--quick", "--only", "fold", "--rounds", "2", "--against", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("fold")]
    assert "this is" in row and "as fast (medians of 2)" in row
    refused = subprocess.run(
        [sys.executable, bench, "--quick", "--against", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"bench_core: --against {tmp_path}: not a kvflow checkout (no kvflow/__init__.py there)"
    ]


def test_the_documented_executor_imports_work() -> None:
    """docs/executor.md imports the job and result types from ``kvflow`` and the rank group
    from ``kvflow.executors``: the names the engine and the executors use."""
    import kvflow.core.commands
    import kvflow.core.jobs
    from kvflow import JobResult, TransferJob

    assert JobResult is kvflow.core.commands.JobResult and TransferJob is kvflow.core.jobs.TransferJob
    pytest.importorskip("torch")
    from kvflow.executors import RandomKV, RankGroup

    assert RankGroup.__module__ == RandomKV.__module__ == "kvflow.executors.torch.ranks"
