"""A seeded swarm: many small engine-like runs of kvflow, each drawn from one seed, each checked.

Every seed ``N`` draws, from ``random.Random(N)`` and nothing else:

* a workload slice: a few dozen to a few hundred requests with prefix-sharing prompts (system
  prompts, multi-turn conversations), arrivals per step, chunked prefill, decode steps that
  fill new blocks;
* a configuration: ``cpu_blocks`` (small to moderate, sometimes 0), policy ``lru`` / ``arc``,
  ``store_mode`` ``eager`` / ``lazy``, ``world_size`` 1..8, ``job_deadline_ms``; a device pool,
  with or without a device prefix cache (whose evictions are the lazy stores);
* faults: a fault rate in ``0..--fault-max`` (``SimulatedExecutor`` ``fault_rate`` on
  ``fail_rank``), hung jobs (``hang_jobs``), copies that report after their deadline
  (``slow_jobs`` + ``slow_by_ms``), integrity failures (a load result ``ok=False`` with
  ``corrupt=...``), rank results delayed or lost, repeated results, results for unknown jobs,
  a failed submit, preemption with re-admission under the same id while jobs are in flight,
  finishes during transfers, ``reset()``, ``invalidate()``.

It drives a ``SyncEngine`` (its manager made paranoid: every event re-checked) on a
``VirtualClock`` the way an engine does (see docs/embedding.md), recording
a trace: it never reuses a device block until ``released_device_blocks`` names it, recomputes a
fenced load into fresh blocks, touches chains deepest first with ``reuse=False`` at finish
when a scenario turns kvflow's own chain recency off, drains and closes. Then it checks:

* after every step: the engine's holds are exactly the blocks the driver was not given back,
  ``check_invariants`` holds, no notice is left behind;
* the bytes: the executor models what every device block and host slot holds (a copy writes
  its targets when it completes, late or not; a failed one writes garbage), so a load that
  finishes must have brought its blocks' contents, and a request's blocks must still hold
  them when it finishes (no late copy wrote a block or slot that kvflow had given back);
* F17: a block reported corrupt never stays on offer once no load holds it; F16: a
  store never evicts its own chain; F13: hits stay under the token cap;
* every job has exactly one terminal event (a job abandoned by a reset whose copy never
  reported ends by its ``fence_lifted`` instead), every fenced outcome is lifted exactly once,
  every load gets exactly one notice (finished or failed), every store not abandoned one;
  the engine's counters agree with the trace;
* before ``close()`` every remaining fence waits on a rank whose result never came, and after
  it nothing leaks: no job, hold, fenced slot, fence; pins only of live requests;
* ``kvflow.replay.fold.replay(trace, strict=True)`` (every invariant after every event) and
  ``replay(trace, redecide=True)`` are consistent and end at the live state's digest;
* the seed re-run in this process gives the same trace bytes, and (every
  ``--subprocess-every``-th seed) so does a subprocess under another ``PYTHONHASHSEED``.

A failing seed prints the one command that reproduces it and what failed; the tool then exits 1.

Usage, from the repository root::

    python tools/swarm.py --seeds 2000 [--start 0] [--fault-max 0.5]
    python tools/swarm.py --seeds 1 --start 17 -v        # one seed, with its scenario
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvflow.core.commands import COMMAND_TYPES, BlocksComputed, DeviceBlocksEvicting, JobResult
from kvflow.core.config import Config
from kvflow.core.events import (
    BlocksEvicted,
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobTimedOut,
    LateResultIgnored,
    LoadQueued,
    Reset,
    StoreQueued,
    event_name,
)
from kvflow.core.jobs import LOAD, TransferJob
from kvflow.core.state.invariants import check_invariants
from kvflow.engine.notices import StepReport
from kvflow.engine.sync import SyncEngine
from kvflow.executors.simulated import SimulatedExecutor, TransferModel, VirtualClock
from kvflow.log.format import Checkpoint
from kvflow.log.reader import TraceReader
from kvflow.replay.fold import replay

BLOCK_TOKENS = 16
MAX_PROMPT_BLOCKS = 12
MAX_DECODE_BLOCKS = 4
MAX_REQUEST_BLOCKS = MAX_PROMPT_BLOCKS + MAX_DECODE_BLOCKS
MAX_PREEMPTIONS = 3  # per request (preempting faster than loads land would livelock the run)
MAX_STEPS = 20_000  # past this the run is starved (fences that never lift hold the device)
CHECKPOINT_EVERY = 64
UNKNOWN_JOB = 1 << 40  # results for jobs nobody issued: counted, never applied
GARBAGE = "garbage"  # what a failed copy leaves in its targets
INJECTED = "injected-corruption"  # a host slot this tool broke on purpose (checksums catch it)


class QuietLog:
    """The engine's logger here: counts the warnings and errors instead of printing them."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def _count(self, event: str, **_: Any) -> None:
        self.counts[event] += 1

    debug = info = warning = error = _count


class SwarmFailure(Exception):
    """A check failed (kvflow broke a promise, or the driver did: the message says which)."""


class DriverError(SwarmFailure):
    """The driver itself broke the engine contract (a bug of this tool, not of kvflow)."""


# --- the scenario a seed draws ------------------------------------------------------------


@dataclass
class Scenario:
    seed: int
    requests: int
    config: Config
    device_blocks: int
    device_cache: bool
    cache_blocks: int  # the device prefix cache keeps at most this many unreferenced blocks
    step_ms: float
    arrivals: int  # at most this many arrivals per step
    max_running: int  # requests scheduled at once (the rest wait, first come first served)
    chunks: int  # prefill in up to this many chunks
    latency_us: float
    bandwidth_gbps: float
    fault_rate: float
    fail_rank: int
    fail_jobs: tuple[int, ...]
    hang_jobs: tuple[int, ...]
    slow_jobs: tuple[int, ...]
    slow_by_ms: float
    corrupt_rate: float
    delay_rate: float
    delay_ms: float
    lost_ranks: dict[int, int]  # job ordinal -> the rank whose result is lost
    dup_rate: float
    bogus_rate: float
    submit_fail_batch: int  # the k-th submit raises (0: none)
    preempt_rate: float
    abort_rate: float
    reset_rate: float
    invalidate_rate: float
    accept_fewer: float
    new_block_rate: float
    release_unscheduled: bool
    touch_hits: bool
    wait_fences: bool  # let late copies report before close (else close ends the fences)
    leave_live: bool  # close with some requests still running
    exec_seed: int
    wrap_seed: int
    work_seed: int
    drive_seed: int

    def describe(self) -> str:
        c = self.config
        faults = [f"fault_rate {self.fault_rate:.3f} rank {self.fail_rank}"]
        for name, value in (
            ("fail", self.fail_jobs),
            ("hang", self.hang_jobs),
            ("slow", self.slow_jobs),
        ):
            if value:
                faults.append(f"{name} {list(value)}")
        if self.slow_jobs:
            faults.append(f"slow_by {self.slow_by_ms:.0f} ms")
        if self.lost_ranks:
            faults.append(f"lost ranks {self.lost_ranks}")
        if self.submit_fail_batch:
            faults.append(f"submit #{self.submit_fail_batch} raises")
        rates = (
            f"corrupt {self.corrupt_rate:.2f} delay {self.delay_rate:.2f} dup {self.dup_rate:.2f} "
            f"bogus {self.bogus_rate:.2f} preempt {self.preempt_rate:.3f} abort {self.abort_rate:.3f} "
            f"reset {self.reset_rate:.3f} invalidate {self.invalidate_rate:.3f}"
        )
        return (
            f"seed {self.seed}: {self.requests} requests; cpu_blocks {c.cpu_blocks} {c.policy} "
            f"{c.store_mode} world {c.world_size} deadline {c.job_deadline_ms:g} ms; device "
            f"{self.device_blocks} blocks"
            f"{f' + prefix cache of {self.cache_blocks}' if self.device_cache else ''}; "
            f"{self.max_running} running at most; step "
            f"{self.step_ms:g} ms; copies {self.latency_us:.0f} us + {self.bandwidth_gbps:g} GB/s\n"
            f"  faults: {'; '.join(faults)}\n  rates: {rates}\n  flags: "
            f"chain_recency={self.config.chain_recency} "
            f"release_unscheduled={self.release_unscheduled} touch_hits={self.touch_hits} "
            f"wait_fences={self.wait_fences} leave_live={self.leave_live}"
        )


