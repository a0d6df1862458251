"""Applying events: ``evolve``, the one function every event goes through (a fold, a replay,
the live engine's ``emit``).

* A legal event is applied; an illegal one raises and leaves the state exactly as it was.
* The live path (``live_applier``) hands back each command's own events and its observers see
  them; a raising observer stops the decision with state and log agreeing.
(The Hypothesis machines of test_stateful.py fold every log they make, checked, after every
step: a decider that emitted an event the checks refuse is found there.)
"""

from __future__ import annotations

import pytest

from kvflow.core.commands import BlocksComputed, Lookup
from kvflow.core.config import Config
from kvflow.core.errors import IllegalTransition
from kvflow.core.events import ChainExtended, PinsAcquired, StoreQueued
from kvflow.core.state.apply import evolve, fold, live_applier
from kvflow.core.state.model import State
from kvflow.engine.manager import OffloadManager
from kvflow.log.memory import MemoryLog, NullLog


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
    # fold (evolve, event after event) refuses the same events alike
    with pytest.raises(IllegalTransition, match="gapless"):
        fold(state, [PinsAcquired(seq=99, request_id="x", hashes=(), num_tokens=1)])
    with pytest.raises(IllegalTransition, match="already on the tier"):
        fold(state, [again])
    assert state.canonical() == before


def test_the_live_applier_applies_keeps_and_observes_each_event_checked_when_asked() -> None:
    """``live_applier``'s emit is ``evolve`` (with the checks when asked: a paranoid manager),
    then the log's list, then the event's observers, in order; an event the checks refuse is
    neither kept nor observed."""
    state = State(Config(cpu_blocks=4, block_tokens=4))
    kept: list[object] = []
    seen: list[object] = []
    emit = live_applier(state, {StoreQueued: (seen.append,)}, kept, check=True)
    store = _store_event(state)
    emit(store)
    emit(PinsAcquired(seq=state.next_seq, request_id="x", hashes=(), num_tokens=1))
    assert kept == [store, PinsAcquired(seq=2, request_id="x", hashes=(), num_tokens=1)]
    assert seen == [store] and state.last_seq == 2
    before = state.canonical()
    again = StoreQueued(
        seq=state.next_seq, job_id=2, request_id="r", hashes=(11,), device_blocks=(5,), slots=(2,)
    )
    with pytest.raises(IllegalTransition, match="already on the tier"):
        emit(again)
    assert state.canonical() == before and len(kept) == 2 and seen == [store]


@pytest.mark.parametrize("recording", [True, False], ids=["memory-log", "null-log"])
def test_handle_returns_the_events_each_command_appended(recording: bool) -> None:
    """``handle`` hands back each command's own events, whether the log keeps them or not."""
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
