"""Block names: hashes of up to 256 bits and tenants in the engine API, the 64-bit keys the
decisions use, collisions detected rather than served, and tenants kept apart (F21)."""

from __future__ import annotations

import hashlib

import pytest
from core_helpers import consistent, manager, store, tokens

from kvflow.core.errors import Rejected
from kvflow.core.jobs import REMOTE_STORE
from kvflow.core.names import (
    NO_TENANT,
    BlockName,
    BlockNames,
    full_hash,
    name_of,
    tenant_id,
    tier_names,
)

SHA = [int.from_bytes(hashlib.sha256(b"block %d" % i).digest(), "big") for i in range(8)]


def test_a_64_bit_hash_without_a_tenant_is_its_own_key_and_any_other_gets_a_derived_one() -> None:
    assert name_of(5).key == 5 and name_of(-(2**63)).key == -(2**63)
    for wide in (2**63, 2**64 - 1, SHA[0], -(2**255)):
        key = name_of(wide).key
        assert 2**63 <= key < 2**64  # (never one of the first kind: those cannot collide with it)
    assert name_of(5, tenant_id("a")).key >= 2**63
    assert name_of(5, tenant_id("a")) != name_of(5, tenant_id("b"))
    assert name_of(SHA[0]).full == full_hash(SHA[0]) == SHA[0].to_bytes(32, "little")
    assert tenant_id(None) == tenant_id("") == NO_TENANT and len(tenant_id("a")) == 16


def test_full_width_hashes_hit_store_and_replay_like_64_bit_ones() -> None:
    m = manager()
    store(m, "a", SHA[:3], [1, 2, 3])
    assert m.lookup("b", SHA[:4], tokens(4)) == 3
    assert m.lookup("c", [SHA[3], SHA[0]], tokens(2)) == 0
    m.accept_hits("b", [])  # (its offer pinned them)
    assert m.touch(SHA[:2]) == 2 and m.invalidate([SHA[2]]) == 1
    consistent(m)  # (the trace holds the keys: folding it rebuilds the state)


def test_F21_a_block_stored_for_one_tenant_never_hits_for_another() -> None:
    m = manager(cpu_blocks=8)
    store(m, "a", [1, 2], [1, 2])  # no tenant
    job = m.blocks_computed("b", [1, 2], [3, 4], tenant="tenant-b")
    assert job is not None  # the same hashes for a tenant are other blocks: stored again
    for j in m.plan_step(0.0):
        m.job_result(j.job_id)
    assert m.lookup("x", [1, 2], tokens(2), tenant="tenant-c") == 0
    assert m.lookup("y", [1, 2], tokens(2), tenant="tenant-b") == 2
    assert m.lookup("z", [1, 2], tokens(2)) == 2
    assert m.lookup("w", [SHA[0]], tokens(1), tenant="tenant-b") == 0
    assert m.touch([1, 2], tenant="tenant-c") == 0 and m.invalidate([1, 2], tenant="tenant-c") == 0
    assert m.state.num_resident() == 4
    consistent(m)


def test_F21_a_remote_job_names_each_block_by_its_full_hash_and_tenant() -> None:
    m = manager(remote_blocks=100)  # write-through: a store goes on to the remote tier
    store(m, "a", [SHA[0], 7], [1, 2])
    m.blocks_computed("b", [7], [3], tenant="t")
    jobs = m.plan_step(0.0)
    pushes = [j for j in jobs if j.direction == REMOTE_STORE]
    assert pushes and all(len(j.names) == len(j.hashes) for j in pushes)
    names = {n.key: n for j in pushes for n in j.names}
    assert names[name_of(SHA[0]).key] == BlockName(
        name_of(SHA[0]).key, full_hash(SHA[0]), NO_TENANT
    )
    assert names[7] == BlockName(7, full_hash(7), NO_TENANT)


