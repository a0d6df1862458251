"""The simulation with a disk tier below the CPU tier: ``sweep`` over the disk's size, and the
real (third-party) Mooncake trace, read from ``../shared/traces/`` beside the checkout, with its
figures per tier."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvflow.cli.main import main
from kvflow.core.errors import ConfigError
from kvflow.simulate.run import SimOptions, simulate, sweep
from kvflow.simulate.workload import EXAMPLE_WORKLOAD

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.exists(), reason=f"{MOONCAKE} not present")
LLAMA = SimOptions(model="llama3-8b", cpu_gb=1.0)


def test_a_disk_sweep_is_each_disk_run_alone() -> None:
    seen: list[tuple[str, float]] = []
    result = sweep(str(EXAMPLE_WORKLOAD), LLAMA, disk_gb=[0, 2, 10], policies=["lru"],
                   on_run=lambda p, c, s: seen.append((p, c)))  # fmt: skip
    assert seen == [("lru", 0), ("lru", 2), ("lru", 10)]
    assert (result["unit"], result["capacities"]) == ("disk GB", [0, 2, 10])
    for gb, summary in zip([0, 2, 10], result["results"]["lru"]):
        assert summary == simulate(str(EXAMPLE_WORKLOAD), replace(LLAMA, disk_gb=gb))
        assert summary["config"]["cpu_blocks"] == 14  # the CPU tier of the base, every time


def test_a_sweep_takes_one_kind_of_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvflow.simulate.run as sim

    runs: list[object] = []
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: runs.append(a))
    with pytest.raises(ConfigError, match="one kind"):
        sweep(str(EXAMPLE_WORKLOAD), LLAMA, cpu_gb=[1], disk_gb=[2])
    with pytest.raises(ConfigError, match="less than one block"):
        sweep(str(EXAMPLE_WORKLOAD), LLAMA, disk_gb=[2, 0.01])
    with pytest.raises(ConfigError, match="CPU tier"):  # a disk needs a CPU tier above it
        sweep(str(EXAMPLE_WORKLOAD), replace(LLAMA, cpu_gb=0.0), disk_gb=[2])
    assert runs == []
    sweep(str(EXAMPLE_WORKLOAD), LLAMA, disk_gb=[2], policies=["arc"])
    assert len(runs) == 1  # positive control: the spy sees a run


def test_the_timed_mode_waits_for_disk_runs_and_counts_their_hits() -> None:
    """Arrivals overlap: a request whose next blocks are on disk waits for their load (the
    disk's time), then loads them from the CPU tier; the hits split as in sequential mode."""
    without = simulate(str(EXAMPLE_WORKLOAD), replace(LLAMA, mode="timed"))
    timed = simulate(str(EXAMPLE_WORKLOAD), replace(LLAMA, disk_gb=10.0, mode="timed"))
    assert timed["hit_tokens_disk"] > 0 and timed["disk_loaded_blocks"] > 0
    assert timed["hit_tokens_cpu"] + timed["hit_tokens_disk"] == timed["cpu_hit_tokens"]
    assert timed["hit_tokens_disk"] <= timed["disk_loaded_blocks"] * LLAMA.block_tokens
    assert timed["hit_rate"] > without["hit_rate"]
    assert timed["disk_load_ms"] > 0 and timed["failed_jobs"] == 0


@needs_mooncake
def test_the_mooncake_trace_with_a_disk_tier_reports_each_tier() -> None:
    """64 GB of host memory above 256 GB of disk, Llama-3-8B's KV: the disk serves hits the CPU
    tier alone could not, and its time is its bytes over its bandwidth plus its latency."""
    base = SimOptions(model="llama3-8b", cpu_gb=64.0)
    alone = simulate(str(MOONCAKE), base)
    s = simulate(str(MOONCAKE), replace(base, disk_gb=256.0))
    assert s["requests"] == alone["requests"] == 3993
    assert s["hit_tokens_cpu"] + s["hit_tokens_disk"] == s["cpu_hit_tokens"]
    assert s["hit_tokens_disk"] > 0 and s["hit_rate"] > alone["hit_rate"]
    block = s["config"]["bytes_per_block"]
    assert s["config"]["disk_blocks"] == 256 * 10**9 // block
    assert s["disk_bytes_loaded"] == s["disk_loaded_blocks"] * block
    assert s["hit_tokens_disk"] <= s["disk_loaded_blocks"] * 512
    moved_ms = s["disk_bytes_loaded"] / 3e9 * 1000  # the default 3 GB/s
    assert moved_ms < s["disk_load_ms"] <= moved_ms + s["disk_loaded_blocks"] * 0.1  # + 100 µs a job at most

    out = CliRunner().invoke(main, ["simulate", str(MOONCAKE), "--model", "llama3-8b", "--cpu-gb", "64",
                                    "--disk-gb", "256"], env={"COLUMNS": "200"})  # fmt: skip
    assert out.exit_code == 0, out.output
    tiers = {}
    for text in out.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", text)[1:-1]]
        if len(cells) == 5:
            tiers[cells[0]] = cells[1:]
    assert tiers["disk tier"][0] == f"{s['hit_tokens_disk']:,} ({s['hit_tokens_disk'] / s['prompt_tokens']:.1%})"
    assert tiers["CPU tier"][0] == f"{s['hit_tokens_cpu']:,} ({s['hit_tokens_cpu'] / s['prompt_tokens']:.1%})"
    as_json: dict[str, Any] = json.loads(
        CliRunner().invoke(main, ["simulate", str(MOONCAKE), "--model", "llama3-8b", "--cpu-gb", "64",
                                  "--disk-gb", "256", "--json"]).stdout  # fmt: skip
    )
    assert {k: v for k, v in as_json.items() if k != "workload"} == {k: v for k, v in s.items() if k != "workload"}
