"""tools/bench_remote.py, quickly, against a real redis-server: it prints its table (kvflow beside
redis-benchmark, per value size and protection mode) and the engine thread's CPU per block."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("xxhash")
from redis_servers import require_redis  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_bench_prints_its_table() -> None:
    require_redis("redis-benchmark")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_remote.py"), "--quick"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    row = re.search(r"256KiB\s+none\s+\d+ \|\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) \|\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out.stdout)
    assert row, out.stdout
    assert all(float(x) > 0 for x in row.groups()), out.stdout
    cost = re.search(r"compute \+ store ([\d.]+) without a remote tier, ([\d.]+) with it", out.stdout)
    assert cost and float(cost[2]) > 0, out.stdout
