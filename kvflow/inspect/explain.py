"""Why a request missed: the analysis behind ``kvflow explain``.

For every request that looked up the CPU tier, each of its full blocks either hit (on the
device, or loaded from the CPU tier, brought there from the disk or the remote tier for this
request or already there) or missed, and a miss has a cause named from the trace: the block
was never stored (no store of it was ever queued), its last store was rejected (the reason the
decision gave: a tier full of pinned, in-flight or own-chain entries), failed, timed out or was
fenced by a reset, it was evicted (at which seq, by which command and request, under which
policy), found corrupt, invalidated, cleared by a reset, refused by a shared tier (another
tenant's, forged ...), still being stored or on its way from a lower tier when the request
looked up, its load failed, timed out or was abandoned, the engine did not accept the hit, a
block before it missed (a lookup hits a prefix only), or it is the prompt's last block, which
is always computed.

One streaming pass over the trace (:class:`ExplainFold`): the events are folded into the state
with ``evolve``, as every fold does, and beside it every block absent from the CPU tier keeps the
last fact the log says about it. A lookup reads the folded state as its decision read it (before
its events) and those facts; its hits are the recorded ``pins_acquired``; its load's outcome is
the recorded terminal event. Nothing decides a second time: a cause is an event the decision
code recorded. Memory: the state, one fact per block off the tier, and the live requests and
jobs (unlike ``kvflow.inspect.walk``'s pass, which keeps every job's description for the
incident and history queries, this one forgets a job when it ends).

The ``--json`` schema is documented in docs/debugging.md ("The explain schema").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvflow.core.commands import COMMAND_TYPES, FinishRequest, JobResult, JobResults, Lookup
from kvflow.core.decide.lookup import hit_cap_blocks
from kvflow.core.errors import IllegalTransition, KvflowError
from kvflow.core.events import (
    BlocksEvicted,
    DiskLoadQueued,
    EntriesRefused,
    JobCompleted,
    JobFailed,
    JobTimedOut,
    LoadQueued,
    PinsAcquired,
    RemoteLoadQueued,
    Reset,
    StoreRejected,
    event_name,
)
from kvflow.core.jobs import DISK_LOAD, FILLING, LOAD, REMOTE_LOAD, STORE
from kvflow.core.state.apply import evolve
from kvflow.log.format import Checkpoint
from kvflow.log.reader import TraceReader

HIT_TIERS = ("device", "cpu", "disk", "remote")
"""Where a hit came from: the engine's own device cache, or a load from the CPU tier of an
entry that was there (``cpu``) or that the disk or remote tier brought for this request."""

CAUSES = (
    "never_stored",
    "store_rejected",
    "store_failed",
    "store_timed_out",
    "store_fenced",
    "store_in_flight",
    "evicted",
    "corrupt",
    "invalidated",
    "reset",
    "refused",
    "arriving",
    "load_failed",
    "load_timed_out",
    "load_abandoned",
    "load_in_flight",
    "not_accepted",
    "behind_miss",
    "beyond_cap",
    "no_cpu_tier",
)
"""Why a block missed, in the order a summary lists them (docs/debugging.md says what each means)."""

_EVICTION_CAUSE = {"capacity": "evicted", "explicit": "evicted", "corrupt": "corrupt", "invalidated": "invalidated"}


class ExplainError(KvflowError):
    """A question the trace cannot answer (no such request, a trace that does not fold); one line."""


@dataclass(frozen=True, slots=True)
class Fact:
    """The last thing the log says about a block that is off the CPU tier (or, for a load,
    about its copy to the device): the cause it gives a miss, and where the log says it."""

    cause: str
    seq: int | None = None
    line: int | None = None
    job_id: int | None = None
    request_id: str | None = None  # whose store / admission / load
    command: str | None = None  # the command that decided it (its tag)
    reason: str | None = None  # an eviction's, a rejection's or a refusal's reason; an error
    tier: str | None = None  # the tier concerned (a shared tier's refusal, a lower tier's load)
    stored_before: bool = False  # the block was on the CPU tier at some point before


@dataclass(slots=True)
class BlockOutcome:
    """One full block of a request: a hit (``tier``) or a miss (``cause`` and the fact behind it)."""

    index: int
    block: int
    hit: bool
    tier: str | None
    fact: Fact | None
    policy: str | None = None  # an eviction's policy
    lower_tiers: dict[str, str] | None = None  # disk / remote: "held" or "absent" at the lookup
    first_miss: int | None = None  # behind_miss: the index of the block whose miss ended the hits

    def to_dict(self) -> dict[str, Any]:
        f = self.fact
        return {
            "index": self.index,
            "block": self.block,
            "hit": self.hit,
            "tier": self.tier if self.hit else (f.tier if f is not None else None),
            "cause": None if f is None else f.cause,
            "seq": None if f is None else f.seq,
            "line": None if f is None else f.line,
            "job_id": None if f is None else f.job_id,
            "request_id": None if f is None else f.request_id,
            "command": None if f is None else f.command,
            "reason": None if f is None else f.reason,
            "policy": self.policy,
            "stored_before": None if f is None else f.stored_before,
            "lower_tiers": self.lower_tiers,
            "first_miss": self.first_miss,
        }


@dataclass
class RequestOutcome:
    """What one request's last lookup got: hit tokens per tier and missed blocks per cause
    (``blocks``, one per full block, when asked for)."""

    request_id: str
    line: int  # the trace line of its last lookup
    lookups: int
    num_tokens: int
    full_blocks: int
    hit_cap_blocks: int
    device_hit_blocks: int
    hit_tokens: dict[str, int]
    missed: dict[str, int]  # cause -> blocks
    blocks: list[BlockOutcome] | None = None
    run: int = 1  # the how-many-th request of this id (an id used again after it finished)

    @property
    def total_hit_tokens(self) -> int:
        return sum(self.hit_tokens.values())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "run": self.run,
            "line": self.line,
            "lookups": self.lookups,
            "num_tokens": self.num_tokens,
            "full_blocks": self.full_blocks,
            "hit_cap_blocks": self.hit_cap_blocks,
            "device_hit_blocks": self.device_hit_blocks,
            "hit_tokens": self.total_hit_tokens,
            "hit_tokens_by_tier": dict(self.hit_tokens),
            "missed_blocks": sum(self.missed.values()),
            "missed_by_cause": dict(self.missed),
        }
        if self.blocks is not None:
            out["blocks"] = [b.to_dict() for b in self.blocks]
        return out


@dataclass
class Totals:
    """The trace's figures, named as ``kvflow simulate --json`` names them where they mean the
    same: per-request hits summed, and what the recorded events moved."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    cpu_hit_tokens: int = 0  # loaded from the CPU tier, whatever brought it there
    hit_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HIT_TIERS, 0))
    missed_blocks: int = 0
    missed_by_cause: dict[str, int] = field(default_factory=dict)
    stored_blocks: int = 0
    loaded_blocks: int = 0
    evicted_blocks: int = 0
    rejected_blocks: int = 0
    failed_jobs: int = 0  # failed or timed out (jobs a reset abandoned are not counted)
    timed_out_jobs: int = 0
    disk_stored_blocks: int = 0
    disk_loaded_blocks: int = 0
    remote_stored_blocks: int = 0
    remote_loaded_blocks: int = 0
    bytes_per_block: int | None = None  # from the trace's header, when it says

    def add(self, outcome: RequestOutcome) -> None:
        self.requests += 1
        self.prompt_tokens += outcome.num_tokens
        for tier, tokens in outcome.hit_tokens.items():
            self.hit_tokens_by_tier[tier] += tokens
        self.hit_tokens += outcome.total_hit_tokens
        self.device_hit_tokens += outcome.hit_tokens["device"]
        self.cpu_hit_tokens += outcome.total_hit_tokens - outcome.hit_tokens["device"]
        for cause, n in outcome.missed.items():
            self.missed_by_cause[cause] = self.missed_by_cause.get(cause, 0) + n
            self.missed_blocks += n

    def to_dict(self) -> dict[str, Any]:
        bpb = self.bytes_per_block
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "device_hit_tokens": self.device_hit_tokens,
            "cpu_hit_tokens": self.cpu_hit_tokens,
            "hit_tokens_by_tier": dict(self.hit_tokens_by_tier),
            "missed_blocks": self.missed_blocks,
            "missed_by_cause": {c: self.missed_by_cause[c] for c in CAUSES if c in self.missed_by_cause},
            "stored_blocks": self.stored_blocks,
            "loaded_blocks": self.loaded_blocks,
            "evicted_blocks": self.evicted_blocks,
            "rejected_blocks": self.rejected_blocks,
            "failed_jobs": self.failed_jobs,
            "timed_out_jobs": self.timed_out_jobs,
            "disk_stored_blocks": self.disk_stored_blocks,
            "disk_loaded_blocks": self.disk_loaded_blocks,
            "remote_stored_blocks": self.remote_stored_blocks,
            "remote_loaded_blocks": self.remote_loaded_blocks,
            "bytes_per_block": bpb,
            "bytes_stored": None if bpb is None else self.stored_blocks * bpb,
            "bytes_loaded": None if bpb is None else self.loaded_blocks * bpb,
        }