def _ordinals(rng: random.Random, chance: float, most: int, upto: int) -> tuple[int, ...]:
    if rng.random() >= chance:
        return ()
    return tuple(sorted(rng.sample(range(1, upto + 1), rng.randint(1, most))))


def pick_scenario(seed: int, fault_max: float) -> Scenario:
    """Everything a seed's run depends on, drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    requests = rng.choice((rng.randint(24, 80), rng.randint(24, 160), rng.randint(80, 300)))
    cpu_blocks = 0 if rng.random() < 0.03 else rng.choice((4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192))
    world = rng.choice((1, 1, 1, 2, 2, 3, 4, 8)) if rng.random() < 0.8 else rng.randint(1, 8)
    step_ms = rng.choice((2.0, 5.0, 10.0, 20.0))
    deadline = rng.choice((15.0, 40.0, 100.0, 250.0, 1000.0))
    config = Config(
        cpu_blocks=cpu_blocks,
        block_tokens=BLOCK_TOKENS,
        policy=rng.choice(("lru", "arc")),
        store_mode=rng.choice(("eager", "lazy")),
        world_size=world,
        job_deadline_ms=deadline,
    )
    expected_jobs = max(4, requests * 2)
    fault_rate = 0.0 if rng.random() < 0.2 else rng.uniform(0.0, fault_max)
    slow_jobs = _ordinals(rng, 0.4, 4, expected_jobs)
    lost: dict[int, int] = {}
    if world > 1 and rng.random() < 0.2:
        for ordinal in rng.sample(range(1, expected_jobs + 1), rng.randint(1, 2)):
            lost[ordinal] = rng.randrange(world)
    scenario = Scenario(
        seed=seed,
        requests=requests,
        config=config,
        device_blocks=3 * MAX_REQUEST_BLOCKS + 16 + rng.randint(0, 160),
        device_cache=rng.random() < 0.5,
        cache_blocks=rng.choice((4, 16, 48, 128)),
        step_ms=step_ms,
        arrivals=rng.randint(1, 4),
        max_running=rng.choice((4, 8, 16, 32, 64)),
        chunks=rng.choice((1, 1, 2, 3)),
        latency_us=rng.choice((200.0, 1_000.0, 5_000.0, 20_000.0)),
        bandwidth_gbps=rng.choice((0.5, 2.0, 10.0, 55.5)),
        fault_rate=fault_rate,
        fail_rank=rng.randrange(world),
        fail_jobs=_ordinals(rng, 0.3, 5, expected_jobs),
        hang_jobs=_ordinals(rng, 0.35, 3, expected_jobs),
        slow_jobs=slow_jobs,
        slow_by_ms=deadline * rng.uniform(1.05, 3.0) if slow_jobs else 0.0,
        corrupt_rate=rng.choice((0.0, 0.0, 0.05, 0.2)) * (fault_max > 0),
        delay_rate=rng.choice((0.0, 0.0, 0.1, 0.3)),
        delay_ms=deadline * rng.uniform(0.2, 2.5),
        lost_ranks=lost,
        dup_rate=rng.choice((0.0, 0.0, 0.05)),
        bogus_rate=rng.choice((0.0, 0.0, 0.02)),
        submit_fail_batch=rng.randint(1, 40) if rng.random() < 0.15 else 0,
        preempt_rate=rng.choice((0.0, 0.01, 0.03, 0.08)),
        abort_rate=rng.choice((0.0, 0.0, 0.01, 0.04)),
        reset_rate=rng.choice((0.0, 0.0, 0.002, 0.01, 0.03)),
        invalidate_rate=rng.choice((0.0, 0.0, 0.01, 0.05)),
        accept_fewer=rng.choice((0.0, 0.1, 0.3)),
        new_block_rate=rng.choice((0.0, 0.2, 0.5)),
        release_unscheduled=rng.random() < 0.6,
        touch_hits=rng.random() < 0.3,
        wait_fences=rng.random() < 0.6,
        leave_live=rng.random() < 0.2,
        exec_seed=rng.getrandbits(32),
        wrap_seed=rng.getrandbits(32),
        work_seed=rng.getrandbits(32),
        drive_seed=rng.getrandbits(32),
    )
    # drawn last, so every earlier draw (and each seed's scenario) stays as it was: most runs
    # leave chain recency to kvflow, the others touch the chain at finish themselves
    scenario.config = msgspec.structs.replace(config, chain_recency=rng.random() < 0.75)
    return scenario


# --- the workload ---------------------------------------------------------------------------


@dataclass
class Prompt:
    hashes: list[int]
    extra: int  # tokens in the partial last block
    decode_steps: int


def make_workload(scn: Scenario) -> list[Prompt]:
    """Prefix-sharing prompts: a few system prompts; conversations whose next turn extends
    the previous turn's full blocks; block hashes are unique random 64-bit numbers."""
    rng = random.Random(scn.work_seed)
    used: set[int] = set()

    def fresh(count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            h = rng.getrandbits(64)
            if h not in used:
                used.add(h)
                out.append(h)
        return out

    systems = [fresh(rng.randint(1, 4)) for _ in range(rng.randint(1, 4))]
    open_conversations = rng.randint(2, 12)
    conversations: list[list[int]] = []
    prompts: list[Prompt] = []
    while len(prompts) < scn.requests:
        if len(conversations) < open_conversations or rng.random() < 0.2:
            hashes = list(rng.choice(systems)) + fresh(rng.randint(0, 3))
            conversations.append(hashes)
        else:
            index = rng.randrange(len(conversations))
            hashes = conversations[index] + fresh(rng.randint(1, 3))
            if len(hashes) > MAX_PROMPT_BLOCKS:
                del conversations[index]
                continue
            conversations[index] = hashes
        extra = 0 if rng.random() < 0.2 else rng.randrange(1, BLOCK_TOKENS)
        if not hashes and not extra:
            extra = 1
        prompts.append(Prompt(list(hashes), extra, rng.randint(1, 6)))
    return prompts


# --- the executor: SimulatedExecutor plus the faults it does not model -----------------------


class FaultyExecutor:
    """Wraps a SimulatedExecutor: turns some load results into integrity failures (``corrupt``),
    delays or loses single ranks' results, repeats results, adds results for unknown jobs,
    makes one submit raise. Remembers every (job, rank) result it delivered."""

    def __init__(self, inner: SimulatedExecutor, scn: Scenario) -> None:
        self.inner = inner
        self.model = inner.model
        self.clock = inner.clock
        self.scn = scn
        self.rng = random.Random(scn.wrap_seed)
        self.jobs: dict[int, TransferJob] = {}
        self.ordinal: dict[int, int] = {}
        self._ordinals = 0
        self._submits = 0
        self.never: dict[int, tuple[int, ...]] = {}  # job -> ranks whose result never comes
        self.delayed: list[tuple[float, int, JobResult]] = []
        self.delivered: set[tuple[int, int]] = set()
        # (block, slot) a delivered result reported bad -> (job, rank) that reported it
        self.reported_bad: dict[tuple[int, int], tuple[int, int]] = {}
        self.corrupted = 0
        self.checksum_failures = 0
        self.closed = False
        # the data model: what each device block and host slot holds (a block hash, GARBAGE
        # or INJECTED); the driver writes device blocks when it computes them, a copy writes
        # its targets when it completes (also a copy whose rank result is lost or late)
        self.device_data: dict[int, object] = {}
        self.slot_data: dict[int, object] = {}

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any = None) -> None:
        self._submits += 1
        world = self.scn.config.world_size
        if self._submits == self.scn.submit_fail_batch:
            for job in jobs:  # nothing accepted: no rank will ever report these
                self.jobs[job.job_id] = job
                self.never[job.job_id] = tuple(range(world))
                self.delivered.add((job.job_id, 0))  # the engine reports rank 0 failed itself
            raise RuntimeError("simulated submit failure: copy stream could not be created")
        self.inner.submit(jobs, compute_done)
        for job in jobs:
            self._ordinals += 1
            self.jobs[job.job_id] = job
            self.ordinal[job.job_id] = self._ordinals
            if self._ordinals in self.inner.hang_jobs:
                self.never[job.job_id] = tuple(range(world))
            elif self._ordinals in self.scn.lost_ranks:
                self.never[job.job_id] = (self.scn.lost_ranks[self._ordinals],)

    def _copy(self, job: TransferJob, results: list[JobResult]) -> list[JobResult]:
        """The copy is over: its targets change now. A load reading a slot broken on purpose
        fails its checksum (``corrupt``), as the torch executor's checksums make it."""
        ok = all(r.ok for r in results)
        if job.direction != LOAD:
            for d, s in zip(job.device_blocks, job.slots):
                self.slot_data[s] = self.device_data.get(d, GARBAGE) if ok else GARBAGE
            return results
        for d, s in zip(job.device_blocks, job.slots):
            self.device_data[d] = self.slot_data.get(s, GARBAGE) if ok else GARBAGE
        bad = tuple(h for h, s in zip(job.hashes, job.slots) if self.slot_data.get(s) == INJECTED)
        if not bad:
            return results
        self.checksum_failures += 1
        error = "checksum mismatch: host copy broken earlier"
        return [JobResult(job_id=r.job_id, rank=r.rank, ok=False, error=error, corrupt=bad) for r in results]

    def _inject(self, job: TransferJob, result: JobResult) -> JobResult:
        """This rank found bad bytes in the job's host copy: the slots named go bad."""
        rng = self.rng
        named = [(h, s) for h, s in zip(job.hashes, job.slots) if rng.random() < 0.5] or [(job.hashes[0], job.slots[0])]
        for _, s in named:
            self.slot_data[s] = INJECTED
        for d in job.device_blocks:
            self.device_data[d] = GARBAGE
        # (its checksums also see the slots broken earlier, as _copy's do)
        bad = [h for h, s in zip(job.hashes, job.slots) if self.slot_data.get(s) == INJECTED]
        if rng.random() < 0.2:
            bad.append(rng.getrandbits(64))  # a hash the job does not name
        self.corrupted += 1
        return JobResult(
            job_id=result.job_id,
            rank=result.rank,
            ok=False,
            error=f"checksum mismatch: host slot {named[0][1]} read back bad bytes",
            corrupt=tuple(bad),
        )

    def poll(self) -> list[JobResult]:
        rng, scn, now = self.rng, self.scn, self.clock.now_ms
        out: list[JobResult] = []
        by_job: dict[int, list[JobResult]] = {}
        for result in self.inner.poll():  # (every rank of a job comes in one poll)
            by_job.setdefault(result.job_id, []).append(result)
        # job by job: a copy sees the slots an earlier one in this poll found broken
        copied = (r for jid, rs in by_job.items() for r in self._copy(self.jobs[jid], rs))
        for result in copied:
            job = self.jobs[result.job_id]
            if result.rank in self.never.get(result.job_id, ()):
                continue  # this rank's result is lost
            if job.direction == LOAD and scn.corrupt_rate and rng.random() < scn.corrupt_rate:
                result = self._inject(job, result)
            if scn.delay_rate and rng.random() < scn.delay_rate:
                self.delayed.append((now + rng.uniform(0.0, scn.delay_ms), len(self.delayed), result))
                continue
            out.append(result)
            if scn.dup_rate and rng.random() < scn.dup_rate:
                out.append(result)
        if self.delayed:
            due = [d for d in self.delayed if d[0] <= now]
            if due:
                self.delayed = [d for d in self.delayed if d[0] > now]
                out.extend(r for _, _, r in sorted(due, key=lambda d: (d[0], d[1])))
        if scn.bogus_rate and rng.random() < scn.bogus_rate:
            out.append(JobResult(job_id=UNKNOWN_JOB + rng.randrange(1000), rank=0, ok=True))
        self.delivered.update((r.job_id, r.rank) for r in out)
        for r in out:
            if r.corrupt:
                job = self.jobs[r.job_id]
                for h, s in zip(job.hashes, job.slots):
                    if h in r.corrupt:
                        self.reported_bad.setdefault((h, s), (r.job_id, r.rank))
        return out

    def next_event_ms(self) -> float | None:
        times = [t for t, _, _ in self.delayed]
        nxt = self.inner.next_completion_ms()
        if nxt is not None:
            times.append(nxt)
        return min(times) if times else None

    def will_report(self) -> bool:
        """Whether some result is still to come (a copy running, or a delayed result)."""
        return bool(self.delayed) or self.inner.in_flight() > 0

    def close(self) -> None:
        self.closed = True
        self.inner.close()
        self.delayed.clear()


