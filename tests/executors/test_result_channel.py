"""The torch executor's result channel: whichever thread finds copies over puts their results,
the engine's thread reads them (F6: one thread-safe channel, each result delivered exactly
once)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

from kvflow.core.commands import JobResult  # noqa: E402
from kvflow.core.errors import Rejected, UnknownJob  # noqa: E402
from kvflow.core.jobs import TransferJob  # noqa: E402
from kvflow.executors.torch.result_channel import ResultChannel  # noqa: E402

THREADS, PER_THREAD = 8, 500


def jobs(first: int, n: int) -> list[TransferJob]:
    return [TransferJob(job_id, "store", (0,), (0,)) for job_id in range(first, first + n)]


def test_F6_results_put_by_many_threads_reach_the_reader_exactly_once() -> None:
    """Eight threads report 4,000 jobs while the engine's thread polls and asks for one job:
    every result arrives once, none is lost or repeated, and each thread's results keep the
    order it put them in."""
    channel = ResultChannel(rank=3)
    batches = [jobs(1 + t * PER_THREAD, PER_THREAD) for t in range(THREADS)]
    for batch in batches:
        channel.claim(batch)
    start = threading.Barrier(THREADS + 1)

    def complete(batch: list[TransferJob]) -> None:
        start.wait()
        for i, job in enumerate(batch):
            channel.put(job, ok=i % 7 != 0, error=None if i % 7 else "copy failed")
            if i % 50 == 0:
                time.sleep(0.001)  # let the reader in while the others keep putting

    threads = [threading.Thread(target=complete, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    start.wait()
    received: list[JobResult] = []
    waited = None
    while len(received) < THREADS * PER_THREAD:
        got = channel.poll()
        assert got or any(t.is_alive() for t in threads), "a result was lost"
        received += got
        if waited is None:
            waited = channel.finished(PER_THREAD)  # the last job of the first thread
        if not got:
            time.sleep(0.0005)
    for thread in threads:
        thread.join()
    assert channel.poll() == []

    ids = [r.job_id for r in received]
    assert sorted(ids) == list(range(1, THREADS * PER_THREAD + 1))  # each once
    for batch in batches:
        mine = [job_id for job_id in ids if batch[0].job_id <= job_id <= batch[-1].job_id]
        assert mine == [job.job_id for job in batch]  # one thread's results stay in order
    assert all(r.rank == 3 and r.ok == (r.error is None) for r in received)
    assert channel.finished(PER_THREAD) in received
    assert channel.finished(1).job_id == 1  # a finished job can still be asked for


def test_F5_the_channel_claims_a_job_once() -> None:
    channel = ResultChannel(rank=0)
    channel.claim(jobs(1, 2))
    with pytest.raises(Rejected, match="job 2 was already submitted"):
        channel.claim(jobs(2, 2))
    with pytest.raises(Rejected, match="job 4 was already submitted"):
        channel.claim([*jobs(4, 1), *jobs(4, 1)])
    channel.claim(jobs(3, 2))  # the refused calls recorded nothing
    channel.put(jobs(1, 1)[0], ok=True, error=None)
    assert [r.job_id for r in channel.poll()] == [1]
    with pytest.raises(Rejected, match="job 1 was already submitted"):
        channel.claim(jobs(1, 1))  # finished jobs are remembered too


def test_F12_waiting_on_a_job_never_submitted_is_refused() -> None:
    channel = ResultChannel(rank=0)
    channel.claim(jobs(1, 1))
    with pytest.raises(UnknownJob, match="job 99 was never submitted"):
        channel.finished(99)
    assert channel.finished(1) is None  # submitted, not finished: slow, not unknown
