"""F14: within a chain, tails are evicted before heads whatever order its stores land in.

Recency inside a chain comes from the engine's touch at the request's finish (deepest block
first, DESIGN §7 rule 4), never from when each store happens to land: a touch of a block still
being stored is kept on its store job and applied when it lands.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvflow.config import Config
from kvflow.events import BlocksEvicted
from kvflow.manager import OffloadManager
from kvflow.state import check_invariants

BT = 4


def manager(cpu_blocks: int, policy: str = "lru") -> OffloadManager:
    return OffloadManager(Config(cpu_blocks=cpu_blocks, block_tokens=BT, policy=policy))


def eviction_order(m: OffloadManager, n: int) -> list[int]:
    """Evict ``n`` blocks one at a time; the hashes in the order they went."""
    order = []
    for _ in range(n):
        m.evict(1)
        (event,) = [e for e in m.log.events()[-1:] if isinstance(e, BlocksEvicted)]
        order.extend(event.hashes)
    return order


def test_F14_a_chain_whose_tail_lands_after_the_finish_touch_loses_its_tail_first() -> None:
    """The issue's case: chain [1,2,3,4]; the store of [1,2] landed, the store of [3,4] is
    still in flight when the request finishes and is touched deepest-first; when [3,4]
    lands, the next eviction takes 4 (not 2, which would orphan 3 and 4)."""
    m = manager(cpu_blocks=8)
    head = m.blocks_computed("r", [1, 2], [10, 11])
    tail = m.blocks_computed("r", [3, 4], [12, 13])
    m.plan_step(0.0)
    m.job_result(head)
    assert m.touch([4, 3, 2, 1], reuse=False) == 4  # 3 and 4 are on the tier, still storing
    m.finish_request("r")
    m.job_result(tail)  # lands after the touch: the touch is applied now
    assert eviction_order(m, 4) == [4, 3, 2, 1]
    assert check_invariants(m.state) == []


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
    touch (deepest first, ``reuse=False``) comes before, between or after the landings:
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
            m.touch(chain[::-1], reuse=False)
            m.finish_request("r")
        m.job_result(job)
    if touch_at == len(landing):
        m.touch(chain[::-1], reuse=False)
        m.finish_request("r")
    assert check_invariants(m.state) == []
    assert eviction_order(m, chain_len) == chain[::-1]
