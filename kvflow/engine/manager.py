"""The synchronous, engine-facing API: commands in, events applied, answers and notices out.

``OffloadManager`` is what a vLLM-like scheduler embeds. Every method builds a command, runs
its decider, which applies, records and dispatches each event as it emits it, and returns the
answer. Outcomes that arrive later (loads finished or failed, device blocks released)
accumulate as *notices* that the engine collects with :meth:`take_notices` whenever it likes,
many steps later included (F4).

:meth:`OffloadManager.step` is the scheduler half of one engine step (the executor's results
applied, timeouts, the jobs to hand over, the notices in a report): ``SyncEngine`` wraps it
with an executor and a clock, the vLLM connector's scheduler side calls it from vLLM's hooks.

A refused call raises a :class:`~kvflow.core.errors.Rejected` subclass and changes nothing (F12).
Apart from the log it is handed, this module does no I/O but for the warning logged when a
step refuses an executor's result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from math import isfinite
from typing import Any

import msgspec
import structlog

from kvflow.core import values as bd
from kvflow.core.commands import (
    AcceptHits,
    BlocksComputed,
    Command,
    DeviceBlocksEvicting,
    DiskRestored,
    EndFences,
    Evict,
    FinishRequest,
    Invalidate,
    JobResult,
    JobResults,
    Lookup,
    PlanStep,
    RemoteFound,
    ResetAll,
    Tick,
    TierRefused,
    Touch,
)
from kvflow.core.config import Config
from kvflow.core.decide.dispatch import DECIDERS, after_decision
from kvflow.core.decide.jobs import expired_jobs
from kvflow.core.decide.lookup import arriving, hit_cap_blocks
from kvflow.core.decide.remote import probe_candidates
from kvflow.core.errors import ConcurrentCall, EngineClosed, Rejected
from kvflow.core.events import EVENT_TYPES, Event, Reset
from kvflow.core.jobs import COPYING_DOWN, DISK_LOAD, LOAD, REMOTE_LOAD, TransferJob, ranks_missing
from kvflow.core.names import BlockName, BlockNames, all_own_keys, tenant_id
from kvflow.core.state.apply import live_applier
from kvflow.core.state.model import State
from kvflow.core.state.tables import JobState
from kvflow.engine.notices import (
    ABANDONED_BY_RESET,
    NO_NOTICES,
    NOTICE_TYPES,
    Fence,
    LoadFailure,
    NoticeBook,
    Notices,
    StepReport,
)
from kvflow.engine.protocols import SelectsEvents
from kvflow.log.memory import MemoryLog, NullLog
from kvflow.log.protocol import Log


class OffloadManager:
    """The offload decisions for one engine (all ranks): pure state + log + notices."""

    _emit: Callable[[Event], None]  # the deciders' emit (see _rebuild_dispatch)

    def __init__(
        self, config: Config, log: Log | None = None, *, paranoid: bool = False, logger: Any = None
    ) -> None:
        """``log`` records the commands and events (default: a ``MemoryLog``). ``logger``
        (structlog's ``kvflow`` logger by default) takes the warning about an executor result
        a step refused. ``paranoid=True`` re-checks every event's legality as it is applied
        (tests, debugging); by default the decider's own validation is trusted on the live
        path."""
        self.config = config
        self.paranoid = paranoid
        self.logger = logger if logger is not None else structlog.get_logger("kvflow")
        self.state = State(config)
        # the full names (and tenants) behind the keys the decisions use (kvflow.core.names)
        self.names = BlockNames()
        self.notice_book = NoticeBook()  # the notices not taken yet
        self._told_abandoned: set[int] = set()  # abandoned loads already reported failed
        # callables receiving the applied events, by event type (see subscribe)
        self._subscribers: list[tuple[Callable[[Any], None], tuple[type, ...] | None]] = []
        self._dispatch: dict[type, tuple[Callable[[Any], None], ...]] = {}
        self._applied: list[Event] = []  # the events of the command being decided, for the log
        self.log = log if log is not None else MemoryLog(config)  # (builds the dispatch)
        # one call at a time: a second thread (or a callback calling back in) is refused
        self._deciding = threading.Lock()
        self.closed = False

    # -- the core loop -------------------------------------------------------------------

    @property
    def log(self) -> Log:
        """Where commands and events are recorded (a MemoryLog, a TraceWriter, a NullLog)."""
        return self._log

    @log.setter
    def log(self, log: Log) -> None:
        self._log = log
        self._recording = not isinstance(log, NullLog)  # a NullLog's calls are skipped
        self._rebuild_dispatch()  # (the events are kept only for a log that records them)

    def execute(self, command: Command) -> Any:
        """Decide and apply one command; returns its answer. Each event is applied, kept for
        the log and handed to its subscribers as the decider emits it (``_emit``, built once
        per subscriber set). Refused, changing nothing, after ``close()`` (``EngineClosed``)
        or while another call is being decided (``ConcurrentCall``: kvflow is called from
        one thread)."""
        if not self._deciding.acquire(False):
            if self.closed:  # (close() keeps the lock: a closed manager is found here)
                raise EngineClosed(f"{type(command).__name__}: the engine is closed")
            raise ConcurrentCall(
                f"{type(command).__name__} while another call is being decided: call kvflow from one thread"
            )
        try:
            applied = self._applied
            if applied:  # (the events of the command before, kept for ``handle``)
                applied.clear()
            try:
                state = self.state
                answer = DECIDERS[type(command)](state, command, self._emit)
                if state.bad:  # (``decide``'s epilogue, F17; skipped while nothing is bad)
                    after_decision(state, command, self._emit)
            except BaseException:
                # what was applied is recorded (it was observed already), even if a paranoid
                # check raised; a call refused before its first event leaves no record
                if applied:
                    self._log.record_command(command)
                    self._log.record_events(applied)
                raise
            if self._recording:
                log = self._log
                log.record_command(command)
                log.record_events(applied)
                log.after_command(self.state)
            return answer
        finally:
            self._deciding.release()

    def handle(self, command: Command) -> tuple[Any, list[Event]]:
        """``execute``, also returning the events the command appended."""
        if self._recording:
            return self.execute(command), self._applied.copy()
        # (a NullLog keeps no events: this call has its own emit collect them)
        events: list[Event] = []
        emit = self._emit
        self._emit = live_applier(self.state, self._dispatch, events, self.paranoid)
        try:
            return self.execute(command), events
        finally:
            self._emit = emit

    def subscribe(
        self, callback: Callable[[Any], None], event_types: Sequence[type] | None = None
    ) -> None:
        """Call ``callback(event)`` for every event applied from now on whose type is in
        ``event_types`` (default: the callback's own ``event_types`` if it names them, a
        :class:`~kvflow.engine.protocols.SelectsEvents`; else every event), in log order, as
        each event is applied (before the decision's next event). Naming the types keeps the
        other events free of the call.

        A callback must not raise: an exception propagates out of the engine call at once and
        the decision stops there. The events applied until then are kept and recorded, so the
        state and its log still agree (every event legal, the invariants kept), but the rest
        of that decision is not made (a callback raising on a store's eviction leaves the
        blocks evicted and the store not queued)."""
        types = event_types
        if types is None and isinstance(callback, SelectsEvents):
            types = callback.event_types
        self._subscribers.append((callback, None if types is None else tuple(types)))
        self._rebuild_dispatch()

    def _rebuild_dispatch(self) -> None:
        notice = self.notice_book.observe
        self._dispatch = {
            kind: tuple(
                [notice] * (kind in NOTICE_TYPES)
                + [self._tell_abandoned_loads] * (kind is Reset)
                + [fn for fn, types in self._subscribers if types is None or kind in types]
            )
            for kind in EVENT_TYPES
        }
        # the deciders' emit: evolve (every check when paranoid), keep for a log that records,
        # hand to the subscribers
        kept = self._applied if self._recording else None
        self._emit = live_applier(self.state, self._dispatch, kept, self.paranoid)

    def _tell_abandoned_loads(self, event: Reset) -> None:
        """F18: a load the reset abandoned never lands: its request recomputes those device
        blocks (which stay held until the abandoned copy reports); told once, though a later
        reset abandons the job again."""
        if not event.keeps_requests:
            return
        jobs = self.state.jobs
        # (the jobs that ended since are forgotten here: an ended job is never abandoned again)
        told = self._told_abandoned = {jid for jid in self._told_abandoned if jid in jobs}
        loads_failed = self.notice_book.notices.loads_failed
        for jid in event.abandoned_job_ids:
            job = jobs.get(jid)
            if (
                job is not None
                and job.direction == LOAD
                and job.request_id is not None
                and jid not in told
            ):
                told.add(jid)
                loads_failed.append(
                    LoadFailure(
                        job.request_id, jid, job.device_blocks, ABANDONED_BY_RESET, fenced=True
                    )
                )

    def take_notices(self) -> Notices:
        """What happened since the last call (F4: kept until taken)."""
        return self.notice_book.take()

    def has_notices(self) -> bool:
        """Whether ``take_notices`` would hand over anything."""
        return self.notice_book.notices != NO_NOTICES

    # -- the step ------------------------------------------------------------------------

    def step(
        self,
        now_ms: float,
        results: Sequence[JobResult] = (),
        *,
        found: Sequence[int] = (),
        refusals: Sequence[TierRefused] = (),
        plan: bool = True,
    ) -> tuple[list[TransferJob], StepReport]:
        """The scheduler half of one engine step at ``now_ms``: the executor's ``results`` are
        applied (a bad one is refused alone, logged and counted in the report, never raised:
        F2), what the remote tier's probes ``found`` and what the shared tiers refused
        (``refusals``, see ``tier_refused``) are recorded, jobs past their deadline time out
        (F2), and the queued jobs are handed over (each once, F5). Returns those
        jobs and the step's report: its notices taken, whatever the steps before left in
        them included (F4).

        ``plan=False`` leaves the queued jobs queued, for a caller that hands jobs over
        only at another moment (vLLM's connector: its results arrive after the forward pass,
        its jobs go to the workers with the next step's metadata). A bad ``now_ms`` refuses
        the step before anything is applied."""
        if type(now_ms) is not float or not isfinite(now_ms):
            now_ms = bd.time_ms(now_ms, "now_ms")
        refused = self.apply_results(results) if results else 0
        if found:
            self.remote_found(found)
        for refusal in refusals:
            self._record_refusal(refusal)
        timed_out = self._time_out(now_ms)
        jobs = self._hand_over(now_ms) if plan else []
        if self.names.table:
            self.names.prune(self.knows)
        book = self.notice_book
        # (a StepReport's first fields are the Notices', in their order: its positional ones)
        notices = msgspec.structs.astuple(book.take()) if book.notices != NO_NOTICES else ()
        report = StepReport(
            *notices, now_ms=now_ms, submitted=jobs, timed_out=timed_out, refused_results=refused
        )
        return jobs, report

    def apply_results(self, results: Sequence[JobResult]) -> int:
        """Apply executor outcomes without raising for a bad one (F2): one command for all of
        them; if the decisions refuse it, each result alone, so that one bad result (an
        unknown job, a rank outside the world) costs only itself. A refused result is logged
        (``kvflow.result_rejected``); returns how many were refused. A closed manager, or a
        call from a second thread, refuses them all by raising (nothing is applied)."""
        if not results:
            return 0
        try:
            self.job_results(results)
            return 0
        except (EngineClosed, ConcurrentCall):
            raise
        except Rejected:
            pass
        refused = 0
        for result in results:
            # (with its integrity report: dropping it would leave a bad host copy on offer, F17)
            outcome = bd.result(result)
            try:
                self.execute(outcome)
            except Rejected as exc:
                refused += 1
                self.logger.warning(
                    "kvflow.result_rejected", job=outcome.job_id, rank=outcome.rank, error=str(exc)
                )
        return refused

    def _record_refusal(self, refusal: TierRefused) -> None:
        """``tier_refused``, never raising for a malformed refusal (F2: logged as
        ``kvflow.refusal_rejected``; the tier counted and logged the refusal itself)."""
        try:
            self.tier_refused(refusal)
        except (EngineClosed, ConcurrentCall):
            raise
        except (Rejected, TypeError, AttributeError) as exc:
            self.logger.warning("kvflow.refusal_rejected", error=str(exc))

    # -- the engine API ------------------------------------------------------------------

    def keys(self, block_hashes: Sequence[int], tenant: str | None = None) -> Sequence[int]:
        """The keys the decisions use for ``block_hashes`` of ``tenant`` (kvflow.core.names):
        the hashes themselves when they fit 64 signed bits and no tenant is named; else
        derived keys, stopping short of a block whose key another name holds (a collision:
        that block and the rest are treated as absent). A hash is an int in [-2**255, 2**256);
        a tenant a string (None or "" for none). A query: nothing is remembered."""
        keyed = self.names.keys(block_hashes, tenant_id(tenant))
        return block_hashes if keyed is None else keyed[0]

    def knows(self, key: int) -> bool:
        """Whether a tier holds (or is filling) ``key`` (so its name is kept). A query."""
        state = self.state
        disk = state.disk
        return (
            key in state.slot_of
            or key in state.remote
            or (disk is not None and key in disk.slot_of)
        )

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        num_tokens: int,
        device_hit_blocks: int = 0,
        tenant: str | None = None,
    ) -> int:
        """How many blocks after the device hit can be loaded from the CPU tier; pins them (F7)."""
        return self._lookup(request_id, self.keys(block_hashes, tenant), num_tokens, device_hit_blocks)

    def _lookup(self, request_id: str, keys: Sequence[int], num_tokens: int, device_hit_blocks: int) -> int:
        answer = self.execute(
            Lookup(
                request_id=bd.request_id(request_id),
                block_hashes=bd.hashes(keys),
                num_tokens=bd.count(num_tokens, "num_tokens"),
                device_hit_blocks=bd.count(device_hit_blocks, "device_hit_blocks"),
            )
        )
        return int(answer)

    def lookup_and_probe(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        num_tokens: int,
        device_hit_blocks: int = 0,
        tenant: str | None = None,
    ) -> tuple[int, list[int], list[BlockName]]:
        """``lookup``, and the blocks after its hits worth asking the remote tier about
        (neither on the CPU tier nor known remotely), in prefix order: their keys, and their
        names unless every key is its own hash (``kvflow.core.names.tier_names``); the keys
        are computed once for both. The names are remembered: what the probe finds joins the
        remote index by key."""
        keyed = self.names.keys(block_hashes, tenant_id(tenant))
        keys = block_hashes if keyed is None else keyed[0]
        hits = self._lookup(request_id, keys, num_tokens, device_hit_blocks)
        cap = hit_cap_blocks(int(num_tokens), self.config.block_tokens)
        wanted = probe_candidates(self.state, list(keys[int(device_hit_blocks) + hits : cap]))
        if keyed is None:
            return hits, wanted, []
        fresh = {n.key: n for n in keyed[1]}
        self.names.add([fresh[k] for k in wanted if k in fresh])
        names = [n for n in map(self.names.name, wanted) if n is not None]
        return hits, [n.key for n in names], names

    def accept_hits(self, request_id: str, device_blocks: Sequence[int]) -> int | None:
        """The engine allocated device blocks for the first hits: queue their load."""
        command = AcceptHits(
            request_id=bd.request_id(request_id), device_blocks=bd.device_blocks(device_blocks)
        )
        job: int | None = self.execute(command)
        return job

    def blocks_computed(
        self,
        request_id: str | None,
        block_hashes: Sequence[int],
        device_blocks: Sequence[int],
        tenant: str | None = None,
    ) -> int | None:
        """Eager mode: store the computed blocks not yet on the tier (F3 dedupe)."""
        keys, device_blocks, fresh = self._keys_of_blocks(block_hashes, device_blocks, tenant)
        job: int | None = self.execute(
            BlocksComputed(
                request_id=bd.optional_request_id(request_id),
                block_hashes=bd.hashes(keys),
                device_blocks=bd.device_blocks(device_blocks),
            )
        )
        self.names.add(fresh)
        return job

    def device_blocks_evicting(
        self, block_hashes: Sequence[int], device_blocks: Sequence[int], tenant: str | None = None
    ) -> int | None:
        """Lazy mode: store blocks the device cache is about to drop."""
        keys, device_blocks, fresh = self._keys_of_blocks(block_hashes, device_blocks, tenant)
        command = DeviceBlocksEvicting(
            block_hashes=bd.hashes(keys), device_blocks=bd.device_blocks(device_blocks)
        )
        job: int | None = self.execute(command)
        self.names.add(fresh)
        return job

    def _keys_of_blocks(
        self, block_hashes: Sequence[int], device_blocks: Sequence[int], tenant: str | None
    ) -> tuple[Sequence[int], Sequence[int], list[BlockName]]:
        """A store's keys, its device blocks cut to match when a collision cut the keys short
        (a call whose lengths differ is refused as it is), and the names to remember once the
        store is accepted (a refused call changes nothing)."""
        keyed = self.names.keys(block_hashes, tenant_id(tenant))
        if keyed is None:
            return block_hashes, device_blocks, []
        keys, fresh = keyed
        if len(keys) < len(block_hashes) and len(device_blocks) == len(block_hashes):
            device_blocks = device_blocks[: len(keys)]
        return keys, device_blocks, fresh

    def touch(
        self, block_hashes: Sequence[int], reuse: bool = True, tenant: str | None = None
    ) -> int:
        """Recency for resident blocks in this order; ``reuse=False`` only reorders."""
        keys = self.keys(block_hashes, tenant)
        answer = self.execute(Touch(block_hashes=bd.hashes(keys), reuse=bd.flag(reuse, "reuse")))
        return int(answer)

    def evict(self, num_blocks: int) -> int:
        """Evict ``num_blocks`` unpinned resident blocks through the policy (all or nothing)."""
        answer = self.execute(Evict(num_blocks=bd.count(num_blocks, "num_blocks")))
        return int(answer)

    def plan_step(self, now_ms: float = 0.0) -> list[TransferJob]:
        """The jobs to hand to the executor now; each job is returned once (F5).

        With nothing queued there is nothing to decide, and no command is recorded (an
        engine calls this every step)."""
        return self._hand_over(bd.time_ms(now_ms, "now_ms"))

    def _hand_over(self, now_ms: float) -> list[TransferJob]:
        """``plan_step`` at a checked ``now_ms``."""
        if not self.state.queued:  # (nothing queued: nothing to decide, nothing recorded)
            return []
        jobs: list[TransferJob] = self.execute(PlanStep(now_ms=now_ms))
        return [self._named(job) if job.direction in _NAMED else job for job in jobs]

    def _named(self, job: TransferJob) -> TransferJob:
        """A disk or remote job with its blocks' full names (a name forgotten is an empty
        one: the tier fails that job rather than guess); none when every key is its own hash
        (the tier names those: ``tier_names``)."""
        if all_own_keys(job.hashes):
            return job
        name = self.names.name
        names = tuple(name(h) or BlockName(h, b"") for h in job.hashes)
        return msgspec.structs.replace(job, names=names)

    def job_result(
        self,
        job_id: int,
        rank: int = 0,
        ok: bool = True,
        error: str | None = None,
        corrupt: Sequence[int] = (),
    ) -> None:
        """One executor outcome (``ok`` must be a bool: anything else is a failed result);
        ``corrupt`` names the blocks whose host copy failed its integrity check (F17)."""
        # (bd.result checks and normalises every field, corrupt included)
        outcome = JobResult(job_id=job_id, rank=rank, ok=ok, error=error, corrupt=tuple(corrupt))
        self.execute(bd.result(outcome))

    def job_results(self, results: Sequence[JobResult]) -> None:
        """Apply many outcomes in one command; a bad one refuses the batch (nothing applied)."""
        if results:
            self.execute(JobResults(results=tuple(map(bd.result, results))))

    def tick(self, now_ms: float) -> int:
        """Time out in-flight jobs whose deadline has passed (F2); returns how many.

        When no job is due there is nothing to decide, and no command is recorded (an
        engine calls this every step)."""
        return self._time_out(bd.time_ms(now_ms, "now_ms"))

    def _time_out(self, now_ms: float) -> int:
        """``tick`` at a checked ``now_ms``."""
        if not expired_jobs(self.state, now_ms):  # (none due: nothing to decide, nothing recorded)
            return 0
        return int(self.execute(Tick(now_ms=now_ms)))

    def next_deadline_ms(self) -> float | None:
        """The earliest deadline of an in-flight job (when the next timeout can come)."""
        in_flight = JobState.IN_FLIGHT
        return min(
            (j.deadline_ms for j in self.state.jobs.values() if j.state is in_flight), default=None
        )

    def finish_request(self, request_id: str, preempted: bool = False) -> bool:
        """The request is done (or preempted): its offered pins are released at once; it
        leaves the state when its last live job ends. False (and nothing changes) for a
        request kvflow does not know: one it never saw or already forgot (F18)."""
        command = FinishRequest(
            request_id=bd.request_id(request_id), preempted=bd.flag(preempted, "preempted")
        )
        answer = self.execute(command)
        return bool(answer)

    def invalidate(self, block_hashes: Sequence[int], tenant: str | None = None) -> int:
        """The engine learned that these blocks' bytes are bad (F17): the resident, unpinned
        ones are evicted (reason ``invalidated``) so no lookup offers them again and a
        recompute stores them anew. Returns how many were evicted; blocks pinned by a
        request's lookup or load, or still being stored, stay (a load of them that fails
        its integrity check evicts them)."""
        answer = self.execute(Invalidate(block_hashes=bd.hashes(self.keys(block_hashes, tenant))))
        return int(answer)

    def remote_found(self, block_hashes: Sequence[int]) -> int:
        """A probe found these blocks on the remote tier: lookups that miss the CPU tier on
        them load them from there. Returns how many were new to the remote index."""
        answer = self.execute(RemoteFound(block_hashes=bd.hashes(block_hashes)))
        return int(answer)

    def tier_refused(self, refusal: TierRefused) -> int:
        """A shared tier refused values it found (each value once, handed over by its
        executor's ``take_refused``): the refusal is recorded (``EntriesRefused``, which
        ``kvflow incidents`` lists) and the blocks leave the tier's index where it holds them.
        Returns how many left an index."""
        command = TierRefused(
            tier=refusal.tier,
            block_hashes=bd.hashes(refusal.block_hashes),
            reasons=tuple(refusal.reasons),
            job_ids=bd.ints(refusal.job_ids, "job ids"),
        )
        return int(self.execute(command))

    def disk_restored(self, entries: Sequence[tuple[int, BlockName]]) -> int:
        """A warm restart: the disk tier's journal vouches for these ``(disk slot, block name)``
        entries; lookups that miss the CPU tier on them load them from disk. Returns how many
        joined the disk index (an entry whose slot or block is taken already is skipped, and
        so is one whose key another name holds)."""
        if not all(isinstance(n, BlockName) for _, n in entries):
            raise Rejected("disk entries must be (disk slot, BlockName) pairs")
        fits = self.names.fits
        entries = [(s, n) for s, n in entries if fits(n)]
        slots = bd.ints([s for s, _ in entries], "disk slots")
        hashes = bd.hashes([n.key for _, n in entries])
        answer = self.execute(DiskRestored(block_hashes=hashes, disk_slots=slots))
        self.names.add([n for _, n in entries])
        return int(answer)

    def arriving(
        self,
        block_hashes: Sequence[int],
        num_tokens: int,
        device_hit_blocks: int = 0,
        tenant: str | None = None,
    ) -> int:
        """How many of a request's blocks right after its CPU-tier hits (those after the first
        ``device_hit_blocks``) a lower tier (disk, remote) is loading into the CPU tier now. An
        engine that can hold a request back (vLLM: "ask again later") waits for them, then its
        next lookup hits them. A query."""
        cap = hit_cap_blocks(int(num_tokens), self.config.block_tokens)
        return arriving(self.state, self.keys(block_hashes, tenant)[int(device_hit_blocks) : cap])

    def reset(self) -> None:
        """Forget the tier: queued jobs are cancelled, in-flight ones abandoned (their slots
        and device blocks stay fenced until every rank reports, F15)."""
        self.execute(ResetAll())

    def end_fences(self) -> int:
        """The executor is closed and its copies have stopped: every fence ends (its device
        blocks are released, its slots freed). Returns how many. Call only once no copy can
        run any more: ``SyncEngine.close`` does, after the executor's ``close()``."""
        if not any(job.fenced for job in self.state.jobs.values()):
            return 0
        answer = self.execute(EndFences())
        return int(answer)

    def close(self) -> None:
        """Close the log (a trace file gets its last checkpoint); later calls are refused.
        Idempotent."""
        if self.closed:
            return
        # waits for a call in progress, and is kept: every later call is refused (execute)
        self._deciding.acquire()
        self.closed = True
        self.log.close(self.state)

    # -- views ---------------------------------------------------------------------------

    def held_device_blocks(self) -> list[int]:
        """Device blocks the engine must not reuse yet (named by a live job)."""
        return list(self.state.held)

    def has_live_jobs(self) -> bool:
        """Whether a job's outcome is still to come (queued or in flight). Fenced jobs are
        not live: their outcome is known, only their memory waits (see ``fences``)."""
        live = (JobState.QUEUED, JobState.IN_FLIGHT)
        return any(job.state in live for job in self.state.jobs.values())

    def fences(self) -> list[Fence]:
        """The fenced jobs, oldest first: outcome known, copy perhaps still running (F15)."""
        world = self.config.world_size
        return [
            Fence(
                job_id=job.job_id,
                direction=job.direction,
                request_id=job.request_id,
                device_blocks=job.device_blocks,
                slots=job.slots,
                deadline_ms=job.deadline_ms,
                ranks_pending=ranks_missing(job.reported, world),
                abandoned=job.abandoned,
            )
            for job in self.state.jobs.values()
            if job.fenced
        ]


# the jobs whose tier keys its entries by the blocks' full names
_NAMED = frozenset((*COPYING_DOWN, DISK_LOAD, REMOTE_LOAD))

__all__ = ["OffloadManager"]