def test_a_job_whose_keys_are_all_their_own_hashes_is_named_by_the_tier() -> None:
    m = manager(remote_blocks=100)
    store(m, "a", [7, -8, 2**63 - 1], [1, 2, 3])
    (push,) = [j for j in m.plan_step(0.0) if j.direction == REMOTE_STORE]
    assert push.names == ()  # (the engine thread names nothing)
    assert tier_names(push.hashes, push.names) == tuple(name_of(h) for h in (7, -8, 2**63 - 1))


def test_tier_names_are_the_engines_when_given_and_an_unnamed_derived_key_gets_an_empty_name() -> None:
    given = (name_of(SHA[0]), name_of(7, tenant_id("t")))
    assert tier_names([n.key for n in given], given) == given
    derived = name_of(SHA[1]).key
    assert tier_names([3, derived], ()) == (name_of(3), BlockName(derived, b""))  # a tier fails that job


def test_lookup_and_probe_computes_keys_once_and_remembers_the_candidates_names() -> None:
    m = manager(cpu_blocks=8, remote_blocks=100)
    m.blocks_computed("a", SHA[:2], [1, 2], tenant="t")
    while jobs := m.plan_step(0.0):  # the store, then its write-through
        for j in jobs:
            m.job_result(j.job_id)
    hits, keys, names = m.lookup_and_probe("b", SHA[:5], tokens(5), tenant="t")
    assert hits == 2
    assert names == [name_of(h, tenant_id("t")) for h in SHA[2:5]] and keys == [n.key for n in names]
    assert all(m.names.name(n.key) == n for n in names)  # what the probe finds joins by key
    assert m.lookup_and_probe("c", [5, 6], tokens(2)) == (0, [5, 6], [])  # the tier names those
    m.accept_hits("b", [])
    consistent(m)


def test_a_key_collision_is_detected_and_never_served() -> None:
    """Two names can share only a derived key (63 bits); the second one to come is treated
    as absent from there on: no hit, no store, counted."""
    m = manager(cpu_blocks=8)
    store(m, "a", SHA[:2], [1, 2])
    victim = name_of(SHA[1]).key
    # another block whose derived key happens to be the same (planted: 2**-63 in practice)
    intruder = 2**200 + 12345
    m.names.table.pop(victim)
    m.names.add([BlockName(victim, full_hash(intruder), NO_TENANT)])
    assert m.lookup("b", SHA[:3], tokens(3)) == 1  # stops before the block whose key is taken
    assert m.names.collisions == 1
    resident = set(m.state.slot_of)
    assert m.blocks_computed("c", [SHA[1]], [5]) is None  # nothing of it is stored either
    assert set(m.state.slot_of) == resident and m.state.jobs == {}
    assert m.names.collisions == 2
    consistent(m)


def test_a_refused_call_remembers_no_name() -> None:
    m = manager()
    with pytest.raises(Rejected):
        m.blocks_computed("a", [SHA[0], SHA[1]], [1])  # lengths differ
    with pytest.raises(Rejected):
        m.lookup("a", [SHA[0], 2**256], tokens(2))
    assert m.names.table == {}


def test_names_of_blocks_no_tier_holds_are_forgotten_and_the_rest_kept() -> None:
    names = BlockNames()
    held = name_of(SHA[0])
    names.add([held])
    for i in range(3 * 2**16):
        names.add([name_of(2**100 + i)])
        names.prune(lambda key: key == held.key)
    assert len(names.table) <= 2 * 2**16 and names.name(held.key) == held
    assert names.name(5) == BlockName(5, full_hash(5), NO_TENANT)  # own keys need no table


def test_a_warm_restart_refuses_a_name_whose_key_does_not_match() -> None:
    m = manager(disk_blocks=4)
    good, forged = name_of(SHA[0]), BlockName(name_of(SHA[0]).key, full_hash(SHA[1]), NO_TENANT)
    assert m.disk_restored([(0, forged), (1, good)]) == 1
    assert m.state.disk is not None and m.state.disk.slot_of == {good.key: 1}
    with pytest.raises(Rejected):
        m.disk_restored([(2, 5)])  # type: ignore[list-item]
