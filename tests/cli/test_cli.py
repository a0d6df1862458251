"""The ``kvflow`` command over the golden traces: replay, incidents, inspect, diagram, errors.

Expected numbers (incident counts, late results, recovery) are counted here straight from
the trace's JSON lines, independently of ``kvflow.inspect``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvflow.cli.main import main
from kvflow.core.state.tables import BLOCK_TRANSITIONS, JOB_TRANSITIONS

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "traces"
GOLDEN = sorted(p.name for p in TRACES.glob("*.jsonl"))
# recorded by an earlier build and kept as recorded (traces/README.md), not regenerated
RECORDED_EARLIER = ["clean_idle_ticks.jsonl", "clean_v2.jsonl", "clean_v3.jsonl"]
CONSISTENT = [name for name in GOLDEN if name != "divergent.jsonl"]
KVFLOW_SCRIPT = Path(sys.executable).with_name("kvflow")


def kvflow(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def records(name_or_path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line, record) for every line after the header, by plain json."""
    path = name_or_path if isinstance(name_or_path, Path) else TRACES / name_or_path
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(n, json.loads(text)) for n, text in enumerate(lines[1:], start=2)]


def of_type(name: str, *types: str) -> list[dict[str, Any]]:
    return [r for _, r in records(name) if r["type"] in types]


def one_line_error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert "\n" not in err, err
    assert err.startswith("kvflow: error: "), err
    assert "Traceback" not in result.output
    return err


def test_golden_traces_are_present() -> None:
    assert set(GOLDEN) >= {
        "clean.jsonl",
        "store_failures.jsonl",
        "load_failures.jsonl",
        "timeouts.jsonl",
        "finish_inflight.jsonl",
        "two_ranks.jsonl",
        "reset_inflight.jsonl",
        "divergent.jsonl",
    }
    for name in GOLDEN:
        size = (TRACES / name).stat().st_size
        events = sum(1 for _, r in records(name) if "seq" in r and r["type"] != "checkpoint")
        assert size < 300_000, name
        assert 100 <= events <= 2_000, (name, events)


# --- version and start-up ------------------------------------------------------------------


def test_version() -> None:
    from kvflow import __version__

    result = kvflow("--version")
    assert result.exit_code == 0
    assert result.output.strip() == f"kvflow {__version__}"