def bytes_per_block_of(meta: dict[str, Any], block_tokens: int) -> int | None:
    """The bytes of one block, when the trace's header says (``kvflow simulate`` records its KV
    geometry in ``meta.kv``; an engine may record ``bytes_per_block``)."""
    given = meta.get("bytes_per_block")
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return given
    kv = meta.get("kv")
    per_token = kv.get("bytes_per_token") if isinstance(kv, dict) else None
    if isinstance(per_token, int) and not isinstance(per_token, bool) and per_token > 0:
        return per_token * block_tokens
    return None


class _Run:
    """A request being followed: its last lookup, what that lookup found, its load."""

    __slots__ = (
        "request_id", "lookup", "line", "lookups", "before", "offered", "pinned",
        "loads", "loaded", "load_end", "brought", "finished",
    )  # fmt: skip

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.lookup: Lookup | None = None
        self.line = 0
        self.lookups = 0
        # index in the window -> why the block was not a hit candidate when the lookup decided
        self.before: dict[int, tuple[Fact, dict[str, str] | None]] = {}
        self.offered: tuple[int, ...] = ()
        self.pinned = False  # the last lookup recorded its pins (offload on)
        self.loads: dict[int, tuple[int, ...]] = {}  # live load job -> its hashes
        self.loaded: set[int] = set()
        self.load_end: dict[int, Fact] = {}  # hash -> its failed, timed-out or abandoned load
        self.brought: dict[int, str] = {}  # hash -> the lower tier whose load brought it for us
        self.finished = False


