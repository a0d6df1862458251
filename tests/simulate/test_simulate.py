"""``kvflow simulate``'s engine against the independent model of DESIGN §7 (tests/reference_sim.py).

The bundled example workload is compared on a grid of configurations; the real (third-party)
Mooncake trace, read from ``../shared/traces/``, on a few, and for speed, the timed mode, ARC,
recording and determinism across hash seeds.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reference_sim import reference_simulate

from kvflow.core.errors import ConfigError
from kvflow.replay.fold import replay
from kvflow.simulate.run import SUMMARY_KEYS, SimOptions, simulate
from kvflow.simulate.workload import EXAMPLE_WORKLOAD

REPO = Path(__file__).resolve().parents[2]
MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.exists(), reason=f"{MOONCAKE} not present")

def ours(path: Path, **kw: object) -> dict[str, object]:
    return simulate(str(path), SimOptions(**kw))  # type: ignore[arg-type]


def theirs(path: Path, *, cpu_blocks: int, device_blocks: int = 0, store: str = "eager",
           block_tokens: int = 512, fault_rate: float = 0.0, seed: int = 0) -> dict[str, int]:
    return reference_simulate(path, cpu_blocks, device_blocks, store, block_tokens, fault_rate, seed)


def counters(summary: dict[str, object]) -> dict[str, object]:
    return {k: summary[k] for k in SUMMARY_KEYS}


# cpu_blocks x device_blocks x store x (fault_rate, seed). The 32-block tier behind a 64-block
# device cache is the cell where a store evicts the request's own device-hit blocks, which §7
# then stores again at their turn (see test_the_store_rule_on_a_three_request_workload).
_FAULTS = [(0.0, 0), (0.1, 0), (0.1, 1)]
_GRID = []
for _cpu, _dev, _store, (_rate, _seed) in itertools.product([0, 32, 256, 10000], [0, 64], ["eager", "lazy"], _FAULTS):
    _GRID.append(pytest.param(_cpu, _dev, _store, _rate, _seed,
                              id=f"cpu{_cpu}-dev{_dev}-{_store}-p{_rate}-s{_seed}"))


@pytest.mark.parametrize(("cpu_blocks", "device_blocks", "store", "fault_rate", "seed"), _GRID)
def test_example_workload_matches_the_reference(
    cpu_blocks: int, device_blocks: int, store: str, fault_rate: float, seed: int
) -> None:
    kw = dict(cpu_blocks=cpu_blocks, device_blocks=device_blocks, store=store, fault_rate=fault_rate, seed=seed)
    got = counters(ours(EXAMPLE_WORKLOAD, **kw))
    assert got == theirs(EXAMPLE_WORKLOAD, **kw)  # type: ignore[arg-type]
    assert got["requests"] == 200


def test_example_workload_numbers_pinned_by_its_readme() -> None:
    """EXAMPLE_WORKLOAD's docstring: 256 blocks hit 865,792 of 1,198,285 tokens, 298 evictions;
    an unbounded tier hits 950,272."""
    s = ours(EXAMPLE_WORKLOAD, cpu_blocks=256)
    assert (s["hit_tokens"], s["prompt_tokens"], s["evicted_blocks"]) == (865_792, 1_198_285, 298)
    assert ours(EXAMPLE_WORKLOAD, cpu_blocks=10_000)["hit_tokens"] == 950_272


def test_the_store_rule_on_a_three_request_workload(tmp_path: Path) -> None:
    """The smallest case of the divergence, worked by hand (4-token blocks, 2 CPU blocks, lazy,
    no device cache, so every full block is offered for storage at the end of its request):

    1. [1, 2]: stores 2 then 1 (eviction order) -> tier [2, 1].
    2. [1, 2, 3]: hits 1, 2; offers 3, 2, 1. 2 and 1 are on the tier; 3 could only evict 2 or
       1, blocks of the very store (F16: before it, 3 evicted 2, 2 was stored again evicting
       1, and 1 was rejected, leaving [3, 2]), so 3 is rejected and the tier stays [2, 1].
    3. [1, 2, 3]: hits 1, 2 again.
    """
    path = tmp_path / "w.jsonl"
    rows = [(9, [1, 2, 100]), (13, [1, 2, 3, 101]), (13, [1, 2, 3, 102])]
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
        for i, (n, ids) in enumerate(rows)
    ))
    want = theirs(path, cpu_blocks=2, store="lazy", block_tokens=4)
    assert (want["hit_tokens"], want["stored_blocks"], want["evicted_blocks"]) == (16, 2, 0)
    assert counters(ours(path, cpu_blocks=2, store="lazy", block_tokens=4)) == want


_MOONCAKE_CONFIGS = [
    pytest.param(dict(cpu_blocks=2000), id="cpu2000-eager"),
    pytest.param(dict(cpu_blocks=500, device_blocks=200, store="lazy", fault_rate=0.1, seed=3), id="cpu500-dev200-lazy-faults"),
    pytest.param(dict(cpu_blocks=10_000, device_blocks=1000, fault_rate=0.05, seed=1), id="cpu10000-dev1000-faults"),
    pytest.param(dict(cpu_blocks=100, store="lazy"), id="cpu100-lazy"),
]


@needs_mooncake
@pytest.mark.parametrize("kw", _MOONCAKE_CONFIGS)
def test_mooncake_trace_matches_the_reference(kw: dict[str, object]) -> None:
    got = counters(ours(MOONCAKE, **kw))
    assert got == theirs(MOONCAKE, **kw)  # type: ignore[arg-type]
    assert got["requests"] == 3993


@needs_mooncake
def test_the_whole_mooncake_trace_simulates_fast() -> None:
    start = time.perf_counter()
    s = ours(MOONCAKE, cpu_blocks=2000, device_blocks=500, fault_rate=0.05, seed=1)
    elapsed = time.perf_counter() - start
    assert s["requests"] == 3993
    assert elapsed < 30, f"{elapsed:.1f} s"


# --- timed mode -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workload() -> Path:
    return MOONCAKE if MOONCAKE.exists() else EXAMPLE_WORKLOAD


def test_timed_mode_reports_latency_and_is_deterministic(workload: Path) -> None:
    kw = dict(cpu_blocks=1000, device_blocks=100, mode="timed", fault_rate=0.05, seed=4)
    a, b = ours(workload, **kw), ours(workload, **kw)
    assert a == b
    sequential = ours(workload, cpu_blocks=1000, device_blocks=100)
    assert (a["requests"], a["prompt_tokens"]) == (sequential["requests"], sequential["prompt_tokens"])
    p50, p90, p99 = a["load_p50_ms"], a["load_p90_ms"], a["load_p99_ms"]
    assert isinstance(p50, float) and isinstance(p90, float) and isinstance(p99, float)
    assert 0 < p50 <= p90 <= p99
    # a load moves at least one 2 MiB block at 55.5 GB/s after 20 µs of latency
    assert p50 >= 0.02 + 2 * 1024 * 1024 / 55.5e9 * 1e3 - 1e-9
    assert a["failed_jobs"] > 0 and a["mode"] == "timed"
    assert "load_p50_ms" not in sequential
    assert ours(workload, **{**kw, "seed": 5}) != a  # the seed matters


def test_timed_mode_with_hung_jobs_finishes_every_request(workload: Path) -> None:
    s = ours(workload, cpu_blocks=500, mode="timed", hang_jobs=(2, 9), job_deadline_ms=50.0)
    assert s["timed_out_jobs"] == 2
    assert s["requests"] == ours(workload, cpu_blocks=500)["requests"]


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_a_nonpositive_prefill_rate_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError):
        SimOptions(cpu_blocks=10, mode="timed", prefill_tokens_per_ms=bad).validate()


def test_a_nan_prefill_rate_is_refused() -> None:
    with pytest.raises(ConfigError):
        SimOptions(cpu_blocks=10, mode="timed", prefill_tokens_per_ms=float("nan")).validate()


# --- policies -------------------------------------------------------------------------------


@needs_mooncake
def test_arc_runs_and_differs_from_lru_at_2000_blocks() -> None:
    lru = ours(MOONCAKE, cpu_blocks=2000, policy="lru")
    arc = ours(MOONCAKE, cpu_blocks=2000, policy="arc")
    assert arc["requests"] == lru["requests"] == 3993
    assert arc["prompt_tokens"] == lru["prompt_tokens"]
    assert arc["hit_tokens"] != lru["hit_tokens"]
    assert arc["config"]["policy"] == "arc"  # type: ignore[index]
    assert 0 < arc["hit_tokens"] <= arc["prompt_tokens"]  # type: ignore[operator]


# --- recording -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sequential", "timed"])
def test_a_recorded_simulation_replays_and_redecides_clean(workload: Path, tmp_path: Path, mode: str) -> None:
    out = tmp_path / f"{mode}.jsonl"
    s = ours(workload, cpu_blocks=300, device_blocks=50, store="lazy", fault_rate=0.1, seed=2,
             mode=mode, hang_jobs=(3,), record=str(out))
    assert s["failed_jobs"] > 0 and s["timed_out_jobs"] == 1
    result = replay(out, redecide=True)
    assert result.ok, result.divergence
    assert result.events == s["events"]
    assert result.checkpoints >= 1


# --- determinism across processes ---------------------------------------------------------


_SCRIPT = Path(sys.executable).with_name("kvflow")
KVFLOW = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-c", "from kvflow.cli.main import main; main()"]


def _run_cli(hash_seed: str, record: Path, workload: Path) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run(
        [*KVFLOW, "simulate", str(workload), "--cpu-blocks", "300",
         "--device-blocks", "50", "--fault-rate", "0.1", "--seed", "11", "--policy", "arc",
         "--record", str(record), "--json"],
        capture_output=True, text=True, env=env, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_same_seed_gives_identical_json_and_trace_bytes_under_two_hash_seeds(tmp_path: Path) -> None:
    first = _run_cli("1", tmp_path / "a.jsonl", EXAMPLE_WORKLOAD)
    second = _run_cli("4242", tmp_path / "b.jsonl", EXAMPLE_WORKLOAD)
    assert json.loads(first)["requests"] == 200
    assert first == second
    a, b = (tmp_path / "a.jsonl").read_bytes(), (tmp_path / "b.jsonl").read_bytes()
    assert len(a) > 10_000
    assert a == b
