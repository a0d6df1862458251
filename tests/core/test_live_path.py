"""The live path against the checked path of the one core.

On the live path the manager applies the events its own deciders produced without the
legality and seq checks (``live_applier``: the decider validated them); folds and replays of recorded logs
always check. These tests pin that the shortcut never changes a result:

* Twin state machines: every command the Hypothesis machines of test_stateful.py issue runs
  through a live manager and a paranoid one (``check=True`` on every event); answers,
  events, refusals (type and message) and state digests must be equal after every command,
  and folding the log (checked) must rebuild the live state. The twins are where those
  machines run: each inherits all of its machine's rules and invariants.
* Every golden trace folds to the same canonical state, event by event, checked and not.
* An illegal event raises and leaves the state exactly as it was.
* The engine boundary's normalisation of block ids and hashes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_stateful
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine
from test_stateful import (
    OffloadMachine,
    OffloadMachineARC,
    OffloadMachineLazyTwoRanks,
    OffloadMachineRemote,
    OffloadMachineRemoteAheadTwoRanks,
    OffloadMachineTwoRanks,
)

from kvflow.core.commands import BlocksComputed, Lookup
from kvflow.core.config import Config
from kvflow.core.errors import IllegalTransition, KvflowError
from kvflow.core.events import EVENT_TYPES, ChainExtended, PinsAcquired, StoreQueued
from kvflow.core.state.apply import evolve, fold
from kvflow.core.state.model import State
from kvflow.core.values import hashes as _hashes
from kvflow.core.values import ints as _ints
from kvflow.engine.manager import OffloadManager
from kvflow.log.memory import MemoryLog, NullLog
from kvflow.log.reader import read_trace

ROOT = Path(__file__).resolve().parents[2]


class TwinManager(OffloadManager):
    """The live manager, shadowed command by command by a paranoid one."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.shadow = OffloadManager(config, paranoid=True)

    def execute(self, command: Any) -> Any:
        # (every engine method and ``handle`` come through here)
        expected: Any = None
        try:
            expected = self.shadow.handle(command)
        except KvflowError as exc:
            expected_exc: KvflowError | None = exc
        else:
            expected_exc = None
        try:
            got = (super().execute(command), self._applied.copy())
        except KvflowError as exc:
            assert expected_exc is not None, f"the live path refused {command}: {exc}"
            assert (type(exc), str(exc)) == (type(expected_exc), str(expected_exc))
            assert self.state.digest() == self.shadow.state.digest()
            raise
        assert expected_exc is None, f"the checked path refused {command} ({expected_exc}), the live one did not"
        assert got[0] == expected[0], (command, got[0], expected[0])
        assert got[1] == expected[1], (command, got[1], expected[1])
        assert self.state.digest() == self.shadow.state.digest(), command
        return got[0]


class TwinMixin:
    m: Any
    config: Config

    def __init__(self) -> None:
        super().__init__()  # type: ignore[call-arg]
        subscribers = self.m._subscribers
        self.m = TwinManager(self.config)
        for callback, event_types in subscribers:
            self.m.subscribe(callback, event_types)

    def teardown(self) -> None:
        rebuilt = fold(State(self.config), self.m.log.events())
        assert rebuilt.digest() == self.m.state.digest()


