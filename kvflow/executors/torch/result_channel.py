"""The torch executor's results: each job submitted once, each result delivered once.

The completion threads ``put`` a result per job on ONE ``SimpleQueue`` (F6: one channel, so
results of both directions arrive in the order their copies finished); ``poll``, ``wait`` and
``wait_any`` read it from the engine's thread. The channel also remembers which job ids were
submitted and finished (the last ``HISTORY`` of them), so that a job submitted twice is refused
(F5) and ``wait`` can tell an unknown job from a slow one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvflow.core.commands import JobResult
from kvflow.core.errors import Rejected, UnknownJob
from kvflow.core.jobs import TransferJob

HISTORY = 100_000  # finished results kept for wait() and duplicate detection


class ResultChannel:
    """Submitted job ids, and the results the completion threads report for them."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._queue: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
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
        self._queue.put(JobResult(job_id=job.job_id, rank=self.rank, ok=ok, error=error, corrupt=corrupt))

    def poll(self) -> list[JobResult]:
        """Every result that arrived since the last poll (each exactly once); never blocks."""
        with self._lock:
            self._drain()
            out, self._ready = self._ready, []
        return out

    def wait(self, job_id: int, timeout_s: float | None = None) -> JobResult:
        """Block until ``job_id`` is terminal and return its result (``poll`` still reports it).

        Raises ``UnknownJob`` for an id never submitted (F12), ``TimeoutError`` after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._drain()
                done = self._finished.get(job_id)
                if done is not None:
                    return done
                if job_id not in self._in_flight:
                    raise UnknownJob(f"wait: job {job_id} was never submitted to this executor")
            remaining = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if remaining <= 0:
                raise TimeoutError(f"job {job_id} not finished after {timeout_s} s")
            try:
                result = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            with self._lock:
                self._accept(result)

    def wait_any(self, timeout_s: float | None = None) -> list[JobResult]:
        """Block until at least one result is ready (or ``timeout_s``), then poll."""
        with self._lock:
            self._drain()
            if self._ready:
                out, self._ready = self._ready, []
                return out
        try:
            first = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return []
        with self._lock:
            self._accept(first)
            self._drain()
            out, self._ready = self._ready, []
        return out

    def _drain(self) -> None:
        """Caller holds the lock."""
        while True:
            try:
                result = self._queue.get_nowait()
            except queue.Empty:
                return
            self._accept(result)

    def _accept(self, result: JobResult) -> None:
        """Caller holds the lock."""
        self._in_flight.discard(result.job_id)
        self._finished[result.job_id] = result
        if len(self._finished) > HISTORY:
            self._finished.popitem(last=False)
        self._ready.append(result)
