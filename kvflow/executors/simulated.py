"""A simulated transfer executor on a virtual clock, with seeded faults.

It is a real component (used by ``kvflow simulate`` and the fault tests), not a stand-in for
the torch executor: it models two copy streams (one per direction) that each run their jobs
one after another, a per-job latency plus bytes over bandwidth, and faults:

* ``fault_rate``: each job fails with this probability, drawn once per job *in submission
  order* from ``random.Random(seed)`` (the simulation's rule 5, docs/simulate.md);
* ``fail_jobs``: the k-th submitted jobs (1-based) fail;
* ``hang_jobs``: the k-th submitted jobs never complete (they time out in the engine and
  stay fenced until the executor is closed);
* ``slow_jobs``: the k-th submitted jobs take ``slow_by_ms`` longer (a copy that outlives its
  deadline reports late: that result lifts its fence, F15);
* ``fail_rank``: with several ranks, which rank reports the failure (others succeed).

With ``disk`` (a ``TransferModel`` of the disk: its bandwidth and per-job latency) and
``disk_slots``, it also serves a simulated disk tier: disk stores and loads run on two more
streams, one per direction, taking the disk model's time for their blocks (the bytes are not
kept: the decisions say what the disk holds). Faults apply to them as to any job.

Deterministic for a seed. Reads time only from the clock it is given.
"""

from __future__ import annotations

import bisect
import math
import operator
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Any

from kvflow.core.commands import JobResult
from kvflow.core.errors import ConfigError, Rejected, UnknownJob
from kvflow.core.jobs import DISK_LOAD, DISK_STORE, LOAD, STORE, TransferJob
from kvflow.core.names import BlockName
from kvflow.core.values import is_int

_job_id = operator.attrgetter("job_id")
# one copy stream per direction: the link's two, and the disk's two
_STREAMS = (STORE, LOAD, DISK_STORE, DISK_LOAD)


class VirtualClock:
    """Milliseconds that move only when told to."""

    def __init__(self, now_ms: float = 0.0) -> None:
        self.now_ms = now_ms

    def __call__(self) -> float:
        return self.now_ms

    def advance_to(self, now_ms: float) -> None:
        if now_ms > self.now_ms:
            self.now_ms = now_ms


@dataclass(frozen=True)  # (frozen: an executor works out each job size's duration once)
class TransferModel:
    """How long a job takes: ``latency_us + bytes / bandwidth``.

    Defaults follow the link's measurement (docs/performance.md) (one pinned copy ~55.5 GB/s each way) and a KV
    block of a 7B-class model at 512 tokens (32 layers x 2 x 512 x 4096 x 2 bytes = 256 MiB
    would be one whole block; we use bytes_per_block given by the caller).
    """

    bytes_per_block: int = 2 * 1024 * 1024
    bandwidth_gbps: float = 55.5  # GB/s (1e9 bytes per second)
    latency_us: float = 20.0

    def __post_init__(self) -> None:
        # NaN passes every comparison and would stall the virtual clock forever
        if not is_int(self.bytes_per_block) or self.bytes_per_block <= 0:
            raise ConfigError(f"bytes_per_block must be a whole number > 0, got {self.bytes_per_block}")
        if not math.isfinite(self.bandwidth_gbps) or self.bandwidth_gbps <= 0:
            raise ConfigError(f"bandwidth_gbps must be a finite number > 0, got {self.bandwidth_gbps}")
        if not math.isfinite(self.latency_us) or self.latency_us < 0:
            raise ConfigError(f"latency_us must be a finite number >= 0, got {self.latency_us}")

    def duration_ms(self, num_blocks: int) -> float:
        seconds = num_blocks * self.bytes_per_block / (self.bandwidth_gbps * 1e9)
        return self.latency_us / 1000.0 + seconds * 1000.0


