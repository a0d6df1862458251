"""F14: within a chain, tails are evicted before heads whatever order its stores land in.

Recency inside a chain is kvflow's own rule (``Config.chain_recency``, on for new configs):
each request's chain (the hashes its lookups and stores name, in prefix order) is kept in the
state; ``accept_hits`` touches the hits it loads deepest first (DESIGN §7 rule 2) and
``finish_request`` touches the chain's blocks on the tier deepest first (rule 4), never from
when each store happens to land: a touch of a block still being stored is kept on its store
job and applied when it lands. An engine's own ``touch`` adds recency on top.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.core.config import Config, config_from_dict
from kvflow.core.events import BlocksEvicted, BlocksTouched, ChainExtended
from kvflow.core.state.invariants import check_invariants
from kvflow.engine.manager import OffloadManager
from kvflow.replay.fold import replay

BT = 4


def manager(cpu_blocks: int, policy: str = "lru", chain_recency: bool = True) -> OffloadManager:
    return OffloadManager(Config(cpu_blocks=cpu_blocks, block_tokens=BT, policy=policy, chain_recency=chain_recency))


def eviction_order(m: OffloadManager, n: int) -> list[int]:
    """Evict ``n`` blocks one at a time; the hashes in the order they went."""
    order = []
    for _ in range(n):
        m.evict(1)
        (event,) = [e for e in m.log.events()[-1:] if isinstance(e, BlocksEvicted)]
        order.extend(event.hashes)
    return order


@pytest.mark.parametrize("chain_recency", [True, False])
def test_F14_a_chain_whose_tail_lands_after_the_finish_loses_its_tail_first(chain_recency: bool) -> None:
    """The issue's case: chain [1,2,3,4]; the store of [1,2] landed, the store of [3,4] is
    still in flight when the request finishes; when [3,4] lands, the next eviction takes 4
    (not 2, which would orphan 3 and 4). With chain recency the finish does it, with no
    touch at all; without it, the engine's touch at the finish does (deepest first)."""
    m = manager(cpu_blocks=8, chain_recency=chain_recency)
    head = m.blocks_computed("r", [1, 2], [10, 11])
    tail = m.blocks_computed("r", [3, 4], [12, 13])
    m.plan_step(0.0)
    m.job_result(head)
    if not chain_recency:
        assert m.touch([4, 3, 2, 1], reuse=False) == 4  # 3 and 4 are on the tier, still storing
    m.finish_request("r")
    m.job_result(tail)  # lands after the finish's touch: the touch is applied now
    assert eviction_order(m, 4) == [4, 3, 2, 1]
    assert check_invariants(m.state) == []


def test_F14_without_chain_recency_and_no_touch_the_head_goes_first() -> None:
    """The gap chain recency closes: an engine that never touches leaves the chain in the
    order its stores landed, so the head (stored first) is evicted first."""
    m = manager(cpu_blocks=8, chain_recency=False)
    head = m.blocks_computed("r", [1, 2], [10, 11])
    tail = m.blocks_computed("r", [3, 4], [12, 13])
    m.plan_step(0.0)
    m.job_result(head)
    m.finish_request("r")
    m.job_result(tail)
    assert eviction_order(m, 4) == [1, 2, 3, 4]
    assert not any(isinstance(e, (ChainExtended, BlocksTouched)) for e in m.log.events())


def test_the_chain_is_what_lookups_and_stores_name_in_prefix_order() -> None:
    """A lookup names the prompt's blocks; later stores add the blocks decode fills (each
    hash once); the finish touches the ones on the tier deepest first, reuse=False."""
    m = manager(cpu_blocks=8)
    m.blocks_computed("w", [1, 2], [10, 11])
    m.plan_step(0.0)
    m.job_result(1)
    m.finish_request("w")
    assert m.lookup("r", [1, 2, 3], 3 * BT) == 2
    m.accept_hits("r", [20, 21])
    store = m.blocks_computed("r", [3, 4, 3], [22, 23, 24])  # 3 named twice: stored once
    assert list(m.state.requests["r"].chain) == [1, 2, 3, 4]
    extended = [e.hashes for e in m.log.events() if isinstance(e, ChainExtended) and e.request_id == "r"]
    assert extended == [(1, 2, 3), (3, 4, 3)]  # (what each call named; 4 was new)
    m.plan_step(1.0)
    m.job_result(2)  # the load
    m.job_result(store)
    start = len(m.log.events())
    m.finish_request("r")
    (touch,) = [e for e in m.log.events()[start:] if isinstance(e, BlocksTouched)]
    assert touch.hashes == (4, 3, 2, 1) and touch.reuse is False
    assert "r" not in m.state.requests  # closed: its chain goes with it
    assert check_invariants(m.state) == []


