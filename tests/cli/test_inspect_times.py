"""``kvflow inspect`` and ``kvflow incidents`` print times at the full resolution of the trace:
every time on screen reads back as exactly the float the trace holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvflow.cli.main import main
from kvflow.simulate.workload import EXAMPLE_WORKLOAD


def kvflow(*args: object, columns: int = 140) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], env={"COLUMNS": str(columns)})


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A timed run: transfers end at fractional milliseconds, thousands of them in."""
    path = tmp_path_factory.mktemp("times") / "timed.jsonl"
    result = kvflow("simulate", EXAMPLE_WORKLOAD, "--mode", "timed", "--cpu-blocks", 32, "--fault-rate", 0.2,
                    "--seed", 3, "--record", path, "--json")
    assert result.exit_code == 0, result.output
    return path


def records(path: Path, kind: str) -> list[dict[str, object]]:
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    return [r for r in map(json.loads, lines) if r.get("type") == kind]


def coarse(t: float) -> bool:
    """Whether six significant digits (``%g``) would change ``t``."""
    return float(f"{t:g}") != t


def test_jobs_submitted_times_read_back_exactly(trace: Path) -> None:
    submitted = [r for r in records(trace, "jobs_submitted") if coarse(r["now_ms"])]  # type: ignore[arg-type]
    assert len(submitted) >= 3  # positive control: times that %g would have rounded
    for rec in submitted[:3]:
        job = rec["job_ids"][0]  # type: ignore[index]
        out = kvflow("inspect", trace, "--job", job).stdout
        (line,) = [x for x in out.splitlines() if f"seq {rec['seq']}" in x or re.match(rf"\s*{rec['seq']}\s", x)]
        at, deadline = re.search(r"submitted at (\S+) ms, deadline (\S+) ms", line).groups()  # type: ignore[union-attr]
        assert (float(at), float(deadline)) == (rec["now_ms"], rec["deadline_ms"])


@pytest.mark.parametrize("columns", [80, 300])
def test_incident_times_read_back_exactly(trace: Path, columns: int) -> None:
    incidents = json.loads(kvflow("incidents", trace, "--json").stdout)
    want = {i["seq"]: i["time_ms"] for i in incidents}
    assert sum(coarse(t) for t in want.values()) >= 3  # positive control
    out = kvflow("incidents", trace, columns=columns).stdout
    if columns == 80:  # one block of lines per incident
        got = {int(s): float(t) for s, t in re.findall(r"when\s+seq (\d+), step \d+, (\S+) ms", out)}
    else:  # the table: seq, step, ms are its first three cells
        got = {}
        for line in out.splitlines():
            cells = [c.strip() for c in line.split("│")[1:4]]
            if len(cells) == 3 and cells[0].isdigit():
                got[int(cells[0])] = float(cells[2])
    assert got == want


def test_whole_times_stay_whole() -> None:
    from kvflow.inspect.render import exact_ms

    assert [exact_ms(t) for t in (60.0, 60, 1653390.125, 0.1 + 0.2)] == ["60", "60", "1653390.125", "0.30000000000000004"]
