"""Hypothesis drives ``OffloadManager`` like a (misbehaving) engine would: lookups over a small
hash pool (so hits happen), partial acceptance of hits, stores that reuse in-flight device
blocks (F3), submission, results from any rank (ok or failed), time passing (timeouts), late
results, finish/preempt, touches, explicit evictions and resets; copies that outlive their
deadline and report late, one rank failing while another still copies, resets mid-copy, and
the executor closing (F15).

After every step: the structural invariants hold, folding the log into a fresh ``State`` gives
the live digest, every issued job has at most one terminal event (exactly one once it left the
state), no pin is negative, free + used + fenced == capacity, the vLLM-style KV
events announce exactly the resident blocks, and (F15) no slot or device block is handed out
while a copy that targets it may still run: the machine keeps its own record of which handed-out
copies have not reported on every rank yet.

A refused call (``Rejected``) must change nothing: neither the state nor the log.

The manager applies its deciders' events as the live engine does (without the per-event
legality checks); folding the log with every check after every step finds an event a decider
should not have emitted, and any difference between the two.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow.core.commands import JobResult, TierRefused
from kvflow.core.config import Config
from kvflow.core.errors import BlockHeld, Rejected
from kvflow.core.events import (
    EVENT_TYPES,
    TERMINAL_TYPES,
    BlocksEvicted,
    FenceLifted,
    LateResultIgnored,
)
from kvflow.core.jobs import TransferJob, ranks_in, ranks_missing
from kvflow.core.names import name_of
from kvflow.core.state.apply import fold
from kvflow.core.state.invariants import check_invariants
from kvflow.core.state.model import State
from kvflow.core.state.tables import RESIDENT, JobState
from kvflow.engine.manager import OffloadManager
from kvflow.integrations.vllm.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
)

BT = 4
DEADLINE_MS = 100.0
HASH_POOL = st.integers(min_value=1, max_value=7)
PREFIX = st.lists(HASH_POOL, min_size=1, max_size=4, unique=True)
MOSTLY = st.sampled_from([True, True, True, False])  # (lookups that hit and loads that run)

SUBMITTED = (JobState.IN_FLIGHT, JobState.ABANDONED)  # submitted, a result still decides something
REPORTING = (*SUBMITTED, JobState.FENCED)  # a rank's result is still expected

class OffloadMachine(RuleBasedStateMachine):
    WORLD_SIZE = 1
    POLICY = "lru"
    STORE_MODE = "eager"
    CPU_BLOCKS = 5
    REMOTE_BLOCKS = 0  # a remote tier's index (0: none)
    REMOTE_MODE = "write_through"
    DISK_BLOCKS = 0  # a disk tier's slots (0: none)
    DISK_MODE = "ahead_of_eviction"

    def __init__(self) -> None:
        super().__init__()
        self.config = Config(
            cpu_blocks=self.CPU_BLOCKS,
            block_tokens=BT,
            policy=self.POLICY,
            store_mode=self.STORE_MODE,
            world_size=self.WORLD_SIZE,
            job_deadline_ms=DEADLINE_MS,
            remote_blocks=self.REMOTE_BLOCKS,
            remote_store_mode=self.REMOTE_MODE,
            disk_blocks=self.DISK_BLOCKS,
            disk_store_mode=self.DISK_MODE,
        )
        self.m = OffloadManager(self.config)
        self.kv = KVEventPublisher(BT)
        self.m.subscribe(self.kv)
        self.announced: set[int] = set()  # what a KV-event consumer believes is on the tier
        self.now = 0.0
        self.next_device_block = 1000
        self.next_request = 0
        self.live: list[str] = []  # requests the engine has not finished
        self.handed_out: set[int] = set()  # job ids returned by plan_step (F5)
        # F15, the model: copies handed out whose ranks have not all reported (they may run)
        self.copying: dict[int, tuple[TransferJob, set[int]]] = {}
        # the log as the invariants have read it so far (each event is folded and counted
        # once, not once per step: the same checks as reading the whole log, in linear time)
        self.read = 0
        self.replayed = State(self.config)
        self.terminal: Counter[int] = Counter()
        self.lifted: Counter[int] = Counter()

    # -- helpers ---------------------------------------------------------------------------

    def fresh_blocks(self, n: int) -> list[int]:
        start = self.next_device_block
        self.next_device_block += n
        return list(range(start, start + n))

    def refused(self, call: Any, expected: type[Exception] = Rejected) -> bool:
        """Run ``call``; a refusal must be of ``expected`` and change nothing."""
        digest, records = self.m.state.digest(), len(self.m.log.records)
        try:
            call()
        except Rejected as exc:
            assert isinstance(exc, expected), f"{type(exc).__name__}: {exc}"
            assert self.m.state.digest() == digest, "a refused command changed the state"
            assert len(self.m.log.records) == records, "a refused command was logged"
            return True
        return False

    def request_id(self, data: Any) -> str:
        if self.live and data.draw(st.booleans(), label="existing request"):
            return data.draw(st.sampled_from(self.live), label="request")
        self.next_request += 1
        rid = f"req{self.next_request}"
        self.live.append(rid)
        return rid

    def in_flight(self) -> list[int]:
        # submitted and not yet terminal: in flight, or abandoned by a reset and still copying
        return [j for j, job in self.m.state.jobs.items() if job.state in SUBMITTED]

    def reporting(self) -> list[int]:
        # jobs with a rank whose copy may still run: in flight, abandoned or fenced
        return [j for j, job in self.m.state.jobs.items() if job.state in REPORTING]

    def reported(self, job_id: int, rank: int) -> None:
        """The executor said rank ``rank`` of ``job_id`` is over (the model's side)."""
        copying = self.copying.get(job_id)
        if copying is not None:
            copying[1].discard(rank)
            if not copying[1]:
                del self.copying[job_id]

    def report(self, job_id: int, rank: int, ok: bool, error: str | None = None) -> None:
        self.m.job_result(job_id, rank=rank, ok=ok, error=error)
        self.reported(job_id, rank)

    def terminal_job_ids(self) -> list[int]:
        return [j for j in range(1, self.m.state.last_job_id + 1) if j not in self.m.state.jobs]

    def expected_block_held(self, hashes: list[int], device_blocks: list[int]) -> bool:
        state = self.m.state
        for h, d in zip(hashes, device_blocks, strict=True):
            jid = state.held.get(d)
            if jid is None:
                continue
            job = state.jobs[jid]
            # only a live store of the same hash shares its block (F3); a fenced or abandoned
            # job may still copy into it, whatever the hash (F15)
            if job.direction != "store" or job.fenced or job.hashes[job.device_blocks.index(d)] != h:
                return True
        return False

    # -- rules -----------------------------------------------------------------------------

    @initialize(hashes=st.lists(HASH_POOL, max_size=4, unique=True))
    def warm_tier(self, hashes: list[int]) -> None:
        """Start with some resident blocks so that lookups hit early."""
        if not hashes:
            return
        blocks = self.fresh_blocks(len(hashes))
        if self.STORE_MODE == "eager":
            job_id = self.m.blocks_computed("warm", hashes, blocks)
        else:
            job_id = self.m.device_blocks_evicting(hashes, blocks)
        self.m.plan_step(self.now)
        for rank in range(self.WORLD_SIZE):
            self.m.job_result(job_id, rank=rank)
        self.copying.clear()
        if "warm" in self.m.state.requests:
            self.m.finish_request("warm")
        assert all(self.m.state.is_resident(h) for h in hashes)

    @rule(data=st.data(), hashes=PREFIX, extra_tokens=st.integers(0, BT))
    def lookup(self, data: Any, hashes: list[int], extra_tokens: int) -> None:
        rid = self.request_id(data)
        resident = [h for h in self.m.state.policy.resident() if self.m.state.is_resident(h)]
        if resident and data.draw(MOSTLY, label="aim at resident blocks"):
            head = data.draw(
                st.lists(st.sampled_from(resident), min_size=1, unique=True), label="head"
            )
            hashes = head + [h for h in hashes if h not in head]
        if data.draw(st.integers(0, 7), label="repeat a hash") == 0:
            # a prefix naming one block twice, anywhere: a load may then read one slot twice
            i = data.draw(st.integers(0, len(hashes) - 1), label="repeated position")
            hashes = hashes[: i + 1] + hashes[i:]
        num_tokens = (len(hashes) - 1) * BT + extra_tokens  # sometimes an exact multiple (F13)
        device_hit = data.draw(st.integers(0, 1), label="device hit blocks")
        hits = self.m.lookup(rid, hashes, num_tokens, device_hit_blocks=device_hit)
        cap = max(0, (num_tokens - 1) // BT)
        assert 0 <= hits <= max(0, cap - device_hit)
        assert self.m.state.requests[rid].offered == tuple(hashes[device_hit : device_hit + hits])
        if hits and data.draw(MOSTLY, label="accept at once"):
            self.accept_hits_of(rid, data)

    def accept_hits_of(self, rid: str, data: Any) -> None:
        n = data.draw(st.integers(0, len(self.m.state.requests[rid].offered)), label="accepted")
        job_id = self.m.accept_hits(rid, self.fresh_blocks(n))
        assert (job_id is None) == (n == 0)
        assert self.m.state.requests[rid].offered == ()

    @precondition(lambda self: any(r.offered for r in self.m.state.requests.values()))
    @rule(data=st.data())
    def accept_hits(self, data: Any) -> None:
        offered = sorted(r for r, req in self.m.state.requests.items() if req.offered)
        self.accept_hits_of(data.draw(st.sampled_from(offered), label="request with hits"), data)

    @rule(data=st.data(), hashes=PREFIX)
    def blocks_computed(self, data: Any, hashes: list[int]) -> None:
        rid = (
            None if data.draw(st.integers(0, 5), label="no request") == 0 else self.request_id(data)
        )
        device_blocks = self.fresh_blocks(len(hashes))
        # F3: sometimes the engine names the device block an in-flight store already copies
        for i, h in enumerate(hashes):
            entry = self.m.state.entries.get(h)
            job = self.m.state.jobs[entry.job_id] if entry is not None and entry.job_id else None
            # (a remote load fills entries from the remote tier: it copies no device block)
            if job is not None and job.device_blocks and data.draw(st.booleans(), label="reuse"):
                device_blocks[i] = job.device_blocks[job.hashes.index(h)]
        # ...and sometimes, wrongly, one held by a live load (F12)
        loads = [j for j in self.m.state.jobs.values() if j.direction == "load"]
        if loads and data.draw(st.integers(0, 4), label="misuse") == 0:
            device_blocks[0] = data.draw(st.sampled_from(loads), label="load").device_blocks[0]
        # ...or, with the very hash it copies, one that a fenced or abandoned job holds
        fenced = sorted(d for d, j in self.m.state.held.items() if self.m.state.jobs[j].fenced)
        if fenced and data.draw(st.integers(0, 4), label="fenced block") == 0:
            d = data.draw(st.sampled_from(fenced), label="held block")
            job = self.m.state.jobs[self.m.state.held[d]]
            h = job.hashes[job.device_blocks.index(d)]
            hashes = [h] + [x for x in hashes if x != h]
            device_blocks = [d] + self.fresh_blocks(len(hashes) - 1)
        expect_held = self.expected_block_held(hashes, device_blocks)
        in_flight = {
            h: (e.state, e.job_id)
            for h in hashes
            if (e := self.m.state.entries.get(h)) and e.job_id
        }
        events_before = len(self.m.log.events())
        refused = self.refused(
            lambda: self.m.blocks_computed(rid, hashes, device_blocks), BlockHeld
        )
        assert refused == expect_held
        for event in self.m.log.events()[events_before:]:  # F16: never its own chain
            assert not (isinstance(event, BlocksEvicted) and set(event.hashes) & set(hashes)), event
        for h, (state, job_id) in in_flight.items():
            # a hash queued or in flight is never stored twice (F3): same entry, same job
            entry = self.m.state.entries[h]
            assert (entry.state, entry.job_id) == (state, job_id)

    @rule(data=st.data(), hashes=PREFIX)
    def device_blocks_evicting(self, data: Any, hashes: list[int]) -> None:
        device_blocks = self.fresh_blocks(len(hashes))
        self.m.device_blocks_evicting(hashes, device_blocks)

    @rule()
    def plan_step(self) -> None:
        queued = list(self.m.state.queued)
        jobs = self.m.plan_step(self.now)
        ids = [j.job_id for j in jobs]
        # (ahead of eviction, planning itself may queue remote / disk stores: handed out at once)
        assert ids[: len(queued)] == queued
        assert all(j.direction in ("remote_store", "disk_store") for j in jobs[len(queued) :])
        assert not set(ids) & self.handed_out, "a job was handed out twice (F5)"
        self.handed_out.update(ids)
        for job in jobs:
            lower = job.direction.startswith(("remote_", "disk_"))
            assert len(job.hashes) == len(job.slots) == (len(job.hashes) if lower else len(job.device_blocks)) > 0
            assert len(job.disk_slots) == (len(job.hashes) if job.direction.startswith("disk_") else 0)
            self.copying[job.job_id] = (job, set(range(self.WORLD_SIZE)))

    @precondition(
        lambda self: any(j.state in REPORTING for j in self.m.state.jobs.values())
    )
    @rule(data=st.data(), ok=st.integers(0, 3))
    def job_result(self, data: Any, ok: int) -> None:
        """A rank reports: for a fenced job (timed out, or failed on another rank) that is
        the late copy saying it is over; the last such report lifts the fence."""
        job_id = data.draw(st.sampled_from(self.reporting()), label="job")
        job = self.m.state.jobs[job_id]
        fenced = job.state is JobState.FENCED
        ranks = list(ranks_missing(job.reported, self.WORLD_SIZE))
        rank = data.draw(st.sampled_from(ranks), label="rank")
        self.report(job_id, rank, ok != 0, None if ok else "copy failed")
        if fenced:
            events = self.m.log.events()
            lifted = len(ranks) == 1
            assert isinstance(events[-1 - lifted], LateResultIgnored)
            assert isinstance(events[-1], FenceLifted) is lifted
            assert (job_id in self.m.state.jobs) is not lifted

    @precondition(
        lambda self: any(j.state in SUBMITTED and j.direction == "load" for j in self.m.state.jobs.values())
    )
    @rule(data=st.data(), foreign=st.lists(HASH_POOL, max_size=2))
    def integrity_failure(self, data: Any, foreign: list[int]) -> None:
        """F17: a load finds some of its host copies bad (and names blocks it never read)."""
        loads = [j for j in self.in_flight() if self.m.state.jobs[j].direction == "load"]
        job = self.m.state.jobs[data.draw(st.sampled_from(loads), label="load")]
        named = data.draw(st.lists(st.sampled_from(job.hashes), min_size=1, unique=True), label="corrupt")
        rank = ranks_missing(job.reported, self.WORLD_SIZE)[0]
        abandoned = job.abandoned
        corrupt = tuple(named + [h for h in foreign if h not in job.hashes])
        before = {h for h in foreign if self.m.state.is_resident(h)} - set(job.hashes)
        self.m.job_results([JobResult(job_id=job.job_id, rank=rank, ok=False, error="checksum", corrupt=corrupt)])
        self.reported(job.job_id, rank)
        state = self.m.state
        if not abandoned:  # an abandoned job's entries already left the tier at the reset
            for h in named:  # gone, unless another request still pins it
                assert not state.is_resident(h) or h in state.pin_count, h
        assert {h for h in before if state.is_resident(h)} == before  # blocks it never read stay

    @rule(hashes=st.lists(HASH_POOL, max_size=5))
    def invalidate(self, hashes: list[int]) -> None:
        """F17: the engine says these blocks are bad."""
        state = self.m.state
        expected = len({h for h in hashes if state.is_resident(h) and h not in state.pin_count})
        assert self.m.invalidate(hashes) == expected
        assert not any(state.is_resident(h) and h not in state.pin_count for h in hashes)

    @precondition(lambda self: bool(self.m.state.queued) or bool(self.reporting()))
    @rule(data=st.data(), batched=st.booleans())
    def executor_step(self, data: Any, batched: bool) -> None:
        """A whole engine step: submit what is queued, then every submitted or fenced job
        reports on every rank that has not reported yet (mostly successes), one by one or as
        a batch: afterwards nothing is in flight and no fence is left."""
        for _ in range(3):  # (with a remote tier a completed store queues its remote store)
            if not (self.m.state.queued or self.reporting()):
                break
            self.plan_step()
            results = []
            for job_id in self.reporting():
                job = self.m.state.jobs[job_id]
                for rank in ranks_missing(job.reported, self.WORLD_SIZE):
                    ok = data.draw(st.integers(0, 5), label="ok") != 0
                    results.append(JobResult(job_id=job_id, rank=rank, ok=ok, error=None if ok else "x"))
            if batched:
                self.m.job_results(results)
            else:
                for result in results:
                    self.m.handle(result)
            for result in results:
                self.reported(result.job_id, result.rank)
        assert not self.reporting() and not self.m.state.jobs and not self.m.state.fenced_slots

    @precondition(lambda self: any(j.acks and j.state in SUBMITTED for j in self.m.state.jobs.values()))
    @rule(data=st.data())
    def repeated_success(self, data: Any) -> None:
        """A rank repeats its success while another rank still copies: recorded, nothing
        else changes."""
        repeated = [j for j, job in self.m.state.jobs.items() if job.acks and job.state in SUBMITTED]
        job_id = data.draw(st.sampled_from(repeated), label="job")
        acks = self.m.state.jobs[job_id].acks
        rank = data.draw(st.sampled_from(ranks_in(acks)), label="rank")
        before = self.m.state.canonical()
        self.m.job_result(job_id, rank=rank)
        after = self.m.state.canonical()
        assert after[0] == before[0] + 1 and after[1:] == before[1:]
        assert isinstance(self.m.log.events()[-1], LateResultIgnored)

    @precondition(lambda self: self.m.state.last_job_id > len(self.m.state.jobs))
    @rule(data=st.data(), ok=st.booleans())
    def late_result(self, data: Any, ok: bool) -> None:
        job_id = data.draw(st.sampled_from(self.terminal_job_ids()), label="terminal job")
        rank = data.draw(st.integers(0, self.WORLD_SIZE - 1), label="rank")
        before = self.m.state.canonical()
        self.report(job_id, rank, ok, None if ok else "late")
        after = self.m.state.canonical()
        assert after[0] == before[0] + 1 and after[1:] == before[1:]
        assert isinstance(self.m.log.events()[-1], LateResultIgnored)

    @rule(advance=st.sampled_from([0.0, 10.0, DEADLINE_MS / 2, DEADLINE_MS]))
    def tick(self, advance: float) -> None:
        self.now += advance
        due = [
            j
            for j, job in self.m.state.jobs.items()
            if job.state is JobState.IN_FLIGHT and job.deadline_ms <= self.now
        ]
        assert self.m.tick(self.now) == len(due)
        # F15: timed out at once (the engine was told), but fenced while the copy may run
        assert all(self.m.state.jobs[j].state is JobState.FENCED for j in due)

    @precondition(lambda self: any(job.fenced for job in self.m.state.jobs.values()))
    @rule(go=st.integers(0, 3))
    def close_executor(self, go: int) -> None:
        """The executor closes (its copies stop): every fence ends."""
        if go:
            return
        fenced = [j for j, job in self.m.state.jobs.items() if job.fenced]
        assert self.m.end_fences() == len(fenced)
        for job_id in fenced:
            self.copying.pop(job_id, None)
        assert not any(job.fenced for job in self.m.state.jobs.values())

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), preempted=st.booleans())
    def finish(self, data: Any, preempted: bool) -> None:
        rid = data.draw(st.sampled_from(self.live), label="request")
        self.live.remove(rid)
        known = rid in self.m.state.requests
        events = len(self.m.log.events())
        assert self.m.finish_request(rid, preempted) == known  # a reset made kvflow forget it
        assert known or len(self.m.log.events()) == events
        if known:
            req = self.m.state.requests.get(rid)
            assert req is None or (req.finished and (req.jobs or req.pins))
            assert req is None or not req.offered

    @precondition(lambda self: any(r.finished and r.preempted for r in self.m.state.requests.values()))
    @rule(data=st.data(), hashes=PREFIX, store=st.booleans())
    def resume(self, data: Any, hashes: list[int], store: bool) -> None:
        """F18: a request preempted while its jobs run comes back under its id (a lookup, or
        straight to computing); its earlier jobs finish on their own."""
        preempted = sorted(r for r, req in self.m.state.requests.items() if req.finished and req.preempted)
        rid = data.draw(st.sampled_from(preempted), label="preempted request")
        jobs_before = dict(self.m.state.requests[rid].jobs)
        if store:
            self.refused(lambda: self.m.blocks_computed(rid, hashes, self.fresh_blocks(len(hashes))), BlockHeld)
        else:
            self.m.lookup(rid, hashes, len(hashes) * BT)
        req = self.m.state.requests[rid]
        assert not req.finished and not req.preempted
        assert set(jobs_before) <= set(req.jobs) | set(range(1, self.m.state.last_job_id + 1))
        self.live.append(rid)

    @rule(hashes=st.lists(HASH_POOL, max_size=5, unique=True), reuse=st.booleans())
    def touch(self, hashes: list[int], reuse: bool) -> None:
        # resident blocks, and those still being stored (F14: they keep the touch)
        on_tier = [h for h in hashes if h in self.m.state.slot_of]
        assert self.m.touch(hashes, reuse=reuse) == len(on_tier)

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        # (an entry whose slot a fenced load may still read would free nothing: not a victim)
        fenced_slots = self.m.state.fenced_slots
        evictable = sum(
            1
            for h, e in self.m.state.entries.items()
            if e.state is RESIDENT and e.pins == 0 and e.slot not in fenced_slots
        )
        if n > evictable:
            assert self.refused(lambda: self.m.evict(n))  # all or nothing (F8)
            return
        start = len(self.m.log.events())
        assert self.m.evict(n) == n
        evicted = [
            h for e in self.m.log.events()[start:] if isinstance(e, BlocksEvicted) for h in e.hashes
        ]
        assert len(evicted) == n and not set(evicted) & set(self.m.state.entries)

    @rule(go=st.integers(0, 5))
    def reset(self, go: int) -> None:
        if go:
            return  # rare on purpose: it wipes the tier
        in_flight = set(self.in_flight())
        fenced = {j for j, job in self.m.state.jobs.items() if job.state is JobState.FENCED}
        unfinished = {rid for rid, r in self.m.state.requests.items() if not r.finished}
        loads = {
            j
            for j in in_flight - fenced
            if self.m.state.jobs[j].direction == "load" and self.m.state.jobs[j].request_id and not self.m.state.jobs[j].abandoned
        }
        self.m.take_notices()
        self.m.reset()
        assert set(self.m.state.jobs) == in_flight | fenced
        assert all(job.fenced for job in self.m.state.jobs.values())
        assert self.m.state.entries == {}
        # F18: live requests stay known, with nothing on the tier; abandoned loads are reported
        assert set(self.m.state.requests) == unfinished
        assert all(not r.pins and not r.jobs for r in self.m.state.requests.values())
        notices = self.m.take_notices()
        assert notices.all_blocks_cleared
        assert {f.job_id for f in notices.loads_failed} >= loads

    def catch_up(self) -> None:
        """Fold the events logged since the last check into ``replayed`` and the counts."""
        records = self.m.log.records
        new = [r for r in records[self.read :] if isinstance(r, EVENT_TYPES)]
        self.read = len(records)
        fold(self.replayed, new)
        for event in new:
            if isinstance(event, TERMINAL_TYPES):
                self.terminal[event.job_id] += 1
            elif isinstance(event, FenceLifted):
                self.lifted[event.job_id] += 1

    def loads_share_a_slot(self) -> bool:
        """Two submitted loads read one slot, or one load reads a slot twice."""
        seen: set[int] = set()
        for job in self.m.state.jobs.values():
            if job.direction == "load" and job.state in SUBMITTED:
                if len(set(job.slots)) != len(job.slots) or not seen.isdisjoint(job.slots):
                    return True
                seen.update(job.slots)
        return False

    @precondition(lambda self: self.loads_share_a_slot())
    @rule()
    def reset_while_loads_share_a_slot(self) -> None:
        """A reset fences each abandoned load's slots: a shared one stays fenced until the
        last of them reports (this machine found two bugs here, see test_machine_findings)."""
        self.reset(0)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def structure(self) -> None:
        assert check_invariants(self.m.state) == []

    @invariant()
    def log_replays_to_the_live_state(self) -> None:
        self.catch_up()
        assert self.replayed.digest() == self.m.state.digest()

    @invariant()
    def every_job_ends_exactly_once(self) -> None:
        """One outcome per job (a fenced job has its outcome already); a job abandoned by a
        reset whose copy never reported ends by its fence alone (the reset was its outcome)."""
        self.catch_up()
        terminal, lifted = self.terminal, self.lifted
        jobs = self.m.state.jobs
        for job_id in range(1, self.m.state.last_job_id + 1):
            assert lifted[job_id] <= 1 and not (lifted[job_id] and job_id in jobs), job_id
            job = jobs.get(job_id)
            if job is not None:
                assert terminal[job_id] == (job.state is JobState.FENCED), job_id
            else:
                assert terminal[job_id] + (lifted[job_id] and not terminal[job_id]) == 1, job_id
        assert set(terminal) <= set(range(1, self.m.state.last_job_id + 1))

    @invariant()
    def no_memory_is_handed_out_while_a_copy_may_still_use_it(self) -> None:
        """F15, against the machine's own record of the copies that may still run."""
        state = self.m.state
        free = set(state.free_slots)
        owner = {slot: h for h, slot in state.slot_of.items()}
        for job_id, (job, ranks) in self.copying.items():
            assert ranks
            for d in job.device_blocks:
                assert state.held.get(d) == job_id, f"device block {d} of running job {job_id} was released"
            for h, slot in zip(job.hashes, job.slots):  # (remote jobs too: they have no device blocks)
                assert slot not in free, f"slot {slot} of running job {job_id} is free"
                assert owner.get(slot, h) == h, f"slot {slot} of running job {job_id} holds block {owner.get(slot)}"

    @invariant()
    def kv_events_announce_exactly_the_resident_blocks(self) -> None:
        for kv in self.kv.take():
            if getattr(kv, "medium", MEDIUM_CPU) != MEDIUM_CPU:
                continue  # (the lower tiers' events: tests/integrations/test_kv_events.py)
            if isinstance(kv, BlockStored):
                assert not self.announced & set(kv.block_hashes), "announced twice"
                self.announced |= set(kv.block_hashes)
            elif isinstance(kv, BlockRemoved):
                assert set(kv.block_hashes) <= self.announced, "removed, never announced"
                self.announced -= set(kv.block_hashes)
            else:
                assert isinstance(kv, AllBlocksCleared)
                self.announced = set()
        resident = {h for h, e in self.m.state.entries.items() if e.state is RESIDENT}
        assert self.announced == resident

    @invariant()
    def pins_never_negative(self) -> None:
        assert all(e.pins >= 0 for e in self.m.state.entries.values())
        assert all(n > 0 for r in self.m.state.requests.values() for n in r.pins.values())

    @invariant()
    def slots_add_up(self) -> None:
        s = self.m.state
        owned = set(s.slot_of.values())
        only_fenced = [q for q in s.fenced_slots if q not in owned]  # a fenced load's slot may be both
        assert len(s.free_slots) + len(s.entries) + len(only_fenced) == s.capacity == self.CPU_BLOCKS