class ExplainFold:
    """One pass over a trace: yields each request's outcome once it is final (finished, with
    its load over; the rest at the end of the trace). ``detail(request_id)`` says which
    requests get their blocks one by one. After the pass: ``totals``, ``warnings``."""

    def __init__(self, path: str | os.PathLike[str], detail: Callable[[str], bool] = lambda rid: False) -> None:
        self.reader = TraceReader(path)
        self.path = self.reader.path
        self.config = self.reader.config
        self.state = self.reader.new_state()
        self.policy = self.config.policy
        self.block_tokens = self.config.block_tokens
        self.detail = detail
        self.totals = Totals(bytes_per_block=bytes_per_block_of(self.reader.header.meta, self.block_tokens))
        self.warnings: list[str] = []
        self.last_seq = 0
        self._gone: dict[int, Fact] = {}
        self._live: dict[str, _Run] = {}
        self._load_jobs: dict[int, _Run] = {}
        self._lower_jobs: dict[int, tuple[_Run, str]] = {}
        self._corrupt: dict[int, tuple[int, ...]] = {}  # job -> blocks its result named corrupt
        self._command: Any = None
        self._command_tag: str | None = None

    # -- the pass ------------------------------------------------------------------------

    def outcomes(self) -> Iterator[RequestOutcome]:
        with self.reader:
            for line, rec in self.reader.records():
                kind = type(rec)
                if kind is Checkpoint:
                    continue
                if kind in COMMAND_TYPES:
                    yield from self._on_command(line, rec)
                    continue
                yield from self._on_event(line, rec)
        self.warnings.extend(self.reader.findings())
        for run in list(self._live.values()):
            if run.lookup is not None:
                yield self._final(run)
        self._live.clear()

    def _on_command(self, line: int, command: Any) -> Iterator[RequestOutcome]:
        self._command, self._command_tag = command, event_name(command)
        kind = type(command)
        if kind is Lookup:
            self._looked_up(line, command)
        elif kind is FinishRequest and not command.preempted:
            run = self._live.get(command.request_id)
            if run is not None:
                run.finished = True
                if not run.loads:
                    yield self._close(run)
        elif kind is JobResult or kind is JobResults:
            for result in command.results if kind is JobResults else (command,):
                if result.corrupt:
                    self._corrupt[result.job_id] = result.corrupt

    def _on_event(self, line: int, event: Any) -> Iterator[RequestOutcome]:
        kind = type(event)
        state = self.state
        self.last_seq = event.seq
        closed: _Run | None = None
        # what the event tells, read before it is applied (the state as the decision saw it)
        if kind is PinsAcquired:
            run = self._live.get(event.request_id)
            if run is not None and type(self._command) is Lookup:
                run.offered, run.pinned = event.hashes, True
        elif kind is LoadQueued:
            run = self._live.get(event.request_id)
            if run is not None:
                run.loads[event.job_id] = event.hashes
                self._load_jobs[event.job_id] = run
        elif kind is DiskLoadQueued or kind is RemoteLoadQueued:
            if type(self._command) is Lookup:
                run = self._live.get(self._command.request_id)
                if run is not None:
                    self._lower_jobs[event.job_id] = (run, DISK_LOAD if kind is DiskLoadQueued else REMOTE_LOAD)
        elif kind is StoreRejected:
            for h in event.hashes:
                self._gone[h] = self._fact("store_rejected", event, line, request_id=event.request_id, reason=event.reason, block=h)
        elif kind is BlocksEvicted:
            cause = _EVICTION_CAUSE.get(event.reason, "evicted")
            by = getattr(self._command, "request_id", None)
            evicted = self._fact(cause, event, line, request_id=by, reason=event.reason, stored=True)
            self._gone.update(dict.fromkeys(event.hashes, evicted))  # (one fact for the event's blocks)
            self.totals.evicted_blocks += len(event.hashes)
        elif kind is EntriesRefused:
            for h, reason, job in zip(event.hashes, event.reasons, event.job_ids):
                self._gone[h] = self._fact("refused", event, line, job_id=job or None, reason=reason, tier=event.tier, block=h)
        elif kind is Reset:
            self._gone.update(dict.fromkeys(state.slot_of, self._fact("reset", event, line, stored=True)))
            for jid in event.abandoned_job_ids:
                job = state.jobs.get(jid)
                if job is None:
                    continue
                if job.direction == STORE:
                    for h in job.hashes:
                        self._gone[h] = self._fact(
                            "store_fenced", event, line, job_id=jid, request_id=job.request_id,
                            reason=f"store abandoned by the reset at seq {event.seq}; its copy fenced", block=h,
                        )  # fmt: skip
                elif job.direction == LOAD:
                    run = self._load_jobs.pop(jid, None)
                    if run is not None:
                        fact = self._fact("load_abandoned", event, line, job_id=jid, request_id=run.request_id,
                                          reason=f"abandoned by the reset at seq {event.seq}")
                        for h in job.hashes:
                            run.load_end[h] = fact
                        run.loads.pop(jid, None)
                        if run.finished and not run.loads:
                            closed = run
        elif kind is JobCompleted or kind is JobFailed or kind is JobTimedOut:
            closed = self._ended(line, event)
        try:
            evolve(state, event)
        except IllegalTransition as exc:
            raise ExplainError(
                f"{self.path}:{line}: seq {event.seq} does not fold ({exc}); run: kvflow replay {self.path}"
            ) from None
        if closed is not None:
            yield self._close(closed)

    def _fact(
        self,
        cause: str,
        event: Any,
        line: int,
        *,
        job_id: int | None = None,
        request_id: str | None = None,
        reason: str | None = None,
        tier: str | None = None,
        stored: bool | None = None,
        block: int | None = None,
    ) -> Fact:
        if stored is None:  # (a block off the tier now was on it before if its last fact says so)
            before = self._gone.get(block) if block is not None else None
            stored = before is not None and before.stored_before
        return Fact(cause, event.seq, line, job_id, request_id, self._command_tag, reason, tier, stored)

    def _ended(self, line: int, event: Any) -> _Run | None:
        """A terminal event: the totals, the facts of a filling job's blocks, a request's load."""
        direction, n, t = event.direction, len(event.hashes), self.totals
        if event.abandoned:
            return None  # (a reset already told: its blocks left the tier then)
        if kind_completed := type(event) is JobCompleted:
            if direction == STORE:
                t.stored_blocks += n
            elif direction == LOAD:
                t.loaded_blocks += n
            elif direction == DISK_LOAD:
                t.disk_loaded_blocks += n
            elif direction == REMOTE_LOAD:
                t.remote_loaded_blocks += n
            elif direction == "disk_store":
                t.disk_stored_blocks += n
            else:
                t.remote_stored_blocks += n
        else:
            t.failed_jobs += 1
            if type(event) is JobTimedOut:
                t.timed_out_jobs += 1
        if direction in FILLING:
            if kind_completed:
                for h in event.hashes:
                    self._gone.pop(h, None)
                lower = self._lower_jobs.pop(event.job_id, None)
                if lower is not None:
                    bringer, tier = lower
                    for h in event.hashes:
                        bringer.brought[h] = "disk" if tier == DISK_LOAD else "remote"
            else:
                self._lower_jobs.pop(event.job_id, None)
                self._filling_failed(line, event)
            return None
        if direction != LOAD:
            return None
        run = self._load_jobs.pop(event.job_id, None)
        corrupt = self._corrupt.pop(event.job_id, ())
        if run is None:
            return None
        run.loads.pop(event.job_id, None)
        if kind_completed:
            run.loaded.update(event.hashes)
        else:
            timed_out = type(event) is JobTimedOut
            reason = "deadline passed" if timed_out else event.error
            if event.fenced:
                reason += "; fenced until the copy reports over"
            fact = self._fact("load_timed_out" if timed_out else "load_failed", event, line,
                              job_id=event.job_id, request_id=run.request_id, reason=reason)
            for h in event.hashes:
                run.load_end[h] = fact
            for h in corrupt:
                run.load_end[h] = self._fact("corrupt", event, line, job_id=event.job_id,
                                             request_id=run.request_id, reason=reason, stored=True)
        return run if run.finished and not run.loads else None

    def _filling_failed(self, line: int, event: Any) -> None:
        """A store (or a lower tier's load into the CPU tier) that failed or timed out: its
        blocks never became visible."""
        timed_out = type(event) is JobTimedOut
        tier = None
        if event.direction == STORE:
            cause = "store_timed_out" if timed_out else "store_failed"
        else:
            cause = "load_timed_out" if timed_out else "load_failed"
            tier = "disk" if event.direction == DISK_LOAD else "remote"
        reason = "deadline passed" if timed_out else event.error
        if event.fenced:
            reason += "; fenced until the copy reports over"
        for h in event.hashes:
            self._gone[h] = self._fact(cause, event, line, job_id=event.job_id, request_id=event.request_id,
                                       reason=reason, tier=tier, block=h)

    # -- a lookup ------------------------------------------------------------------------

    def _looked_up(self, line: int, cmd: Lookup) -> None:
        """The request's lookup, read against the state before its events: why each block of
        its window that is not RESIDENT could not hit."""
        run = self._live.get(cmd.request_id)
        if run is None:
            run = self._live[cmd.request_id] = _Run(cmd.request_id)
        run.lookup, run.line, run.lookups = cmd, line, run.lookups + 1
        run.offered, run.pinned, run.before = (), False, {}
        run.finished = False  # (a request looked up again after its finish is followed again)
        state = self.state
        slot_of, pending = state.slot_of, state.pending
        disk, remote = state.disk, state.remote
        cap = hit_cap_blocks(cmd.num_tokens, self.block_tokens)
        skip = cmd.device_hit_blocks
        for i in range(skip, min(cap, len(cmd.block_hashes))):
            h = cmd.block_hashes[i]
            lower: dict[str, str] | None = None
            if disk is not None or self.config.remote:
                lower = {}
                if disk is not None:
                    lower["disk"] = "held" if h in disk.slot_of else "absent"
                if self.config.remote:
                    lower["remote"] = "held" if h in remote else "absent"
            if h in slot_of:
                job_id = pending.get(h)
                if job_id is None:
                    continue  # RESIDENT: a hit, or behind the first miss
                job = state.jobs[job_id]
                if job.direction == STORE:
                    fact = Fact("store_in_flight", None, None, job_id, job.request_id, None,
                                f"store job {job_id} not complete yet: a block is visible once stored",
                                None, self._stored_before(h))
                else:
                    tier = "disk" if job.direction == DISK_LOAD else "remote"
                    fact = Fact("arriving", None, None, job_id, None, None,
                                f"the {tier} tier's load (job {job_id}) had not landed yet", tier,
                                self._stored_before(h))
            elif lower and "held" in lower.values():
                tier = "disk" if lower.get("disk") == "held" else "remote"
                fact = Fact("arriving", None, None, None, None, None,
                            f"held by the {tier} tier: this lookup queued its load to the CPU tier",
                            tier, self._stored_before(h))
            else:
                fact = self._gone.get(h) or Fact("never_stored", reason="no store of it was queued before")
            run.before[i] = (fact, lower)

    def _stored_before(self, h: int) -> bool:
        fact = self._gone.get(h)
        return fact is not None and fact.stored_before

    # -- a request's outcome -------------------------------------------------------------

    def _close(self, run: _Run) -> RequestOutcome:
        del self._live[run.request_id]
        return self._final(run)

    def _final(self, run: _Run) -> RequestOutcome:
        cmd = run.lookup
        assert cmd is not None
        B = self.block_tokens
        full = cmd.block_hashes
        cap = hit_cap_blocks(cmd.num_tokens, B)
        skip = cmd.device_hit_blocks
        offered = run.offered
        n = len(offered)
        detail = self.detail(run.request_id)
        blocks: list[BlockOutcome] | None = [] if detail else None
        hits = dict.fromkeys(HIT_TIERS, 0)
        missed: dict[str, int] = {}
        first_miss: int | None = None
        for i, h in enumerate(full):
            fact: Fact | None = None
            tier: str | None = None
            lower: dict[str, str] | None = None
            behind: int | None = None
            if i < skip:
                tier = "device"
            elif i >= cap:
                fact = Fact("beyond_cap", reason=f"at most {max(0, cmd.num_tokens - 1)} of {cmd.num_tokens} tokens can hit")
            elif not self.config.enabled or not run.pinned:
                fact = Fact("no_cpu_tier", reason="offload is disabled (cpu_blocks 0)")
            elif i - skip < n:
                if h in run.loaded:
                    tier = run.brought.get(h, "cpu")
                elif h in run.load_end:
                    fact = run.load_end[h]
                elif any(h in hashes for hashes in run.loads.values()):
                    fact = Fact("load_in_flight", reason="the trace ends before the load's outcome")
                else:
                    fact = Fact("not_accepted", reason=f"the engine accepted fewer of the {n} hits offered")
            else:
                if first_miss is None:
                    first_miss = i
                known = run.before.get(i)
                if known is not None:
                    fact, lower = known
                else:
                    fact, behind = Fact("behind_miss", reason="on the tier, but a block before it missed"), first_miss
            if tier is not None:
                hits[tier] += B
            else:
                assert fact is not None
                missed[fact.cause] = missed.get(fact.cause, 0) + 1
            if blocks is not None:
                policy = self.policy if fact is not None and fact.cause == "evicted" and fact.reason == "capacity" else None
                blocks.append(BlockOutcome(i, h, tier is not None, tier, fact, policy, lower, behind))
        outcome = RequestOutcome(
            run.request_id, run.line, run.lookups, cmd.num_tokens, len(full), cap, skip, hits,
            {c: missed[c] for c in CAUSES if c in missed}, blocks,
        )  # fmt: skip
        self.totals.add(outcome)
        return outcome


