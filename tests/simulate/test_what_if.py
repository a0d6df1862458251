"""``kvflow what-if``: a trace's workload, rebuilt from its commands and rerun under another
configuration, gives on a ``kvflow simulate`` trace exactly what ``simulate`` gives for that
configuration on the original workload; the recording and the rerun are compared request by
request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvflow.cli.main import main
from kvflow.simulate.run import SimOptions, simulate
from kvflow.simulate.whatif import recorded_workload, what_if
from kvflow.simulate.workload import EXAMPLE_WORKLOAD, read_workload

TRACES = Path(__file__).resolve().parents[2] / "traces"
RECORDED = dict(cpu_blocks=256, policy="lru", fault_rate=0.05, seed=3)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("what-if") / "recorded.jsonl"
    simulate(str(EXAMPLE_WORKLOAD), SimOptions(**RECORDED, record=str(path)))
    return path


def same_figures(rerun: dict[str, Any], direct: dict[str, Any]) -> None:
    rerun = {k: v for k, v in rerun.items() if k not in ("trace", "device_hits")}
    direct = {k: v for k, v in direct.items() if k != "workload"}
    assert rerun == direct


def test_the_rebuilt_workload_is_the_workload(trace: Path) -> None:
    original = list(read_workload(EXAMPLE_WORKLOAD, 512))
    rebuilt = list(recorded_workload(trace))
    assert [r.request_id for r in rebuilt] == [f"r{r.line}" for r in original]
    assert [r.input_length for r in rebuilt] == [r.input_length for r in original]
    assert [r.hash_ids for r in rebuilt] == [r.hash_ids[: r.input_length // 512] for r in original]


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("cpu_blocks", [32, 128, 256, 600])
def test_what_if_gives_what_simulate_gives(trace: Path, policy: str, cpu_blocks: int) -> None:
    rerun = what_if(trace, {"cpu_blocks": cpu_blocks, "policy": policy})
    direct = simulate(str(EXAMPLE_WORKLOAD), SimOptions(**{**RECORDED, "cpu_blocks": cpu_blocks, "policy": policy}))
    same_figures(rerun, direct)


@pytest.mark.parametrize(
    "changes",
    [dict(store="lazy", device_blocks=64), dict(disk_gb=0.5, cpu_blocks=64), dict(fault_rate=0.0), dict(mode="timed")],
    ids=["lazy-device", "disk", "no-faults", "timed"],
)
def test_what_if_of_other_settings_gives_what_simulate_gives(trace: Path, changes: dict[str, Any]) -> None:
    rerun = what_if(trace, changes)
    direct = simulate(str(EXAMPLE_WORKLOAD), SimOptions(**{**RECORDED, **changes}))
    if changes.get("mode") == "timed":  # (arrivals come from the engine times the trace recorded)
        assert rerun["requests"] == direct["requests"] and rerun["prompt_tokens"] == direct["prompt_tokens"]
        return
    same_figures(rerun, direct)


def run(*args: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_unchanged_it_is_the_recording(trace: Path) -> None:
    out = run("what-if", trace, "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["recorded"] == data["what_if"] and data["requests_changed"] == 0
    assert data["recorded"]["failed_jobs"] > 0  # (the seeded faults were rerun as recorded)


def test_the_verb_side_by_side(trace: Path, tmp_path: Path) -> None:
    rerun_trace = tmp_path / "rerun.jsonl"
    out = run("what-if", trace, "--cpu-blocks", 600, "--policy", "arc", "--json", "--record", rerun_trace)
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    direct = simulate(str(EXAMPLE_WORKLOAD), SimOptions(**{**RECORDED, "cpu_blocks": 600, "policy": "arc"}))
    for key in ("requests", "prompt_tokens", "hit_tokens", "cpu_hit_tokens", "stored_blocks", "loaded_blocks",
                "evicted_blocks", "failed_jobs", "bytes_stored", "bytes_loaded"):
        assert data["what_if"][key] == direct[key], key
    changed = data["changed"]
    assert data["requests_changed"] == len(changed) > 0
    assert all(c["what_if_hit_tokens"] - c["recorded_hit_tokens"] == c["delta_hit_tokens"] != 0 for c in changed)
    assert sum(c["delta_hit_tokens"] for c in changed) == data["what_if"]["hit_tokens"] - data["recorded"]["hit_tokens"]
    table = run("what-if", trace, "--cpu-blocks", 600, "--policy", "arc")
    assert "requests changed" in table.output and "hit tokens" in table.output
    assert run("explain", rerun_trace, "--request", changed[0]["request_id"]).exit_code == 0


def test_an_engine_trace_keeps_its_device_hits_and_is_deterministic() -> None:
    golden = TRACES / "clean.jsonl"
    first = run("what-if", golden, "--cpu-blocks", 96, "--json")
    second = run("what-if", golden, "--cpu-blocks", 96, "--json")
    assert first.exit_code == 0, first.output
    assert first.output == second.output
    data = json.loads(first.output)
    assert data["device_hits"] == "as recorded"
    assert data["what_if"]["requests"] == data["recorded"]["requests"] > 0
    assert data["what_if"]["device_hit_tokens"] == data["recorded"]["device_hit_tokens"]


@pytest.mark.parametrize(
    "args",
    [["--policy", "mru"], ["--cpu-blocks", "-1"], ["--cpu-gb", "1", "--cpu-blocks", "2"],
     ["--disk-latency-us", "5"], ["--record", "{trace}"]],
    ids=["policy", "negative", "twice", "disk model without a disk", "record over the trace"],
)
def test_bad_options_are_one_line(trace: Path, args: list[str]) -> None:
    before = trace.read_bytes()
    out = run("what-if", trace, *(a.format(trace=trace) for a in args))
    assert trace.read_bytes() == before
    assert out.exit_code == 2 and out.output.count("\n") == 1 and "Traceback" not in out.output, out.output


def test_a_bad_trace_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "kvflow-trace", "version": 4, "kvflow": "0", "config": {"cpu_blocks": 4}}\n{"type": 1}\n')
    out = run("what-if", bad)
    assert out.exit_code == 2 and out.output.count("\n") == 1 and f"{bad}:2" in out.output, out.output
