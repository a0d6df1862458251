"""The C accelerator (``kvflow._native``) against the pure-Python core, which is its reference.

* Differential state machines: every command the Hypothesis machines of test_stateful.py
  issue runs through a pure-Python manager and a native one; answers, events, refusals
  (type and message) and state digests must be equal after every command, and folding the
  log with the C ``evolve`` and with ``evolve_python`` must give the same state.
* Every golden trace folds to the same canonical state, event by event, on both paths.
* The C paths really run (they do not just decline everything), and illegal events are
  declined with the state untouched, so the Python error is the one raised.
* Where a C compiler exists, the extension must have been built (a broken build would
  otherwise silently fall back to Python and pass every other test).
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from test_stateful import (
    OffloadMachine,
    OffloadMachineARC,
    OffloadMachineLazyTwoRanks,
    OffloadMachineTwoRanks,
)

import kvflow.native as native
import kvflow.state as state_mod
from kvflow.config import Config
from kvflow.errors import IllegalTransition, KvflowError
from kvflow.events import EVENT_TYPES, Lookup, PinsAcquired, StoreQueued
from kvflow.log import read_trace
from kvflow.manager import OffloadManager
from kvflow.state import State, evolve, evolve_python

ROOT = Path(__file__).resolve().parents[1]
needs_native = pytest.mark.skipif(not native.available(), reason="kvflow._native is not built")


def test_the_extension_is_built_where_a_compiler_exists() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the pure-Python core is expected")
    assert native.available(), (
        "a C compiler exists but kvflow._native is not importable: rebuild it with "
        "`pip install -e .` (or `python setup.py build_ext --inplace`) and read the compiler output"
    )
    assert native.core_name() == "native"


class TwinManager(OffloadManager):
    """The native manager, shadowed command by command by a pure-Python one."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.shadow = OffloadManager(config, native=False)

    def handle(self, command: Any) -> tuple[Any, list[Any]]:
        expected: Any = None
        try:
            expected = self.shadow.handle(command)
        except KvflowError as exc:
            expected_exc: KvflowError | None = exc
        else:
            expected_exc = None
        try:
            got = super().handle(command)
        except KvflowError as exc:
            assert expected_exc is not None, f"native refused {command}: {exc}"
            assert (type(exc), str(exc)) == (type(expected_exc), str(expected_exc))
            assert self.state.digest() == self.shadow.state.digest()
            raise
        assert expected_exc is None, f"python refused {command} ({expected_exc}), native did not"
        assert got[0] == expected[0], (command, got[0], expected[0])
        assert got[1] == expected[1], (command, got[1], expected[1])
        assert self.state.digest() == self.shadow.state.digest(), command
        return got


class TwinMixin:
    m: Any
    config: Config

    def __init__(self) -> None:
        super().__init__()  # type: ignore[call-arg]
        observers = self.m.observers
        self.m = TwinManager(self.config)
        self.m.observers.extend(observers)

    def teardown(self) -> None:
        events = self.m.log.events()
        a, b = State(self.config), State(self.config)
        for event in events:
            evolve(a, event)
            evolve_python(b, event)
        assert a.digest() == b.digest() == self.m.state.digest()


TWIN_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
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


TestTwinOneRank = needs_native(TwinOneRank.TestCase)
TestTwinTwoRanks = needs_native(TwinTwoRanks.TestCase)
TestTwinARC = needs_native(TwinARC.TestCase)
TestTwinLazyTwoRanks = needs_native(TwinLazyTwoRanks.TestCase)
TestTwinTinyTier = needs_native(TwinTinyTier.TestCase)
for _case in (TestTwinOneRank, TestTwinTwoRanks, TestTwinARC, TestTwinLazyTwoRanks, TestTwinTinyTier):
    _case.settings = TWIN_SETTINGS


GOLDEN = sorted((ROOT / "traces").glob("*.jsonl"))


@needs_native
@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_traces_fold_identically_on_both_paths(path: Path) -> None:
    reader, records = read_trace(path)
    a, b = State(reader.config), State(reader.config)
    applied = 0
    for _, rec in records:
        if isinstance(rec, EVENT_TYPES):
            try:
                evolve_python(b, rec)
            except IllegalTransition as exc:
                with pytest.raises(IllegalTransition) as raised:
                    evolve(a, rec)
                assert str(raised.value) == str(exc)
                assert a.canonical() == b.canonical()
                break
            evolve(a, rec)
            applied += 1
            assert a.canonical() == b.canonical(), (path.name, rec)
    assert applied > 0


def _store_event(state: State) -> StoreQueued:
    return StoreQueued(
        seq=state.next_seq, job_id=1, request_id="r", hashes=(11, 12), device_blocks=(0, 1), slots=(0, 1)
    )


@needs_native
def test_the_c_evolve_applies_legal_events_itself() -> None:
    state = State(Config(cpu_blocks=4, block_tokens=4))
    applied = state_mod._native_evolve(state, _store_event(state), True)  # type: ignore[misc]
    assert applied is True
    assert state.last_seq == 1 and state.slot_of == {11: 0, 12: 1}


@needs_native
def test_the_c_evolve_declines_illegal_events_and_changes_nothing() -> None:
    state = State(Config(cpu_blocks=4, block_tokens=4))
    evolve(state, _store_event(state))
    before = state.canonical()
    again = StoreQueued(  # the same hashes again: already on the tier
        seq=state.next_seq, job_id=2, request_id="r", hashes=(11, 12), device_blocks=(2, 3), slots=(2, 3)
    )
    assert state_mod._native_evolve(state, again, True) is False  # type: ignore[misc]
    assert state.canonical() == before
    with pytest.raises(IllegalTransition, match="already on the tier"):
        evolve(state, again)
    wrong_seq = PinsAcquired(seq=99, request_id="x", hashes=(), num_tokens=1)
    assert state_mod._native_evolve(state, wrong_seq, True) is False  # type: ignore[misc]
    assert state.canonical() == before


@needs_native
def test_the_c_deciders_run_the_hot_commands() -> None:
    m = OffloadManager(Config(cpu_blocks=4, block_tokens=4))
    handle = native.function("handle")
    result = handle(m.state, Lookup(request_id="r", block_hashes=(1, 2), num_tokens=9), False)
    assert result is not NotImplemented
    answer, events = result
    assert answer == 0 and [type(e) for e in events] == [PinsAcquired]


BOUNDARY_INPUTS: list[Any] = [
    [],
    (),
    [1, 2, 3],
    (5, 4),
    range(3, 9),
    [True, 2],
    [2**64 - 1, -(2**63)],
    [2**64],
    [-(2**63) - 1],
    [1.5, 2],
    ["a"],
    [None],
    iter([7, 8]),
]


@needs_native
@pytest.mark.parametrize("values", BOUNDARY_INPUTS, ids=repr)
def test_boundary_normalisation_matches_python(values: Any) -> None:
    import numpy as np

    from kvflow.manager import _hashes, _ints

    for py, c in ((_ints, native.function("ints")), (_hashes, native.function("hashes"))):
        items = list(values) if not isinstance(values, (list, tuple, range)) else values
        outcomes = []
        for fn in (py, c):
            try:
                out = fn(items)
                outcomes.append(("ok", out, [type(v) for v in out]))
            except KvflowError as exc:
                outcomes.append((type(exc).__name__, str(exc)))
        assert outcomes[0] == outcomes[1]
    assert native.function("ints")(np.arange(3, dtype=np.int64)) == (0, 1, 2)
