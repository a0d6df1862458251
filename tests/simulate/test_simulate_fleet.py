"""``kvflow simulate --instances N``: the fleet runs the real decision code per instance; a
shared remote tier only adds hits, and one instance without it is the plain simulation."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvflow.cli.main import main
from kvflow.core.errors import ConfigError
from kvflow.simulate.fleet import run_fleet, simulate_fleet
from kvflow.simulate.run import SimOptions, simulate
from kvflow.simulate.workload import EXAMPLE_WORKLOAD

OPTIONS = SimOptions(cpu_blocks=50)


def test_one_instance_without_a_remote_tier_is_the_plain_simulation() -> None:
    plain = simulate(str(EXAMPLE_WORKLOAD), SimOptions(cpu_blocks=50))
    fleet = run_fleet(str(EXAMPLE_WORKLOAD), OPTIONS, 1, "round-robin", 0)
    for key in ("requests", "prompt_tokens", "hit_tokens", "cpu_hit_tokens", "device_hit_tokens"):
        assert fleet[key] == plain[key], key
    assert fleet["remote_hit_tokens"] == 0 and fleet["remote_bytes_stored"] == 0


@pytest.mark.parametrize("routing", ["round-robin", "session"])
def test_a_shared_tier_serves_what_other_instances_stored(routing: str) -> None:
    out = simulate_fleet(str(EXAMPLE_WORKLOAD), OPTIONS, 4, routing, 1000)
    shared, local = out["shared"], out["local"]
    assert shared["requests"] == local["requests"] == 200
    assert shared["hit_tokens"] > local["hit_tokens"]
    assert shared["remote_hit_tokens"] > 0 and local["remote_hit_tokens"] == 0
    assert shared["remote_bytes_loaded"] >= shared["remote_hit_tokens"] // 512 * OPTIONS.bytes_per_block
    assert 0 < shared["remote_bytes_held"] <= 1000 * OPTIONS.bytes_per_block
    assert simulate_fleet(str(EXAMPLE_WORKLOAD), OPTIONS, 4, routing, 1000) == out  # deterministic


def test_session_routing_beats_round_robin_without_a_shared_tier() -> None:
    rr = run_fleet(str(EXAMPLE_WORKLOAD), OPTIONS, 4, "round-robin", 0)
    session = run_fleet(str(EXAMPLE_WORKLOAD), OPTIONS, 4, "session", 0)
    assert session["hit_tokens"] > rr["hit_tokens"]


def test_a_tiny_shared_tier_holds_no_more_than_its_capacity() -> None:
    out = run_fleet(str(EXAMPLE_WORKLOAD), OPTIONS, 4, "round-robin", 3)
    assert out["remote_bytes_held"] == 3 * OPTIONS.bytes_per_block
    assert out["remote_bytes_stored"] > out["remote_bytes_held"]  # the rest was evicted


@pytest.mark.parametrize(
    "args, message",
    [
        (["--instances", "0"], "--instances must be a whole number within 1..1024"),
        (["--instances", "2", "--remote-blocks", "0"], "--remote-blocks must be a whole number > 0"),
        (["--instances", "2", "--mode", "timed"], "--instances runs the sequential mode"),
    ],
)
def test_bad_fleet_options_are_one_line_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["simulate", str(EXAMPLE_WORKLOAD), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_cli_json() -> None:
    result = CliRunner().invoke(
        main, ["simulate", str(EXAMPLE_WORKLOAD), "--cpu-blocks", "50", "--instances", "3", "--routing", "session", "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["instances"] == 3 and out["remote_blocks"] == 500
    assert out["shared"]["hit_rate"] >= out["local"]["hit_rate"]


def test_fleet_refuses_bad_input_before_any_work() -> None:
    with pytest.raises(ConfigError):
        simulate_fleet(str(EXAMPLE_WORKLOAD), OPTIONS, 2, "sticky", 10)


def test_a_block_the_shared_tier_dropped_fails_its_remote_load_once() -> None:
    from kvflow.core.config import Config
    from kvflow.engine.sync import SyncEngine
    from kvflow.executors.simulated import SimulatedExecutor, TransferModel, VirtualClock
    from kvflow.tiers.simulated_remote import SimulatedRemoteExecutor, SimulatedRemoteStore

    store = SimulatedRemoteStore(1)
    store.put([1, 2])  # 1 is dropped (LRU)
    clock = VirtualClock()
    executor = SimulatedRemoteExecutor(SimulatedExecutor(clock, TransferModel(1024, 10.0, 1.0)), store, clock)
    engine = SyncEngine(Config(cpu_blocks=4, block_tokens=4, remote_blocks=8), executor, clock=clock, keep_log=True)
    engine.manager.remote_found([1, 2])  # what an earlier probe said
    assert engine.lookup("r", [1, 2], 9) == 0
    engine.step()  # submits the remote load
    engine.step()  # its failure
    assert engine.counters.jobs_failed == 1 and not engine.has_live_jobs()
    assert 1 not in engine.manager.state.remote
    assert engine.lookup("r", [1, 2], 9) == 0 and engine.manager.state.jobs == {}  # no loop
    engine.close()


def test_ahead_of_eviction_mode_shares_blocks_too() -> None:
    from dataclasses import replace

    ahead = run_fleet(str(EXAMPLE_WORKLOAD), replace(OPTIONS, remote_store_mode="ahead_of_eviction"), 4, "round-robin", 1000)
    local = run_fleet(str(EXAMPLE_WORKLOAD), OPTIONS, 4, "round-robin", 0)
    assert ahead["remote_hit_tokens"] > 0 and ahead["hit_tokens"] > local["hit_tokens"]
    result = CliRunner().invoke(
        main, ["simulate", str(EXAMPLE_WORKLOAD), "--cpu-blocks", "50", "--instances", "4", "--remote-blocks", "1000",
               "--remote-store", "ahead-of-eviction", "--json"],
    )  # fmt: skip
    assert json.loads(result.output)["shared"]["hit_tokens"] == ahead["hit_tokens"]


def test_a_fleet_reports_the_failed_jobs_of_every_instance() -> None:
    """Faults injected into a fleet's instances show in its results: every injected fault
    fails one job (without a shared tier nothing else fails or times out), and each
    instance draws faults of its own rather than failing the same jobs as the others."""
    faulty = SimOptions(cpu_blocks=50, fault_rate=0.1, seed=3)
    out = simulate_fleet(str(EXAMPLE_WORKLOAD), faulty, 4, "round-robin", 500)
    local, shared = out["local"], out["shared"]
    assert local["failed_jobs"] == local["faults_injected"] > 0
    assert shared["failed_jobs"] >= shared["faults_injected"] > 0
    result = CliRunner().invoke(
        main, ["simulate", "--example", "--cpu-blocks", "50", "--instances", "4", "--fault-rate", "0.1", "--seed", "3"]
    )
    row = next(line for line in result.output.splitlines() if "failed jobs" in line)
    assert f"{shared['failed_jobs']} (timed out" in row and f"{local['failed_jobs']} (timed out" in row
    from kvflow.simulate.fleet import FleetInstance, instance_seed

    seeds = {instance_seed(3, i) for i in range(4)}
    assert len(seeds) == 4 and instance_seed(3, 0) == 3
    draws = []
    for i in range(2):
        sim = FleetInstance(SimOptions(cpu_blocks=50, fault_rate=0.5, seed=instance_seed(3, i)), None)
        draws.append([sim.copies.rng.random() for _ in range(8)])
    assert draws[0] != draws[1]


def test_a_fleet_of_one_with_faults_is_the_plain_simulation() -> None:
    faulty = SimOptions(cpu_blocks=50, fault_rate=0.1, seed=5)
    plain = simulate(str(EXAMPLE_WORKLOAD), faulty)
    fleet = run_fleet(str(EXAMPLE_WORKLOAD), faulty, 1, "round-robin", 0)
    assert plain["failed_jobs"] > 0
    for key in ("hit_tokens", "failed_jobs", "timed_out_jobs", "jobs"):
        assert fleet[key] == plain[key], key
