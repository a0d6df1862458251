"""A simulated remote tier, shared by the simulated instances of ``kvflow simulate
--instances N`` (``kvflow.simulate.fleet``): the same decisions and lifecycle as the Redis tier,
with a store that is a dict in memory.

``SimulatedRemoteStore`` holds block hashes up to a capacity and drops the least recently used
beyond it (what Redis does under ``maxmemory-policy allkeys-lru``). ``SimulatedRemoteExecutor``
wraps an instance's simulated executor like ``RemoteTierExecutor`` wraps the torch one: remote
jobs and probes are answered from the shared store, at once (the simulation does not model the
remote tier's time), through ``poll()`` / ``take_found()``; a remote load of a block the store
has dropped fails, as a real miss does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvflow.core.commands import JobResult
from kvflow.core.jobs import REMOTE_LOAD, REMOTE_STORE, TransferJob
from kvflow.core.names import BlockName


class SimulatedRemoteStore:
    """Block hashes shared by every instance; LRU beyond ``capacity_blocks``."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evicted_blocks = 0

    def put(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.evicted_blocks += 1

    def get(self, hashes: Sequence[int]) -> bool:
        """Whether every block is there (each one read is the most recent)."""
        if not all(h in self._blocks for h in hashes):
            return False
        for h in hashes:
            self._blocks.move_to_end(h)
        return True

    def contains(self, hashes: Sequence[int]) -> list[bool]:
        return [h in self._blocks for h in hashes]

    def __len__(self) -> int:
        return len(self._blocks)


class SimulatedCopies(Protocol):
    """What ``SimulatedRemoteExecutor`` needs of the executor it wraps (the simulated one of
    ``kvflow.executors.simulated``)."""

    @property
    def block_bytes(self) -> int: ...

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any = None) -> None: ...

    def poll(self) -> list[JobResult]: ...

    def next_completion_ms(self) -> float | None: ...

    def close(self) -> None: ...


class SimulatedRemoteExecutor:
    """An instance's simulated executor with the shared simulated remote tier beside it."""

    def __init__(
        self, inner: SimulatedCopies, store: SimulatedRemoteStore, clock: Callable[[], float], world_size: int = 1
    ) -> None:
        self.inner = inner
        self.store = store
        self._clock = clock
        self._world = world_size
        self._ready: list[JobResult] = []
        self._found: list[int] = []

    @property
    def block_bytes(self) -> int:
        return self.inner.block_bytes

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any = None) -> None:
        local = [j for j in jobs if j.direction not in (REMOTE_STORE, REMOTE_LOAD)]
        if local:
            self.inner.submit(local, compute_done)
        for job in jobs:
            if job.direction == REMOTE_STORE:
                self.store.put(job.hashes)
                self._answer(job.job_id, True, None)
            elif job.direction == REMOTE_LOAD:
                ok = self.store.get(job.hashes)
                self._answer(job.job_id, ok, None if ok else "remote miss: evicted from the shared tier")

    def _answer(self, job_id: int, ok: bool, error: str | None) -> None:
        self._ready.extend(JobResult(job_id=job_id, rank=r, ok=ok, error=error) for r in range(self._world))

    def probe(self, keys: Sequence[int], names: Sequence[BlockName] = ()) -> None:
        self._found.extend(h for h, there in zip(keys, self.store.contains(keys)) if there)

    def take_found(self) -> list[int]:
        found, self._found = self._found, []
        return found

    def poll(self) -> list[JobResult]:
        ready, self._ready = self._ready, []
        return list(self.inner.poll()) + ready

    def next_completion_ms(self) -> float | None:
        return self._clock() if self._ready else self.inner.next_completion_ms()

    def close(self) -> None:
        self.inner.close()
