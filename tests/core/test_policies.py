"""Eviction policies: ordering, all-or-nothing victims (F8), the chain rule (F14), ARC's
adaptation, determinism, the registry, and model-based checks against list references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import kvflow.core.policies.registry as policies
from kvflow.core.errors import ConfigError
from kvflow.core.policies.arc import ARCPolicy
from kvflow.core.policies.lru import LRUPolicy
from kvflow.core.policies.registry import POLICIES, make_policy, register_policy

A, B, C, D = 101, 102, 103, 104

PolicyClass = type[LRUPolicy] | type[ARCPolicy]
BOTH: list[PolicyClass] = [LRUPolicy, ARCPolicy]


def none_pinned(_: int) -> bool:
    return False


AnyPolicy = TypeVar("AnyPolicy", bound=LRUPolicy | ARCPolicy)


def build(cls: type[AnyPolicy], hashes: Iterable[int], capacity: int = 8) -> AnyPolicy:
    policy = cls(capacity)
    for block_hash in hashes:
        policy.insert(block_hash)
    return policy


def run_tier(policy: LRUPolicy | ARCPolicy, capacity: int, accesses: Iterable[int]) -> None:
    """A minimal tier: a hit touches; a miss evicts one victim when full, then inserts."""
    for block_hash in accesses:
        if block_hash in policy:
            policy.touch(block_hash)
            continue
        if len(policy) >= capacity:
            chosen = policy.victims(1, none_pinned)
            assert chosen is not None
            policy.remove(chosen[0])
        policy.insert(block_hash)


# --- ordering ----------------------------------------------------------------------------------


def test_lru_evicts_least_recent_and_touch_refreshes() -> None:
    policy = build(LRUPolicy, [A, B, C])
    assert policy.victims(1, none_pinned) == [A]
    policy.touch(A)
    assert policy.victims(1, none_pinned) == [B]
    assert policy.victims(3, none_pinned) == [B, C, A]
    assert policy.resident() == [B, C, A]


@pytest.mark.parametrize("cls", BOTH)
def test_F7_victims_skip_pinned_blocks(cls: PolicyClass) -> None:
    policy = build(cls, [A, B, C, D])
    pinned = {A, C}
    assert policy.victims(2, pinned.__contains__) == [B, D]


@pytest.mark.parametrize("cls", BOTH)
def test_F8_victims_are_all_or_nothing(cls: PolicyClass) -> None:
    policy = build(cls, [A, B, C])
    before = policy.snapshot()
    assert policy.victims(3, lambda h: h == B) is None  # only 2 evictable
    assert policy.victims(4, none_pinned) is None  # only 3 resident
    assert policy.victims(0, none_pinned) == []
    assert policy.snapshot() == before
    with pytest.raises(ValueError):
        policy.victims(-1, none_pinned)


@pytest.mark.parametrize("cls", BOTH)
def test_F14_a_chain_touched_deepest_first_loses_its_tail_before_its_head(cls: PolicyClass) -> None:
    # A prefix chain head -> tail, stored head first (so the tail is the most recent).
    chain = [A, B, C, D]
    policy = build(cls, chain)
    assert policy.victims(1, none_pinned) == [A]  # without the touch the head would go first
    policy.touch(D)
    policy.touch(C)
    policy.touch(B)
    policy.touch(A)  # head last: the most recent (F14)
    assert policy.victims(1, none_pinned) == [D]
    assert policy.victims(4, none_pinned) == [D, C, B, A]


@pytest.mark.parametrize("cls", BOTH)
def test_misuse_raises_and_changes_nothing(cls: PolicyClass) -> None:
    policy = build(cls, [A, B])
    before = policy.snapshot()
    with pytest.raises(ValueError, match="already resident"):
        policy.insert(A)
    with pytest.raises(KeyError):
        policy.touch(C)
    with pytest.raises(KeyError):
        policy.remove(C)
    assert policy.snapshot() == before


# --- ARC ---------------------------------------------------------------------------------------


def test_arc_survives_a_scan_that_flushes_lru() -> None:
    hot = [A, B, A, B]  # seen twice: ARC's T2
    scan = list(range(1000, 1020))  # one-time hashes, 5x the tier
    arc, lru = ARCPolicy(4), LRUPolicy(4)
    run_tier(arc, 4, hot + scan)
    run_tier(lru, 4, hot + scan)
    assert A in arc and B in arc
    assert A not in lru and B not in lru


def test_arc_ghost_hit_in_b1_grows_p_and_promotes() -> None:
    arc = build(ARCPolicy, [A, B], capacity=2)
    assert arc.victims(1, none_pinned) == [A]
    arc.remove(A)
    assert arc.snapshot() == ("arc", [B], [], [A], [], 0)
    arc.insert(A)
    assert arc.snapshot() == ("arc", [B], [A], [], [], 1)


def test_arc_ghost_step_is_ratio_of_ghost_lists() -> None:
    arc = build(ARCPolicy, [A, B, C, D], capacity=8)
    for block_hash in (A, B, C, D):
        arc.touch(block_hash)
        arc.remove(block_hash)  # evicted from T2: ghost in B2
    arc.insert(1)
    arc.remove(1)  # ghost in B1
    assert arc.snapshot() == ("arc", [], [], [1], [A, B, C, D], 0)
    arc.insert(1)  # step max(1, |B2| // |B1|) = 4
    assert arc.p == 4
    arc.insert(A)  # B2 hit: step max(1, |B1| // |B2|) = max(1, 0) = 1
    assert arc.snapshot() == ("arc", [], [1, A], [], [B, C, D], 3)


def test_arc_ghost_hit_in_b2_shrinks_p_by_ratio() -> None:
    arc = ARCPolicy(4)
    arc.insert(A)
    arc.touch(A)
    arc.remove(A)  # B2 = [A]
    for block_hash in (1, 2, 3, 4):
        arc.insert(block_hash)
        arc.remove(block_hash)  # B1 = [1, 2, 3, 4]: |T1| + |B1| <= 4 still holds
    arc.insert(3)  # B1 hit, step max(1, 1 // 4) = 1
    arc.insert(4)  # B1 hit, step max(1, 1 // 3) = 1
    assert arc.snapshot() == ("arc", [], [3, 4], [1, 2], [A], 2)
    arc.insert(A)  # B2 hit, step max(1, |B1| // |B2|) = 2
    assert arc.snapshot() == ("arc", [], [3, 4, A], [1, 2], [], 0)


def test_arc_directory_bound_trims_b2_first() -> None:
    # With the tier full, L1 + L2 <= 2 * capacity is restored by dropping B2's oldest ghost,
    # as in the paper's case IV(B); B1 is already bounded by |T1| + |B1| <= capacity.
    arc = ARCPolicy(2)
    run_tier(arc, 2, [B, B, C, C])
    arc.remove(B)
    arc.remove(C)
    run_tier(arc, 2, [A, A, 1])
    arc.remove(1)
    assert arc.snapshot() == ("arc", [], [A], [1], [B, C], 0)
    arc.insert(2)
    assert arc.snapshot() == ("arc", [2], [A], [1], [C], 0)


def test_arc_p_is_capped_by_capacity() -> None:
    arc = ARCPolicy(1)
    arc.insert(A)
    arc.remove(A)
    arc.insert(A)  # B1 hit: p = 1 = capacity
    arc.remove(A)
    arc.insert(B)
    arc.remove(B)
    assert arc.snapshot() == ("arc", [], [], [B], [A], 1)
    arc.insert(B)  # another B1 hit: p would be 2
    assert arc.snapshot() == ("arc", [], [B], [], [A], 1)


def test_arc_victims_follow_p_and_fall_back_to_the_other_list() -> None:
    arc = ARCPolicy(4)
    arc.insert(9)
    arc.remove(9)
    arc.insert(9)  # B1 hit: p = 1
    arc.remove(9, ghost=False)
    for block_hash in (C, D):
        arc.insert(block_hash)
        arc.touch(block_hash)
    arc.insert(A)
    arc.insert(B)
    assert arc.snapshot() == ("arc", [A, B], [C, D], [], [], 1)
    # |T1| = 2 > p: T1's coldest; then |T1| = 1 = p: T2.
    assert arc.victims(3, none_pinned) == [A, C, D]
    assert arc.victims(3, lambda h: h == A) == [B, C, D]
    # T2 has nothing evictable: T1 is used even though |T1| <= p.
    assert arc.victims(2, lambda h: h not in (A, B)) == [A, B]
    assert arc.victims(3, lambda h: h not in (A, B)) is None


def test_arc_removal_that_is_not_an_eviction_leaves_no_ghost() -> None:
    arc = build(ARCPolicy, [A, B], capacity=4)
    arc.touch(B)
    arc.remove(A, ghost=False)
    arc.remove(B, ghost=False)
    assert arc.snapshot() == ("arc", [], [], [], [], 0)


def test_arc_clear_forgets_ghosts_and_p() -> None:
    arc = build(ARCPolicy, [A, B], capacity=2)
    arc.remove(A)
    arc.insert(A)
    arc.remove(B)
    assert arc.p == 1 and len(arc) == 1
    arc.clear()
    assert arc.snapshot() == ("arc", [], [], [], [], 0)
    assert len(arc) == 0


def test_arc_ghosts_stay_bounded_by_capacity() -> None:
    # |T1| + |B1| <= capacity: with T1 holding 2 of 3 slots only the newest scan ghost stays.
    arc = ARCPolicy(3)
    run_tier(arc, 3, [A, A, *range(100)])
    assert arc.snapshot() == ("arc", [98, 99], [A], [97], [], 0)


def test_arc_rejects_bad_capacity() -> None:
    with pytest.raises(ConfigError):
        ARCPolicy(-1)


# --- purity and determinism --------------------------------------------------------------------


@pytest.mark.parametrize("cls", BOTH)
def test_victims_does_not_mutate(cls: PolicyClass) -> None:
    policy = cls(4)
    run_tier(policy, 4, [A, B, A, C, D, 1, 2, B])
    before = policy.snapshot()
    for count in range(6):
        policy.victims(count, none_pinned)
        policy.victims(count, lambda h: h % 2 == 1)
    assert policy.snapshot() == before


_ACCESSES = [7, 3, 7, 9, 1, 3, 12, 7, 2, 9, 9, 4, 1, 15, 3, 2, 8, 7, 11, 4] * 3
# The same tier loop as run_tier, self-contained so the child imports only kvflow.
_SNAPSHOT_SCRIPT = """
import json, sys
import msgspec
from kvflow.core.policies.registry import make_policy
policy = make_policy(sys.argv[1], 5)
for h in json.loads(sys.argv[2]):
    if h in policy:
        policy.touch(h)
        continue
    if len(policy) >= 5:
        policy.remove(policy.victims(1, lambda _: False)[0])
    policy.insert(h)
