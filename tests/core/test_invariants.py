"""``check_invariants`` finds each kind of corruption (and names it), and stays silent on
consistent states. The states are built through the real manager, then one field is broken
by hand, as a bug in evolve would break it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from core_helpers import manager, store, tokens

from kvflow.core.state.invariants import check_invariants
from kvflow.core.state.tables import JobState
from kvflow.engine.manager import OffloadManager


def busy() -> OffloadManager:
    """Resident blocks (one pinned by a lookup), a queued store and an in-flight load."""
    m = manager(cpu_blocks=8)
    store(m, "a", [1, 2, 3], [0, 1, 2])
    assert m.lookup("b", [1, 2, 3], tokens(3)) == 3
    m.accept_hits("b", [10, 11])  # load of 1, 2 queued; the pin on 3 is released
    m.plan_step(1.0)  # the load is in flight
    assert m.lookup("c", [3], tokens(1)) == 1  # 3 pinned by c's offer
    m.blocks_computed("d", [7, 8], [20, 21])  # a queued store
    assert check_invariants(m.state) == []
    return m


def dup_slot(m: OffloadManager) -> None:
    m.state.free_slots.freed[m.state.slot_of[1]] = None


def lost_slot(m: OffloadManager) -> None:
    m.state.free_slots.fresh += 1  # the next never-used slot is neither free nor owned


def wild_slot(m: OffloadManager) -> None:
    m.state.free_slots.freed[99] = None


def never_handed_out(m: OffloadManager) -> None:
    m.state.slot_of[1] = 7  # a slot the free stack still holds among the never-used ones


def extra_pin(m: OffloadManager) -> None:
    m.state.pin_count[3] += 1


def pin_off_tier(m: OffloadManager) -> None:
    m.state.pin_count[12345] = 1


def pending_without_job(m: OffloadManager) -> None:
    m.state.pending[1] = 777  # resident block 1 claimed by a job that does not exist


def policy_forgets(m: OffloadManager) -> None:
    m.state.policy.remove(2)


def stray_hold(m: OffloadManager) -> None:
    m.state.held[555] = 1


def request_lists_dead_job(m: OffloadManager) -> None:
    m.state.requests["b"].jobs[999] = None


def job_state_index(m: OffloadManager) -> None:
    job = next(j for j in m.state.jobs.values() if j.state is JobState.QUEUED)
    job.state = JobState.IN_FLIGHT  # but still in the queued index


def entries_sum_astray(m: OffloadManager) -> None:
    m.state.tally.entries += 1


def free_sum_astray(m: OffloadManager) -> None:
    m.state.free_slots.tally += 1


def fence_stray(m: OffloadManager) -> None:
    (slot,) = m.state.free_slots.top(1)
    m.state.free_slots.take(1)
    m.state.fenced_slots[slot] = (4242,)


def chain_tuple_astray(m: OffloadManager) -> None:
    req = m.state.requests["d"]  # its chain (7, 8), named by its store alone: kept as the tuple
    assert req.chain_order == (7, 8)
    req._chain = {7: None}


def chain_whole_astray(m: OffloadManager) -> None:
    req = m.state.requests["d"]
    assert req.chain_whole_at == m.state.departures  # (its store put its whole chain on the tier)
    req.chain_order = (7, 8, 4444)


CASES: list[tuple[Callable[[OffloadManager], None], str]] = [
    (chain_tuple_astray, "request d: its chain's tuple is not its chain"),
    (chain_whole_astray, "request d: its chain is marked whole on the tier but is not"),
    (dup_slot, "owned twice"),
    (lost_slot, "!= capacity 8"),
    (wild_slot, "slot 99 outside 0..7"),
    (never_handed_out, "slot 7 was never handed out (free from 5 up) but is block 1"),
    (extra_pin, "block 3 has 2 pins but requests hold 1"),
    (pin_off_tier, "pins on block 12345 which is not on the tier"),
    (pending_without_job, "block 1 (STORING) has no live store job"),
    (policy_forgets, "policy tracks"),
    (stray_hold, "device-block holds do not match the live jobs"),
    (request_lists_dead_job, "request b lists job 999 which is not live"),
    (job_state_index, "queued index disagrees"),
    (fence_stray, "fenced for job 4242"),
    (entries_sum_astray, "the digest's sum over the entries does not match"),
    (free_sum_astray, "the digest's sum over the free slots does not match"),
]


@pytest.mark.parametrize("corrupt, message", CASES, ids=[c.__name__ for c, _ in CASES])
def test_each_corruption_is_found_and_named(corrupt: Callable[[OffloadManager], None], message: str) -> None:
    m = busy()
    corrupt(m)
    problems = check_invariants(m.state)
    assert any(message in p for p in problems), problems


def test_a_consistent_state_has_no_problems_at_every_step() -> None:
    m = manager(cpu_blocks=4)
    for i in range(12):
        hashes = [i, i + 1, i + 2]
        hits = m.lookup(f"r{i}", hashes, tokens(3))
        if hits:
            m.accept_hits(f"r{i}", list(range(100 + 3 * i, 100 + 3 * i + hits)))
        m.blocks_computed(f"r{i}", hashes, [10 * i, 10 * i + 1, 10 * i + 2])
        for job in m.plan_step(float(i)):
            m.job_result(job.job_id, ok=job.job_id % 3 != 0, error="x")
        m.finish_request(f"r{i}")
        assert check_invariants(m.state) == []