# --- the engine-like driver -----------------------------------------------------------------


@dataclass
class Req:
    rid: str
    hashes: list[int]
    extra: int
    decode_left: int
    phase: str = "waiting"  # waiting -> loading -> compute -> decode -> (finished)
    device_hit: int = 0
    shared: list[int] = field(default_factory=list)  # device-cache hashes it references
    own: list[int] = field(default_factory=list)  # device blocks of positions device_hit..
    accepted: int = 0
    load_job: int | None = None
    valid: int = 0  # own blocks whose contents are computed or loaded
    ready_step: int = 0
    looked_up: bool = False  # kvflow knows it since its (re)admission
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * BLOCK_TOKENS + self.extra


@dataclass
class Stats:
    steps: int = 0
    jobs: int = 0
    loads: int = 0
    stores: int = 0
    completed: int = 0
    failed: int = 0
    rank_failures: int = 0  # failed on one rank while another rank's copy still ran (fenced)
    timed_out: int = 0
    fenced: int = 0
    abandoned: int = 0
    lifted_copy_over: int = 0
    lifted_closed: int = 0
    late_results: int = 0
    corrupt_results: int = 0
    corrupt_evictions: int = 0
    resets: int = 0
    preempted: int = 0
    preempted_in_flight: int = 0
    resumed: int = 0
    aborted: int = 0
    finished_in_flight: int = 0
    fenced_recomputes: int = 0
    invalidations: int = 0
    unknown_results: int = 0
    executor_errors: int = 0
    hit_tokens: int = 0
    starved: int = 0
    checksum_failures: int = 0
    fence_warnings: int = 0

    def add(self, other: Stats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Driver:
    """One engine: a scheduler, a device pool (with an optional prefix cache) and kvflow."""

    def __init__(self, scn: Scenario, fault_max: float, trace_path: str, checks: bool = True) -> None:
        self.scn = scn
        self.checks = checks
        self.rng = random.Random(scn.drive_seed)
        self.clock = VirtualClock()
        model = TransferModel(
            bytes_per_block=2 * 1024 * 1024, bandwidth_gbps=scn.bandwidth_gbps, latency_us=scn.latency_us
        )
        inner = SimulatedExecutor(
            self.clock,
            model,
            world_size=scn.config.world_size,
            fault_rate=scn.fault_rate,
            seed=scn.exec_seed,
            fail_jobs=scn.fail_jobs,
            hang_jobs=scn.hang_jobs,
            slow_jobs=scn.slow_jobs,
            slow_by_ms=scn.slow_by_ms,
            fail_rank=scn.fail_rank,
        )
        self.executor = FaultyExecutor(inner, scn)
        self.engine = SyncEngine(
            scn.config,
            self.executor,
            clock=self.clock,
            trace_path=trace_path,
            trace_meta={"generator": "tools/swarm.py", "seed": scn.seed, "fault_max": fault_max},
            checkpoint_every=CHECKPOINT_EVERY,
        )
        self.engine.manager.paranoid = True  # every event re-checked against the tables
        self.log = QuietLog()
        self.engine.watch.log = self.log  # (warnings such as kvflow.fence_held are expected here)
        self.data = self.executor.device_data
        self.lost_reports: list[str] = []  # F17: bad bytes reported, still on offer
        self.state = self.engine.manager.state
        self.prompts = make_workload(scn)
        self.stats = Stats()
        # device pool: free, held by kvflow (block -> job), released by their owner but held
        self.free: list[int] = list(range(scn.device_blocks))
        self.held: dict[int, int] = {}
        self.limbo: dict[int, None] = {}
        self.cache: dict[int, int] = {}  # device prefix cache: hash -> block, LRU first
        self.cache_refs: dict[int, int] = {}
        self.active: dict[str, Req] = {}  # every live request: waiting or running
        self.waiting: list[Req] = []  # the waiting ones, first come first served
        self.retry: list[Req] = []  # preempted, back in a few steps
        self.arrived = 0
        self.step_no = 0
        self.known_hashes: list[int] = []
        self.notices: Counter[int] = Counter()  # outcome notices (loads, stores) per job

    # -- device blocks -------------------------------------------------------------------

    def _guard(self, blocks: Sequence[int], what: str) -> None:
        for d in blocks:
            if d in self.held:
                raise DriverError(f"{what}: device block {d} is still held by job {self.held[d]}")

    def _track(self, job_id: int | None, kind: str) -> None:
        if job_id is None:
            return
        job = self.state.jobs.get(job_id)
        if job is None:
            raise SwarmFailure(f"job {job_id} returned by a {kind} call is not live")
        for d in job.device_blocks:
            if d in self.held:
                raise SwarmFailure(f"job {job_id} holds device block {d}, already held by job {self.held[d]}")
            self.held[d] = job_id

    def _drop(self, blocks: Sequence[int]) -> None:
        """The owner is done with these blocks: free now, or once kvflow releases them."""
        for d in blocks:
            if d in self.held:
                self.limbo[d] = None
            else:
                self.free.append(d)

    def _evict_cache(self, wanted: int) -> None:
        victims = [h for h in self.cache if not self.cache_refs.get(h)][:wanted]
        if not victims:
            return
        blocks = [self.cache.pop(h) for h in victims]
        if self.scn.config.store_mode == "lazy":
            self._guard(blocks, "device_blocks_evicting")
            self._track(self.engine.device_blocks_evicting(victims, blocks), "device_blocks_evicting")
        self._drop(blocks)

    def _alloc(self, n: int) -> list[int] | None:
        if n > len(self.free) and self.cache:
            self._evict_cache(n - len(self.free))
        if n > len(self.free):
            return None
        self.free.sort(reverse=True)
        taken = [self.free.pop() for _ in range(n)]
        self._guard(taken, "allocation")
        return taken

    # -- requests ------------------------------------------------------------------------

    def _arrive(self) -> None:
        prompt = self.prompts[self.arrived]
        req = Req(f"req-{self.arrived:04d}", list(prompt.hashes), prompt.extra, prompt.decode_steps)
        self.arrived += 1
        self.active[req.rid] = req
        self.waiting.append(req)

    def _admit(self, req: Req) -> bool:
        """Schedule a waiting request: look it up, allocate, load its hits (True), or leave
        it waiting (False)."""
        eng, rng = self.engine, self.rng
        n = len(req.hashes)
        cap = max(0, (req.num_tokens - 1) // BLOCK_TOKENS)
        device_hit = 0
        if self.scn.device_cache:
            while device_hit < min(n, cap) and req.hashes[device_hit] in self.cache:
                device_hit += 1
        hits = eng.lookup(req.rid, req.hashes, req.num_tokens, device_hit)
        req.looked_up = True
        if not 0 <= hits <= max(0, cap - device_hit):
            raise SwarmFailure(f"lookup of {req.rid} answered {hits} hits, cap {cap - device_hit}")
        shared = req.hashes[:device_hit]
        for h in shared:  # referenced before allocating, so the allocation cannot evict them
            self.cache_refs[h] = self.cache_refs.get(h, 0) + 1
        own = self._alloc(n - device_hit)
        if own is None:
            for h in shared:
                self.cache_refs[h] -= 1
            if self.scn.release_unscheduled:
                eng.accept_hits(req.rid, [])  # not scheduled: release every hit
            req.phase = "waiting"
            return False
        for h in shared:
            self.cache[h] = self.cache.pop(h)  # most recently used
        req.device_hit, req.shared, req.own = device_hit, shared, own
        accept = hits
        if hits and rng.random() < self.scn.accept_fewer:
            accept = rng.randint(0, hits - 1)
        self._guard(own[:accept], "accept_hits")
        job = eng.accept_hits(req.rid, own[:accept])
        if (job is None) != (accept == 0):
            raise SwarmFailure(f"accept_hits of {req.rid} with {accept} blocks returned job {job}")
        self._track(job, "accept_hits")
        req.accepted, req.valid = accept, 0
        if job is not None:
            self.notices.setdefault(job, 0)
            req.phase, req.load_job = "loading", job
        else:
            req.phase, req.load_job = "compute", None
        return True

    def _compute(self, req: Req) -> None:
        remaining = len(req.own) - req.valid
        chunk = remaining
        if self.scn.chunks > 1 and remaining > 1:
            chunk = max(1, math.ceil(remaining / self.rng.randint(1, self.scn.chunks)))
        if chunk:
            start = req.valid
            blocks = req.own[start : start + chunk]
            hashes = req.hashes[req.device_hit + start : req.device_hit + start + chunk]
            self._guard(blocks, "blocks_computed")
            self.data.update(zip(blocks, hashes))  # the forward pass wrote them
            self._track(self.engine.blocks_computed(req.rid, hashes, blocks), "blocks_computed")
            req.valid += chunk
        if req.valid == len(req.own):
            req.phase = "decode"

    def _decode(self, req: Req) -> None:
        req.decode_left -= 1
        room = len(req.hashes) < MAX_REQUEST_BLOCKS
        if room and self.scn.new_block_rate and self.rng.random() < self.scn.new_block_rate:
            got = self._alloc(1)
            if got is not None:
                h = self.rng.getrandbits(64)
                req.hashes.append(h)
                req.own.extend(got)
                req.valid += 1
                self._guard(got, "blocks_computed")
                self.data[got[0]] = h
                self._track(self.engine.blocks_computed(req.rid, [h], got), "blocks_computed")
        if req.decode_left <= 0:
            self._finish(req)

    def _live_jobs(self, rid: str) -> bool:
        kreq = self.state.requests.get(rid)
        return bool(kreq is not None and kreq.jobs)

    def _release_request_blocks(self, req: Req, keep: bool) -> None:
        for h in req.shared:
            self.cache_refs[h] -= 1
        if keep and self.scn.device_cache:
            for h, d in zip(req.hashes[req.device_hit :], req.own):
                if h in self.cache or d in self.held:
                    # (a block still being stored stays out of the cache: simpler to drop)
                    self._drop([d])
                else:
                    self.cache[h] = d
            if len(self.cache) > self.scn.cache_blocks:
                self._evict_cache(len(self.cache) - self.scn.cache_blocks)
        else:
            if keep and self.scn.config.store_mode == "lazy" and req.own:
                hashes = req.hashes[req.device_hit :]
                self._guard(req.own, "device_blocks_evicting")
                self._track(self.engine.device_blocks_evicting(hashes, req.own), "device_blocks_evicting")
            self._drop(req.own)
        req.shared, req.own = [], []

    def _check_data(self, req: Req, what: str, upto: int | None = None) -> None:
        """The request's device blocks hold its blocks' contents (a late copy never wrote
        a block the engine was given back, a load brought the right bytes)."""
        blocks = [self.cache[h] for h in req.shared] + req.own
        for i, (h, d) in enumerate(zip(req.hashes, blocks)):
            if upto is not None and not req.device_hit <= i < upto:
                continue
            if self.data.get(d) != h:
                got = self.data.get(d)
                raise SwarmFailure(
                    f"{what}: device block {d} of {req.rid} (position {i}) holds "
                    f"{got if isinstance(got, str) else f'block {got}'}, expected block {h}"
                )

    def _finish(self, req: Req) -> None:
        eng = self.engine
        self._check_data(req, "at finish")
        if not self.scn.config.chain_recency:  # (else kvflow's finish does it)
            eng.touch(list(reversed(req.hashes)), reuse=False)  # deepest first (F14)
        if self._live_jobs(req.rid):
            self.stats.finished_in_flight += 1
        self._release_request_blocks(req, keep=True)
        known = eng.finish_request(req.rid)
        if known != self.scn.config.enabled:
            raise SwarmFailure(f"finish_request({req.rid}) returned {known}")
        self.known_hashes.extend(req.hashes[-4:])
        del self.active[req.rid]

    def _preempt(self, req: Req) -> None:
        if self._live_jobs(req.rid):
            self.stats.preempted_in_flight += 1
        self.stats.preempted += 1
        req.preemptions += 1
        known = self.engine.finish_request(req.rid, preempted=True)
        if known != self.scn.config.enabled:
            raise SwarmFailure(f"finish_request({req.rid}, preempted=True) returned {known}")
        self._release_request_blocks(req, keep=False)
        req.phase, req.load_job, req.accepted, req.valid, req.device_hit = "waiting", None, 0, 0, 0
        req.looked_up = False
        req.ready_step = self.step_no + self.rng.randint(1, 5)
        del self.active[req.rid]
        self.retry.append(req)

    def _abort(self, req: Req) -> None:
        self.stats.aborted += 1
        if self._live_jobs(req.rid):
            self.stats.finished_in_flight += 1
        known = self.engine.finish_request(req.rid)
        if known != self.scn.config.enabled:
            raise SwarmFailure(f"finish_request({req.rid}) returned {known}")
        self._release_request_blocks(req, keep=False)
        del self.active[req.rid]

    # -- reports -------------------------------------------------------------------------

    def _handle(self, report: StepReport) -> None:
        for rid, job in report.loads_finished:
            self.notices[job] += 1
            req = self.active.get(rid)
            if req is not None and req.phase == "loading" and req.load_job == job:
                self._check_data(req, f"load {job} finished", req.device_hit + req.accepted)
                req.phase, req.valid, req.load_job = "compute", req.accepted, None
                self.stats.hit_tokens += req.accepted * BLOCK_TOKENS
                if self.scn.touch_hits:
                    lo = req.device_hit
                    self.engine.touch(req.hashes[lo : lo + req.accepted], reuse=True)
        for failure in report.loads_failed:
            self.notices[failure.job_id] += 1
            req = self.active.get(failure.request_id)
            if req is None or req.phase != "loading" or req.load_job != failure.job_id:
                continue
            if tuple(req.own[: req.accepted]) != failure.device_blocks:
                raise SwarmFailure(
                    f"load {failure.job_id} of {req.rid} failed naming device blocks "
                    f"{list(failure.device_blocks)}, it was given {req.own[: req.accepted]}"
                )
            req.phase, req.valid, req.load_job = "compute", 0, None
            if failure.fenced:
                # F15: the copy may still write these blocks: recompute into fresh ones
                self.stats.fenced_recomputes += 1
                fresh = self._alloc(req.accepted)
                if fresh is None:
                    self._preempt(req)
                    continue
                old, req.own[: req.accepted] = req.own[: req.accepted], fresh
                self._drop(old)
        for job in report.stores_finished:
            self.notices[job] += 1
        for job, _ in report.stores_failed:
            self.notices[job] += 1
        for d in report.released_device_blocks:
            if d not in self.held:
                raise SwarmFailure(f"released_device_blocks names block {d}, which no job held")
            del self.held[d]
            if d in self.limbo:
                del self.limbo[d]
                self.free.append(d)

    def _step(self) -> StepReport:
        report = self.engine.step()
        if self.checks and self.engine.manager.has_notices():
            raise SwarmFailure(f"notices left behind by step {self.step_no}")
        self._handle(report)
        if self.checks:
            self._check_step()
        return report

    def _check_bad_offers(self) -> None:
        """F17: once kvflow was told a block's host copy is bad, that copy must not stay on
        offer once no load holds it (a load that pinned it when the report came may end
        without failing its checksum on it: it timed out, failed for another reason, read the
        slot before the bytes went bad; or the pin was only a lookup's). Each such block is
        reported once, and the run goes on (the next load of it fails its checksum)."""
        bad, state, slots = self.executor.reported_bad, self.state, self.executor.slot_data
        for (h, slot), (job, rank) in list(bad.items()):
            if slots.get(slot) != INJECTED or state.slot_of.get(h) != slot:
                del bad[h, slot]  # rewritten, or the block left the tier (or that slot)
            elif h not in state.pending and h not in state.pin_count:
                del bad[h, slot]
                self.lost_reports.append(
                    f"F17: block {h} was reported corrupt (load {job} rank {rank}) but stays on "
                    f"offer from its bad slot {slot}, unpinned, after step {self.step_no}"
                )

    def _check_step(self) -> None:
        state = self.state
        self._check_bad_offers()
        if self.held != state.held:
            mine = sorted(set(self.held.items()) ^ set(state.held.items()))[:6]
            raise SwarmFailure(f"held device blocks disagree after step {self.step_no}: {mine}")
        problems = check_invariants(state)
        if problems:
            raise SwarmFailure(f"invariants after step {self.step_no}: {'; '.join(problems[:3])}")

    # -- the run -------------------------------------------------------------------------

    def _wake(self) -> None:
        """Advance the virtual clock to the next thing that can happen (drain's sleep)."""
        times = [self.clock.now_ms + self.scn.step_ms]
        nxt = self.executor.next_event_ms()
        if nxt is not None:
            times.append(nxt)
        deadline = self.engine.manager.next_deadline_ms()
        if deadline is not None:
            times.append(deadline)
        self.clock.advance_to(max(self.clock.now_ms + 0.001, min(times)))

    def run(self) -> None:
        scn, rng, eng = self.scn, self.rng, self.engine
        stop_at = None
        while True:
            done = self.arrived >= scn.requests and not self.retry
            if done and not self.active:
                break
            if done and scn.leave_live and stop_at is None:
                stop_at = self.step_no + rng.randint(0, 20)
            if stop_at is not None and self.step_no >= stop_at:
                break
            if self.step_no >= MAX_STEPS:
                self.stats.starved += 1
                for req in list(self.active.values()):
                    if req.phase != "waiting" or req.looked_up:
                        self._abort(req)
                    else:
                        del self.active[req.rid]
                self.waiting, self.retry = [], []  # (preempted: kvflow counts them finished)
                break
            self.clock.advance_to(self.step_no * scn.step_ms)
            if scn.reset_rate and rng.random() < scn.reset_rate:
                self.stats.resets += 1
                eng.reset()
                for h in [h for h in self.cache if not self.cache_refs.get(h)]:
                    self._drop([self.cache.pop(h)])
            if scn.invalidate_rate and self.known_hashes and rng.random() < scn.invalidate_rate:
                self.stats.invalidations += 1
                eng.invalidate(rng.sample(self.known_hashes, min(len(self.known_hashes), rng.randint(1, 4))))
            running = 0
            for req in list(self.active.values()):
                if req.rid not in self.active or req.phase == "waiting":
                    continue
                roll = rng.random()
                if roll < scn.preempt_rate and req.preemptions < MAX_PREEMPTIONS:
                    self._preempt(req)
                    continue
                running += 1
                if req.phase == "loading" and roll < scn.preempt_rate + scn.abort_rate:
                    self._abort(req)
                elif req.phase == "compute":
                    self._compute(req)
                elif req.phase == "decode":
                    self._decode(req)
            due = [r for r in self.retry if r.ready_step <= self.step_no]
            if due:  # preempted requests go back to the head of the queue
                self.retry = [r for r in self.retry if r.ready_step > self.step_no]
                for req in due:
                    self.active[req.rid] = req
                self.waiting[:0] = due
            for _ in range(rng.randint(0, scn.arrivals)):
                if self.arrived < scn.requests:
                    self._arrive()
            while self.waiting and running < scn.max_running:
                if not self._admit(self.waiting[0]):
                    break  # (the scheduler stops at the first request it cannot place)
                self.waiting.pop(0)
                running += 1
            self._step()
            self.step_no += 1
        self.stats.steps = self.step_no
        self.finish_run()

    def finish_run(self) -> None:
        eng, scn = self.engine, self.scn
        limit = 50 * scn.config.job_deadline_ms + 100 * scn.step_ms + 10 * scn.slow_by_ms + 10 * scn.delay_ms
        report = eng.drain(timeout_ms=limit, sleep=lambda _s: self._wake())
        self._handle(report)
        if eng.has_live_jobs():
            raise SwarmFailure(f"drain left live jobs after {limit:.0f} ms of engine time")
        if self.checks:
            self._check_step()
        if scn.wait_fences:
            # let the late copies report: their results lift the fences ("copy over")
            until = self.clock.now_ms + limit
            while eng.fences() and self.executor.will_report() and self.clock.now_ms < until:
                self._wake()
                self._step()
        fences = eng.fences()
        fenced_blocks = sorted(d for f in fences for d in f.device_blocks)
        if self.checks:
            self._check_step()
            if sorted(self.held) != fenced_blocks:
                raise SwarmFailure(
                    f"before close the engine holds {sorted(self.held)[:8]} but the fences name "
                    f"{fenced_blocks[:8]}"
                )
            for f in fences:
                delivered = tuple(
                    r for r in range(scn.config.world_size) if (f.job_id, r) not in self.executor.delivered
                )
                if f.ranks_pending != delivered:
                    raise SwarmFailure(
                        f"fence of job {f.job_id} waits on ranks {list(f.ranks_pending)}, but the "
                        f"ranks that never reported are {list(delivered)}"
                    )
        eng.close()
        for d in fenced_blocks:  # close ended every fence: the executor's copies stopped
            self.held.pop(d, None)
            if d in self.limbo:
                del self.limbo[d]
                self.free.append(d)
        self.stats.unknown_results = eng.counters.unknown_results
        self.stats.executor_errors = eng.counters.executor_errors
        self.stats.corrupt_results = self.executor.corrupted
        self.stats.checksum_failures = self.executor.checksum_failures
        self.stats.fence_warnings = self.log.counts["kvflow.fence_held"]
        if self.checks:
            self._check_closed()

    def _check_closed(self) -> None:
        state, eng = self.state, self.engine
        problems: list[str] = []
        if state.jobs:
            problems.append(f"jobs left after close: {list(state.jobs.values())[:4]}")
        if state.held:
            problems.append(f"device blocks still held after close: {sorted(state.held)[:8]}")
        if state.fenced_slots:
            problems.append(f"slots still fenced after close: {sorted(state.fenced_slots)[:8]}")
        if eng.fences():
            problems.append("fences left after close")
        if state.queued or state.deferred_touches:
            problems.append("queued jobs or deferred touches left after close")
        live = set(self.active)
        for rid, kreq in state.requests.items():
            if kreq.finished:
                problems.append(f"finished request {rid} never closed")
            elif rid not in live:
                problems.append(f"request {rid} is live in kvflow but not in the engine")
            if kreq.holds_pins() and rid not in live:
                problems.append(f"request {rid} holds pins but is not running")
            if kreq.loading:
                problems.append(f"request {rid} still pins loads {list(kreq.loading)} after close")
        problems.extend(check_invariants(state))
        c = eng.counters
        if c.jobs_fenced != c.fences_lifted:
            problems.append(f"{c.jobs_fenced} jobs fenced but {c.fences_lifted} fences lifted")
        if self.held or self.limbo:
            problems.append(f"the driver still waits for device blocks {sorted(self.held)[:8]}")
        owned = len(self.free) + len(self.cache) + sum(len(r.own) for r in self.active.values())
        if owned != self.scn.device_blocks:
            problems.append(f"device pool: {owned} blocks accounted of {self.scn.device_blocks}")
        if problems:
            raise SwarmFailure("after close: " + "; ".join(problems[:4]))


# --- checks on the recorded trace -------------------------------------------------------------


def check_trace(path: str, driver: Driver) -> None:
    """Every job ends exactly once; fences lift exactly once; the notices match; replay agrees."""
    stats = driver.stats
    kinds: dict[int, str] = {}
    terminals: dict[int, list[Any]] = {}
    lifts: Counter[int] = Counter()
    abandoned: set[int] = set()
    problems: list[str] = []
    seen: Counter[str] = Counter()  # what the engine's counters count, from the trace
    chain: frozenset[int] = frozenset()  # the blocks of the store command being decided
    with TraceReader(path) as reader:
        for line, rec in reader.records():
            kind = type(rec)
            if kind is Checkpoint:
                continue
            name = event_name(rec)
            if isinstance(rec, COMMAND_TYPES):
                chain = frozenset(rec.block_hashes) if kind in (BlocksComputed, DeviceBlocksEvicting) else frozenset()
                continue
            if kind is BlocksEvicted and rec.reason == "capacity" and not chain.isdisjoint(rec.hashes):
                problems.append(f"F16: a store evicted its own chain (line {line}): {sorted(chain & set(rec.hashes))[:3]}")
            if kind is JobCompleted or kind is JobFailed or kind is JobTimedOut:
                seen[name] += not rec.abandoned
            elif name == "jobs_submitted":
                seen[name] += len(rec.job_ids)
            elif name in ("blocks_evicted", "store_rejected"):
                seen[name] += len(rec.hashes)
            elif name == "late_result_ignored":
                seen[name] += 1
            if kind is StoreQueued or kind is LoadQueued:
                if rec.job_id in kinds:
                    problems.append(f"job {rec.job_id} queued twice")
                kinds[rec.job_id] = "store" if kind is StoreQueued else "load"
            elif kind is JobCompleted or kind is JobFailed or kind is JobTimedOut:
                if rec.job_id not in kinds:
                    problems.append(f"{event_name(rec)} for job {rec.job_id}, never queued")
                terminals.setdefault(rec.job_id, []).append(rec)
            elif kind is FenceLifted:
                lifts[rec.job_id] += 1
                if rec.reason == "copy over":
                    stats.lifted_copy_over += 1
                else:
                    stats.lifted_closed += 1
            elif kind is Reset:
                abandoned.update(rec.abandoned_job_ids)
            elif kind is LateResultIgnored:
                stats.late_results += 1
            elif kind is BlocksEvicted and rec.reason == "corrupt":
                stats.corrupt_evictions += 1
            elif event_name(rec) == "request_resumed":
                stats.resumed += 1
    for jid, direction in kinds.items():
        ends = terminals.get(jid, [])
        stats.jobs += 1
        if direction == "load":
            stats.loads += 1
        else:
            stats.stores += 1
        if jid in abandoned:
            stats.abandoned += 1
        expected = 1 if direction == "load" or jid not in abandoned else 0
        if driver.scn.config.enabled and driver.notices.get(jid, 0) != expected:
            problems.append(f"{direction} job {jid} got {driver.notices.get(jid, 0)} notices, expected {expected}")
        if not ends:
            if jid not in abandoned or lifts[jid] != 1:
                problems.append(f"job {jid} has no terminal event (abandoned: {jid in abandoned}, lifts {lifts[jid]})")
            continue
        if len(ends) > 1:
            problems.append(f"job {jid} has {len(ends)} terminal events: {[event_name(e) for e in ends]}")
            continue
        end = ends[0]
        fenced = type(end) is not JobCompleted and end.fenced
        stats.fenced += fenced
        if type(end) is JobCompleted:
            stats.completed += 1
        elif type(end) is JobFailed:
            stats.failed += 1
            stats.rank_failures += fenced and end.rank >= 0 and not end.abandoned
        else:
            stats.timed_out += 1
        if lifts[jid] != int(fenced):
            problems.append(f"job {jid} ended {event_name(end)} fenced={fenced} but its fence lifted {lifts[jid]} times")
        if end.abandoned != (jid in abandoned):
            problems.append(f"job {jid}: {event_name(end)} abandoned={end.abandoned}, reset abandoned it: {jid in abandoned}")
    for jid in lifts:
        if jid not in kinds:
            problems.append(f"fence_lifted for job {jid}, never queued")
    c = driver.engine.counters
    for counter, name in (
        ("jobs_submitted", "jobs_submitted"),
        ("jobs_completed", "job_completed"),
        ("jobs_failed", "job_failed"),
        ("jobs_timed_out", "job_timed_out"),
        ("late_results", "late_result_ignored"),
        ("blocks_evicted", "blocks_evicted"),
        ("blocks_rejected", "store_rejected"),
    ):
        if getattr(c, counter) != seen[name]:
            problems.append(f"counters.{counter} is {getattr(c, counter)}, the trace has {seen[name]}")
    failed = ["trace: " + "; ".join(problems[:4]) + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")]
    failed = failed if problems else []
    live_digest = driver.state.digest()
    for redecide in (False, True):  # (also after a problem above: every finding is reported)
        # the fold checks every invariant after every event (the live run checks each step)
        result = replay(path, redecide=redecide, strict=not redecide)
        what = "replay --redecide" if redecide else "replay"
        if not result.ok:
            d = result.divergence
            assert d is not None
            failed.append(f"{what}: {d.kind} at seq {d.seq} (line {d.line}): {d.message}")
        elif result.state.digest() != live_digest:
            failed.append(f"{what} ends at digest {result.state.digest()}, the live state is {live_digest}")
        elif result.warnings:
            failed.append(f"{what} warned: {result.warnings[0]}")
    if failed:
        raise SwarmFailure(" | ".join(failed))


# --- one seed -------------------------------------------------------------------------------


@dataclass
class SeedResult:
    seed: int
    scenario: Scenario
    stats: Stats
    failure: str | None = None
    trace: bytes = b""


def run_seed(seed: int, fault_max: float, trace_path: str, checks: bool = True) -> SeedResult:
    scn = pick_scenario(seed, fault_max)
    driver: Driver | None = None
    try:
        driver = Driver(scn, fault_max, trace_path, checks=checks)
        driver.run()
        if checks:
            check_trace(trace_path, driver)
        failure = None
    except DriverError as exc:
        failure = f"driver bug (tools/swarm.py): {exc}"
    except SwarmFailure as exc:
        failure = str(exc)
    except Exception as exc:  # kvflow raised where it promised not to, or refused a call
        tb = traceback.extract_tb(exc.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "kvflow" in f.filename), "?")
        failure = f"{type(exc).__name__} at {where} (step {driver.step_no if driver else 0}): {exc}"
    finally:
        if driver is not None and not driver.engine.closed:
            try:
                driver.engine.close()
            except Exception:
                pass
    if driver is not None and driver.lost_reports:  # (found along the way; the run went on)
        more = len(driver.lost_reports) - 1
        lost = driver.lost_reports[0] + (f" (+{more} more)" if more else "")
        failure = lost if failure is None else f"{failure} | {lost}"
    stats = driver.stats if driver is not None else Stats()
    data = Path(trace_path).read_bytes() if Path(trace_path).exists() else b""
    return SeedResult(seed, scn, stats, failure, data)


def _emit(seed: int, fault_max: float, out: str) -> int:
    """Subprocess mode: write the seed's trace to ``out`` (no checks)."""
    run_seed(seed, fault_max, out, checks=False)
    return 0


def repro(seed: int, fault_max: float) -> str:
    extra = "" if fault_max == 0.5 else f" --fault-max {fault_max!r}"  # (exact: it draws the scenario)
    return f"python tools/swarm.py --seeds 1 --start {seed}{extra}"


def check_seed(seed: int, fault_max: float, tmp: Path, subprocess_check: bool) -> SeedResult:
    """Run a seed with every check, re-run it in-process (and maybe in a subprocess under
    another PYTHONHASHSEED): the trace bytes must be identical."""
    first = tmp / f"seed-{seed}.jsonl"
    result = run_seed(seed, fault_max, str(first))
    if result.failure is None:
        again = tmp / f"seed-{seed}-again.jsonl"
        rerun = run_seed(seed, fault_max, str(again), checks=False)
        if rerun.trace != result.trace:
            result.failure = f"re-run in-process: trace bytes differ ({_first_difference(result.trace, rerun.trace)})"
        again.unlink(missing_ok=True)
    if result.failure is None and subprocess_check:
        other = tmp / f"seed-{seed}-subprocess.jsonl"
        env = dict(os.environ)
        hash_seed = (seed * 7919 + 13) % 4_000_000_000 + 1
        if env.get("PYTHONHASHSEED") == str(hash_seed):  # (never the one this process runs under)
            hash_seed += 1
        env["PYTHONHASHSEED"] = str(hash_seed)
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--emit", str(seed), "--fault-max", repr(fault_max),
             "--out", str(other)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            result.failure = f"subprocess run failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
        else:
            data = other.read_bytes()
            if data != result.trace:
                result.failure = (
                    f"subprocess (PYTHONHASHSEED={env['PYTHONHASHSEED']}): trace bytes differ "
                    f"({_first_difference(result.trace, data)})"
                )
        other.unlink(missing_ok=True)
    return result


def _first_difference(a: bytes, b: bytes) -> str:
    la, lb = a.split(b"\n"), b.split(b"\n")
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}: {x[:80]!r} vs {y[:80]!r}"
    return f"{len(la)} vs {len(lb)} lines"


# --- the command ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds (default 100)")
    parser.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--fault-max", type=float, default=0.5, help="highest fault rate drawn (0..1)")
    parser.add_argument(
        "--subprocess-every", type=int, default=50, metavar="K",
        help="re-run every K-th seed in a subprocess under another PYTHONHASHSEED (0: never)",
    )
    parser.add_argument("--keep", type=Path, metavar="DIR", help="copy failing seeds' traces here")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per seed")
    parser.add_argument("--emit", type=int, metavar="SEED", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0.0 <= args.fault_max <= 1.0:
        parser.error("--fault-max must be within 0..1")
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.emit is not None:
        return _emit(args.emit, args.fault_max, args.out)

    started = time.perf_counter()
    total = Stats()
    failures: list[SeedResult] = []
    rates: list[float] = []
    kinds: Counter[str] = Counter()
    subprocess_runs = 0
    with tempfile.TemporaryDirectory(prefix="kvflow-swarm-") as tmp_dir:
        tmp = Path(tmp_dir)
        for seed in range(args.start, args.start + args.seeds):
            every = args.subprocess_every
            sub = bool(every) and (seed % every == 0 or args.seeds == 1)
            subprocess_runs += sub
            result = check_seed(seed, args.fault_max, tmp, sub)
            scn = result.scenario
            rates.append(scn.fault_rate)
            _count_kinds(kinds, scn)
            total.add(result.stats)
            if args.verbose or args.seeds == 1:
                if args.seeds == 1:
                    print(scn.describe())
                s = result.stats
                print(
                    f"seed {seed}: {'FAIL' if result.failure else 'ok'}  {s.jobs} jobs ({s.failed} failed, "
                    f"{s.timed_out} timed out, {s.fenced} fenced, {s.abandoned} abandoned), {s.steps} steps",
                    flush=True,
                )
            if result.failure is not None:
                failures.append(result)
                print(f"FAIL seed {seed}: {result.failure}", flush=True)
                print(f"  reproduce: {repro(seed, args.fault_max)}", flush=True)
                if args.keep is not None:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    src = tmp / f"seed-{seed}.jsonl"
                    if src.exists():
                        shutil.copy(src, args.keep / src.name)
                        print(f"  trace: {args.keep / src.name}", flush=True)
            (tmp / f"seed-{seed}.jsonl").unlink(missing_ok=True)
    elapsed = time.perf_counter() - started
    _summary(args, total, failures, rates, kinds, subprocess_runs, elapsed)
    return 1 if failures else 0


def _count_kinds(kinds: Counter[str], scn: Scenario) -> None:
    c = scn.config
    kinds[f"policy {c.policy}"] += 1
    kinds[f"store {c.store_mode}"] += 1
    kinds["world 1" if c.world_size == 1 else "world >1"] += 1
    kinds["offload off"] += not c.enabled
    kinds["device cache"] += scn.device_cache
    for name, on in (
        ("fault_rate>0", scn.fault_rate > 0),
        ("fail_jobs", bool(scn.fail_jobs)),
        ("hang_jobs", bool(scn.hang_jobs)),
        ("slow_jobs", bool(scn.slow_jobs)),
        ("corrupt", scn.corrupt_rate > 0),
        ("delayed ranks", scn.delay_rate > 0),
        ("lost ranks", bool(scn.lost_ranks)),
        ("repeated results", scn.dup_rate > 0),
        ("unknown results", scn.bogus_rate > 0),
        ("submit failure", scn.submit_fail_batch > 0),
        ("preemption", scn.preempt_rate > 0),
        ("aborts", scn.abort_rate > 0),
        ("resets", scn.reset_rate > 0),
        ("invalidations", scn.invalidate_rate > 0),
        ("closed with live requests", scn.leave_live),
    ):
        kinds[name] += on


def _summary(
    args: argparse.Namespace,
    total: Stats,
    failures: list[SeedResult],
    rates: list[float],
    kinds: Counter[str],
    subprocess_runs: int,
    elapsed: float,
) -> None:
    n = len(rates)
    buckets = Counter(
        "0" if r == 0 else f"{math.floor(r * 10) / 10:.1f}-{math.floor(r * 10) / 10 + 0.1:.1f}" for r in rates
    )
    print()
    print(f"kvflow swarm: seeds {args.start}..{args.start + n - 1} ({n} seeds), fault-max {args.fault_max:g}")
    print(f"  fault rates     {min(rates):.3f}..{max(rates):.3f}; by range: "
          + ", ".join(f"{k}: {v}" for k, v in sorted(buckets.items())))
    covered = [f"{k} {v}" for k, v in kinds.items() if v]
    for i in range(0, len(covered), 7):
        print(("  seeds with      " if i == 0 else " " * 18) + ", ".join(covered[i : i + 7]))
    print(
        f"  jobs            {total.jobs:,} ({total.loads:,} loads, {total.stores:,} stores): "
        f"{total.completed:,} completed, {total.failed:,} failed ({total.rank_failures:,} on one rank while "
        f"another copied), {total.timed_out:,} timed out; {total.fenced:,} fenced, {total.abandoned:,} "
        f"abandoned by {total.resets:,} resets"
    )
    print(
        f"  fences lifted   {total.lifted_copy_over:,} by the copy's end, {total.lifted_closed:,} at close; "
        f"{total.late_results:,} late results"
    )
    print(
        f"  requests        {total.preempted:,} preempted ({total.preempted_in_flight:,} with jobs in flight, "
        f"{total.resumed:,} resumed), {total.aborted:,} aborted, {total.finished_in_flight:,} finished "
        f"during transfers, {total.fenced_recomputes:,} fenced loads recomputed"
    )
    print(
        f"  integrity       {total.corrupt_results:,} corrupt load results injected, "
        f"{total.checksum_failures:,} loads of broken slots caught by checksum, {total.corrupt_evictions:,} "
        f"corrupt evictions; {total.invalidations:,} invalidations; {total.unknown_results:,} unknown "
        f"results counted; {total.executor_errors:,} executor errors"
    )
    print(f"  steps           {total.steps:,} engine steps; {total.starved} runs starved of device blocks")
    print(f"  determinism     {n} in-process re-runs, {subprocess_runs} subprocess re-runs")
    print(f"  failures        {len(failures)}" + (
        "" if not failures else " (seeds " + ", ".join(str(f.seed) for f in failures[:20])
        + (", ..." if len(failures) > 20 else "") + ")"
    ))
    classes: dict[str, list[int]] = {}
    for f in failures:
        for part in (f.failure or "").split(" | "):
            key = re.sub(r"\b\d+\b", "N", re.sub(r"\[[^]]*\]", "[...]", part.split(";")[0]))[:90]
            classes.setdefault(key, []).append(f.seed)
    for key, seeds in sorted(classes.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(map(str, seeds[:8])) + (", ..." if len(seeds) > 8 else "")
        print(f"    {len(seeds):5d} x {key}  (seeds {shown})")
    print(f"  time            {elapsed:.1f} s ({n / elapsed:.1f} seeds/s)")


if __name__ == "__main__":
    sys.exit(main())