@dataclass
class Explanation:
    """``kvflow explain``'s answer: the requests asked about, and the whole trace's totals."""

    path: str
    config: dict[str, Any]
    requests: list[RequestOutcome]
    totals: Totals
    last_seq: int
    warnings: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "config": self.config,
            "requests": [r.to_dict() for r in self.requests],
            "totals": self.totals.to_dict(),
            "last_seq": self.last_seq,
            "warnings": self.warnings,
        }


def explain(
    path: str | os.PathLike[str],
    request_id: str | None = None,
    keep: Callable[[RequestOutcome], bool] | None = None,
) -> Explanation:
    """Explain one request (``request_id``: every block of each of its runs) or, without it,
    every request (``keep`` chooses the outcomes kept in the answer; all by default). Raises
    :class:`ExplainError` for a request no lookup of the trace names, and
    :class:`~kvflow.core.errors.TraceError` for an unreadable trace."""
    fold = ExplainFold(path, (lambda rid: rid == request_id) if request_id is not None else (lambda rid: False))
    kept: list[RequestOutcome] = []
    runs: dict[str, int] = {}  # (of the requests kept: what is not kept is only summed)
    for outcome in fold.outcomes():
        if request_id is not None and outcome.request_id != request_id:
            continue
        if keep is not None and not keep(outcome):
            continue
        outcome.run = runs[outcome.request_id] = runs.get(outcome.request_id, 0) + 1
        kept.append(outcome)
    if request_id is not None and not kept:
        raise ExplainError(f"no lookup of request {request_id!r} in {fold.path} (last seq {fold.last_seq})")
    return Explanation(fold.path, fold.config.to_dict(), kept, fold.totals, fold.last_seq, fold.warnings)


