"""A remote job over several connections: split into parts of consecutive blocks, as even as can
be, every block in exactly one part, in order (the job's outcome waits for all of them: see
tests/tiers/test_remote_engine.py, which runs jobs over 3 and 4 connections on a real server)."""

from __future__ import annotations

import pytest

from kvflow.core.jobs import REMOTE_LOAD, TransferJob
from kvflow.core.names import name_of
from kvflow.tiers.remote_executor import _split


def job(n: int) -> TransferJob:
    hashes = tuple(range(100, 100 + n))
    return TransferJob(
        job_id=7, direction=REMOTE_LOAD, device_blocks=(), slots=tuple(range(n)), hashes=hashes,
        names=tuple(name_of(h) for h in hashes),
    )  # fmt: skip


@pytest.mark.parametrize("blocks, workers", [(1, 4), (4, 1), (4, 3), (5, 3), (16, 4), (3, 8), (33, 4)])
def test_parts_cover_the_job_in_order_and_evenly(blocks: int, workers: int) -> None:
    whole = job(blocks)
    parts = _split(whole, workers)
    assert len(parts) == min(workers, blocks)
    assert all(p.job_id == whole.job_id and p.direction == whole.direction for p in parts)
    assert sum((p.hashes for p in parts), ()) == whole.hashes
    assert sum((p.slots for p in parts), ()) == whole.slots
    assert sum((p.names for p in parts), ()) == whole.names
    sizes = [len(p.hashes) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    if workers == 1 or blocks == 1:
        assert parts == [whole]
