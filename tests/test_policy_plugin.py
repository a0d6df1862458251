"""A policy of one's own, as a user writes and names it: docs/policies.md's FIFO example run
through ``SyncEngine``, ``kvflow simulate`` and ``kvflow replay``; the one-line errors for a
class that cannot be loaded or does not fit; and the checks that keep a policy's wrong answer
from changing the state or the trace."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from core_helpers import consistent, manager, store, tokens

from kvflow import Config, PolicyError, SyncEngine
from kvflow.core.errors import ConfigError
from kvflow.core.policies.lru import LRUPolicy
from kvflow.core.state.digest import digest
from kvflow.engine.manager import OffloadManager
from kvflow.executors.simulated import SimulatedExecutor, VirtualClock
from kvflow.integrations.vllm.sides import ConnectorConfig
from kvflow.log.reader import TraceReader
from kvflow.simulate.workload import EXAMPLE_WORKLOAD

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "policies.md"
EXAMPLE = EXAMPLE_WORKLOAD
_SCRIPT = Path(sys.executable).with_name("kvflow")
KVFLOW = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-c", "from kvflow.cli.main import main; main()"]
FIFO = "fifo_policy:Fifo"
A, B, C, D, E, F = 11, 12, 13, 14, 15, 16


def example_code() -> str:
    """The Python block of the docs' "A complete example" section, as written there."""
    section = DOC.read_text(encoding="utf-8").split("## A complete example", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on the import path holding ``fifo_policy.py``, the docs' example, as a
    user saves it; its modules are forgotten afterwards."""
    (tmp_path / "fifo_policy.py").write_text(example_code(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def run_kvflow(*args: object, path: Path | None) -> subprocess.CompletedProcess[str]:
    """The ``kvflow`` command in a process of its own, with ``path`` on PYTHONPATH (or not)."""
    python_path = [str(REPO), *([str(path)] if path is not None else []), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in python_path if p)}
    return subprocess.run([*KVFLOW, *map(str, args)], capture_output=True, text=True, env=env, cwd=REPO)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kvflow: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


# --- the docs' example, run as a user runs it ---------------------------------------------


def test_every_python_block_of_the_doc_runs(user_dir: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 2 and blocks[0] == example_code()
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    assert namespace["config"] == Config(cpu_blocks=32_768, block_tokens=16, policy=FIFO)



def test_the_fifo_example_runs_through_sync_engine_and_its_trace_replays(user_dir: Path) -> None:
    trace = user_dir / "run.jsonl"
    clock = VirtualClock()
    executor = SimulatedExecutor(clock)
    engine = SyncEngine(Config(cpu_blocks=4, block_tokens=4, policy=FIFO), executor, clock=clock, trace_path=str(trace))
    device = iter(range(1000))

    def request(rid: str, hashes: list[int]) -> int:
        hits = engine.lookup(rid, hashes, tokens(len(hashes)))
        if hits:
            engine.accept_hits(rid, [next(device) for _ in range(hits)])
        if hits < len(hashes):
            engine.blocks_computed(rid, hashes[hits:], [next(device) for _ in hashes[hits:]])
        engine.step()  # (submits the jobs; the simulated copies end on the virtual clock)
        while engine.has_live_jobs():
            clock.advance_to(executor.next_completion_ms())
            engine.step()
        engine.finish_request(rid)
        return hits

    assert request("r1", [A, B]) == 0
    assert request("r2", [C, D]) == 0
    assert request("r3", [A, B]) == 2  # A and B used again: FIFO pays no attention
    assert request("r4", [E, F]) == 0  # the tier is full: the oldest, A and B, leave
    assert request("r5", [C, D]) == 2  # (under LRU C and D would have left instead)
    assert request("r6", [A]) == 0
    engine.close()

    assert TraceReader(str(trace)).config.policy == FIFO  # the header names the class
    replayed = run_kvflow("replay", trace, "--redecide", path=user_dir)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert_one_line_error(run_kvflow("replay", trace, path=None), FIFO, "cannot import 'fifo_policy'")


def test_simulate_runs_the_fifo_example_and_records_a_trace_that_replays(user_dir: Path) -> None:
    record = user_dir / "sim.jsonl"
    args = ("simulate", EXAMPLE, "--cpu-blocks", 256, "--json")
    fifo = run_kvflow(*args, "--policy", FIFO, "--record", record, path=user_dir)
    assert fifo.returncode == 0, fifo.stderr
    lru = run_kvflow(*args, path=None)
    fifo_summary, lru_summary = json.loads(fifo.stdout), json.loads(lru.stdout)
    assert fifo_summary["config"]["policy"] == FIFO
    assert fifo_summary["requests"] == lru_summary["requests"] == 200
    assert fifo_summary["hit_tokens"] != lru_summary["hit_tokens"]  # it did decide otherwise
    assert run_kvflow("replay", record, "--redecide", path=user_dir).returncode == 0
    assert_one_line_error(run_kvflow(*args, "--policy", FIFO, path=None), FIFO)


def test_the_vllm_extra_config_names_a_class_of_ones_own(user_dir: Path) -> None:
    assert ConnectorConfig.from_extra({"cpu_blocks": 8, "policy": FIFO}).policy == FIFO
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config: policy 'fifo_policy:Nope': .*no 'Nope'"):
        ConnectorConfig.from_extra({"cpu_blocks": 8, "policy": "fifo_policy:Nope"})
    with pytest.raises(ConfigError, match="^kv_connector_extra_config: unknown policy 'fifo'"):
        ConnectorConfig.from_extra({"cpu_blocks": 8, "policy": "fifo"})


# --- a class that cannot be loaded or does not fit: one line, at configuration --------------

MISFITS = '''
from kvflow import Policy
from kvflow.core.policies.lru import LRUPolicy


class NoVictims(Policy):
    def insert(self, block_hash): pass
    def touch(self, block_hash): pass
    def remove(self, block_hash): pass
    def resident(self): return []
    def clear(self): pass


class ShortVictims(LRUPolicy):
    def victims(self, num_blocks):
        return []


class NoCapacity(LRUPolicy):
    def __init__(self):
        super().__init__()


class OldProtocol:
    """Written to the former protocol: bulk forms of its own, no base class."""
    name = "old"
    def __init__(self, capacity): self.order = {}
    def insert(self, block_hash): self.order[block_hash] = None
    def insert_many(self, hashes): self.order.update(dict.fromkeys(hashes))
    def admit_new_many(self, hashes): self.insert_many(hashes)
    def touch_many(self, hashes): pass
    def refresh_many(self, hashes): pass
    def remove_many(self, hashes): pass
    def victims(self, num_blocks, pinned): return list(self.order)[:num_blocks]


NOT_A_CLASS = 3
'''


@pytest.mark.parametrize(
    ("name", "wanted"),
    [
        ("misfits:NoVictims", "NoVictims does not implement victims"),
        ("misfits:ShortVictims", "ShortVictims.victims cannot be called as victims(self, num_blocks, pinned)"),
        ("misfits:NoCapacity", "NoCapacity.__init__ cannot be called as __init__(self, capacity)"),
        ("misfits:OldProtocol", "OldProtocol is not a subclass of kvflow.Policy"),
        ("misfits:NOT_A_CLASS", "NOT_A_CLASS is not a subclass of kvflow.Policy"),
        ("misfits:Missing", "module 'misfits' has no 'Missing'"),
        ("no_such_module:Fifo", "cannot import 'no_such_module': ModuleNotFoundError: No module named 'no_such_module'"),
        ("broken:Fifo", "cannot import 'broken': ZeroDivisionError: division by zero"),
        ("misfits:", "name a class of your own as 'package.module:ClassName'"),
        (":Fifo", "name a class of your own as 'package.module:ClassName'"),
        ("fifo", "unknown policy 'fifo'; known policies: arc, lru, or a class of your own as 'module:Class'"),
    ],
)
def test_a_class_that_cannot_be_loaded_or_does_not_fit_is_a_one_line_config_error(
    user_dir: Path, name: str, wanted: str
) -> None:
    (user_dir / "misfits.py").write_text(MISFITS, encoding="utf-8")
    (user_dir / "broken.py").write_text("1 / 0\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        Config(cpu_blocks=8, policy=name)
    message = str(caught.value)
    assert wanted in message and "\n" not in message, message
    if ":" in name:
        assert message.startswith(f"policy {name!r}: ")


def test_replay_of_a_trace_whose_policy_does_not_fit_is_refused_in_one_line(user_dir: Path) -> None:
    (user_dir / "misfits.py").write_text(MISFITS, encoding="utf-8")
    header, *rest = (REPO / "traces" / "clean.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    trace = user_dir / "t.jsonl"
    trace.write_text(header.replace('"policy":"lru"', '"policy":"misfits:ShortVictims"') + "".join(rest))
    assert_one_line_error(run_kvflow("replay", trace, path=user_dir), f"{trace}:1", "ShortVictims.victims")


# --- a policy's wrong answers change nothing ----------------------------------------------


def _coldest(policy: LRUPolicy, num_blocks: int) -> list[int]:
    return policy.resident()[:num_blocks]


# Each names the blocks to evict as a broken policy might: the answer, and what the error says.
ANSWERS: dict[str, tuple[Callable[[LRUPolicy, int], object], str]] = {
    "IgnoresPins": (_coldest, "is pinned"),
    "NotResident": (lambda p, n: [999, *_coldest(p, n)[1:]], "block 999 is not resident on the tier"),
    "Twice": (lambda p, n: [p.resident()[1]] * n, "is named twice"),
    "TooFew": (lambda p, n: _coldest(p, n)[1:], "1 blocks, not 2"),
    "TooMany": (lambda p, n: _coldest(p, n + 1), "3 blocks, not 2"),
    "NotInts": (lambda p, n: [float(h) for h in _coldest(p, n)], "is not an int block hash"),
    "Tuple": (lambda p, n: tuple(_coldest(p, n)), "not a list (or None) but tuple"),
    "Raises": (lambda p, n: 1 // 0, "raised ZeroDivisionError: integer division or modulo by zero"),
}


def _answering(kind: str) -> type[LRUPolicy]:
    answer = ANSWERS[kind][0]

    def victims(self: LRUPolicy, num_blocks: int, pinned: Callable[[int], bool]) -> list[int] | None:
        return answer(self, num_blocks)  # type: ignore[return-value]

    return type(kind, (LRUPolicy,), {"__slots__": (), "name": "", "victims": victims, "__module__": __name__})


for _kind in ANSWERS:
    globals()[_kind] = _answering(_kind)


class KeepsNothing(LRUPolicy):
    """Evicts the coldest blocks, whatever must be kept."""

    __slots__ = ()
    name = ""

    def victims(self, num_blocks: int, pinned: Callable[[int], bool]) -> list[int] | None:
        return self.resident()[:num_blocks]


class TouchFails(LRUPolicy):
    __slots__ = ()
    name = ""

    def touch(self, block_hash: int) -> None:
        raise RuntimeError("lost track")


def _full_tier(policy: str) -> OffloadManager:
    """A tier of 4 holding A, B, C, D, D the coldest (the request's end refreshed its chain
    deepest first) and pinned by a live lookup."""
    m = manager(cpu_blocks=4, policy=policy)
    store(m, "r1", [A, B, C, D], [0, 1, 2, 3])
    m.finish_request("r1")
    assert m.state.policy.resident() == [D, C, B, A]
    assert m.lookup("r2", [D], tokens(1)) == 1
    return m


def _refused(m: OffloadManager, call: Callable[[], object], *needles: str) -> None:
    """``call`` raises a one-line PolicyError and changes neither the state nor the log."""
    before, records = digest(m.state), len(m.log.records)
    with pytest.raises(PolicyError) as caught:
        call()
    message = str(caught.value)
    assert message.startswith(f"policy '{__name__}:") and "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    assert digest(m.state) == before
    assert len(m.log.records) == records


@pytest.mark.parametrize("kind", sorted(ANSWERS))
def test_a_wrong_victims_answer_is_refused_before_anything_changes(kind: str) -> None:
    policy = f"{__name__}:{kind}"
    wanted = ANSWERS[kind][1]
    m = _full_tier(policy)
    # a store that needs two slots, by a request whose chain it also extends (F14): the
    # eviction is decided before the chain's event, so a refusal leaves no record at all
    _refused(m, lambda: m.blocks_computed("r3", [E, F], [10, 11]), "victims(2)", wanted)
    _refused(m, lambda: m.evict(2), "victims(2)", wanted)


def test_a_victim_of_the_stores_own_chain_is_refused() -> None:
    m = manager(cpu_blocks=4, policy=f"{__name__}:KeepsNothing")
    store(m, "r1", [A, B, C, D], [0, 1, 2, 3])
    m.finish_request("r1")
    # D is the coldest and on the tier: the store of D, E must not evict it to make room for E
    _refused(m, lambda: m.blocks_computed("r3", [D, E], [10, 11]), f"block {D} must be kept")


def test_a_policy_that_raises_while_the_state_updates_it_is_a_policy_error() -> None:
    m = _full_tier(f"{__name__}:TouchFails")
    _refused(m, lambda: m.touch([B]), f"touch({B}) raised RuntimeError: lost track")


class BrokenLater(LRUPolicy):
    """LRU until ``broken`` is set, then every victim list names one block too many."""

    __slots__ = ()
    name = ""
    broken = False

    def victims(self, num_blocks: int, pinned: Callable[[int], bool]) -> list[int] | None:
        chosen = super().victims(num_blocks, pinned)
        return [*chosen, 999] if chosen is not None and type(self).broken else chosen


@pytest.fixture
def broken_later(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    return lambda: monkeypatch.setattr(BrokenLater, "broken", True)


def test_a_wrong_answer_for_the_remote_tiers_coldest_blocks_changes_nothing(broken_later: Callable[[], None]) -> None:
    m = manager(cpu_blocks=16, policy=f"{__name__}:BrokenLater", remote_blocks=100, remote_store_mode="ahead_of_eviction")
    store(m, "a", list(range(1, 15)), list(range(100, 114)))
    store(m, "b", [15], [200])  # 1 free slot: below the window (2), the two coldest are copied
    (push,) = m.state.jobs.values()
    m.job_result(push.job_id)
    broken_later()
    assert m.blocks_computed("c", [16], [300]) is not None  # the last free slot: no eviction
    _refused(m, lambda: m.plan_step(1.0), "victims(2)", "3 blocks, not 2")  # the copy's question


def test_a_wrong_answer_for_a_remote_load_evicts_nothing(broken_later: Callable[[], None]) -> None:
    """The one question asked after a decision's first events: a lookup's load from the remote
    tier follows the lookup's own events. Those stay (legal, and recorded as the log says);
    nothing is evicted and no load is queued."""
    m = manager(cpu_blocks=2, policy=f"{__name__}:BrokenLater", remote_blocks=100)
    store(m, "a", [A, B], [10, 11])
    for job_id in list(m.state.jobs):  # the write-through copies of A and B
        m.plan_step(0.0)
        m.job_result(job_id)
    m.finish_request("a")
    m.remote_found([C, D])
    broken_later()
    with pytest.raises(PolicyError, match="victims\\(2\\) answered .*: 3 blocks, not 2"):
        m.lookup("r", [C, D], tokens(2))
    assert m.state.is_resident(A) and m.state.is_resident(B) and m.state.jobs == {}
    consistent(m)  # the invariants hold, and the log folds to this very state