sys.stdout.write(msgspec.json.encode(policy.snapshot()).decode())
"""


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_same_ops_same_snapshot_across_processes(name: str) -> None:
    policy = make_policy(name, 5)
    run_tier(policy, 5, _ACCESSES)  # type: ignore[arg-type]
    local = msgspec.json.encode(policy.snapshot()).decode()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        remote = subprocess.run(
            [sys.executable, "-c", _SNAPSHOT_SCRIPT, name, json.dumps(_ACCESSES)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
            cwd=root,
        ).stdout
        assert remote == local


# --- registry ----------------------------------------------------------------------------------


def test_make_policy_builds_registered_policies() -> None:
    assert isinstance(make_policy("lru", 8), LRUPolicy)
    arc = make_policy("arc", 8)
    assert isinstance(arc, ARCPolicy) and arc.capacity == 8
    assert make_policy("arc", 8) is not arc  # fresh each time


def test_make_policy_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as excinfo:
        make_policy("fifo", 8)
    assert str(excinfo.value) == "unknown policy 'fifo'; known policies: arc, lru"


@pytest.mark.parametrize("capacity", [-1, 1.5, True])
def test_make_policy_rejects_bad_capacity(capacity: object) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        make_policy("lru", capacity)  # type: ignore[arg-type]


def test_register_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policies, "POLICIES", dict(POLICIES))

    class MRUForTest(LRUPolicy):
        __slots__ = ()
        name = "mru-test"

    register_policy("mru-test", MRUForTest)
    register_policy("mru-test", MRUForTest)  # same class again: no-op
    assert isinstance(policies.make_policy("mru-test", 2), MRUForTest)
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("lru", MRUForTest)
    assert "mru-test" not in POLICIES  # the real registry was untouched


# --- model-based -------------------------------------------------------------------------------

HASHES = st.integers(0, 11)  # small, so hashes come back after eviction (ghost hits)


class _PolicyMachine(RuleBasedStateMachine):
    """Shared rules: the policy under test against a list reference, op by op."""

    policy: LRUPolicy | ARCPolicy

    def reference_insert(self, block_hash: int) -> None:
        raise NotImplementedError

    def reference_touch(self, block_hash: int) -> None:
        raise NotImplementedError

    def reference_remove(self, block_hash: int, ghost: bool) -> None:
        raise NotImplementedError

    def reference_refresh(self, block_hash: int) -> None:
        raise NotImplementedError

    def reference_victims(self, count: int, evictable: Callable[[int], bool]) -> list[int] | None:
        raise NotImplementedError

    def reference_clear(self) -> None:
        raise NotImplementedError

    def reference_snapshot(self) -> object:
        raise NotImplementedError

    @rule(block_hash=HASHES)
    def insert(self, block_hash: int) -> None:
        if block_hash in self.policy.resident():
            with pytest.raises(ValueError):
                self.policy.insert(block_hash)
            return
        self.policy.insert(block_hash)
        self.reference_insert(block_hash)

    @precondition(lambda self: len(self.policy) > 0)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        block_hash = data.draw(st.sampled_from(self.policy.resident()))
        self.policy.touch(block_hash)
        self.reference_touch(block_hash)

    @precondition(lambda self: len(self.policy) > 0)
    @rule(data=st.data(), ghost=st.booleans())
    def remove(self, data: st.DataObject, ghost: bool) -> None:
        block_hash = data.draw(st.sampled_from(self.policy.resident()))
        self.policy.remove(block_hash, ghost=ghost)
        self.reference_remove(block_hash, ghost)

    @rule(count=st.integers(0, 6), pinned=st.frozensets(HASHES), evict=st.booleans())
    def victims(self, count: int, pinned: frozenset[int], evict: bool) -> None:
        def evictable(block_hash: int) -> bool:
            return block_hash not in pinned

        before = self.policy.snapshot()
        # (nothing pinned is passed as None, as the engine does: no call per hash)
        chosen = self.policy.victims(count, pinned.__contains__ if pinned else None)
        assert self.policy.snapshot() == before
        assert chosen == self.reference_victims(count, evictable)
        if chosen is None:
            evictable_count = sum(1 for h in self.policy.resident() if h not in pinned)
            assert evictable_count < count
            return
        assert len(chosen) == count == len(set(chosen))
        resident = self.policy.resident()
        assert all(h in resident and h not in pinned for h in chosen)
        if evict:  # what evolve does with an eviction decision
            for block_hash in chosen:
                self.policy.remove(block_hash)
                self.reference_remove(block_hash, True)

    # The bulk forms evolve calls, one per event: the reference applies the hashes one by
    # one. (Tier sizes are not enforced here, so ARC also meets overfilled tiers and runs of
    # ghost hits mixed with first sightings.)

    @rule(hashes=st.lists(HASHES, max_size=6))
    def insert_many(self, hashes: list[int]) -> None:
        resident = self.policy.resident()
        if len(set(hashes)) != len(hashes) or any(h in resident for h in hashes):
            before = self.policy.snapshot()
            with pytest.raises(ValueError, match="already resident"):
                self.policy.insert_many(tuple(hashes))
            assert self.policy.snapshot() == before  # all-or-nothing
            return
        self.policy.insert_many(tuple(hashes))
        for block_hash in hashes:
            self.reference_insert(block_hash)

    @rule(hashes=st.lists(HASHES, max_size=6, unique=True))
    def admit_new_many(self, hashes: list[int]) -> None:
        """The state's stores: hashes it knows are new (unchecked by the policy)."""
        resident = self.policy.resident()
        new = tuple(h for h in hashes if h not in resident)
        self.policy.admit_new_many(new)
        for block_hash in new:
            self.reference_insert(block_hash)

    @precondition(lambda self: len(self.policy) > 0)
    @rule(data=st.data())
    def touch_many(self, data: st.DataObject) -> None:
        hashes = data.draw(st.lists(st.sampled_from(self.policy.resident()), max_size=6))
        self.policy.touch_many(tuple(hashes))
        for block_hash in hashes:
            self.reference_touch(block_hash)

    @precondition(lambda self: len(self.policy) > 0)
    @rule(data=st.data())
    def refresh_many(self, data: st.DataObject) -> None:
        hashes = data.draw(st.lists(st.sampled_from(self.policy.resident()), max_size=6))
        self.policy.refresh_many(tuple(hashes))
        for block_hash in hashes:
            self.reference_refresh(block_hash)

    @precondition(lambda self: len(self.policy) > 0)
    @rule(data=st.data())
    def remove_many(self, data: st.DataObject) -> None:
        resident = self.policy.resident()
        hashes = data.draw(st.lists(st.sampled_from(resident), max_size=6, unique=True))
        self.policy.remove_many(tuple(hashes))
        for block_hash in hashes:
            self.reference_remove(block_hash, True)

    @rule()
    def clear(self) -> None:
        self.policy.clear()
        self.reference_clear()

    @invariant()
    def matches_reference(self) -> None:
        assert self.policy.snapshot() == self.reference_snapshot()