def test_accept_hits_touches_the_hits_it_loads_deepest_first() -> None:
    """DESIGN §7 rule 2: the loaded hits are used again now (reuse=True), deepest first, so
    the request's own stores evict other blocks before the prefix they extend."""
    m = manager(cpu_blocks=4)
    m.blocks_computed("w", [1, 2, 3], [10, 11, 12])
    m.plan_step(0.0)
    m.job_result(1)
    m.finish_request("w")
    assert m.lookup("r", [1, 2, 3, 4], 4 * BT) == 3
    start = len(m.log.events())
    m.accept_hits("r", [20, 21])  # loads 1 and 2; 3 is released
    touches = [e for e in m.log.events()[start:] if isinstance(e, BlocksTouched)]
    assert [(t.hashes, t.reuse) for t in touches] == [((2, 1), True)]
    assert check_invariants(m.state) == []


def test_a_preempted_request_is_not_over_its_finish_touches_later() -> None:
    m = manager(cpu_blocks=8)
    job = m.blocks_computed("r", [1, 2], [10, 11])
    m.plan_step(0.0)
    start = len(m.log.events())
    m.finish_request("r", preempted=True)
    assert not any(isinstance(e, BlocksTouched) for e in m.log.events()[start:])
    m.blocks_computed("r", [1, 2, 3], [12, 13, 14])  # back under its id (F18): 3 extends its chain
    assert list(m.state.requests["r"].chain) == [1, 2, 3]
    m.job_result(job)
    m.plan_step(1.0)
    m.job_result(2)
    start = len(m.log.events())
    m.finish_request("r")
    (touch,) = [e for e in m.log.events()[start:] if isinstance(e, BlocksTouched)]
    assert touch.hashes == (3, 2, 1)


def test_a_trace_header_without_the_flag_reads_as_off() -> None:
    """Traces recorded before chain recency existed re-decide exactly as recorded."""
    assert config_from_dict({"cpu_blocks": 4}).chain_recency is False
    assert config_from_dict({"cpu_blocks": 4, "chain_recency": True}).chain_recency is True
    assert Config(cpu_blocks=4).chain_recency is True  # new configs: on


@pytest.mark.parametrize("chain_recency", [True, False])
def test_a_recorded_run_with_chain_recency_replays_and_redecides(tmp_path, chain_recency: bool) -> None:
    from kvflow.log.writer import TraceWriter

    path = str(tmp_path / "t.jsonl")
    config = Config(cpu_blocks=3, block_tokens=BT, chain_recency=chain_recency)
    m = OffloadManager(config, log=TraceWriter(path, config, checkpoint_every=5))
    for i, chain in enumerate([[1, 2], [1, 2, 3], [4, 5], [1, 6]]):
        rid = f"r{i}"
        hits = m.lookup(rid, chain, len(chain) * BT + 1)
        if hits:
            m.accept_hits(rid, [100 + 10 * i + k for k in range(hits)])
        m.blocks_computed(rid, chain[hits:], [200 + 10 * i + k for k in range(len(chain) - hits)])
        if i == 1:
            assert list(m.state.requests[rid].chain) == ([1, 2, 3] if chain_recency else [])
        for job in m.plan_step(float(i)):
            m.job_result(job.job_id)
        m.finish_request(rid)
    m.close()
    for redecide in (False, True):
        report = replay(path, redecide=redecide)
        assert report.ok and report.checkpoints > 1, report
        assert report.state.digest() == m.state.digest()


def test_F14_a_touch_of_a_store_that_fails_is_dropped_with_it() -> None:
    m = manager(cpu_blocks=8)
    job = m.blocks_computed("r", [1, 2], [10, 11])
    m.plan_step(0.0)
    m.touch([2, 1])
    assert m.state.deferred_touches
    m.job_result(job, ok=False, error="copy failed")
    assert not m.state.deferred_touches and check_invariants(m.state) == []


