"""The torch executor's results: each job submitted once, each result delivered once.

Whichever thread finds a batch's copies over (the engine's own ``poll``, a blocking ``wait``)
``put``s one result per job here, and ``poll`` hands them over (F6: one channel, so results of
both directions arrive in the order they were found over). Nothing here waits: the channel
needs no other thread to run for a result to reach ``poll``. It also remembers which job ids
were submitted and finished (the last ``HISTORY`` of them), so that a job submitted twice is
refused (F5) and ``wait`` can tell an unknown job from a slow one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvflow.core.commands import JobResult
from kvflow.core.errors import Rejected, UnknownJob
from kvflow.core.jobs import TransferJob

HISTORY = 100_000  # finished results kept for wait() and duplicate detection


class ResultChannel:
    """Submitted job ids, and the results reported for them."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        self._finished: OrderedDict[int, JobResult] = OrderedDict()
        self._ready: list[JobResult] = []

    def claim(self, jobs: Sequence[TransferJob]) -> None:
        """Record ``jobs`` as submitted, or refuse them all (``Rejected``, nothing recorded)
        when one was submitted before or twice in ``jobs`` (F5)."""
        with self._lock:
            seen: set[int] = set()
            for job in jobs:
                if not isinstance(job, TransferJob):
                    raise TypeError(f"submit() takes TransferJob objects, not {type(job).__name__}")
                jid = job.job_id
                if jid in seen or jid in self._in_flight or jid in self._finished:
                    raise Rejected(f"job {jid} was already submitted; a job is submitted once (F5)")
                seen.add(jid)
            self._in_flight.update(seen)

    def put(self, job: TransferJob, ok: bool, error: str | None, corrupt: tuple[int, ...] = ()) -> None:
        """Report ``job``'s result (any thread)."""
        result = JobResult(job_id=job.job_id, rank=self.rank, ok=ok, error=error, corrupt=corrupt)
        with self._lock:
            self._in_flight.discard(result.job_id)
            self._finished[result.job_id] = result
            if len(self._finished) > HISTORY:
                self._finished.popitem(last=False)
            self._ready.append(result)

    def poll(self) -> list[JobResult]:
        """Every result put since the last poll (each exactly once); never blocks."""
        with self._lock:
            out, self._ready = self._ready, []
        return out

    def finished(self, job_id: int) -> JobResult | None:
        """``job_id``'s result once it was put (``poll`` still reports it), None while it runs.

        Raises ``UnknownJob`` for an id never submitted (F12)."""
        with self._lock:
            done = self._finished.get(job_id)
            if done is None and job_id not in self._in_flight:
                raise UnknownJob(f"wait: job {job_id} was never submitted to this executor")
            return done
