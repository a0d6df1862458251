"""The seeded swarm (``tools/swarm.py``): a fixed set of seeds passes every check, the checks
catch a planted bug, a failing seed prints the command that reproduces it, and the kvflow bugs
the swarm found keep their seeds as tests: a load abandoned by two resets was reported failed
twice (fixed); a corrupt report arriving after the job's outcome left the bad block on the tier
(fixed); a block reported corrupt while another load pinned it stayed on the tier when that
load ended without failing its checksum on it (fixed: it is remembered and evicted with its
last pin); a corrupt report in a batch the engine had to split (a stray result refused it)
lost its integrity report (fixed: the one-by-one path carries ``corrupt``)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvflow.core.decide import jobs as decide_jobs
from kvflow.core.events import JobTimedOut

REPO = Path(__file__).resolve().parents[2]
FAULT_MAX = 0.5


def _load_swarm() -> ModuleType:
    """Import tools/swarm.py, which is a script rather than part of the package."""
    if "swarm" in sys.modules:
        return sys.modules["swarm"]
    spec = importlib.util.spec_from_file_location("swarm", REPO / "tools" / "swarm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["swarm"] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


swarm = _load_swarm()

# Seeds 0..59 (about 5 s together, re-runs included).
SEEDS = tuple(range(60))

# What the fixed seeds must exercise between them.
KINDS = (
    "fault_rate>0",
    "fail_jobs",
    "hang_jobs",
    "slow_jobs",
    "corrupt",
    "delayed ranks",
    "lost ranks",
    "repeated results",
    "unknown results",
    "submit failure",
    "preemption",
    "aborts",
    "resets",
    "invalidations",
    "closed with live requests",
    "offload off",
    "device cache",
    "policy lru",
    "policy arc",
    "store eager",
    "store lazy",
    "world 1",
    "world >1",
)


# What the fixed seeds must run into between them (counted from their runs): copies that
# finish after their timeout (lifted by the copy), one-rank failures, integrity failures,
# resets abandoning jobs, re-admission after preemption, finishes during transfers...
OUTCOMES = (
    "timed_out",
    "lifted_copy_over",
    "lifted_closed",
    "rank_failures",
    "checksum_failures",
    "corrupt_evictions",
    "abandoned",
    "preempted_in_flight",
    "resumed",
    "finished_in_flight",
    "fenced_recomputes",
    "late_results",
    "unknown_results",
    "invalidations",
)

_CHECKED: dict[int, Any] = {}  # seed -> its SeedResult, so that each seed runs once per session


def checked(seed: int, tmp_path: Path) -> Any:
    if seed not in _CHECKED:
        _CHECKED[seed] = swarm.check_seed(seed, FAULT_MAX, tmp_path, subprocess_check=False)
    return _CHECKED[seed]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seed_passes_every_check_and_reruns_to_the_same_bytes(seed: int, tmp_path: Path) -> None:
    result = checked(seed, tmp_path)
    assert result.failure is None, f"{swarm.repro(seed, FAULT_MAX)}: {result.failure}"
    assert result.trace  # a trace was recorded


def test_the_fixed_seeds_run_into_every_fault_the_swarm_is_for(tmp_path: Path) -> None:
    total = swarm.Stats()
    for seed in SEEDS:
        total.add(checked(seed, tmp_path).stats)
    assert [name for name in OUTCOMES if not getattr(total, name)] == []


def test_the_fixed_seeds_cover_every_kind_of_fault_and_configuration() -> None:
    kinds: Counter[str] = Counter()
    for seed in SEEDS:
        swarm._count_kinds(kinds, swarm.pick_scenario(seed, FAULT_MAX))
    assert [k for k in KINDS if not kinds[k]] == []


def test_a_seed_decides_its_whole_scenario() -> None:
    assert swarm.pick_scenario(7, FAULT_MAX) == swarm.pick_scenario(7, FAULT_MAX)
    assert swarm.pick_scenario(7, FAULT_MAX) != swarm.pick_scenario(8, FAULT_MAX)
    assert all(s.fault_rate <= 0.1 for s in map(lambda n: swarm.pick_scenario(n, 0.1), range(50)))


def test_the_trace_is_identical_in_a_subprocess_under_another_hash_seed(tmp_path: Path) -> None:
    result = swarm.check_seed(SEEDS[0], FAULT_MAX, tmp_path, subprocess_check=True)
    assert result.failure is None, result.failure


@pytest.mark.parametrize("seed", (22, 31))
def test_the_data_model_catches_a_timed_out_copy_that_is_not_fenced(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plant a bug no table or invariant sees: a timed-out job is not fenced, so its memory is
    handed back while the copy still runs. Its late write lands in a block a request reuses."""
    real = decide_jobs._terminal_event

    def unfenced(kind: type, state: object, job: object, **outcome: object) -> object:
        if kind is JobTimedOut:
            outcome["fenced"] = False
        return real(kind, state, job, **outcome)

    monkeypatch.setattr(decide_jobs, "_terminal_event", unfenced)
    result = swarm.run_seed(seed, FAULT_MAX, str(tmp_path / "planted.jsonl"))
    assert result.failure is not None and "at finish: device block" in result.failure


def test_a_failing_seed_prints_the_command_that_reproduces_it_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def planted(path: str, driver: object) -> None:
        raise swarm.SwarmFailure("planted failure")

    monkeypatch.setattr(swarm, "check_trace", planted)
    start = SEEDS[0]
    assert swarm.main(["--seeds", "2", "--start", str(start), "--subprocess-every", "0"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL seed {start}: planted failure" in out
    assert f"reproduce: python tools/swarm.py --seeds 1 --start {start}\n" in out
    assert f"reproduce: python tools/swarm.py --seeds 1 --start {start + 1}\n" in out
    assert "failures        2" in out and "2 x planted failure" in out


def test_a_clean_run_prints_its_summary_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert swarm.main(["--seeds", "3", "--start", str(SEEDS[0]), "--subprocess-every", "0"]) == 0
    out = capsys.readouterr().out
    for line in ("(3 seeds)", "fault rates ", "jobs ", "fences lifted", "determinism     3 in-process",
                 "failures        0", "time "):
        assert line in out


def test_F18_seed_151_a_load_abandoned_by_two_resets_is_reported_once(tmp_path: Path) -> None:
    result = swarm.check_seed(151, FAULT_MAX, tmp_path, subprocess_check=False)
    assert result.failure is None, result.failure


def test_F17_seed_153_a_late_corrupt_report_still_evicts_the_bad_block(tmp_path: Path) -> None:
    result = swarm.check_seed(153, FAULT_MAX, tmp_path, subprocess_check=False)
    assert result.failure is None, result.failure


def test_F17_seed_16_a_block_reported_corrupt_while_pinned_leaves_the_tier_with_its_pins(tmp_path: Path) -> None:
    result = swarm.check_seed(16, FAULT_MAX, tmp_path, subprocess_check=False)
    assert result.failure is None, result.failure


def test_F17_seed_155_a_corrupt_report_survives_a_batch_split_by_a_stray_result(tmp_path: Path) -> None:
    result = swarm.check_seed(155, FAULT_MAX, tmp_path, subprocess_check=False)
    assert result.failure is None, result.failure


def test_the_command_a_failing_seed_prints_draws_the_same_scenario() -> None:
    fault_max = 0.123456789  # (a rounded --fault-max would draw another scenario)
    words = swarm.repro(7, fault_max).split()
    assert words[:2] == ["python", "tools/swarm.py"]
    again = float(words[words.index("--fault-max") + 1])
    assert swarm.pick_scenario(7, again) == swarm.pick_scenario(7, fault_max)
