"""Planning a submit: the whole-submit check must agree with the job-by-job one."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvflow.core.jobs import TransferJob
from kvflow.executors.torch.transfer_plan import _plan_job_by_job, plan_jobs

NB, CB = 12, 10


def _jobs(direction: str, draws: list[list[tuple[int, int]]]) -> list[TransferJob]:
    return [
        TransferJob(i + 1, direction, tuple(d for d, _ in pairs), tuple(s for _, s in pairs))
        for i, pairs in enumerate(draws)
    ]


pair = st.tuples(st.integers(-1, NB), st.integers(-1, CB))


@given(
    direction=st.sampled_from(["store", "load"]),
    draws=st.lists(st.lists(pair, max_size=5), max_size=5),
)
def test_plan_is_the_same_as_checking_each_job(direction: str, draws: list[list[tuple[int, int]]]) -> None:
    jobs = _jobs(direction, draws)
    fast_failed: list[tuple[int, str]] = []
    slow_failed: list[tuple[int, str]] = []
    fast = plan_jobs(direction, jobs, NB, CB, lambda j, e: fast_failed.append((j.job_id, e)))
    slow = _plan_job_by_job(direction, jobs, NB, CB, lambda j, e: slow_failed.append((j.job_id, e)))
    assert fast_failed == slow_failed  # same jobs fail, with the same reasons, in order
    if slow is None:
        assert fast is None
        return
    assert fast is not None
    assert [j.job_id for j in fast.jobs] == [j.job_id for j in slow.jobs]
    for a, b in ((fast.device_blocks, slow.device_blocks), (fast.slots, slow.slots), (fast.owner, slow.owner)):
        assert np.array_equal(a, b)
    assert (np.diff(fast.slots) >= 0).all()  # sorted by slot (a load may read one slot twice)


def test_a_repeat_across_jobs_fails_the_later_job_only() -> None:
    failed: list[int] = []
    jobs = _jobs("store", [[(0, 1), (1, 2)], [(2, 2)], [(3, 3)]])
    plan = plan_jobs("store", jobs, NB, CB, lambda j, e: failed.append(j.job_id))
    assert failed == [2] and plan is not None
    assert [j.job_id for j in plan.jobs] == [1, 3] and plan.slots.tolist() == [1, 2, 3]