class OffloadMachineTwoRanks(OffloadMachine):
    WORLD_SIZE = 2


class OffloadMachineARC(OffloadMachine):
    POLICY = "arc"


class OffloadMachineLazyTwoRanks(OffloadMachine):
    WORLD_SIZE = 2
    STORE_MODE = "lazy"


class OffloadMachineRemote(OffloadMachine):
    """With a remote tier (write-through): remote stores follow stores, probes find blocks,
    lookups load them into the CPU tier, and every rule above still holds."""

    REMOTE_BLOCKS = 4

    @rule(hashes=st.lists(HASH_POOL, max_size=4))
    def remote_found(self, hashes: list[int]) -> None:
        known = set(self.m.state.remote)
        assert self.m.remote_found(hashes) == len(set(hashes) - known)
        assert set(hashes) <= set(self.m.state.remote) or len(self.m.state.remote) == self.REMOTE_BLOCKS

    @rule(hashes=st.lists(HASH_POOL, min_size=1, max_size=3), by_probe=st.booleans())
    def remote_tier_refused(self, hashes: list[int], by_probe: bool) -> None:
        """The remote tier refused the values under these blocks: they leave the remote index."""
        indexed = set(self.m.state.remote)
        job = 0 if by_probe else self.m.state.last_job_id
        refusal = TierRefused(
            tier="remote", block_hashes=tuple(hashes), reasons=("forged",) * len(hashes), job_ids=(job,) * len(hashes)
        )
        assert self.m.tier_refused(refusal) == len(set(hashes) & indexed)
        assert not set(hashes) & set(self.m.state.remote)

    @invariant()
    def remote_loads_fill_absent_entries_and_remote_stores_read_resident_ones(self) -> None:
        state = self.m.state
        for job in state.jobs.values():
            if job.direction == "remote_load" and job.state in (JobState.QUEUED, JobState.IN_FLIGHT):
                assert all(state.pending.get(h) == job.job_id for h in job.hashes)
            elif job.direction == "remote_store" and job.state in (JobState.QUEUED, JobState.IN_FLIGHT):
                assert all(state.is_resident(h) and state.pin_count.get(h, 0) > 0 for h in job.hashes)


