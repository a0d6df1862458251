"""tools/bench_churn.py on the CPU: a recorded simulation whose tier churns is reduced to its
copy patterns (checked against the trace's own records), and one quick replay through the
executor moves and checks real pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.simulate.workload import EXAMPLE_WORKLOAD

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_churn  # noqa: E402
import numpy as np  # noqa: E402

from kvflow.executors.torch.transfer_plan import slot_runs  # noqa: E402


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("churn")
    trace, patterns = out / "sim.jsonl", out / "churn.npz"
    subprocess.run(
        [sys.executable, "-m", "kvflow", "simulate", str(EXAMPLE_WORKLOAD),
         "--cpu-blocks", "40", "--device-blocks", "8", "--record", str(trace), "--no-progress", "--json"],
        check=True, capture_output=True, cwd=ROOT,
    )
    bench_churn.extract(str(trace), str(patterns))
    return trace, patterns


def test_extract_keeps_every_submit_of_the_trace(recorded: tuple[Path, Path]) -> None:
    trace, patterns = recorded
    queued, submits, first_evict = {}, [], None
    for line in trace.read_text().splitlines()[1:]:  # an independent reading of the records
        rec = json.loads(line)
        if rec.get("type") in ("store_queued", "load_queued"):
            queued[rec["job_id"]] = rec
        elif rec.get("type") == "jobs_submitted":
            submits.append(rec["job_ids"])
        elif rec.get("type") == "blocks_evicted" and first_evict is None:
            first_evict = len(submits)
    p = np.load(patterns)
    assert len(p["step_off"]) - 1 == len(submits) and int(p["first_full_step"]) == first_evict > 0
    jobs = [queued[j] for ids in submits for j in ids]
    assert [int(d) for d in p["job_dir"]] == [0 if j["type"] == "store_queued" else 1 for j in jobs]
    assert p["slots"].tolist() == [s for j in jobs for s in j["slots"]]
    assert p["device_blocks"].tolist() == [b for j in jobs for b in j["device_blocks"]]
    assert int(p["cpu_blocks"]) == 40
    frag = bench_churn.fragmentation(p)
    loads = [np.sort(j["slots"]) for ids in submits[first_evict:] for j in map(queued.get, ids) if j["type"] == "load_queued"]
    runs = sum(len(slot_runs(s)) for s in loads)
    assert frag["slots_per_run"] == pytest.approx(sum(map(len, loads)) / runs)


def test_a_quick_replay_moves_and_checks_pages(recorded: tuple[Path, Path]) -> None:
    _, patterns = recorded
    done = subprocess.run(
        [sys.executable, "tools/bench_churn.py", "run", str(patterns), "--quick", "--device", "cpu",
         "--gib", "0.002", "--pages", "4", "--modes", "host,runs"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| churned")]
    assert len(rows) == 6 and all("data check ok" in r for r in rows)  # 2 modes x store/load/both


def test_extract_of_a_trace_without_submits_is_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text((ROOT / "traces/clean.jsonl").read_text().splitlines()[0] + "\n")
    done = subprocess.run(
        [sys.executable, "tools/bench_churn.py", "extract", str(empty), str(tmp_path / "x.npz")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 1 and "no jobs_submitted records" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