class LRUMachine(_PolicyMachine):
    policy: LRUPolicy

    def __init__(self) -> None:
        super().__init__()
        self.policy = LRUPolicy()
        self.order: list[int] = []  # coldest first

    def reference_insert(self, block_hash: int) -> None:
        self.order.append(block_hash)

    def reference_touch(self, block_hash: int) -> None:
        self.order.remove(block_hash)
        self.order.append(block_hash)

    def reference_refresh(self, block_hash: int) -> None:
        self.reference_touch(block_hash)

    def reference_remove(self, block_hash: int, ghost: bool) -> None:
        self.order.remove(block_hash)

    def reference_victims(self, count: int, evictable: Callable[[int], bool]) -> list[int] | None:
        candidates = [h for h in self.order if evictable(h)]
        return candidates[:count] if len(candidates) >= count else None

    def reference_clear(self) -> None:
        self.order = []

    def reference_snapshot(self) -> object:
        return ("lru", list(self.order))

    @invariant()
    def resident_in_order(self) -> None:
        assert self.policy.resident() == self.order
        assert len(self.policy) == len(self.order)


class ARCMachine(_PolicyMachine):
    """ARC against a plain-list transcription of the rules, whose ``victims`` mutates copies
    instead of walking cursors, plus the structural invariants."""

    policy: ARCPolicy

    def __init__(self) -> None:
        super().__init__()
        self.policy = ARCPolicy(4)
        self.capacity = 4
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[int] = []
        self.b2: list[int] = []
        self.p = 0

    @initialize(capacity=st.integers(0, 6))
    def sized(self, capacity: int) -> None:
        self.policy = ARCPolicy(capacity)
        self.capacity = capacity

    def _trim(self) -> None:
        while self.b1 and len(self.t1) + len(self.b1) > self.capacity:
            self.b1.pop(0)
        while (self.b1 or self.b2) and (
            len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity
        ):
            (self.b2 or self.b1).pop(0)

    def reference_insert(self, block_hash: int) -> None:
        if block_hash in self.b1:
            self.p = min(self.capacity, self.p + max(1, len(self.b2) // len(self.b1)))
            self.b1.remove(block_hash)
            self.t2.append(block_hash)
        elif block_hash in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // len(self.b2)))
            self.b2.remove(block_hash)
            self.t2.append(block_hash)
        else:
            self.t1.append(block_hash)
            self._trim()

    def reference_touch(self, block_hash: int) -> None:
        (self.t1 if block_hash in self.t1 else self.t2).remove(block_hash)
        self.t2.append(block_hash)

    def reference_refresh(self, block_hash: int) -> None:
        home = self.t1 if block_hash in self.t1 else self.t2
        home.remove(block_hash)
        home.append(block_hash)

    def reference_remove(self, block_hash: int, ghost: bool) -> None:
        source, ghosts = (self.t1, self.b1) if block_hash in self.t1 else (self.t2, self.b2)
        source.remove(block_hash)
        if ghost:
            ghosts.append(block_hash)
            self._trim()

    def reference_victims(self, count: int, evictable: Callable[[int], bool]) -> list[int] | None:
        t1, t2, chosen = list(self.t1), list(self.t2), []
        for _ in range(count):
            first1 = next((h for h in t1 if evictable(h)), None)
            first2 = next((h for h in t2 if evictable(h)), None)
            if first1 is not None and (len(t1) > self.p or first2 is None):
                t1.remove(first1)
                chosen.append(first1)
            elif first2 is not None:
                t2.remove(first2)
                chosen.append(first2)
            else:
                return None
        return chosen

    def reference_clear(self) -> None:
        self.t1, self.t2, self.b1, self.b2, self.p = [], [], [], [], 0

    def reference_snapshot(self) -> object:
        return ("arc", self.t1, self.t2, self.b1, self.b2, self.p)

    @invariant()
    def structure(self) -> None:
        _, t1, t2, b1, b2, p = self.policy.snapshot()
        capacity = self.capacity
        everything = t1 + t2 + b1 + b2
        assert len(everything) == len(set(everything))  # the four lists are disjoint
        assert len(self.policy) == len(t1) + len(t2)
        assert sorted(self.policy.resident()) == sorted(t1 + t2)
        assert 0 <= p <= capacity
        # The paper's bounds, relaxed only when the residents alone exceed the capacity.
        assert len(b1) <= max(0, capacity - len(t1))
        assert len(b1) + len(b2) <= max(0, 2 * capacity - len(t1) - len(t2))
        assert len(b1) <= capacity and len(b1) + len(b2) <= 2 * capacity


_machine_settings = settings(stateful_step_count=60)  # examples: the profile's (tests/conftest.py)
TestLRUModel = LRUMachine.TestCase
TestLRUModel.settings = _machine_settings
TestARCModel = ARCMachine.TestCase
TestARCModel.settings = _machine_settings


# --- bulk forms equal the one-by-one methods -----------------------------------------------

BULK_OPS = ("insert", "touch", "refresh", "remove")


def _random_history(policy: Any, rng: Any, capacity: int, fresh: Any) -> None:
    """Inserts (fresh and ghost hits), touches, refreshes and removals, residents <= capacity."""
    for _ in range(rng.randint(0, 60)):
        resident = policy.resident()
        r = rng.random()
        if r < 0.5 and len(resident) < capacity:
            ghosts = [*getattr(policy, "_b1", ()), *getattr(policy, "_b2", ())]
            policy.insert(rng.choice(ghosts) if ghosts and rng.random() < 0.3 else fresh())
        elif r < 0.65 and resident:
            policy.remove(rng.choice(resident))
        elif r < 0.85 and resident:
            policy.touch(rng.choice(resident))
        elif resident:
            policy.refresh(rng.choice(resident))


def _policy_after_history(cls: Any, rng: Any) -> tuple[Any, int, Any]:
    """A policy of a random small capacity after ``_random_history``; with its capacity and
    the counter its fresh hashes came from (later fresh hashes continue it)."""
    capacity = rng.randint(1, 10)
    policy = cls(capacity)
    counter = iter(range(1, 10**6))
    _random_history(policy, rng, capacity, lambda: next(counter))
    return policy, capacity, counter


def _bulk_hashes(policy: Any, rng: Any, capacity: int, counter: Any, op: str) -> tuple[int, ...]:
    """Hashes for ``{op}_many`` as evolve hands them: new ones (fresh or ghosts) that fit for
    an insert, distinct residents for a removal, residents (maybe one twice) otherwise."""
    resident = policy.resident()
    if op == "insert":
        room = capacity - len(resident)
        ghosts = [*getattr(policy, "_b1", ()), *getattr(policy, "_b2", ())]
        pool = [next(counter) for _ in range(room)] + rng.sample(ghosts, min(len(ghosts), rng.randint(0, 2)))
        return tuple(rng.sample(pool, min(len(pool), rng.randint(0, room))))
    hashes = tuple(rng.sample(resident, rng.randint(0, len(resident))))
    if op in ("touch", "refresh") and hashes and rng.random() < 0.2:
        hashes += (hashes[0],)  # a touch may name a block twice: the bulk form must match
    return hashes


@pytest.mark.parametrize("cls", BOTH)
@pytest.mark.parametrize("op", BULK_OPS)
def test_bulk_forms_equal_the_one_by_one_methods(cls: PolicyClass, op: str) -> None:
    """On the inputs evolve hands them (policies/arc.py: resident where needed, distinct
    for stores and evictions), including ghost hits and full tiers."""
    import copy
    import random

    rng = random.Random(f"{cls.name}-{op}")
    compared = 0
    for _ in range(1500):
        policy, capacity, counter = _policy_after_history(cls, rng)
        hashes = _bulk_hashes(policy, rng, capacity, counter, op)
        one_by_one = copy.deepcopy(policy)
        for h in hashes:
            getattr(one_by_one, op)(h)
        getattr(policy, f"{op}_many")(hashes)
        assert policy.snapshot() == one_by_one.snapshot(), (op, hashes)
        compared += bool(hashes)
    assert compared > 500


def test_arc_ghost_steps_equal_the_papers_step_per_hit() -> None:
    """A run of ghost hits moves p by the sum of the paper's per-hit steps, whatever the
    lengths (the quotient-0 shortcut included)."""
    from kvflow.core.policies.arc_runs import ghost_steps as _ghost_steps

    for other in range(0, 30):
        for own in range(1, 30):
            for hits in range(1, own + 1):
                one_by_one = sum(max(1, other // length) for length in range(own - hits + 1, own + 1))
                assert _ghost_steps(other, own, hits) == one_by_one, (other, own, hits)


@pytest.mark.parametrize("cls", BOTH)
def test_refreshing_the_hashes_just_moved_equals_one_by_one(cls: PolicyClass) -> None:
    """``refresh_many`` skips the hashes of the last bulk insert / touch / refresh when
    nothing changed since: the result must still be the one-by-one refreshes', whatever
    happened in between (single-hash moves, inserts, removals of other hashes, touches)."""
    import copy
    import random

    rng = random.Random(f"{cls.name}-again")
    skipped = 0
    for _ in range(1500):
        policy, capacity, counter = _policy_after_history(cls, rng)
        hashes = _bulk_hashes(policy, rng, capacity, counter, rng.choice(("insert", "touch", "refresh")))
        op = "insert" if not set(hashes) <= set(policy.resident()) else rng.choice(("touch", "refresh"))
        getattr(policy, f"{op}_many")(hashes)
        if rng.random() < 0.4:  # something in between that keeps ``hashes`` resident
            others = [h for h in policy.resident() if h not in hashes]
            between = rng.choice(("insert", "touch", "refresh", "touch_many", "remove_many"))
            if between == "insert" and len(policy) < capacity:
                policy.insert(next(counter))
            elif between == "remove_many":
                policy.remove_many(tuple(rng.sample(others, min(len(others), 1))))
            elif between in ("touch", "refresh") and policy.resident():
                getattr(policy, between)(rng.choice(policy.resident()))
            elif between == "touch_many":
                policy.touch_many(hashes[:1])
        else:
            skipped += bool(hashes)
        again = tuple(list(hashes)) if rng.random() < 0.5 else hashes  # equal, or the same tuple
        one_by_one = copy.deepcopy(policy)
        for h in again:
            one_by_one.refresh(h)
        policy.refresh_many(again)
        assert policy.snapshot() == one_by_one.snapshot(), (op, hashes)
    assert skipped > 400


@pytest.mark.parametrize("cls", BOTH)
def test_refreshing_the_hashes_just_moved_after_a_removal_still_raises(cls: PolicyClass) -> None:
    policy = cls(8)
    policy.insert_many((A, B, C))
    policy.touch_many((B, C))
    policy.remove_many((C,))
    with pytest.raises(KeyError):
        policy.refresh_many((B, C))


def test_arc_touch_after_a_refresh_of_the_same_hashes_still_promotes() -> None:
    """Only a refresh is skipped: a touch of just-refreshed T1 members moves them to T2."""
    policy = ARCPolicy(8)
    policy.insert_many((A, B))
    policy.refresh_many((A, B))
    policy.touch_many((A, B))
    assert policy.snapshot() == ("arc", [], [A, B], [], [], 0)


@pytest.mark.parametrize("cls", BOTH)
def test_victims_with_nothing_pinned_equal_victims_with_a_never_pinned_test(cls: PolicyClass) -> None:
    """``pinned=None`` skips the call per hash: same victims, same order, same None."""
    import random

    rng = random.Random(f"{cls.name}-none-pinned")
    for _ in range(1000):
        policy, capacity, counter = _policy_after_history(cls, rng)
        for count in range(len(policy) + 2):
            assert policy.victims(count, None) == policy.victims(count, none_pinned), count


def _chain_refresh(policy: Any, rng: Any, stored: tuple[int, ...]) -> tuple[int, ...]:
    """A request's end as the engine sends it: the chain deepest first, its new blocks (the
    store just admitted, in reverse) then its hits (often the newest of T2, or of LRU's order,
    in order)."""
    t2 = policy.snapshot()[2] if isinstance(policy, ARCPolicy) else policy.resident()
    hits = t2[len(t2) - rng.randint(0, len(t2)) :] if rng.random() < 0.5 else rng.sample(t2, rng.randint(0, len(t2)))
    head = tuple(reversed(stored)) if rng.random() < 0.8 else tuple(rng.sample(stored, len(stored)))
    return head + tuple(h for h in hits if h not in stored)


@pytest.mark.parametrize("policy_type", [ARCPolicy, LRUPolicy])
def test_admitted_store_then_any_operation_equals_one_by_one(policy_type: Any) -> None:
    """``admit_new_many`` (the state's stores) adds its hashes when the policy is next used
    (in a following chain refresh's order when that refresh starts with them reversed):
    whatever comes next must see what inserting them one by one would have left."""
    import copy
    import random

    rng = random.Random(f"{policy_type.name}-admit")
    follow_ups = ("chain", "refresh_many", "touch_many", "remove_many", "evict", "victims", "admit", "read")
    seen = dict.fromkeys(follow_ups, 0)
    for _ in range(3000):
        policy, capacity, counter = _policy_after_history(policy_type, rng)
        stored = _bulk_hashes(policy, rng, capacity, counter, "insert")
        one_by_one = copy.deepcopy(policy)
        policy.admit_new_many(stored)
        for h in stored:
            one_by_one.insert(h)
        follow_up = rng.choice(follow_ups)
        resident = one_by_one.resident()
        if follow_up == "chain":
            hashes = _chain_refresh(one_by_one, rng, stored)
            policy.refresh_many(hashes)
            for h in hashes:
                one_by_one.refresh(h)
        elif follow_up in ("refresh_many", "touch_many"):
            hashes = tuple(rng.choices(resident, k=rng.randint(0, 6))) if resident else ()
            getattr(policy, follow_up)(hashes)
            for h in hashes:
                getattr(one_by_one, follow_up.removesuffix("_many"))(h)
        elif follow_up in ("remove_many", "evict"):
            chosen = one_by_one.victims(rng.randint(0, len(resident)), None)
            hashes = tuple(chosen or ()) if follow_up == "evict" else tuple(rng.sample(resident, rng.randint(0, len(resident))))
            policy.remove_many(hashes)
            for h in hashes:
                one_by_one.remove(h)
        elif follow_up == "victims":
            count = rng.randint(0, len(resident) + 1)
            assert policy.victims(count, None) == one_by_one.victims(count, None)
        elif follow_up == "admit":
            more = _bulk_hashes(one_by_one, rng, capacity, counter, "insert")
            policy.admit_new_many(more)
            for h in more:
                one_by_one.insert(h)
        else:
            assert len(policy) == len(one_by_one)
            assert all(h in policy for h in resident) and next(counter) not in policy
            assert repr(policy) == repr(one_by_one)
        assert policy.snapshot() == one_by_one.snapshot(), (follow_up, stored)
        seen[follow_up] += bool(stored)
    assert min(seen.values()) > 100, seen


@pytest.mark.parametrize("op", ["touch_many", "refresh_many"])
def test_arc_bulk_reorder_of_a_hash_not_resident_raises_key_error(op: str) -> None:
    """A run ends where a list lacks the next hash; a hash in neither list is an error."""
    policy = ARCPolicy(8)
    policy.insert_many((A, B, C))
    policy.touch_many((C,))
    for hashes in ((D,), (A, D), (A, C, D), (C, D, A), (A, C, A, D)):
        with pytest.raises(KeyError):
            getattr(policy, op)(hashes)
