"""A torch executor whose loads report some polls late, for tests of late copies (F15) and of
loads that overlap other requests' work."""

from __future__ import annotations

import time
from typing import Any

from kvflow.core.commands import JobResult
from kvflow.executors.torch.executor import TorchExecutor


class LateLoads(TorchExecutor):
    """Reports each load's result ``polls`` polls late (stores on time): with the engine's
    clock jumping a minute a step, every load outlives its deadline and is fenced,
    deterministically; with a steady clock, every load stays outstanding for ``polls`` polls.
    ``outstanding`` counts the loads submitted and not reported yet."""

    def __init__(self, *args: Any, polls: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.polls = polls
        self._loads: set[int] = set()
        self._held: list[tuple[int, JobResult]] = []  # (polls still to wait, result)
        self._ready: list[JobResult] = []

    @property
    def outstanding(self) -> int:
        return len(self._loads)

    def submit(self, jobs: Any, compute_done: Any = None) -> None:
        self._loads.update(j.job_id for j in jobs if j.direction == "load")
        super().submit(jobs, compute_done)
        # Wait here for this batch's results (the CPU device's copies take milliseconds), so
        # that what a poll returns never depends on how fast the copies ran: on a loaded
        # machine a store reported a poll late would time out too, and only loads must.
        pending = {j.job_id for j in jobs}
        give_up = time.monotonic() + 60.0
        while pending and time.monotonic() < give_up:
            for r in super().poll():
                pending.discard(r.job_id)
                self._ready.append(r)
            if pending:
                time.sleep(0.001)

    def poll(self) -> list[JobResult]:
        fresh, self._ready = self._ready + super().poll(), []
        aged = [(n - 1, r) for n, r in self._held] + [(self.polls - 1, r) for r in fresh if r.job_id in self._loads]
        out = [r for n, r in aged if n < 0] + [r for r in fresh if r.job_id not in self._loads]
        self._held = [(n, r) for n, r in aged if n >= 0]
        self._loads.difference_update(r.job_id for r in out)
        return out