# -- in words --------------------------------------------------------------------------------

_BY_COMMAND = {
    "blocks_computed": "request {r}'s store",
    "device_blocks_evicting": "a store of blocks the device cache dropped",
    "lookup": "request {r}'s lookup (a lower tier's load needed the slot)",
    "evict": "an explicit evict",
    "invalidate": "the engine's invalidate",
}


def _at(fact: Fact) -> str:
    return "" if fact.seq is None else f" at seq {fact.seq} (line {fact.line})"


def why(block: BlockOutcome) -> str:
    """One block's outcome in words: where a hit came from, or why a miss missed."""
    f = block.fact
    if f is None:
        return {"device": "hit on the device (the engine's own prefix cache)",
                "cpu": "hit: loaded from the CPU tier",
                "disk": "hit: brought from the disk tier, loaded from the CPU tier",
                "remote": "hit: brought from the remote tier, loaded from the CPU tier"}[block.tier or "cpu"]
    never = "" if f.stored_before else "never stored: "
    c = f.cause
    if c == "never_stored":
        return "never stored: no store of it was queued before this lookup" + _lower(block)
    if c == "store_rejected":
        return f"{never}its store (request {f.request_id}) was rejected{_at(f)}: {f.reason}" + _lower(block)
    if c in ("store_failed", "store_timed_out"):
        what = "failed" if c == "store_failed" else "timed out"
        return f"{never}its store (job {f.job_id}) {what}{_at(f)}: {f.reason}" + _lower(block)
    if c == "store_fenced":
        return f"{never}its store (job {f.job_id}) was {f.reason}{_at(f)}" + _lower(block)
    if c == "store_in_flight":
        return f"still being stored: {f.reason}"
    if c in ("evicted", "corrupt", "invalidated"):
        by = _BY_COMMAND.get(f.command or "", "{r}").format(r=f.request_id)
        if c == "evicted" and f.reason == "capacity":
            policy = f" (policy {block.policy})" if block.policy else ""
            return f"evicted{_at(f)} to make room for {by}{policy}" + _lower(block)
        if c == "evicted":
            return f"evicted{_at(f)} by {by}" + _lower(block)
        if c == "invalidated":
            return f"invalidated{_at(f)} by {by}" + _lower(block)
        if f.job_id is not None:
            return f"its host copy failed its check in load job {f.job_id}{_at(f)}: {f.reason}"
        return f"evicted as corrupt{_at(f)}: a load found its host copy bad" + _lower(block)
    if c == "reset":
        return f"cleared by the reset{_at(f)}" + _lower(block)
    if c == "refused":
        job = "" if f.job_id is None else f" (load job {f.job_id})"
        return f"the {f.tier} tier refused its entry{_at(f)}{job}: {f.reason}"
    if c == "arriving":
        return f"on its way to the CPU tier: {f.reason}"
    if c in ("load_failed", "load_timed_out", "load_abandoned"):
        what = {"load_failed": "failed", "load_timed_out": "timed out", "load_abandoned": "was abandoned"}[c]
        src = f"the {f.tier} tier's load to the CPU tier" if f.tier else "its load"
        return f"{src} (job {f.job_id}) {what}{_at(f)}: {f.reason}"
    if c == "behind_miss":
        return f"on the CPU tier, but block {block.first_miss} before it missed (only a prefix hits)"
    return f"{c.replace('_', ' ')}: {f.reason}"