class _IdSet:
    """The job ids ever submitted, as sorted disjoint ranges: kvflow issues ids in order, so a
    million submissions take a range or two, not a million set entries."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []  # inclusive

    def __contains__(self, job_id: object) -> bool:
        if not is_int(job_id):
            return False
        i = bisect.bisect_right(self._starts, job_id) - 1
        return i >= 0 and job_id <= self._ends[i]

    def isdisjoint(self, ids: Sequence[int]) -> bool:
        ends = self._ends
        if not ends or not ids:
            return True
        try:
            if min(ids) > ends[-1]:  # (ids newer than any submitted)
                return True
        except TypeError:
            pass  # (not all comparable: asked one by one)
        return not any(j in self for j in ids)

    def add_new(self, ids: list[int]) -> bool:
        """Add ``ids`` if they are distinct and none was seen before (True); else add none
        (False). The usual batch, one job with the next id (kvflow issues ids in order), is
        told and added by one comparison."""
        ends = self._ends
        if len(ids) == 1 and ends:
            job_id = ids[0]
            if type(job_id) is int and job_id == ends[-1] + 1:
                ends[-1] = job_id
                return True
        if len(set(ids)) != len(ids) or not self.isdisjoint(ids):
            return False
        for job_id in ids:
            self.add(job_id)
        return True

    def add(self, job_id: int) -> None:
        starts, ends = self._starts, self._ends
        if starts and ends[-1] + 1 == job_id:  # (the next id: the last range grows)
            ends[-1] = job_id
            return
        if job_id in self:
            return
        i = bisect.bisect_right(starts, job_id)
        starts.insert(i, job_id)
        ends.insert(i, job_id)
        # merge with the neighbours it touches
        if i + 1 < len(starts) and ends[i] + 1 == starts[i + 1]:
            ends[i] = ends.pop(i + 1)
            starts.pop(i + 1)
        if i > 0 and ends[i - 1] + 1 == starts[i]:
            ends[i - 1] = ends.pop(i)
            starts.pop(i)

    def ranges(self) -> int:
        return len(self._starts)


@dataclass
class SimStats:
    jobs: int = 0
    blocks: int = 0
    bytes: int = 0
    faults_injected: int = 0
    hung: int = 0
    busy_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_STREAMS, 0.0))


class SimulatedExecutor:
    """Executes TransferJobs on a virtual clock. ``poll()`` returns the results due by now."""

    def __init__(
        self,
        clock: VirtualClock,
        model: TransferModel | None = None,
        *,
        world_size: int = 1,
        fault_rate: float = 0.0,
        seed: int = 0,
        fail_jobs: Iterable[int] = (),
        hang_jobs: Iterable[int] = (),
        slow_jobs: Iterable[int] = (),
        slow_by_ms: float = 0.0,
        fail_rank: int = 0,
        error_text: str = "simulated transfer failure",
        disk: TransferModel | None = None,
        disk_slots: int = 0,
    ) -> None:
        if not 0.0 <= fault_rate <= 1.0:
            raise ConfigError(f"fault_rate must be within 0..1, got {fault_rate}")
        if not 0 <= fail_rank < world_size:
            raise ConfigError(f"fail_rank {fail_rank} outside world size {world_size}")
        self.clock = clock
        self.model = model or TransferModel()
        # blocks -> the model's duration for them, and the model they were computed with
        self._durations: dict[int, float] = {}
        self._durations_of = self.model
        self.world_size = world_size
        self.fault_rate = fault_rate
        self.rng = random.Random(seed)
        self.fail_jobs = frozenset(fail_jobs)
        self.hang_jobs = frozenset(hang_jobs)
        self.slow_jobs = frozenset(slow_jobs)
        if not math.isfinite(slow_by_ms) or slow_by_ms < 0:
            raise ConfigError(f"slow_by_ms must be a finite number >= 0, got {slow_by_ms}")
        self.slow_by_ms = float(slow_by_ms)
        # (fixed from here on; none configured but in fault tests: submit skips the draws then)
        self._injects_faults = fault_rate > 0.0 or bool(self.fail_jobs or self.hang_jobs or self.slow_jobs)
        self.fail_rank = fail_rank
        self.error_text = error_text
        self.stats = SimStats()
        self._ordinal = 0
        self._stream_free_ms = dict.fromkeys(_STREAMS, 0.0)
        self.disk = disk
        if not is_int(disk_slots) or disk_slots < 0 or (disk_slots > 0 and disk is None):
            raise ConfigError(f"disk_slots must be a whole number >= 0, with a disk model, got {disk_slots!r}")
        self._disk_slots = disk_slots
        self._disk_durations: dict[int, float] = {}
        self._heap: list[tuple[float, int, int]] = []  # (done_ms, ordinal, job_id)
        self._pending: dict[int, tuple[float, bool]] = {}  # job -> (done_ms, fails)
        self._known = _IdSet()  # every id ever submitted (F5), in bounded memory
        self._ready: list[JobResult] = []

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any = None) -> None:
        """Queue jobs; each starts when its direction's stream is free (copies overlap
        across directions, not within one)."""
        if not jobs:
            return
        if self.disk is None and any(job.disk_slots for job in jobs):
            raise Rejected("a disk job, but this simulated executor has no disk model")
        now = self.clock.now_ms
        known = self._known
        ids = list(map(_job_id, jobs))
        if not known.add_new(ids):
            # refuse the whole call: nothing launched, no fault drawn (F5)
            repeated = [j for j in ids if j in known] or [j for j in ids if ids.count(j) > 1]
            raise Rejected(f"job {repeated[0]} submitted twice (F5)")
        stream_free, model, busy_ms = self._stream_free_ms, self.model, self.stats.busy_ms
        injects_faults, pending, heap = self._injects_faults, self._pending, self._heap
        durations = self._durations
        if self._durations_of is not model:  # (the model was replaced since)
            durations.clear()
            self._durations_of = model
        blocks_total = 0
        for job, job_id in zip(jobs, ids):
            direction, blocks = job.direction, len(job.device_blocks)
            self._ordinal = ordinal = self._ordinal + 1
            free = stream_free[direction]
            if job.disk_slots:
                duration = self._disk_duration(len(job.hashes))
            else:
                blocks_total += blocks
                known_duration = durations.get(blocks)
                if known_duration is None:  # (a job's size recurs: its duration is worked out once)
                    known_duration = durations[blocks] = model.duration_ms(blocks)
                duration = known_duration
            done = max(now, free) + duration
            if injects_faults:
                fails, slow, hangs = self._faults(ordinal)
                if slow:
                    done += self.slow_by_ms  # (it holds its stream that long too)
                if hangs:
                    stream_free[direction] = done
                    busy_ms[direction] += duration
                    self.stats.hung += 1
                    continue  # never completes: the engine's deadline must catch it
                if fails:
                    self.stats.faults_injected += 1
            else:
                fails = False
            stream_free[direction] = done
            busy_ms[direction] += duration
            pending[job_id] = (done, fails)
            heappush(heap, (done, ordinal, job_id))
        stats = self.stats
        stats.jobs += len(jobs)
        stats.blocks += blocks_total
        stats.bytes += blocks_total * model.bytes_per_block

    def _disk_duration(self, blocks: int) -> float:
        assert self.disk is not None  # (submit refused disk jobs without one)
        duration = self._disk_durations.get(blocks)
        if duration is None:
            duration = self._disk_durations[blocks] = self.disk.duration_ms(blocks)
        return duration

    # -- the simulated disk tier (kvflow.engine.protocols.ServesDiskTier) ---------------------

    @property
    def disk_slots(self) -> int:
        return self._disk_slots

    def disk_entries(self) -> list[tuple[int, BlockName]]:
        """A simulated disk starts empty."""
        return []

    def disk_problem(self) -> str | None:
        return None

    def _faults(self, ordinal: int) -> tuple[bool, bool, bool]:
        """Whether the ``ordinal``-th submitted job fails, runs slow, hangs. The random draw
        is made for every job, in submission order, so a seed gives the same faults."""
        fails = ordinal in self.fail_jobs
        if self.fault_rate > 0.0:
            fails = (self.rng.random() < self.fault_rate) or fails
        return fails, ordinal in self.slow_jobs, ordinal in self.hang_jobs

    @property
    def block_bytes(self) -> int:
        """Bytes one block's copy moves, as the transfer model has it."""
        return self.model.bytes_per_block

    def next_completion_ms(self) -> float | None:
        """Virtual time of the next result, or None when nothing will complete."""
        return self._heap[0][0] if self._heap else None

    def poll(self) -> list[JobResult]:
        """Results whose completion time has come, in completion order (all ranks)."""
        heap = self._heap
        now = self.clock.now_ms
        if self._ready:
            out, self._ready = self._ready, []
        elif heap and heap[0][0] <= now:
            out = []
        else:
            return []  # (nothing due: the common poll)
        pending, one_rank = self._pending, self.world_size == 1
        while heap and heap[0][0] <= now:
            job_id = heappop(heap)[2]
            fails = pending.pop(job_id)[1]
            if one_rank and not fails:
                out.append(JobResult(job_id))  # (a success of the one rank: the defaults)
            else:
                out.extend(self._results(job_id, fails))
        return out

    def _results(self, job_id: int, fails: bool) -> list[JobResult]:
        """One result per rank: ``fail_rank``'s a failure if the job fails."""
        failing = self.fail_rank if fails else -1
        return [
            JobResult(job_id, rank, False, self.error_text) if rank == failing else JobResult(job_id, rank)
            for rank in range(self.world_size)
        ]

    def wait(self, job_id: int) -> list[JobResult]:
        """Advance the clock to this job's completion and return its results (F12: unknown
        ids raise)."""
        if job_id not in self._known:
            raise UnknownJob(f"wait on unknown job {job_id}")
        pending = self._pending.get(job_id)
        if pending is None:
            return []
        self.clock.advance_to(pending[0])
        due = self.poll()
        mine = [r for r in due if r.job_id == job_id]
        self._ready = [r for r in due if r.job_id != job_id]  # kept for the next poll()
        return mine

    def in_flight(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._pending.clear()
        self._heap.clear()