@given(
    chain_len=st.integers(2, 8),
    data=st.data(),
    policy=st.sampled_from(["lru", "arc"]),
)
def test_F14_tail_first_whatever_the_completion_order(chain_len: int, data: st.DataObject, policy: str) -> None:
    """A chain stored in several jobs (prefix order), the jobs land in any order, the finish
    (touching the chain deepest first, ``reuse=False``) comes before, between or after the landings:
    evicting the chain block by block always takes the deepest resident block."""
    m = manager(cpu_blocks=16, policy=policy)
    chain = list(range(100, 100 + chain_len))
    cuts = sorted(data.draw(st.sets(st.integers(1, chain_len - 1), max_size=chain_len - 1), label="cuts"))
    pieces = [chain[a:b] for a, b in zip([0, *cuts], [*cuts, chain_len])]
    jobs = [m.blocks_computed("r", piece, [1000 + h for h in piece]) for piece in pieces]
    m.plan_step(0.0)
    landing = data.draw(st.permutations(jobs), label="landing order")
    touch_at = data.draw(st.integers(0, len(landing)), label="touch after this many landings")
    for i, job in enumerate(landing):
        if i == touch_at:
            m.finish_request("r")  # (chain recency: it touches the chain, deepest first)
        m.job_result(job)
    if touch_at == len(landing):
        m.finish_request("r")
    assert check_invariants(m.state) == []
    assert eviction_order(m, chain_len) == chain[::-1]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_finish_after_its_chain_lost_a_block_touches_only_the_rest(policy: str) -> None:
    """The finish of a request whose store put its chain's tail on the tier touches the
    whole chain unasked only while no entry has left the tier since: a block of its chain
    evicted in between (here by an explicit eviction) is left out of the touch."""
    m = manager(cpu_blocks=8, policy=policy)
    assert m.lookup("r", [1, 2, 3], 3 * BT + 1) == 0
    store = m.blocks_computed("r", [1, 2, 3], [10, 11, 12])  # the chain's tail: all of it
    m.plan_step(0.0)
    m.job_result(store)
    assert m.state.requests["r"].chain_whole_at == m.state.departures
    assert m.evict(1) == 1  # the coldest: 1
    start = len(m.log.events())
    m.finish_request("r")
    (touch,) = [e for e in m.log.events()[start:] if isinstance(e, BlocksTouched)]
    assert touch.hashes == (3, 2)
    assert check_invariants(m.state) == []


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("cpu_blocks", [3, 8])
def test_a_store_of_the_chains_tail_after_hits_checks_the_hits_are_still_there(policy: str, cpu_blocks: int) -> None:
    """A store of the blocks after the hits puts the chain's tail on the tier; the whole
    chain is known on the tier only if the hits are still there too (the store itself may
    evict them: on a tier of 3 blocks it must)."""
    m = manager(cpu_blocks=cpu_blocks, policy=policy)
    m.blocks_computed("w", [1, 2], [10, 11])
    m.plan_step(0.0)
    m.job_result(1)
    m.finish_request("w")
    assert m.lookup("r", [1, 2, 3, 4, 5], 5 * BT + 1) == 2
    load = m.accept_hits("r", [20, 21])
    m.plan_step(1.0)
    m.job_result(load)  # loaded: its hits are pinned no more
    store = m.blocks_computed("r", [3, 4, 5], [22, 23, 24])  # evicts 1 and 2 for room
    req = m.state.requests["r"]
    assert req.chain_order == (1, 2, 3, 4, 5)
    assert (req.chain_whole_at == m.state.departures) is (cpu_blocks == 8)
    m.plan_step(2.0)
    m.job_result(store)
    start = len(m.log.events())
    m.finish_request("r")
    (touch,) = [e for e in m.log.events()[start:] if isinstance(e, BlocksTouched)]
    assert touch.hashes == ((5, 4, 3) if cpu_blocks == 3 else (5, 4, 3, 2, 1))
    assert check_invariants(m.state) == []


def test_the_chains_tuple_is_its_order_until_a_second_event_extends_it() -> None:
    """``chain_order`` is the chain as one tuple while one event named it (a hash named
    twice once), and None once the chain is extended (the dict alone then)."""
    m = manager(cpu_blocks=8)
    m.lookup("r", [1, 2, 1, 3], 4 * BT + 1)
    req = m.state.requests["r"]
    assert req.chain_order == tuple(req.chain) == (1, 2, 3)
    m.blocks_computed("r", [2, 3], [10, 11])  # the chain's tail: nothing new
    assert req.chain_order == (1, 2, 3)
    m.blocks_computed("r", [3, 4], [12, 13])
    assert req.chain_order is None and list(req.chain) == [1, 2, 3, 4]