class OffloadMachineRemoteAheadTwoRanks(OffloadMachineRemote):
    WORLD_SIZE = 2
    REMOTE_MODE = "ahead_of_eviction"


class OffloadMachineDisk(OffloadMachine):
    """With a disk tier of fewer slots than blocks (spill ahead of eviction): disk stores read
    resident entries, disk loads fill absent ones, the disk's own evictions never take a slot
    a copy may still use, a warm restart's entries join, and every rule above still holds."""

    DISK_BLOCKS = 4

    @rule(data=st.data(), hashes=st.lists(HASH_POOL, max_size=3, unique=True))
    def warm_restart_entries(self, data: Any, hashes: list[int]) -> None:
        """Entries a journal vouches for join where their slot is free and their block new."""
        disk = self.m.state.disk
        assert disk is not None
        slots = data.draw(st.lists(st.integers(0, self.DISK_BLOCKS - 1), min_size=len(hashes), max_size=len(hashes)))
        indexed, free = dict(disk.slot_of), set(disk.free)
        accepted: dict[int, int] = {}
        for h, s in zip(hashes, slots):
            if h not in indexed and s in free and s not in accepted.values():
                accepted[h] = s
        assert self.m.disk_restored([(s, name_of(h)) for s, h in zip(slots, hashes)]) == len(accepted)
        assert all(disk.slot_of[h] == s for h, s in accepted.items())

    @rule(hashes=st.lists(HASH_POOL, min_size=1, max_size=3))
    def disk_tier_refused(self, hashes: list[int]) -> None:
        """The disk tier refused these blocks' entries: those no copy is reading leave the disk
        index (their slots free again); one a load is reading stays until that load ends."""
        disk = self.m.state.disk
        assert disk is not None
        reading = {h for h in hashes if h in disk.slot_of and disk.slot_of[h] in disk.busy}
        refusal = TierRefused(
            tier="disk", block_hashes=tuple(hashes), reasons=("unknown key",) * len(hashes), job_ids=(0,) * len(hashes)
        )
        self.m.tier_refused(refusal)
        assert not (set(hashes) - reading) & disk.slot_of.keys() and reading <= disk.slot_of.keys()

    @invariant()
    def disk_jobs_use_their_disk_slots_alone(self) -> None:
        state = self.m.state
        disk = state.disk
        assert disk is not None
        for job_id, (job, ranks) in self.copying.items():
            for s in job.disk_slots:
                assert disk.busy.get(s) == job_id, f"disk slot {s} of running job {job_id} was released"
                assert s not in disk.free
        for job in state.jobs.values():
            if job.direction == "disk_load" and job.state in (JobState.QUEUED, JobState.IN_FLIGHT):
                assert all(state.pending.get(h) == job.job_id for h in job.hashes)
                assert all(disk.slot_of.get(h) == s for h, s in zip(job.hashes, job.disk_slots))
            elif job.direction == "disk_store" and job.state in (JobState.QUEUED, JobState.IN_FLIGHT):
                assert all(state.is_resident(h) and state.pin_count.get(h, 0) > 0 for h in job.hashes)


