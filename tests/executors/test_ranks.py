"""Two rank processes, one shared host pool (CPU always; CUDA when two GPUs are present)."""

from __future__ import annotations

import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")

from kvflow.core.errors import Rejected, UnknownJob  # noqa: E402
from kvflow.core.jobs import TransferJob  # noqa: E402
from kvflow.executors.torch.layout import KVLayout  # noqa: E402
from kvflow.executors.torch.ranks import RandomKV, RankGroup  # noqa: E402

FACTORY = RandomKV(num_layers=2, num_blocks=16, page_shape=(4, 2, 8), stacked=True, seed=5)
DEVICE_TYPES = ["cpu"] + (
    ["cuda"] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else []
)


def expected_pages(rank: int, blocks: list[int]) -> list[torch.Tensor]:
    """What rank ``rank``'s device KV holds at ``blocks`` (same seed, built on the CPU)."""
    layout = KVLayout.from_caches(FACTORY.build(rank, torch.device("cpu")))
    idx = torch.tensor(blocks)
    return [r.pages.index_select(0, idx) for r in layout.regions]


@pytest.fixture(scope="module", params=DEVICE_TYPES)
def group(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    g = RankGroup(
        FACTORY, cpu_blocks=8, world_size=2, device_type=request.param, fail_job_ids={1: {2}}
    )
    yield g
    g.close()


def by_rank(results: list) -> dict[int, object]:  # type: ignore[type-arg]
    return {r.rank: r for r in results}


def test_both_ranks_store_into_their_own_regions(group: RankGroup) -> None:
    group.submit([TransferJob(1, "store", (3, 4, 5), (0, 1, 2))])
    res = by_rank(group.wait(1, timeout_s=60))
    assert set(res) == {0, 1} and all(r.ok for r in res.values()), res
    R = group.regions_per_rank
    for rank in (0, 1):
        view = group.pool.for_rank(rank, R)
        want = expected_pages(rank, [3, 4, 5])
        for r, w in enumerate(want):
            assert torch.equal(view.region(r, w.dtype)[0:3], w), (rank, r)
    # Different shards, different bytes: the ranks did not write over each other.
    assert not torch.equal(group.pool.region(0)[0:3], group.pool.region(R)[0:3])


def test_failure_injected_on_rank_one(group: RankGroup) -> None:
    group.submit([TransferJob(2, "store", (6,), (3,))])
    res = by_rank(group.wait(2, timeout_s=60))
    assert res[0].ok
    assert not res[1].ok and "injected fault for job 2" in res[1].error


def test_load_back_into_other_blocks_on_each_rank(group: RankGroup) -> None:
    group.submit([TransferJob(3, "load", (10, 11, 12), (0, 1, 2))])
    assert all(r.ok for r in group.wait(3, timeout_s=60))
    for rank in (0, 1):
        got = group.read_device_pages(rank, [10, 11, 12])
        want = b"".join(p.numpy().tobytes() for p in expected_pages(rank, [3, 4, 5]))
        assert got == want


def test_F6_every_rank_reports_each_job_once_through_one_poll(group: RankGroup) -> None:
    polled = group.poll()
    assert sorted((r.job_id, r.rank) for r in polled) == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]
    assert group.poll() == []
    with pytest.raises(UnknownJob):
        group.wait(99)
    with pytest.raises(Rejected):
        group.submit([TransferJob(1, "store", (3,), (0,))])


def test_F2_a_dead_rank_fails_its_jobs(group: RankGroup) -> None:
    os.kill(group._procs[1].pid, signal.SIGKILL)  # type: ignore[arg-type]
    group._procs[1].join(timeout=10)
    group.submit([TransferJob(4, "store", (7,), (4,))])
    deadline = time.monotonic() + 60
    got: list = []  # type: ignore[type-arg]
    while len(got) < 2 and time.monotonic() < deadline:
        got += [r for r in group.poll() if r.job_id == 4]
        time.sleep(0.01)
    res = by_rank(got)
    assert res[0].ok
    assert not res[1].ok and "rank 1" in res[1].error
