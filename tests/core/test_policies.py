"""Eviction policies: ordering, all-or-nothing victims (F8), the chain rule (F14), ARC's
adaptation, determinism, the registry (built-in names and classes of one's own), the bulk
forms of the base class, and model-based checks against list references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

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

from kvflow.core.errors import ConfigError, PolicyError
from kvflow.core.policies.arc import ARCPolicy
from kvflow.core.policies.lru import LRUPolicy
from kvflow.core.policies.registry import POLICIES, make_policy, policy_class

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
    arc.remove(9)  # a ghost in B2 now (ghosts play no part in victims)
    for block_hash in (C, D):
        arc.insert(block_hash)
        arc.touch(block_hash)
    arc.insert(A)
    arc.insert(B)
    assert arc.snapshot() == ("arc", [A, B], [C, D], [], [9], 1)
    # |T1| = 2 > p: T1's coldest; then |T1| = 1 = p: T2.
    assert arc.victims(3, none_pinned) == [A, C, D]
    assert arc.victims(3, lambda h: h == A) == [B, C, D]
    # T2 has nothing evictable: T1 is used even though |T1| <= p.
    assert arc.victims(2, lambda h: h not in (A, B)) == [A, B]
    assert arc.victims(3, lambda h: h not in (A, B)) is None


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
    assert str(excinfo.value) == (
        "unknown policy 'fifo'; known policies: arc, lru, or a class of your own as 'module:Class'"
    )


@pytest.mark.parametrize("capacity", [-1, 1.5, True])
def test_make_policy_rejects_bad_capacity(capacity: object) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        make_policy("lru", capacity)  # type: ignore[arg-type]


def test_a_class_of_ones_own_is_named_by_module_and_class() -> None:
    name = f"{__name__}:MRUForTest"
    assert policy_class(name) is MRUForTest
    policy = make_policy(name, 4)
    assert isinstance(policy, MRUForTest)
    for h in (A, B, C):
        policy.insert(h)
    assert policy.victims(2, none_pinned) == [C, B]
    assert "mru" not in POLICIES  # nothing is registered by loading it


class MRUForTest(LRUPolicy):
    """Most recently used first: a user's subclass of a built-in."""

    __slots__ = ()
    name = ""  # (named by its module path, as a user's class is)

    def victims(self, num_blocks: int, pinned: Callable[[int], bool]) -> list[int] | None:
        chosen = [h for h in reversed(self.resident()) if not pinned(h)][:num_blocks]
        return chosen if len(chosen) == num_blocks else None


# --- model-based -------------------------------------------------------------------------------

HASHES = st.integers(0, 11)  # small, so hashes come back after eviction (ghost hits)


class _PolicyMachine(RuleBasedStateMachine):
    """Shared rules: the policy under test against a list reference, op by op."""

    policy: LRUPolicy | ARCPolicy

    def reference_insert(self, block_hash: int) -> None:
        raise NotImplementedError

    def reference_touch(self, block_hash: int) -> None:
        raise NotImplementedError

    def reference_remove(self, block_hash: int) -> None:
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
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block_hash = data.draw(st.sampled_from(self.policy.resident()))
        self.policy.remove(block_hash)
        self.reference_remove(block_hash)

    @rule(count=st.integers(0, 6), pinned=st.frozensets(HASHES), evict=st.booleans())
    def victims(self, count: int, pinned: frozenset[int], evict: bool) -> None:
        def evictable(block_hash: int) -> bool:
            return block_hash not in pinned

        before = self.policy.snapshot()
        chosen = self.policy.victims(count, pinned.__contains__)
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
                self.reference_remove(block_hash)

    # The bulk forms the state calls, one per event (the base class's: each hash in turn),
    # on the inputs the state gives them. (Tier sizes are not enforced here, so ARC also meets
    # overfilled tiers and runs of ghost hits mixed with first sightings.)

    @rule(hashes=st.lists(HASHES, max_size=6, unique=True))
    def insert_many(self, hashes: list[int]) -> None:
        """The state's stores: new hashes, each once."""
        resident = self.policy.resident()
        new = tuple(h for h in hashes if h not in resident)
        self.policy.insert_many(new)
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
            self.reference_remove(block_hash)

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

    def reference_remove(self, block_hash: int) -> None:
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

    def reference_remove(self, block_hash: int) -> None:
        source, ghosts = (self.t1, self.b1) if block_hash in self.t1 else (self.t2, self.b2)
        source.remove(block_hash)
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


# --- the bulk forms: the base class's, and what a failing policy turns into ---------------------


@pytest.mark.parametrize("cls", BOTH)
def test_a_bulk_form_that_fails_is_a_policy_error_naming_the_call_and_the_block(cls: PolicyClass) -> None:
    policy = build(cls, [A, B])
    for method, hashes, culprit in (
        ("touch", (A, D), D),
        ("refresh", (B, C), C),
        ("remove", (C,), C),
        ("insert", (D, A), A),
    ):
        with pytest.raises(PolicyError) as caught:
            getattr(policy, f"{method}_many")(hashes)
        message = str(caught.value)
        assert message.startswith(f"policy '{cls.name}': {method}({culprit}) raised ")
        assert "\n" not in message


def test_a_bulk_form_names_a_class_of_ones_own_by_module_and_class() -> None:
    policy = MRUForTest(4)
    with pytest.raises(PolicyError, match=rf"^policy '{__name__}:MRUForTest': touch\({A}\) raised KeyError"):
        policy.touch_many((A,))