class OffloadMachineDiskWriteThroughTwoRanks(OffloadMachineDisk):
    WORLD_SIZE = 2
    DISK_MODE = "write_through"


class OffloadMachineTinyTier(OffloadMachine):
    CPU_BLOCKS = 4  # the smallest tier the machine warms: evictions and rejections often


# how many examples: the profile's (tests/conftest.py: 2,000 in CI)
MACHINE_SETTINGS = settings(
    stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestOneRank = OffloadMachine.TestCase
TestTwoRanks = OffloadMachineTwoRanks.TestCase
TestARC = OffloadMachineARC.TestCase
TestLazyTwoRanks = OffloadMachineLazyTwoRanks.TestCase
TestTinyTier = OffloadMachineTinyTier.TestCase
TestRemote = OffloadMachineRemote.TestCase
TestRemoteAheadTwoRanks = OffloadMachineRemoteAheadTwoRanks.TestCase
TestDisk = OffloadMachineDisk.TestCase
TestDiskWriteThroughTwoRanks = OffloadMachineDiskWriteThroughTwoRanks.TestCase
for _case in (
    TestOneRank,
    TestTwoRanks,
    TestARC,
    TestLazyTwoRanks,
    TestTinyTier,
    TestRemote,
    TestRemoteAheadTwoRanks,
    TestDisk,
    TestDiskWriteThroughTwoRanks,
):
    _case.settings = MACHINE_SETTINGS
del _case  # (left in the module, pytest collected it as another machine: the last one twice)
