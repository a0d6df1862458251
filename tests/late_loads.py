"""A torch executor whose loads report one poll late, for tests of late copies (F15)."""

from __future__ import annotations

import time
from typing import Any

from kvflow.core.commands import JobResult
from kvflow.executors.torch.executor import TorchExecutor


class LateLoads(TorchExecutor):
    """Reports each load's result one poll late (stores on time): with the engine's clock
    jumping a minute a step, every load outlives its deadline and is fenced, deterministically."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loads: set[int] = set()
        self._held: list[JobResult] = []
        self._ready: list[JobResult] = []

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
        out = self._held + [r for r in fresh if r.job_id not in self._loads]
        self._held = [r for r in fresh if r.job_id in self._loads]
        return out