def test_installed_script_runs_and_imports_nothing_heavy() -> None:
    # (its start-up time is measured by tools/bench_cli.py, not asserted here)
    assert KVFLOW_SCRIPT.exists(), "kvflow is not installed in this environment"
    done = subprocess.run([str(KVFLOW_SCRIPT), "--version"], check=False, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("kvflow ")
    probe = (
        "import sys, kvflow.cli.main; "
        "print(sorted(m for m in ('torch', 'rich', 'numpy', 'kvflow.replay.fold', 'kvflow.core.state') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_help_lists_every_verb() -> None:
    result = kvflow("--help")
    assert result.exit_code == 0
    for verb in ("replay", "incidents", "inspect", "diagram", "simulate"):
        assert verb in result.output


# --- replay --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_trace_replays_clean(name: str) -> None:
    result = kvflow("replay", TRACES / name)
    assert result.exit_code == 0, result.output
    assert "consistent" in result.output
    assert result.stderr == ""


@pytest.mark.parametrize("name", CONSISTENT)
def test_golden_trace_redecides_clean(name: str) -> None:
    result = kvflow("replay", TRACES / name, "--redecide", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    events = [r for _, r in records(name) if "seq" in r and r["type"] != "checkpoint"]
    checkpoints = of_type(name, "checkpoint")
    assert data["ok"] and data["redecided"] and data["divergence"] is None
    assert data["events"] == len(events)
    assert data["last_seq"] == events[-1]["seq"]
    assert data["checkpoints_verified"] == len(checkpoints)
    assert data["digest"] == checkpoints[-1]["digest"]


def test_strict_replay_of_the_incident_traces() -> None:
    for name in (
        "store_failures.jsonl",
        "timeouts.jsonl",
        "two_ranks.jsonl",
        "reset_inflight.jsonl",
    ):
        result = kvflow("replay", TRACES / name, "--strict", "--redecide")
        assert result.exit_code == 0, (name, result.stdout)


def test_divergent_trace_folds_but_does_not_redecide() -> None:
    path = TRACES / "divergent.jsonl"
    assert kvflow("replay", path).exit_code == 0

    result = kvflow("replay", path, "--redecide")
    assert result.exit_code == 1
    as_json = kvflow("replay", path, "--redecide", "--json")
    assert as_json.exit_code == 1
    data = json.loads(as_json.stdout)
    divergence = data["divergence"]
    seq, line = divergence["seq"], divergence["line"]
    # the reported line is the recorded event with that seq, a capacity eviction
    recorded = dict(records(path))[line]
    assert recorded["seq"] == seq and recorded["type"] == "blocks_evicted"
    assert divergence["recorded"] == recorded
    assert divergence["produced"]["type"] == "blocks_evicted"
    assert divergence["produced"]["hashes"] != recorded["hashes"]
    assert divergence["command"]["type"] == "blocks_computed"
    assert (
        len(
            {
                divergence["digest_before"],
                divergence["digest_recorded"],
                divergence["digest_produced"],
            }
        )
        == 3
    )
    repro = f"kvflow replay {path} --redecide --until {seq}"
    assert data["repro"] == repro

    out = result.output
    assert f"at seq {seq} ({path}:{line})" in out
    assert "blocks_evicted differs in hashes, slots" in out
    assert "recorded" in out and "produced" in out and divergence["digest_before"] in out
    assert repro in out
    # everything before it agrees with today's code; the repro command reproduces it
    assert kvflow("replay", path, "--redecide", "--until", str(seq - 1)).exit_code == 0
    assert kvflow(*repro.split()[1:]).exit_code == 1


def test_until_stops_early() -> None:
    path = TRACES / "clean.jsonl"
    result = kvflow("replay", path, "--until", "100", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["last_seq"] == 100 and data["stopped_at"] == 100 and data["events"] == 100
    plain = kvflow("replay", path, "--until", "100")
    assert "consistent up to seq 100" in plain.output
    redecided = json.loads(kvflow("replay", path, "--until", "100", "--redecide", "--json").stdout)
    assert redecided["last_seq"] == 100 and redecided["digest"] == data["digest"]


def test_plain_summary_has_the_final_state() -> None:
    path = TRACES / "two_ranks.jsonl"
    data = json.loads(kvflow("replay", path, "--json").stdout)
    out = kvflow("replay", path).output
    assert f"seq {data['last_seq']}, digest {data['digest']}" in out
    assert f"{data['resident_blocks']} resident blocks, {data['free_slots']} free slots" in out
    assert f"{data['checkpoints_verified']} verified" in out
    assert f"{data['live_jobs']} live jobs" in out


def test_a_violated_checkpoint_is_reported_with_context(tmp_path: Path) -> None:
    path = tmp_path / "bad_digest.jsonl"
    text = (TRACES / "store_failures.jsonl").read_text()
    first = next(r for _, r in records("store_failures.jsonl") if r["type"] == "checkpoint")
    path.write_text(text.replace(first["digest"], "0" * 32, 1))
    result = kvflow("replay", path)
    assert result.exit_code == 1
    assert f"DIVERGENCE (checkpoint) at seq {first['seq']}" in result.output
    assert "0" * 32 in result.output
    assert f"kvflow replay {path} --until {first['seq']}" in result.output


# --- incidents -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["store_failures.jsonl", "load_failures.jsonl", "timeouts.jsonl", "two_ranks.jsonl"]
)
def test_incidents_lists_every_failed_and_timed_out_job(name: str) -> None:
    failures = of_type(name, "job_failed", "job_timed_out")
    late = of_type(name, "late_result_ignored")
    assert failures, "the golden trace must show incidents"
    result = kvflow("incidents", TRACES / name, "--json")
    assert result.exit_code == 0
    found = json.loads(result.stdout)
    assert [i["job_id"] for i in found] == [f["job_id"] for f in failures]
    assert [i["seq"] for i in found] == [f["seq"] for f in failures]
    for incident, event in zip(found, failures):
        assert incident["direction"] == event["direction"]
        assert incident["hashes"] == event["hashes"] and incident["blocks"] == len(event["hashes"])
        assert incident["requests"] == [event["request_id"]]
        assert incident["outcome"] == (
            "timed_out" if event["type"] == "job_timed_out" else "failed"
        )
        if event["type"] == "job_failed":
            assert incident["error"] == event["error"]
        recovery = incident["recovery"]
        assert incident["verified"]
        fenced = event.get("fenced", False)
        assert incident["fenced"] is fenced
        if fenced:  # F15: the memory comes back when the copy reports over, not before
            assert recovery["device_blocks_released"] == []
            assert recovery["device_blocks_fenced"] == event["device_blocks"]
            lifted = incident["fence_lifted"]
            assert lifted is not None, "every fence of a golden trace ends (copy over or executor closed)"
            assert lifted["device_blocks_released"] == event["device_blocks"]
            assert lifted["reason"] in ("copy over", "executor closed")
        else:
            assert recovery["device_blocks_released"] == event["device_blocks"]
        if event["direction"] == "store" and fenced:
            assert recovery["slots_freed"] == [] and recovery["slots_fenced"] == event["slots"]
            assert sorted(incident["fence_lifted"]["slots_freed"]) == sorted(event["slots"])
        elif event["direction"] == "store":
            assert recovery["slots_freed"] == event["slots"]
            assert recovery["hashes_never_visible"] == event["hashes"]
        else:
            assert recovery["entries_kept_resident"] == event["hashes"]
            assert recovery["pins_released"] == len(event["hashes"])
            assert recovery["recompute_device_blocks"] == event["device_blocks"]
        expected_late = [r["seq"] for r in late if r["job_id"] == event["job_id"]]
        assert [r["seq"] for r in incident["late_results"]] == expected_late
    assert sum(len(i["late_results"]) for i in found) <= len(late)


def test_incident_time_and_step_come_from_the_commands() -> None:
    name = "store_failures.jsonl"
    step, now_ms, expected = 0, None, []
    for _, rec in records(name):
        if rec["type"] == "plan_step":
            step, now_ms = step + 1, rec["now_ms"]
        elif rec["type"] == "tick":
            now_ms = rec["now_ms"]
        elif rec["type"] == "job_failed":
            expected.append((rec["seq"], step, now_ms))
    found = json.loads(kvflow("incidents", TRACES / name, "--json").stdout)
    assert [(i["seq"], i["step"], i["time_ms"]) for i in found] == expected


def test_timeouts_have_late_results() -> None:
    found = json.loads(kvflow("incidents", TRACES / "timeouts.jsonl", "--json").stdout)
    assert all(i["outcome"] == "timed_out" for i in found)
    with_late = [i for i in found if i["late_results"]]
    assert with_late
    for incident in with_late:
        assert all(r["seq"] > incident["seq"] for r in incident["late_results"])


def test_two_ranks_shows_ranks_and_late_successes() -> None:
    found = json.loads(kvflow("incidents", TRACES / "two_ranks.jsonl", "--json").stdout)
    assert {i["rank"] for i in found} == {1}
    assert any(i["ranks_succeeded"] == [0] for i in found)  # rank 0 reported before rank 1 failed
    assert any(r["ok"] and r["rank"] == 0 for i in found for r in i["late_results"])


def test_F15_reset_incidents_note_cancelled_and_abandoned_jobs() -> None:
    reset = of_type("reset_inflight.jsonl", "reset")[0]
    cancelled = [r for r in of_type("reset_inflight.jsonl", "job_failed") if r["rank"] == -1]
    found = json.loads(kvflow("incidents", TRACES / "reset_inflight.jsonl", "--json").stdout)
    assert [i["job_id"] for i in found if i["cancelled_by_reset"]] == [
        r["job_id"] for r in cancelled
    ]
    abandoned = [i for i in found if i["abandoned"]]
    assert abandoned and all(i["job_id"] in reset["abandoned_job_ids"] for i in abandoned)
    for incident in abandoned:
        assert incident["abandoned_at_seq"] == reset["seq"]
        # a slot two abandoned loads read is freed by the last of them to report
        assert set(incident["recovery"]["fenced_slots_released"]) <= set(incident["slots"])
    assert any(
        incident["recovery"]["fenced_slots_released"] == incident["slots"]
        for incident in abandoned
    )
    assert {i["direction"] for i in abandoned} == {"store", "load"}


def test_F15_a_fence_the_executor_never_answers_shows_in_incidents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store timed out and its copy never reported: the trace ends with its memory fenced,
    and ``kvflow incidents`` says so in its JSON, its table and a warning."""
    from kvflow.core.config import Config
    from kvflow.engine.manager import OffloadManager
    from kvflow.log.writer import TraceWriter

    path = tmp_path / "hung.jsonl"
    cfg = Config(cpu_blocks=4, block_tokens=4, job_deadline_ms=100.0)
    m = OffloadManager(cfg, log=TraceWriter(path, cfg))
    done = m.blocks_computed("a", [1], [0])
    hung = m.blocks_computed("b", [2, 3], [1, 2])
    m.plan_step(0.0)
    m.job_result(done)
    assert m.tick(100.0) == 1
    m.close()  # the executor never answered

    (incident,) = json.loads(kvflow("incidents", path, "--json").stdout)
    assert (incident["job_id"], incident["fenced"], incident["fence_lifted"]) == (hung, True, None)
    assert incident["recovery"]["device_blocks_fenced"] == [1, 2]
    assert sorted(incident["recovery"]["slots_fenced"]) == sorted(incident["slots"])
    monkeypatch.setenv("COLUMNS", "400")
    table = kvflow("incidents", path)
    assert table.exit_code == 0
    assert "FENCED to the end of the trace" in table.stdout
    assert "1 fenced job never reported the copy over" in table.stderr and f"[{hung}]" in table.stderr


def test_incidents_table_and_empty_trace() -> None:
    result = kvflow("incidents", TRACES / "load_failures.jsonl")
    assert result.exit_code == 0
    first = of_type("load_failures.jsonl", "job_failed")[0]
    assert "20 incidents" in result.output and str(first["seq"]) in result.output
    assert "kept" in result.output and "recompute" in result.output  # (cells wrap)
    clean = kvflow("incidents", TRACES / "clean.jsonl")
    assert clean.exit_code == 0 and "no failed or timed-out jobs" in clean.output
    assert json.loads(kvflow("incidents", TRACES / "clean.jsonl", "--json").stdout) == []


@pytest.mark.parametrize(
    "name",
    ["load_failures.jsonl", "timeouts.jsonl", "two_ranks.jsonl", "reset_inflight.jsonl", "store_failures.jsonl"],
)
def test_incidents_fit_an_80_column_terminal(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """At 80 columns the table would squeeze its text to a few characters a line: every
    incident is a block of lines instead, and ids, outcome and error stay whole."""
    found = json.loads(kvflow("incidents", TRACES / name, "--json").stdout)
    assert found
    monkeypatch.setenv("COLUMNS", "80")
    result = kvflow("incidents", TRACES / name)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(text) for text in lines) <= 80, max(lines, key=len)
    assert f"{len(found)} incidents" in lines[0]
    for incident in found:
        outcome = incident["outcome"].replace("_", " ")
        heading = next(
            (t for t in lines if t.startswith(f"job {incident['job_id']}: {incident['direction']} {outcome}")),
            None,
        )
        assert heading is not None, (incident["job_id"], outcome)
        assert all(r in heading for r in incident["requests"])
        assert any(f"seq {incident['seq']}, step {incident['step']}" in t for t in lines)
        start = " ".join(incident["error"].split()[:4])  # the start of the error, unbroken
        assert any(t.split(maxsplit=1)[-1].startswith(start) for t in lines if t.startswith("  error ")), start
    if any(i["late_results"] for i in found):
        assert any(t.startswith("  late results  seq ") for t in lines)
    # wide enough, it is still the table (what the docs show at 140 columns)
    monkeypatch.setenv("COLUMNS", "140")
    wide = kvflow("incidents", TRACES / name).stdout
    assert "┃ seq ┃" in wide and max(len(t) for t in wide.splitlines()) <= 140


# --- inspect -------------------------------------------------------------------------------


def first_failed_store() -> dict[str, Any]:
    return of_type("store_failures.jsonl", "job_failed")[0]


def test_inspect_job() -> None:
    failed = first_failed_store()
    path = TRACES / "store_failures.jsonl"
    data = json.loads(kvflow("inspect", path, "--job", str(failed["job_id"]), "--json").stdout)
    events = [h for h in data["history"] if h["kind"] == "event"]
    assert [h["type"] for h in events] == ["store_queued", "jobs_submitted", "job_failed"]
    assert events[-1]["seq"] == failed["seq"] and events[-1]["change"] == "IN_FLIGHT -> FAILED"
    results = [h for h in data["history"] if h["type"] == "job_result"]
    assert results and results[0]["record"]["error"] == failed["error"]
    out = kvflow("inspect", path, "--job", str(failed["job_id"])).output
    assert f"job {failed['job_id']} in {path}" in out
    assert "FAILED on rank 0" in out and "IN_FLIGHT -> FAILED" in out


def test_inspect_block() -> None:
    failed = first_failed_store()
    block = failed["hashes"][0]
    path = TRACES / "store_failures.jsonl"
    expected = [
        r["seq"]
        for _, r in records(path)
        if block in r.get("hashes", ()) and r["type"] != "checkpoint"
    ]
    data = json.loads(kvflow("inspect", path, "--block", str(block), "--json").stdout)
    seqs = [
        h["seq"] for h in data["history"] if h["kind"] == "event" and h["type"] != "jobs_submitted"
    ]
    assert seqs == expected
    failure = next(h for h in data["history"] if h["seq"] == failed["seq"])
    assert failure["change"].endswith("-> ABSENT") and failure["change"].startswith("STORING")
    # hex works too
    again = json.loads(kvflow("inspect", path, "--block", hex(block), "--json").stdout)
    assert again["history"] == data["history"]


def test_inspect_request() -> None:
    failed = first_failed_store()
    request = failed["request_id"]
    path = TRACES / "store_failures.jsonl"
    data = json.loads(kvflow("inspect", path, "--request", request, "--json").stdout)
    types = [h["type"] for h in data["history"]]
    assert types[0] == "lookup"
    for needed in (
        "pins_acquired",
        "store_queued",
        "job_failed",
        "request_finished",
        "request_closed",
    ):
        assert needed in types
    assert all(
        h["record"].get("request_id", request) == request
        for h in data["history"]
        if h["type"] not in ("jobs_submitted", "job_result", "plan_step", "tick")
    )


def test_inspect_slot() -> None:
    failed = first_failed_store()
    slot = failed["slots"][0]
    path = TRACES / "store_failures.jsonl"
    data = json.loads(kvflow("inspect", path, "--slot", str(slot), "--json").stdout)
    events = [h for h in data["history"] if h["kind"] == "event" and h["type"] != "jobs_submitted"]
    assert all(slot in h["record"]["slots"] for h in events)
    failure = next(h for h in events if h["seq"] == failed["seq"])
    assert failure["change"].endswith("-> free")


def test_inspect_at_matches_replay_until() -> None:
    path = TRACES / "timeouts.jsonl"
    timed_out = of_type("timeouts.jsonl", "job_timed_out")[0]
    at = timed_out["seq"] - 1
    state = json.loads(kvflow("inspect", path, "--at", str(at), "--json").stdout)["state"]
    replayed = json.loads(kvflow("replay", path, "--until", str(at), "--json").stdout)
    assert state["seq"] == at and state["digest"] == replayed["digest"]
    assert state["resident_blocks"] == replayed["resident_blocks"]
    assert state["free_slots"] == replayed["free_slots"]
    jobs = {j["job"]: j for j in state["jobs"]}
    assert len(jobs) == replayed["live_jobs"]
    assert jobs[timed_out["job_id"]]["state"] == "IN_FLIGHT"
    assert jobs[timed_out["job_id"]]["deadline_ms"] == timed_out["deadline_ms"]
    plain = kvflow("inspect", path, "--at", str(at))
    assert plain.exit_code == 0
    assert f"at seq {at} (digest {state['digest']})" in plain.output
    assert "live jobs" in plain.output and "pins per request" in plain.output
    initial = json.loads(kvflow("inspect", path, "--at", "0", "--json").stdout)["state"]
    assert initial["seq"] == 0 and initial["entries"] == [] and initial["free_slots"] == 64


def test_inspect_block_at_a_seq() -> None:
    failed = first_failed_store()
    path = TRACES / "store_failures.jsonl"
    block = failed["hashes"][0]
    before = json.loads(
        kvflow(
            "inspect", path, "--block", str(block), "--at", str(failed["seq"] - 1), "--json"
        ).output
    )
    after = json.loads(
        kvflow("inspect", path, "--block", str(block), "--at", str(failed["seq"]), "--json").output
    )
    assert before["focus"]["state"] == "STORING" and before["focus"]["live_jobs"]
    assert after["focus"]["state"] == "ABSENT" and after["focus"]["live_jobs"] == []
    out = kvflow("inspect", path, "--block", str(block), "--at", str(failed["seq"])).output
    assert f"state at seq {failed['seq']}" in out and "state: ABSENT" in out


def test_inspect_bad_input() -> None:
    path = TRACES / "clean.jsonl"
    assert "say what to inspect" in one_line_error(kvflow("inspect", path))
    assert "one thing at a time" in one_line_error(
        kvflow("inspect", path, "--job", "1", "--slot", "2")
    )
    err = one_line_error(kvflow("inspect", path, "--at", "999999"))
    assert "beyond the last event" in err and "999999" in err
    assert "whole number" in one_line_error(kvflow("inspect", path, "--block", "xyz"))


@pytest.mark.parametrize(
    ("option", "value"), [("--job", "99999"), ("--request", "req-nope"), ("--block", "12345")]
)
@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_something_the_trace_never_names(option: str, value: str, as_json: bool) -> None:
    """A job, request or block that never appears is a typo or the wrong trace: exit 2 with
    one line naming it and the trace, not an empty history and exit 0."""
    path = TRACES / "clean.jsonl"


    def names(r: dict[str, Any]) -> bool:  # positive control: the trace really lacks it
        if option == "--job":
            return r.get("job_id") == int(value) or int(value) in r.get("job_ids", [])
        if option == "--request":
            return r.get("request_id") == value
        return int(value) in r.get("hashes", []) + r.get("block_hashes", [])

    assert not any(names(r) for _, r in records(path))
    result = kvflow("inspect", path, option, value, *(["--json"] if as_json else []))
    err = one_line_error(result)
    assert f"{option[2:]} {value}" in err and str(path) in err
    assert result.stdout == ""


def test_inspect_a_slot_beyond_the_tier() -> None:
    path = TRACES / "clean.jsonl"
    capacity = json.loads(path.read_text().splitlines()[0])["config"]["cpu_blocks"]
    err = one_line_error(kvflow("inspect", path, "--slot", str(capacity)))
    assert f"slot {capacity}" in err and f"{capacity} slots" in err
    assert kvflow("inspect", path, "--slot", str(capacity - 1)).exit_code == 0


# --- diagram -------------------------------------------------------------------------------


def test_diagram_is_generated_from_the_tables() -> None:
    text = kvflow("diagram").output
    for table in (BLOCK_TRANSITIONS, JOB_TRANSITIONS):
        for source, edges in table.items():
            for tag, target in edges.items():
                assert f"{source.name} --{tag}--> {target.name}" in text
    mermaid = kvflow("diagram", "block", "--mermaid").output
    assert mermaid.startswith("stateDiagram-v2")
    assert "STORING --> RESIDENT: job_completed" in mermaid


# --- unreadable traces ---------------------------------------------------------------------


@pytest.mark.parametrize("verb", ["replay", "incidents", "inspect"])
def test_nonexistent_file(verb: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    args = [verb, missing] + (["--at", "1"] if verb == "inspect" else [])
    err = one_line_error(kvflow(*args))
    assert str(missing) in err and "No such file" in err


@pytest.mark.parametrize("verb", ["replay", "incidents", "inspect"])
def test_not_json_in_the_middle(verb: str, tmp_path: Path) -> None:
    path = tmp_path / "corrupt.jsonl"
    lines = (TRACES / "store_failures.jsonl").read_text().splitlines(keepends=True)
    lines[4] = "this is not json\n"  # line 5
    path.write_text("".join(lines))
    args = [verb, path] + (["--at", "50"] if verb == "inspect" else [])
    err = one_line_error(kvflow(*args))
    assert f"{path}:5:" in err


def test_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.jsonl"
    lines = (TRACES / "clean.jsonl").read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["version"] = 99
    lines[0] = json.dumps(header) + "\n"
    path.write_text("".join(lines))
    err = one_line_error(kvflow("replay", path))
    assert f"{path}:1:" in err and "newer" in err and "upgrade kvflow" in err


def test_a_torn_last_line_is_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "torn.jsonl"
    data = (TRACES / "store_failures.jsonl").read_bytes()
    last_line_start = data.rstrip(b"\n").rfind(b"\n") + 1
    cut = last_line_start + (len(data) - last_line_start) // 2
    path.write_bytes(data[:cut])
    line_count = data[:cut].count(b"\n") + 1
    for args in (["replay", path], ["replay", path, "--redecide"], ["incidents", path]):
        result = kvflow(*args)
        assert result.exit_code == 0, result.output
        assert "kvflow: warning:" in result.stderr and "torn last line" in result.stderr
        assert f"{path}:{line_count}" in result.stderr
        assert "Traceback" not in result.output


def test_a_gzip_copy_replays(tmp_path: Path) -> None:
    path = tmp_path / "two_ranks.jsonl.gz"
    path.write_bytes(gzip.compress((TRACES / "two_ranks.jsonl").read_bytes(), mtime=0))
    plain = json.loads(kvflow("replay", TRACES / "two_ranks.jsonl", "--json").stdout)
    zipped = kvflow("replay", path, "--redecide", "--json")
    assert zipped.exit_code == 0
    assert json.loads(zipped.stdout)["digest"] == plain["digest"]
    assert len(json.loads(kvflow("incidents", path, "--json").stdout)) == len(
        of_type("two_ranks.jsonl", "job_failed", "job_timed_out")
    )


def test_usage_errors_are_one_line() -> None:
    err = one_line_error(kvflow("replay", TRACES / "clean.jsonl", "--bogus"))
    assert "--bogus" in err
    assert "Missing argument" in one_line_error(kvflow("replay"))


def test_subprocess_errors_and_divergence() -> None:
    """The installed script, end to end: exit codes and stderr as a shell sees them."""
    script = str(KVFLOW_SCRIPT if KVFLOW_SCRIPT.exists() else shutil.which("kvflow"))
    missing = subprocess.run(
        [script, "replay", "/nonexistent/trace.jsonl"], check=False, capture_output=True, text=True
    )
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr
    diverged = subprocess.run(
        [script, "replay", str(TRACES / "divergent.jsonl"), "--redecide"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert diverged.returncode == 1 and "reproduce  kvflow replay" in diverged.stdout
    ok = subprocess.run(
        [script, "incidents", str(TRACES / "timeouts.jsonl")],
        check=False,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "timed out" in ok.stdout


# --- the golden traces are reproducible ----------------------------------------------------


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "make_golden_traces", REPO / "tools" / "make_golden_traces.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_regenerating_golden_traces_is_byte_identical(tmp_path: Path) -> None:
    tool = _load_tool()
    written = tool.make_golden_traces(tmp_path)
    assert sorted(p.name for p in written) == sorted(set(GOLDEN) - set(RECORDED_EARLIER))
    for path in written:
        assert path.read_bytes() == (TRACES / path.name).read_bytes(), (
            f"{path.name} differs from traces/: regenerate with python tools/make_golden_traces.py"
        )


def test_a_trace_that_stops_folding(tmp_path: Path) -> None:
    """An event missing from the middle: replay reports it (exit 1); incidents and history
    still work from the events, with a warning; the state after that point is refused."""
    path = tmp_path / "gap.jsonl"
    lines = (TRACES / "store_failures.jsonl").read_text().splitlines(keepends=True)
    # the first event from seq 50 on that is not itself an incident
    index, gone = next(
        (i, rec["seq"])
        for i, text in enumerate(lines)
        if (rec := json.loads(text)).get("seq", 0) >= 50 and rec["type"] not in ("checkpoint", "job_failed")
    )
    del lines[index]
    path.write_text("".join(lines))
    line = next(n for n, r in records(path) if r.get("seq") == gone + 1)

    replayed = kvflow("replay", path)
    assert replayed.exit_code == 1
    assert f"DIVERGENCE (illegal) at seq {gone + 1} ({path}:{line})" in replayed.output
    assert "events must be gapless" in replayed.output

    found = kvflow("incidents", path, "--json")
    assert found.exit_code == 0 and "does not fold" in found.stderr
    incidents = json.loads(found.stdout)
    assert len(incidents) == len(of_type("store_failures.jsonl", "job_failed"))
    assert not any(i["verified"] for i in incidents if i["seq"] > gone)

    err = one_line_error(kvflow("inspect", path, "--at", str(gone + 10)))
    assert f"cannot compute the state at seq {gone + 10}" in err and f"{path}:{line}" in err
    assert kvflow("inspect", path, "--at", str(gone - 1)).exit_code == 0


@pytest.mark.parametrize(("doc", "minimum"), [("docs/debugging.md", 10)])
def test_the_docs_show_real_output(monkeypatch: pytest.MonkeyPatch, doc: str, minimum: int) -> None:
    """Every ``$ kvflow ...`` pasted in the docs prints what they show (a trailing
    ``| head -n N`` is applied to the real output; other pipes are not checked).
    ``tools/update_doc_outputs.py`` re-pastes them."""
    import re
    import shlex

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("COLUMNS", "140")
    text = (REPO / doc).read_text(encoding="utf-8")
    checked = 0
    for block in text.split("```console\n")[1:]:
        body = block.split("```", 1)[0]
        command, _, pasted = body.partition("\n")
        match = re.match(r"^\$ (kvflow .*?)(?: \| head -n (\d+))?$", command)
        if match is None or any(c in match.group(1) for c in "|;"):
            continue
        result = kvflow(*shlex.split(match.group(1))[1:])
        out = result.stdout
        if match.group(2):
            out = "".join(out.splitlines(keepends=True)[: int(match.group(2))])
        assert out == pasted, command
        checked += 1
    assert checked >= minimum