# how many examples: the profile's (tests/conftest.py: 2,000 in CI)
TWIN_SETTINGS = settings(
    stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class TwinOneRank(TwinMixin, OffloadMachine):
    pass


class TwinTwoRanks(TwinMixin, OffloadMachineTwoRanks):
    pass


class TwinARC(TwinMixin, OffloadMachineARC):
    pass


class TwinLazyTwoRanks(TwinMixin, OffloadMachineLazyTwoRanks):
    pass


class TwinTinyTier(TwinMixin, OffloadMachine):
    CPU_BLOCKS = 4  # the smallest tier the machine warms: evictions and rejections often


class TwinRemote(TwinMixin, OffloadMachineRemote):
    pass


class TwinRemoteAheadTwoRanks(TwinMixin, OffloadMachineRemoteAheadTwoRanks):
    pass


TestTwinOneRank = TwinOneRank.TestCase
TestTwinTwoRanks = TwinTwoRanks.TestCase
TestTwinARC = TwinARC.TestCase
TestTwinLazyTwoRanks = TwinLazyTwoRanks.TestCase
TestTwinTinyTier = TwinTinyTier.TestCase
TestTwinRemote = TwinRemote.TestCase
TestTwinRemoteAheadTwoRanks = TwinRemoteAheadTwoRanks.TestCase
for _case in (
    TestTwinOneRank,
    TestTwinTwoRanks,
    TestTwinARC,
    TestTwinLazyTwoRanks,
    TestTwinTinyTier,
    TestTwinRemote,
    TestTwinRemoteAheadTwoRanks,
):
    _case.settings = TWIN_SETTINGS
del _case  # (left in the module, pytest collected it as another machine: the last one twice)



def test_every_machine_of_test_stateful_runs_as_a_twin() -> None:
    """test_stateful.py runs no machine itself: each must have a twin here, or it never runs."""
    machines = {
        obj
        for obj in vars(test_stateful).values()
        if isinstance(obj, type) and issubclass(obj, RuleBasedStateMachine) and obj.__module__ == "test_stateful"
    }
    run = [globals()[case.__qualname__.removesuffix(".TestCase")] for k, case in globals().items() if k.startswith("Test")]
    twinned = {twin.__bases__[1] for twin in run if twin.__bases__[0] is TwinMixin}
    assert len(machines) == 6 and machines <= twinned, sorted(m.__name__ for m in machines - twinned)


GOLDEN = sorted((ROOT / "traces").glob("*.jsonl"))


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_traces_fold_identically_checked_and_unchecked(path: Path) -> None:
    reader, records = read_trace(path)
    checked, unchecked = State(reader.config), State(reader.config)
    applied = 0
    for _, rec in records:
        if isinstance(rec, EVENT_TYPES):
            try:
                evolve(checked, rec)
            except IllegalTransition:
                break  # the divergent golden trace: its illegal event must not be applied
            evolve(unchecked, rec, check=False)
            applied += 1
            assert checked.canonical() == unchecked.canonical(), (path.name, rec)
    assert applied > 0


def _store_event(state: State) -> StoreQueued:
    return StoreQueued(
        seq=state.next_seq, job_id=1, request_id="r", hashes=(11, 12), device_blocks=(0, 1), slots=(0, 1)
    )


def test_evolve_applies_a_legal_event() -> None:
    state = State(Config(cpu_blocks=4, block_tokens=4))
    evolve(state, _store_event(state))
    assert state.last_seq == 1 and state.slot_of == {11: 0, 12: 1}


def test_an_illegal_event_raises_and_changes_nothing() -> None:
    state = State(Config(cpu_blocks=4, block_tokens=4))
    evolve(state, _store_event(state))
    before = state.canonical()
    again = StoreQueued(  # the same hashes again: already on the tier
        seq=state.next_seq, job_id=2, request_id="r", hashes=(11, 12), device_blocks=(2, 3), slots=(2, 3)
    )
    with pytest.raises(IllegalTransition, match="already on the tier"):
        evolve(state, again)
    assert state.canonical() == before
    with pytest.raises(IllegalTransition, match="gapless"):
        evolve(state, PinsAcquired(seq=99, request_id="x", hashes=(), num_tokens=1))
    assert state.canonical() == before
    # fold (the replay's loop, evolve's body inlined) refuses the same events alike
    with pytest.raises(IllegalTransition, match="gapless"):
        fold(state, [PinsAcquired(seq=99, request_id="x", hashes=(), num_tokens=1)])
    with pytest.raises(IllegalTransition, match="already on the tier"):
        fold(state, [again])
    assert state.canonical() == before


BOUNDARY_INPUTS: list[tuple[Any, Any, Any]] = [
    # (input, _ints result or error, _hashes result or error)
    ([], (), ()),
    ((), (), ()),
    ([1, 2, 3], (1, 2, 3), (1, 2, 3)),
    ((5, 4), (5, 4), (5, 4)),
    (range(3, 6), (3, 4, 5), (3, 4, 5)),
    ([True, 2], (1, 2), (1, 2)),
    ([2**64 - 1, -(2**63)], (2**64 - 1, -(2**63)), (2**64 - 1, -(2**63))),
    ([2**64], (2**64,), "64 bits"),
    ([-(2**63) - 1], (-(2**63) - 1,), "64 bits"),
    ([1.5, 2], "must be integers", "must be integers"),
    (["a"], "must be integers", "must be integers"),
    ([None], "must be integers", "must be integers"),
    (iter([7, 8]), (7, 8), (7, 8)),
]


def _input_id(value: Any) -> str:
    # (an iterator's repr names its address: a test id must be the same in every process)
    return repr(value) if isinstance(value, (list, tuple, range, str, int)) else type(value).__name__


@pytest.mark.parametrize(("values", "as_ints", "as_hashes"), BOUNDARY_INPUTS, ids=_input_id)
def test_boundary_normalisation(values: Any, as_ints: Any, as_hashes: Any) -> None:
    items = list(values) if not isinstance(values, (list, tuple, range)) else values
    for fn, expected in ((_ints, as_ints), (_hashes, as_hashes)):
        if isinstance(expected, str):
            with pytest.raises(KvflowError, match=expected):
                fn(items)
        else:
            out = fn(items)
            assert out == expected and all(type(v) is int for v in out)


def test_numpy_integers_are_accepted_where_ints_are() -> None:
    np = pytest.importorskip("numpy")
    assert _ints(np.arange(3, dtype=np.int64)) == (0, 1, 2)
    assert _hashes([np.uint64(2**64 - 1)]) == (2**64 - 1,)


@pytest.mark.parametrize("recording", [True, False], ids=["memory-log", "null-log"])
def test_handle_returns_the_events_each_command_appended(recording: bool) -> None:
    """``handle`` hands back each command's own events, whether the log keeps them or not
    (the twins above compare these lists: an empty one would pass them unseen)."""
    config = Config(cpu_blocks=4, block_tokens=4)
    log = MemoryLog(config) if recording else NullLog()
    m = OffloadManager(config, log)
    _, looked_up = m.handle(Lookup(request_id="r", block_hashes=(1, 2), num_tokens=9))
    _, stored = m.handle(BlocksComputed(request_id="r", block_hashes=(1, 2), device_blocks=(0, 1)))
    assert [type(e) for e in looked_up] == [ChainExtended, PinsAcquired]
    assert [type(e) for e in stored] == [StoreQueued]
    assert [e.seq for e in looked_up + stored] == [1, 2, 3]
    if recording:
        assert log.events() == looked_up + stored


def test_a_raising_subscriber_stops_the_decision_with_state_and_log_agreeing() -> None:
    """A subscriber that raises (a caller's bug) propagates out of the call; what was applied
    until then is recorded, so a fold of the log rebuilds the state, the invariants hold, and
    the manager keeps serving."""
    from kvflow.core.events import StoreQueued
    from kvflow.core.state.invariants import check_invariants

    manager = OffloadManager(Config(cpu_blocks=2, block_tokens=4))
    store = manager.blocks_computed("a", [1, 2], [0, 1])
    manager.plan_step(0.0)
    manager.job_result(store)  # type: ignore[arg-type]
    manager.finish_request("a")

    def refuse(event: object) -> None:
        raise RuntimeError("subscriber bug")

    manager.subscribe(refuse, [StoreQueued])
    with pytest.raises(RuntimeError, match="subscriber bug"):
        manager.blocks_computed("b", [3, 4], [2, 3])  # evicts 1 and 2, then queues the store
    assert manager.state.jobs and check_invariants(manager.state) == []
    assert fold(State(manager.config), manager.log.events()).digest() == manager.state.digest()
    assert manager.lookup("c", [9], 9) == 0  # still serving (the call lock was released)