def _lower(block: BlockOutcome) -> str:
    tiers = block.lower_tiers
    if not tiers:
        return ""
    absent = [t for t, held in tiers.items() if held == "absent"]
    return f"; absent from the {' and '.join(absent)} tier{'s' if len(absent) > 1 else ''} too" if absent else ""


def block_runs(blocks: list[BlockOutcome]) -> list[tuple[int, int, BlockOutcome]]:
    """Consecutive blocks with the same outcome, said once: (first index, last index, the
    first block of the run)."""
    runs: list[tuple[int, int, BlockOutcome]] = []
    for b in blocks:
        if runs:
            first, _, head = runs[-1]
            if why(head) == why(b):
                runs[-1] = (first, b.index, head)
                continue
        runs.append((b.index, b.index, b))
    return runs


# -- two traces of one workload, side by side -----------------------------------------------


@dataclass
class Change:
    """A request whose hits differ between two traces of the same workload."""

    request_id: str
    run: int
    num_tokens: int
    before: dict[str, int]  # hit tokens by tier
    after: dict[str, int]

    @property
    def delta(self) -> int:
        return sum(self.after.values()) - sum(self.before.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "run": self.run,
            "num_tokens": self.num_tokens,
            "recorded_hit_tokens": sum(self.before.values()),
            "what_if_hit_tokens": sum(self.after.values()),
            "delta_hit_tokens": self.delta,
            "recorded_by_tier": dict(self.before),
            "what_if_by_tier": dict(self.after),
        }


