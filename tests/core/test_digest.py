"""The state digest of trace format 4: kept as the state changes (its work at a checkpoint does
not grow with the tier), the same whoever applies the events, and different for states that
would decide differently."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from core_helpers import manager, store, tokens

from kvflow.core.config import MAX_CPU_BLOCKS, Config
from kvflow.core.state.apply import fold
from kvflow.core.state.digest import canonical, pair_sum
from kvflow.core.state.model import State
from kvflow.core.state.slots import FreeSlots
from kvflow.engine.manager import OffloadManager

ROOT = Path(__file__).resolve().parents[2]


def test_the_pair_terms_are_fixed_values() -> None:
    """A trace's digest must not change with the Python that reads it: the terms are CPython's
    tuple hash of two ints, pinned here (a Python that hashed them differently fails this)."""
    assert hash((1, 2)) == -3550055125485641917
    assert hash((2**64 - 1, 7)) == 6913107858676922533
    assert hash((-5, 0)) == -8131094091488831096
    assert pair_sum([1, 2**64 - 1], [2, 7]) == -3550055125485641917 + 6913107858676922533


def busy(cpu_blocks: int = 8, **kw: object) -> OffloadManager:
    m = manager(cpu_blocks=cpu_blocks, **kw)
    store(m, "a", [1, 2, 3], [0, 1, 2])
    assert m.lookup("b", [1, 2, 3, 9], tokens(4)) == 3
    m.accept_hits("b", [10, 11])
    m.blocks_computed("b", [9], [12])
    m.evict(1)
    store(m, "c", [4, 5], [20, 21])
    m.touch([2])
    return m


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_live_state_and_its_fold_digest_alike(policy: str) -> None:
    m = busy(policy=policy)
    folded = fold(State(m.config), m.log.events())
    assert folded.digest() == m.state.digest() and folded.copy().digest() == m.state.digest()


def test_the_digest_does_not_depend_on_the_hash_seed() -> None:
    code = (
        "from tests.core.test_digest import busy; import sys; sys.stdout.write(busy(policy='arc').state.digest())"
    )
    out = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
        out.add(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout)
    assert len(out) == 1 and out != {""}


def test_states_that_would_decide_differently_digest_differently() -> None:
    # the same resident blocks in another order, reached by as many events
    one, two = manager(cpu_blocks=8), manager(cpu_blocks=8)
    for m, order in ((one, [1, 2]), (two, [2, 1])):
        store(m, "a", [1, 2], [0, 1])
        m.touch([order[0]])
        m.touch([order[1]])
    assert one.state.policy.resident() != two.state.policy.resident()
    assert one.state.digest() != two.state.digest()
    # the same blocks in other slots
    a, b = manager(cpu_blocks=8), manager(cpu_blocks=8)
    store(a, "a", [1, 2], [0, 1])
    store(b, "a", [2, 1], [0, 1])
    assert a.state.slot_of != b.state.slot_of and a.state.digest() != b.state.digest()


def test_an_event_round_trip_leaves_the_entries_sum_as_it_was() -> None:
    m = manager(cpu_blocks=8)
    store(m, "a", [1, 2], [0, 1])
    before = m.state.tally.entries
    store(m, "b", [3], [2])
    assert m.evict(1) == 1
    assert m.state.tally.entries != before
    assert m.state.tally.entries == pair_sum(m.state.slot_of, m.state.slot_of.values())


def test_the_digest_walks_neither_the_tier_nor_its_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a tier of MAX_CPU_BLOCKS slots holding thousands of entries, a checkpoint's digest reads
    no entry, no free slot and no policy order: only what the live jobs and requests hold."""
    m = manager(cpu_blocks=MAX_CPU_BLOCKS)
    for i in range(40):
        store(m, f"r{i}", list(range(100 * i + 1, 100 * i + 101)), list(range(100)))
    assert len(m.state.slot_of) == 4000 and len(m.state.free_slots) == MAX_CPU_BLOCKS - 4000

    def walked(*args: object) -> object:
        raise AssertionError("the digest walked the tier")

    monkeypatch.setattr(FreeSlots, "__iter__", walked)
    monkeypatch.setattr(type(m.state.policy), "resident", walked)
    monkeypatch.setattr(type(m.state.policy), "snapshot", walked)
    monkeypatch.setattr(State, "slots_of", walked)
    assert len(m.state.digest()) == 32


def test_a_state_of_an_older_trace_digests_the_whole_state() -> None:
    m = busy()
    old = fold(State(m.config, full_digest=True), m.log.events())
    assert old.digest() == hashlib.blake2b(msgspec.msgpack.encode(canonical(old)), digest_size=16).hexdigest()
    assert old.digest() != m.state.digest()
    assert Config(cpu_blocks=MAX_CPU_BLOCKS).cpu_blocks == 2**32
