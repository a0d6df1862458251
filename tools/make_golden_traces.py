"""Generate kvflow's golden traces (``traces/*.jsonl``) from scripted, engine-like runs.

Each trace is what a vLLM-like engine would record while driving the real decision code
(``OffloadManager`` writing through ``TraceWriter``): requests arrive with prefix-sharing
prompts, look up the CPU tier, load their hits into freshly allocated device blocks, compute
the rest, store it, decode a few steps and finish (kvflow touches each request's chain,
deepest block first: ``Config.chain_recency``).
The *executor* is this script: it decides, per job and rank, when the result arrives and
whether it succeeds, so each trace shows one kind of incident on purpose.

Everything is drawn from ``random.Random(seed)`` per trace and the writer puts no timestamp
in the file, so running the tool twice gives byte-identical files (a test checks it).

Usage, from the repository root::

    python tools/make_golden_traces.py            # writes traces/*.jsonl
    python tools/make_golden_traces.py --out DIR  # somewhere else
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.core.config import Config
from kvflow.core.jobs import LOAD, STORE, TransferJob
from kvflow.engine.manager import OffloadManager
from kvflow.log.writer import TraceWriter

BLOCK_TOKENS = 16
STEP_MS = 10.0
CHECKPOINT_EVERY = 100
"""Events between checkpoints: small, so that replay verifies a digest many times per trace."""
MAX_STEPS = 2_000

STORE_ERRORS = (
    "CUDA error: an illegal memory access was encountered (cudaMemcpyAsync D2H, device 0)",
    "aclrtMemcpyAsync failed: 507899 (ACL_ERROR_RT_INTERNAL_ERROR) on stream kv-store",
    "host pool write failed: staging buffer not mapped (shm segment /kvflow-pool-0)",
)
LOAD_ERRORS = (
    "checksum mismatch: host slot {slot} read back {bad:08x}, stored {good:08x}",
    "CUDA error: unspecified launch failure (cudaMemcpyAsync H2D, device 0)",
    "aclrtMemcpyAsync failed: 507053 (ACL_ERROR_RT_DEVICE_MEM_ERROR) on stream kv-load",
)


@dataclass(frozen=True)
class Report:
    """One executor result: at engine step ``step``, rank ``rank`` says ``ok`` or ``error``."""

    step: int
    rank: int
    ok: bool = True
    error: str | None = None


# An executor script: (job, step it was submitted at, rng) -> the results it will report.
Outcomes = Callable[[TransferJob, int, random.Random], list[Report]]


def all_ok(delay: tuple[int, int] = (1, 2), world_size: int = 1) -> Outcomes:
    def outcomes(job: TransferJob, step: int, rng: random.Random) -> list[Report]:
        return [Report(step + rng.randint(*delay), rank) for rank in range(world_size)]

    return outcomes


@dataclass
class _Request:
    request_id: str
    hashes: list[int]
    num_tokens: int
    arrival_step: int
    phase: str = "new"  # new -> (waiting) -> loading -> compute -> decode -> done
    device_blocks: list[int] = field(default_factory=list)
    accepted: int = 0
    load_job: int | None = None
    recompute: list[int] = field(default_factory=list)  # device blocks a failed load left
    decode_steps: int = 0
    retries: int = 0


class _Prompts:
    """Prefix-sharing prompts: a few system prompts, conversations whose turns extend the
    previous turn's full blocks. Block hashes are unique random 32-bit numbers."""

    def __init__(self, rng: random.Random, max_blocks: int = 12) -> None:
        self.rng = rng
        self.max_blocks = max_blocks
        self.used: set[int] = set()
        self.system = [self._fresh(rng.randint(2, 3)) for _ in range(3)]
        self.conversations: list[list[int]] = []

    def _fresh(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            h = self.rng.getrandbits(32)
            if h and h not in self.used:
                self.used.add(h)
                out.append(h)
        return out

    def next(self) -> tuple[list[int], int]:
        rng = self.rng
        if len(self.conversations) < 4 or rng.random() < 0.25:
            hashes = list(self.system[rng.randrange(len(self.system))]) + self._fresh(
                rng.randint(1, 3)
            )
            self.conversations.append(hashes)
        else:
            index = rng.randrange(len(self.conversations))
            hashes = self.conversations[index] + self._fresh(rng.randint(1, 3))
            if len(hashes) > self.max_blocks:
                del self.conversations[index]
                return self.next()
            self.conversations[index] = hashes
        # A prompt that fills its last block exactly cannot hit it (F13): keep some.
        extra = 0 if rng.random() < 0.2 else rng.randrange(1, BLOCK_TOKENS)
        return list(hashes), len(hashes) * BLOCK_TOKENS + extra


class Run:
    """An engine-like driver of one OffloadManager; the scenario hooks shape the incidents."""

    def __init__(
        self,
        name: str,
        out_dir: Path,
        config: Config,
        *,
        seed: int,
        requests: int,
        outcomes: Outcomes,
        description: str,
        device_blocks: int = 96,
        arrivals_per_step: tuple[int, int] = (0, 2),
    ) -> None:
        self.name = name
        self.rng = random.Random(seed)
        self.config = config
        self.writer = TraceWriter(
            out_dir / f"{name}.jsonl",
            config,
            meta={
                "golden": name,
                "generator": "tools/make_golden_traces.py",
                "seed": seed,
                "description": description,
            },
            checkpoint_every=CHECKPOINT_EVERY,
        )
        self.manager = OffloadManager(config, log=self.writer)
        self.prompts = _Prompts(self.rng)
        self.total_requests = requests
        self.outcomes = outcomes
        self.arrivals_per_step = arrivals_per_step
        self.device_free = list(range(device_blocks))
        self.device_pending: list[int] = []  # released by a request, maybe still held by a job
        self.requests: dict[str, _Request] = {}
        self.arrived = 0
        self.retry_queue: list[tuple[int, _Request]] = []
        self.reports: dict[int, list[tuple[int, Report]]] = {}  # step -> [(job, report)]
        self.step = 0
        # scenario hooks
        self.before_requests: Callable[[Run], None] = lambda run: None
        self.after_requests: Callable[[Run], None] = lambda run: None
        self.accept_fewer = 0.0  # chance to accept one hit fewer than offered

    # -- device blocks -------------------------------------------------------------------

    def _alloc(self, n: int) -> list[int] | None:
        if n > len(self.device_free):
            return None
        self.device_free.sort()
        taken, self.device_free = self.device_free[:n], self.device_free[n:]
        return taken

    def _release(self, blocks: list[int]) -> None:
        self.device_pending.extend(blocks)

    def _settle_device_blocks(self) -> None:
        held = set(self.manager.held_device_blocks())
        still = [d for d in self.device_pending if d in held]
        self.device_free.extend(d for d in self.device_pending if d not in held)
        self.device_pending = still

    # -- requests ------------------------------------------------------------------------

    def _new_request(self) -> None:
        hashes, num_tokens = self.prompts.next()
        request_id = f"req-{self.arrived:03d}"
        self.arrived += 1
        self.requests[request_id] = _Request(request_id, hashes, num_tokens, self.step)

    def requeue(self, req: _Request, after_steps: int) -> None:
        """A preempted/aborted request runs again later under a new id (kvflow closes ids)."""
        retry = _Request(
            f"{req.request_id.split('.')[0]}.{req.retries + 1}",
            req.hashes,
            req.num_tokens,
            self.step + after_steps,
            retries=req.retries + 1,
        )
        self.retry_queue.append((self.step + after_steps, retry))

    def _admit(self, req: _Request) -> None:
        mgr = self.manager
        hits = mgr.lookup(req.request_id, req.hashes, req.num_tokens)
        blocks = self._alloc(len(req.hashes))
        if blocks is None:
            req.phase = "waiting"  # the scheduler asks again next step (pins are replaced)
            return
        req.device_blocks = blocks
        accept = hits
        if hits and self.rng.random() < self.accept_fewer:
            accept = hits - 1
        req.accepted = accept
        job = mgr.accept_hits(req.request_id, blocks[:accept]) if hits else None
        if job is None:
            req.phase = "compute"
        else:
            req.phase, req.load_job = "loading", job

    def finish(self, req: _Request, preempted: bool = False) -> None:
        mgr = self.manager
        if not preempted:
            if self.config.store_mode == "lazy":
                # no device prefix cache: every block the request leaves is dropped now
                mgr.device_blocks_evicting(req.hashes, req.device_blocks)
        mgr.finish_request(req.request_id, preempted=preempted)
        self._release(req.device_blocks)
        req.phase = "done"

    def _advance(self, req: _Request) -> None:
        mgr = self.manager
        if req.phase == "decode":
            req.decode_steps -= 1
            if req.decode_steps <= 0:
                self.finish(req)
        elif req.phase == "compute":
            # computed: the blocks a load did not bring (or brought broken), in prefix order
            loaded = req.accepted if not req.recompute else 0
            mgr.blocks_computed(req.request_id, req.hashes[loaded:], req.device_blocks[loaded:])
            req.phase = "decode"
            req.decode_steps = self.rng.randint(1, 3)
        elif req.phase in ("new", "waiting"):
            self._admit(req)

    def _take_notices(self) -> None:
        notices = self.manager.take_notices()
        for request_id, job in notices.loads_finished:
            req = self.requests.get(request_id)
            if req is not None and req.phase == "loading" and req.load_job == job:
                req.phase = "compute"
        for failure in notices.loads_failed:
            req = self.requests.get(failure.request_id)
            if req is not None and req.phase == "loading" and req.load_job == failure.job_id:
                req.phase = "compute"
                req.recompute = list(failure.device_blocks)
                if failure.fenced:
                    self._swap_fenced(req, failure.device_blocks)

    def _swap_fenced(self, req: _Request, fenced: tuple[int, ...]) -> None:
        """F15: the failed load may still be writing its device blocks, so the recompute
        goes into fresh ones (the fenced blocks come back once their copy is over); with
        none free, the request is preempted and runs again later."""
        fresh = self._alloc(len(fenced))
        if fresh is None:
            self.finish(req, preempted=True)
            self.requeue(req, after_steps=1)
            return
        self._release(list(fenced))
        req.device_blocks[: len(fenced)] = fresh
        req.recompute = fresh

    def live(self) -> list[_Request]:
        return [r for r in self.requests.values() if r.phase != "done"]

    # -- the loop ------------------------------------------------------------------------

    def _step(self) -> None:
        mgr = self.manager
        now_ms = self.step * STEP_MS
        for job_id, report in self.reports.pop(self.step, []):
            mgr.job_result(job_id, rank=report.rank, ok=report.ok, error=report.error)
        mgr.tick(now_ms)
        self._take_notices()
        self.before_requests(self)
        for req in list(self.requests.values()):
            if req.phase != "done":
                self._advance(req)
        due = [r for s, r in self.retry_queue if s <= self.step]
        self.retry_queue = [(s, r) for s, r in self.retry_queue if s > self.step]
        for req in due:
            self.requests[req.request_id] = req
            self._admit(req)
        if self.arrived < self.total_requests:
            for _ in range(self.rng.randint(*self.arrivals_per_step)):
                if self.arrived < self.total_requests:
                    self._new_request()
                    self._admit(self.requests[f"req-{self.arrived - 1:03d}"])
        self.after_requests(self)
        for job in mgr.plan_step(now_ms):
            for report in self.outcomes(job, self.step, self.rng):
                self.reports.setdefault(report.step, []).append((job.job_id, report))
        self._settle_device_blocks()
        self.step += 1

    def run(self) -> None:
        while (
            self.arrived < self.total_requests
            or self.live()
            or self.retry_queue
            or self.reports
            or self.manager.has_live_jobs()
        ):
            if self.step >= MAX_STEPS:
                raise RuntimeError(f"{self.name}: did not settle in {MAX_STEPS} steps")
            self._step()
        # the executor closes: its copies stop, so the fences of jobs that never answered end
        self.manager.end_fences()
        self.manager.close()


# --- the scenarios -----------------------------------------------------------------------


def _pick(rng: random.Random, choices: tuple[str, ...]) -> str:
    return choices[rng.randrange(len(choices))]


def clean(out: Path) -> None:
    run = Run(
        "clean",
        out,
        Config(cpu_blocks=48, block_tokens=BLOCK_TOKENS),
        seed=101,
        requests=60,
        outcomes=all_ok(),
        description="hits, stores, capacity and explicit evictions; no failures",
        device_blocks=40,
    )
    run.accept_fewer = 0.1

    def explicit_evict(r: Run) -> None:
        if r.step == 60:
            r.manager.evict(3)

    run.after_requests = explicit_evict
    run.run()


def store_failures(out: Path) -> None:
    def outcomes(job: TransferJob, step: int, rng: random.Random) -> list[Report]:
        delay = step + rng.randint(1, 2)
        if job.direction == STORE and rng.random() < 0.25:
            return [Report(delay, 0, ok=False, error=_pick(rng, STORE_ERRORS))]
        return [Report(delay, 0)]

    Run(
        "store_failures",
        out,
        Config(cpu_blocks=64, block_tokens=BLOCK_TOKENS),
        seed=202,
        requests=50,
        outcomes=outcomes,
        description="a quarter of the store jobs fail: slots freed, hashes never visible",
    ).run()


def load_failures(out: Path) -> None:
    def outcomes(job: TransferJob, step: int, rng: random.Random) -> list[Report]:
        delay = step + rng.randint(1, 2)
        if job.direction == LOAD and rng.random() < 0.35:
            error = _pick(rng, LOAD_ERRORS).format(
                slot=job.slots[0], bad=rng.getrandbits(32), good=rng.getrandbits(32)
            )
            return [Report(delay, 0, ok=False, error=error)]
        return [Report(delay, 0)]

    Run(
        "load_failures",
        out,
        Config(cpu_blocks=96, block_tokens=BLOCK_TOKENS, store_mode="lazy"),
        seed=303,
        requests=50,
        outcomes=outcomes,
        description=(
            "lazy stores; about a third of the loads fail: entries stay resident, pins are "
            "released, device blocks are recomputed"
        ),
    ).run()


def timeouts(out: Path) -> None:
    deadline_ms = 60.0  # six engine steps

    def outcomes(job: TransferJob, step: int, rng: random.Random) -> list[Report]:
        roll = rng.random()
        if roll < 0.06:
            return []  # lost: the executor never answers
        if roll < 0.25:  # stuck past the deadline, answers late
            late = step + rng.randint(8, 14)
            if rng.random() < 0.3:
                return [
                    Report(
                        late, 0, ok=False, error="copy thread watchdog: stream stalled, job aborted"
                    )
                ]
            return [Report(late, 0)]
        return [Report(step + rng.randint(1, 3), 0)]

    Run(
        "timeouts",
        out,
        Config(cpu_blocks=64, block_tokens=BLOCK_TOKENS, job_deadline_ms=deadline_ms),
        seed=404,
        requests=50,
        outcomes=outcomes,
        description=(
            "jobs stuck past their 60 ms deadline time out at a tick; most answer later and "
            "their results are recorded as late and ignored; some never answer"
        ),
    ).run()


def finish_inflight(out: Path) -> None:
    run = Run(
        "finish_inflight",
        out,
        Config(cpu_blocks=64, block_tokens=BLOCK_TOKENS),
        seed=505,
        requests=50,
        outcomes=all_ok(delay=(2, 5)),
        description=(
            "requests finish or are preempted while their loads and stores are in flight; "
            "each is closed when its last job lands"
        ),
    )

    def abort_some(r: Run) -> None:
        for req in r.live():
            if req.phase == "loading" and r.rng.random() < 0.35:
                preempted = r.rng.random() < 0.6
                r.finish(req, preempted=preempted)
                if preempted:
                    r.requeue(req, after_steps=r.rng.randint(2, 5))

    run.before_requests = abort_some
    run.run()


def two_ranks(out: Path) -> None:
    def outcomes(job: TransferJob, step: int, rng: random.Random) -> list[Report]:
        rank0 = Report(step + rng.randint(1, 3), 0)
        if rng.random() < 0.25:
            error = f"rank 1: {_pick(rng, STORE_ERRORS if job.direction == STORE else LOAD_ERRORS)}"
            error = error.format(
                slot=job.slots[0], bad=rng.getrandbits(32), good=rng.getrandbits(32)
            )
            return [rank0, Report(step + rng.randint(1, 3), 1, ok=False, error=error)]
        return [rank0, Report(step + rng.randint(1, 3), 1)]

    Run(
        "two_ranks",
        out,
        Config(cpu_blocks=64, block_tokens=BLOCK_TOKENS, world_size=2, policy="arc"),
        seed=606,
        requests=45,
        outcomes=outcomes,
        description=(
            "world_size=2, ARC policy; rank 1 fails a quarter of the jobs, before or after "
            "rank 0 succeeded (rank 0's later success is a late result)"
        ),
    ).run()


def reset_inflight(out: Path) -> None:
    reset_step = 30

    def outcomes(job: TransferJob, step: int, rng: random.Random) -> list[Report]:
        if step >= reset_step:
            return [Report(step + rng.randint(1, 2), 0)]
        # Slow jobs are still in flight at the reset (abandoned) and report afterwards, some
        # failing; abandoned loads may share a fenced slot (freed when the last reports).
        if job.job_id % 5 == 0:
            ok = job.direction == STORE and rng.random() < 0.6  # abandoned loads all fail
            error = None if ok else "stream destroyed by reset"
            return [Report(reset_step + rng.randint(1, 6), 0, ok, error)]
        return [Report(min(step + rng.randint(1, 2), reset_step), 0)]

    run = Run(
        "reset_inflight",
        out,
        Config(cpu_blocks=64, block_tokens=BLOCK_TOKENS),
        seed=707,
        requests=50,
        outcomes=outcomes,
        description=(
            "a reset at step 30 with jobs queued (cancelled) and in flight (abandoned: slots "
            "fenced until they report); the run goes on afterwards"
        ),
    )

    def reset(r: Run) -> None:
        if r.step != reset_step:
            return
        # The engine drops every running request (they run again later), then clears the
        # cache, with this step's jobs still queued and slow ones in flight.
        for req in r.live():
            r.finish(req, preempted=True)
            r.requeue(req, after_steps=r.rng.randint(1, 4))
        r.manager.reset()

    run.after_requests = reset
    run.run()


class _SkipColdestOnce:
    """Wraps the real policy; one ``victims`` call skips the coldest candidate.

    This stands for "production ran an older build whose eviction picked differently": the
    recorded event is legal (its victim was resident and unpinned) and the run goes on from
    the state it produced, so the whole trace folds and every checkpoint digest is the
    state machine's own; only re-running the decisions with today's code disagrees.
    """

    def __init__(self, inner: Any, armed_from_call: int) -> None:
        self.inner = inner
        self.calls = 0
        self.armed_from_call = armed_from_call
        self.done = False

    def victims(self, num_blocks: int, pinned: Callable[[int], bool]) -> list[int] | None:
        self.calls += 1
        if not self.done and self.calls >= self.armed_from_call:
            picked: list[int] | None = self.inner.victims(num_blocks + 1, pinned)
            if picked is not None:
                self.done = True
                return picked[1:]
        return self.inner.victims(num_blocks, pinned)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.inner


def divergent(out: Path) -> None:
    run = Run(
        "divergent",
        out,
        Config(cpu_blocks=32, block_tokens=BLOCK_TOKENS),
        seed=808,
        requests=40,
        outcomes=all_ok(),
        description=(
            "one capacity eviction picked the second-coldest block instead of the coldest "
            "(an older build's decision): folds clean, replay --redecide diverges there"
        ),
    )
    wrapper = _SkipColdestOnce(run.manager.state.policy, armed_from_call=4)
    run.manager.state.policy = wrapper
    run.run()
    if not wrapper.done:
        raise RuntimeError("divergent: the victim was never swapped")


SCENARIOS: dict[str, Callable[[Path], None]] = {
    "clean": clean,
    "store_failures": store_failures,
    "load_failures": load_failures,
    "timeouts": timeouts,
    "finish_inflight": finish_inflight,
    "two_ranks": two_ranks,
    "reset_inflight": reset_inflight,
    "divergent": divergent,
}


def make_golden_traces(out_dir: Path, only: list[str] | None = None) -> list[Path]:
    """Write the golden traces into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, scenario in SCENARIOS.items():
        if only and name not in only:
            continue
        scenario(out_dir)
        paths.append(out_dir / f"{name}.jsonl")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = Path(__file__).resolve().parents[1] / "traces"
    parser.add_argument(
        "--out", type=Path, default=default_out, help="output folder (default: traces/)"
    )
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"only these: {', '.join(SCENARIOS)}"
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown trace {unknown[0]!r}; known: {', '.join(SCENARIOS)}")
    for path in make_golden_traces(args.out, args.names or None):
        print(f"{path}: {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