@dataclass
class Comparison:
    """The figures of two traces of one workload (a recording and its rerun), and the requests
    whose outcome changed (in the order of the rerun)."""

    recorded: Totals
    what_if: Totals
    changed: list[Change]
    only_recorded: int  # requests of the recording the rerun lacks (or the other way round)
    only_what_if: int
    warnings: list[str]


def compare(recorded: str | os.PathLike[str], rerun: str | os.PathLike[str]) -> Comparison:
    """Explain both traces and compare them request by request (a request is its id and its
    run: the how-many-th request of that id)."""
    before_fold = ExplainFold(recorded)
    before: dict[tuple[str, int], RequestOutcome] = {}
    for outcome in before_fold.outcomes():
        key = _keyed(before, outcome)
        outcome.blocks = None
        before[key] = outcome
    after_fold = ExplainFold(rerun)
    changed: list[Change] = []
    seen: dict[tuple[str, int], None] = {}
    only_after = 0
    for outcome in after_fold.outcomes():
        key = _keyed(seen, outcome)
        seen[key] = None
        was = before.get(key)
        if was is None:
            only_after += 1
        elif was.hit_tokens != outcome.hit_tokens:
            changed.append(Change(key[0], key[1], outcome.num_tokens, dict(was.hit_tokens), dict(outcome.hit_tokens)))
    only_before = sum(1 for key in before if key not in seen)
    return Comparison(
        before_fold.totals, after_fold.totals, changed, only_before, only_after,
        before_fold.warnings + after_fold.warnings,
    )  # fmt: skip


def _keyed(known: dict[tuple[str, int], Any], outcome: RequestOutcome) -> tuple[str, int]:
    run = 1
    while (outcome.request_id, run) in known:
        run += 1
    outcome.run = run
    return outcome.request_id, run
