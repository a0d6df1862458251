"""The transition tables drive these tests (h11 style): for every (block state, event tag) and
every (job state, event tag) pair, a state built by real events through ``OffloadManager`` gets
one concrete event of that tag aimed at the block or job. Legal in the table → ``evolve``
applies it and the block/job lands in the table's state; illegal → ``IllegalTransition`` and
the state (digest and ``canonical()``) is exactly as before.

Some tags never name a CPU-tier entry (a job's rank report, a late result, request events) or
never name a job (pins, recency, eviction): for those the test checks that the table does not
mention them and that a legal instance leaves the block's / job's state alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvflow.core.config import Config
from kvflow.core.errors import IllegalTransition
from kvflow.core.events import (
    EVENT_TYPES,
    BlocksCorrupt,
    BlocksEvicted,
    BlocksTouched,
    ChainExtended,
    DiskEvicted,
    DiskIndexed,
    DiskLoadQueued,
    DiskStoreQueued,
    EntriesRefused,
    Event,
    FenceLifted,
    JobCompleted,
    JobFailed,
    JobsSubmitted,
    JobTimedOut,
    LateResultIgnored,
    LoadQueued,
    PinsAcquired,
    PinsReleased,
    RankSucceeded,
    RemoteIndexed,
    RemoteLoadQueued,
    RemoteStoreQueued,
    RequestClosed,
    RequestFinished,
    RequestOpened,
    RequestResumed,
    Reset,
    StoreQueued,
    StoreRejected,
    event_name,
)
from kvflow.core.state.apply import evolve
from kvflow.core.state.invariants import check_invariants
from kvflow.core.state.model import State
from kvflow.core.state.tables import BLOCK_TRANSITIONS, JOB_TRANSITIONS, BlockState, JobState
from kvflow.engine.manager import OffloadManager

BT = 4  # tokens per block
TOKENS = 3 * BT  # a lookup of a 3-block prompt may hit 2 blocks
DEADLINE_MS = 1000.0

LOADABLE, SPARE = 9001, 9002  # resident after the preamble (job 1, completed)
H = 77  # the block under test
D = 700  # its device block
MISS = 555  # never on the tier
DISK_BLOCKS = 4  # a disk tier too, so that its events are tried in every state
ON_DISK = 9100  # put on the disk tier's index by events that need one there


def on_disk(m: OffloadManager, block_hash: int) -> int:
    """``block_hash``'s disk slot, indexing it first (a warm restart's event) if needed."""
    disk = m.state.disk
    assert disk is not None
    if block_hash not in disk.slot_of:
        apply_directly(m, DiskIndexed(seq=seq(m), hashes=(block_hash,), disk_slots=disk.next_slots(1)))
    return disk.slot_of[block_hash]

ALL_TAGS = sorted(t.__struct_config__.tag for t in EVENT_TYPES)  # type: ignore[attr-defined]
# Tags whose event never names (or changes) one CPU-tier entry: the block table leaves them out.
NON_BLOCK_TAGS = {
    "rank_succeeded",  # one rank of a job: the job table's business
    "late_result_ignored",
    "fence_lifted",  # a fenced job's memory: its entries were settled by its outcome
    "store_rejected",  # names hashes that were *not* admitted; changes nothing
    "request_finished",
    "request_opened",
    "request_resumed",
    "request_closed",
    "remote_indexed",  # the remote tier's index, not a CPU-tier entry
    "disk_indexed",  # the disk tier's index
    "disk_evicted",
    "entries_refused",  # a shared tier's refusal: its index, not a CPU-tier entry
    "chain_extended",  # a request's chain: which hashes it names, not what the tier holds
}
BLOCK_TAGS = sorted(set(ALL_TAGS) - NON_BLOCK_TAGS)
# Tags whose event never names a transfer job.
NON_JOB_TAGS = {
    "blocks_corrupt",
    "blocks_evicted",
    "blocks_touched",
    "store_rejected",
    "pins_acquired",
    "pins_released",
    "request_finished",
    "request_opened",
    "request_resumed",
    "request_closed",
    "remote_indexed",
    "chain_extended",
    "disk_indexed",
    "disk_evicted",
    "entries_refused",
}
# An outcome event with ``fenced`` set is its own row key in the job table (F15).
FENCED_TAGS = {"job_failed:fenced", "job_timed_out:fenced"}
JOB_TAGS = sorted((set(ALL_TAGS) - NON_JOB_TAGS) | FENCED_TAGS)


# --- building states through the manager ---------------------------------------------------


def fresh(world_size: int = 1, cpu_blocks: int = 6) -> OffloadManager:
    """LOADABLE and SPARE resident (job 1 completed, its request closed): job 1 is terminal,
    so a late result is legal in every state built on top of this."""
    m = OffloadManager(
        Config(
            cpu_blocks=cpu_blocks,
            block_tokens=BT,
            world_size=world_size,
            job_deadline_ms=DEADLINE_MS,
            disk_blocks=DISK_BLOCKS,
        )
    )
    m.blocks_computed("pre", [LOADABLE, SPARE], [900, 901])
    m.plan_step(0.0)
    complete(m, 1)
    m.finish_request("pre")
    assert "pre" not in m.state.requests
    return m


def complete(m: OffloadManager, job_id: int) -> None:
    for rank in range(m.config.world_size):
        m.job_result(job_id, rank=rank)


def block_in(state: BlockState, world_size: int = 1) -> OffloadManager:
    m = fresh(world_size)
    if state is not BlockState.ABSENT:
        assert m.blocks_computed("w", [H], [D]) == 2
        if state >= BlockState.STORING:
            m.plan_step(1.0)
        if state is BlockState.RESIDENT:
            complete(m, 2)
    assert m.state.block_state(H) is state
    assert check_invariants(m.state) == []
    return m


def load_job(
    m: OffloadManager, block: int, request_id: str, device_block: int, submit: bool
) -> int:
    """Queue (and optionally submit) a load of the resident ``block`` for ``request_id``."""
    assert m.lookup(request_id, [block, MISS], TOKENS) == 1
    job_id = m.accept_hits(request_id, [device_block])
    assert job_id is not None
    if submit:
        m.plan_step(2.0)
    return job_id


def queued_event(m: OffloadManager, job_id: int) -> StoreQueued | LoadQueued:
    (event,) = [
        e for e in m.log.events() if isinstance(e, (StoreQueued, LoadQueued)) and e.job_id == job_id
    ]
    return event


def terminal_fields(m: OffloadManager, job_id: int) -> dict[str, Any]:
    """The fields a terminal event of ``job_id`` carries (made up for a job never queued)."""
    if job_id > m.state.last_job_id:
        return dict(
            job_id=job_id,
            direction="store",
            request_id="w",
            hashes=(H,),
            device_blocks=(D,),
            slots=(0,),
        )
    q = queued_event(m, job_id)
    live = m.state.jobs.get(job_id)
    if live is None:
        gone = [e for e in m.log.events() if type(e) in _TERMINAL_STATE and e.job_id == job_id]  # type: ignore[attr-defined]
        live_abandoned = bool(gone) and gone[0].abandoned  # type: ignore[attr-defined]
    else:
        live_abandoned = live.abandoned
    return dict(
        job_id=job_id,
        direction="store" if isinstance(q, StoreQueued) else "load",
        request_id=q.request_id,
        hashes=q.hashes,
        device_blocks=q.device_blocks,
        slots=q.slots,
        abandoned=live_abandoned,
    )


def deadline_of(m: OffloadManager, job_id: int) -> float:
    job = m.state.jobs.get(job_id)
    return job.deadline_ms if job is not None and job.deadline_ms else 2.0 + DEADLINE_MS


def apply_directly(m: OffloadManager, event: Event) -> None:
    """Preparation that no single manager call produces alone (e.g. a finished request that
    is not closed yet): apply a real event with ``evolve`` and record it in the log."""
    evolve(m.state, event)
    m.log.record_events([event])


def seq(m: OffloadManager) -> int:
    return m.state.next_seq


# --- events aimed at block H ---------------------------------------------------------------


def live_job_naming_h(m: OffloadManager, submit: bool) -> int:
    """The live job that names H: its store job, or a fresh load of it when RESIDENT; for an
    absent block, a job id never issued."""
    entry = m.state.entries.get(H)
    if entry is None:
        return m.state.next_job_id
    if entry.state is BlockState.RESIDENT:
        return load_job(m, H, "rl", 800, submit=submit)
    return entry.job_id


def block_event(tag: str, m: OffloadManager) -> Event:
    s = m.state
    entry = s.entries.get(H)
    slot = entry.slot if entry is not None else 0
    if tag == "store_queued":
        return StoreQueued(
            seq=seq(m),
            job_id=s.next_job_id,
            request_id="x",
            hashes=(H,),
            device_blocks=(801,),
            slots=s.next_slots(1),
        )
    if tag == "remote_load_queued":
        return RemoteLoadQueued(seq=seq(m), job_id=s.next_job_id, hashes=(H,), slots=s.next_slots(1))
    if tag == "remote_store_queued":
        return RemoteStoreQueued(seq=seq(m), job_id=s.next_job_id, hashes=(H,), slots=(slot,))
    if tag == "disk_load_queued":
        disk_slot = on_disk(m, H)
        return DiskLoadQueued(
            seq=seq(m), job_id=s.next_job_id, hashes=(H,), slots=s.next_slots(1), disk_slots=(disk_slot,)
        )
    if tag == "disk_store_queued":
        assert s.disk is not None
        return DiskStoreQueued(
            seq=seq(m), job_id=s.next_job_id, hashes=(H,), slots=(slot,), disk_slots=s.disk.next_slots(1)
        )
    if tag == "load_queued":
        if s.is_resident(H):
            assert m.lookup("rl", [H, MISS], TOKENS) == 1
        return LoadQueued(
            seq=seq(m),
            job_id=s.next_job_id,
            request_id="rl",
            hashes=(H,),
            device_blocks=(800,),
            slots=(slot,),
        )
    if tag == "jobs_submitted":
        job_id = live_job_naming_h(m, submit=False)
        return JobsSubmitted(
            seq=seq(m), job_ids=(job_id,), now_ms=3.0, deadline_ms=3.0 + DEADLINE_MS
        )
    if tag in ("job_completed", "job_failed", "job_timed_out"):
        job_id = live_job_naming_h(m, submit=True)
        fields = terminal_fields(m, job_id)
        if tag == "job_completed":
            return JobCompleted(seq=seq(m), rank=0, **fields)
        if tag == "job_failed":
            return JobFailed(seq=seq(m), rank=0, error="copy failed", **fields)
        deadline = deadline_of(m, job_id)
        return JobTimedOut(seq=seq(m), now_ms=deadline, deadline_ms=deadline, **fields)
    if tag == "blocks_evicted":
        return BlocksEvicted(seq=seq(m), hashes=(H,), slots=(slot,), reason="explicit")
    if tag == "blocks_touched":
        return BlocksTouched(seq=seq(m), hashes=(H,))
    if tag == "blocks_corrupt":
        return BlocksCorrupt(seq=seq(m), hashes=(H,))
    if tag == "pins_acquired":
        return PinsAcquired(seq=seq(m), request_id="rp", hashes=(H,), num_tokens=TOKENS)
    if tag == "pins_released":
        m.lookup("rp", [H, MISS], TOKENS)  # pins H when it is resident, a miss otherwise
        return PinsReleased(seq=seq(m), request_id="rp", hashes=(H,))
    if tag == "reset":
        return Reset(seq=seq(m), abandoned_job_ids=tuple(s.jobs))
    raise AssertionError(f"no block event for {tag}")


def fenced_other_job(m: OffloadManager) -> int:
    """An in-flight store of another block that timed out while its copy may still run."""
    job_id = other_in_flight_job(m)
    fields = terminal_fields(m, job_id)
    apply_directly(m, JobTimedOut(seq=seq(m), now_ms=9.0, deadline_ms=9.0, fenced=True, **fields))
    return job_id


def other_in_flight_job(m: OffloadManager) -> int:
    """An in-flight store of another block, submitted alone so H's state does not move."""
    job_id = m.blocks_computed("o", [601], [810])
    assert job_id is not None
    apply_directly(
        m, JobsSubmitted(seq=seq(m), job_ids=(job_id,), now_ms=3.0, deadline_ms=3.0 + DEADLINE_MS)
    )
    return job_id


def neutral_event(tag: str, m: OffloadManager, target_job: int | None = None) -> Event:
    """A *legal* event of a tag that names no block (for the block table) or no job (for the
    job table). ``target_job``: for rank_succeeded, the in-flight job to report on."""
    if tag == "rank_succeeded":
        if target_job is None:
            entry = m.state.entries.get(H)
            if entry is not None and entry.state is BlockState.STORING:
                target_job = entry.job_id
            elif entry is not None and entry.state is BlockState.RESIDENT:
                target_job = load_job(m, H, "rl", 800, submit=True)
            else:
                target_job = other_in_flight_job(m)
        return RankSucceeded(seq=seq(m), job_id=target_job, rank=0)
    if tag == "late_result_ignored":
        return LateResultIgnored(seq=seq(m), job_id=1, rank=0, ok=True)
    if tag == "remote_indexed":
        return RemoteIndexed(seq=seq(m), hashes=(H, SPARE))
    if tag == "disk_indexed":
        assert m.state.disk is not None
        return DiskIndexed(seq=seq(m), hashes=(H, SPARE), disk_slots=m.state.disk.next_slots(2))
    if tag == "disk_evicted":
        disk_slot = on_disk(m, ON_DISK)
        return DiskEvicted(seq=seq(m), hashes=(ON_DISK,), disk_slots=(disk_slot,))
    if tag == "entries_refused":
        on_disk(m, ON_DISK)  # a refused disk entry whose slot no job uses leaves the index
        return EntriesRefused(
            seq=seq(m), tier="disk", hashes=(ON_DISK, H), reasons=("forged", "another tenant"), job_ids=(0, 0),
            dropped=(ON_DISK,),
        )
    if tag == "fence_lifted":
        job_id = fenced_other_job(m)
        job = m.state.jobs[job_id]
        return FenceLifted(
            seq=seq(m), job_id=job_id, device_blocks=job.device_blocks, slots=job.slots, reason="executor closed"
        )
    if tag == "store_rejected":
        return StoreRejected(
            seq=seq(m), request_id="x", hashes=(602,), device_blocks=(811,), reason="tier full"
        )
    if tag == "request_finished":
        m.lookup("rf", [MISS], TOKENS)
        return RequestFinished(seq=seq(m), request_id="rf", preempted=False)
    if tag == "request_opened":
        return RequestOpened(seq=seq(m), request_id="ro")
    if tag == "chain_extended":  # names H, whatever state its entry is in
        return ChainExtended(seq=seq(m), request_id="rch", hashes=(H, MISS))
    if tag == "request_resumed":
        m.lookup("rr", [MISS], TOKENS)
        apply_directly(m, RequestFinished(seq=seq(m), request_id="rr", preempted=True))
        return RequestResumed(seq=seq(m), request_id="rr")
    if tag == "request_closed":
        m.lookup("rc", [MISS], TOKENS)
        apply_directly(m, RequestFinished(seq=seq(m), request_id="rc", preempted=False))
        return RequestClosed(seq=seq(m), request_id="rc")
    if tag == "blocks_evicted":
        return BlocksEvicted(
            seq=seq(m), hashes=(SPARE,), slots=(m.state.entries[SPARE].slot,), reason="explicit"
        )
    if tag == "blocks_touched":
        return BlocksTouched(seq=seq(m), hashes=(SPARE,))
    if tag == "blocks_corrupt":
        return BlocksCorrupt(seq=seq(m), hashes=(SPARE,))
    if tag == "pins_acquired":
        return PinsAcquired(seq=seq(m), request_id="rp", hashes=(SPARE,), num_tokens=TOKENS)
    if tag == "pins_released":
        assert m.lookup("rp", [SPARE, MISS], TOKENS) == 1
        return PinsReleased(seq=seq(m), request_id="rp", hashes=(SPARE,))
    raise AssertionError(f"no neutral event for {tag}")


# --- checking one event --------------------------------------------------------------------


def assert_illegal_and_unchanged(state: State, event: Event) -> IllegalTransition:
    digest, canonical, next_seq = state.digest(), state.canonical(), state.next_seq
    with pytest.raises(IllegalTransition) as caught:
        evolve(state, event)
    assert state.digest() == digest
    assert state.canonical() == canonical
    assert state.next_seq == next_seq
    assert check_invariants(state) == []
    return caught.value


def apply_legal(state: State, event: Event) -> None:
    before = state.next_seq
    evolve(state, event)
    assert state.next_seq == before + 1
    assert check_invariants(state) == [], check_invariants(state)


def block_cases() -> list[Any]:
    return [
        pytest.param(state, tag, id=f"{state.name}-{tag}")
        for state in BlockState
        for tag in BLOCK_TAGS
    ]


@pytest.mark.parametrize(("block_state", "tag"), block_cases())
def test_block_transition(block_state: BlockState, tag: str) -> None:
    m = block_in(block_state)
    event = block_event(tag, m)
    assert m.state.block_state(H) is block_state, "preparing the event moved the block"
    expected = BLOCK_TRANSITIONS.get(block_state, {}).get(tag)
    if expected is None:
        assert_illegal_and_unchanged(m.state, event)
    else:
        apply_legal(m.state, event)
        assert m.state.block_state(H) is expected


@pytest.mark.parametrize("tag", sorted(NON_BLOCK_TAGS))
@pytest.mark.parametrize("block_state", list(BlockState), ids=lambda s: s.name)
def test_tags_that_name_no_block_leave_blocks_alone(block_state: BlockState, tag: str) -> None:
    assert all(tag not in row for row in BLOCK_TRANSITIONS.values())
    m = block_in(block_state, world_size=2 if tag == "rank_succeeded" else 1)
    event = neutral_event(tag, m)
    assert m.state.block_state(H) is block_state
    apply_legal(m.state, event)
    assert m.state.block_state(H) is block_state


def test_pinned_resident_block_cannot_be_evicted() -> None:
    m = block_in(BlockState.RESIDENT)
    assert m.lookup("rp", [H, MISS], TOKENS) == 1
    entry = m.state.entries[H]
    event = BlocksEvicted(seq=seq(m), hashes=(H,), slots=(entry.slot,), reason="explicit")
    assert_illegal_and_unchanged(m.state, event)


# --- jobs ----------------------------------------------------------------------------------


def job_in(job_state: JobState, direction: str, world_size: int = 1) -> tuple[OffloadManager, int]:
    m = fresh(world_size)
    if job_state is JobState.NEW:
        return m, m.state.next_job_id
    if direction == "store":
        job_id = m.blocks_computed("w", [H], [D])
    else:
        job_id = load_job(m, LOADABLE, "rl", D, submit=False)
    assert job_id == 2
    if job_state is not JobState.QUEUED:
        m.plan_step(1.0)
    if job_state is JobState.COMPLETED:
        complete(m, job_id)
    elif job_state is JobState.FAILED:
        for rank in range(1, world_size):  # the other ranks' copies are over: nothing fenced
            m.job_result(job_id, rank=rank)
        m.job_result(job_id, ok=False, error="copy failed")
    elif job_state is JobState.TIMED_OUT:
        # a timeout that also ended the fence: what traces recorded before fences say
        fields = terminal_fields(m, job_id)
        apply_directly(m, JobTimedOut(seq=seq(m), now_ms=2e3, deadline_ms=1.0 + DEADLINE_MS, **fields))
    elif job_state in (JobState.FENCED, JobState.LIFTED):
        assert m.tick(1.0 + DEADLINE_MS) == 1  # F15: timed out, its copy may still run
        if job_state is JobState.LIFTED:
            complete(m, job_id)  # every rank's (late) result: the copy is over
    elif job_state is JobState.ABANDONED:
        m.reset()
        # the reset cleared the tier: put LOADABLE and SPARE back, as fresh() has them
        restored = m.blocks_computed("pre2", [LOADABLE, SPARE], [900, 901])
        assert restored is not None
        m.plan_step(1.0)
        complete(m, restored)
        m.finish_request("pre2")
    assert observed_job_state(m, job_id) is job_state
    assert check_invariants(m.state) == []
    return m, job_id


_TERMINAL_STATE = {
    JobCompleted: JobState.COMPLETED,
    JobFailed: JobState.FAILED,
    JobTimedOut: JobState.TIMED_OUT,
}


def observed_job_state(m: OffloadManager, job_id: int, applied: Event | None = None) -> JobState:
    """A job's state: live jobs carry it; terminal jobs leave the state, so read the log."""
    live = m.state.jobs.get(job_id)
    if live is not None:
        return live.state
    if job_id > m.state.last_job_id:
        return JobState.NEW
    events = [*m.log.events(), *([applied] if applied is not None else [])]
    if any(type(e) is FenceLifted and e.job_id == job_id for e in events):
        return JobState.LIFTED
    terminal = [e for e in events if type(e) in _TERMINAL_STATE and e.job_id == job_id]  # type: ignore[attr-defined]
    assert len(terminal) == 1, terminal
    return _TERMINAL_STATE[type(terminal[0])]


def job_event(tag: str, m: OffloadManager, job_id: int) -> Event:
    s = m.state
    if tag == "store_queued":
        return StoreQueued(
            seq=seq(m),
            job_id=job_id,
            request_id="x",
            hashes=(602,),
            device_blocks=(811,),
            slots=s.next_slots(1),
        )
    if tag == "remote_load_queued":
        return RemoteLoadQueued(seq=seq(m), job_id=job_id, hashes=(602,), slots=s.next_slots(1))
    if tag == "remote_store_queued":
        return RemoteStoreQueued(seq=seq(m), job_id=job_id, hashes=(SPARE,), slots=(s.entries[SPARE].slot,))
    if tag == "disk_load_queued":
        disk_slot = on_disk(m, 602)
        return DiskLoadQueued(seq=seq(m), job_id=job_id, hashes=(602,), slots=s.next_slots(1), disk_slots=(disk_slot,))
    if tag == "disk_store_queued":
        assert s.disk is not None
        return DiskStoreQueued(
            seq=seq(m), job_id=job_id, hashes=(SPARE,), slots=(s.entries[SPARE].slot,), disk_slots=s.disk.next_slots(1)
        )
    if tag == "load_queued":
        assert m.lookup("rq", [SPARE, MISS], TOKENS) == 1
        return LoadQueued(
            seq=seq(m),
            job_id=job_id,
            request_id="rq",
            hashes=(SPARE,),
            device_blocks=(812,),
            slots=(s.entries[SPARE].slot,),
        )
    if tag == "jobs_submitted":
        return JobsSubmitted(
            seq=seq(m), job_ids=(job_id,), now_ms=3.0, deadline_ms=3.0 + DEADLINE_MS
        )
    if tag == "rank_succeeded":
        return RankSucceeded(seq=seq(m), job_id=job_id, rank=0)
    if tag.split(":")[0] in ("job_completed", "job_failed", "job_timed_out"):
        fields = terminal_fields(m, job_id)
        fenced = tag.endswith(":fenced")
        if tag == "job_completed":
            return JobCompleted(seq=seq(m), rank=0, **fields)
        if tag.startswith("job_failed"):
            return JobFailed(seq=seq(m), rank=0, error="copy failed", fenced=fenced, **fields)
        deadline = deadline_of(m, job_id)
        return JobTimedOut(seq=seq(m), now_ms=deadline, deadline_ms=deadline, fenced=fenced, **fields)
    if tag == "fence_lifted":
        fields = terminal_fields(m, job_id)
        return FenceLifted(
            seq=seq(m),
            job_id=job_id,
            device_blocks=fields["device_blocks"],
            slots=fields["slots"],
            reason="executor closed",
        )
    if tag == "late_result_ignored":
        job = s.jobs.get(job_id)
        if job is not None and job.state in (JobState.IN_FLIGHT, JobState.ABANDONED):
            # the best case for legality: rank 0 already reported, this is a repeat
            m.job_result(job_id, rank=0)
        return LateResultIgnored(seq=seq(m), job_id=job_id, rank=0, ok=True)
    if tag == "reset":  # (a fenced job is already out of the tier's books: not abandoned)
        job = s.jobs.get(job_id)
        if job is not None and job.state is JobState.FENCED:
            live = tuple(j for j, other in s.jobs.items() if other.state is not JobState.FENCED)
            return Reset(seq=seq(m), abandoned_job_ids=live)
        return Reset(seq=seq(m), abandoned_job_ids=(job_id,))
    raise AssertionError(f"no job event for {tag}")


def job_cases() -> list[Any]:
    cases = []
    for state in JobState:
        for direction in ("store",) if state is JobState.NEW else ("store", "load"):
            cases.append((state, direction))
    return cases


def world_size_for(tag: str) -> int:
    # a rank's own success (not the last), and a failure that fences because another rank
    # may still copy, only exist with several ranks
    return 2 if tag in ("rank_succeeded", "late_result_ignored", "job_failed:fenced") else 1


@pytest.mark.parametrize("tag", JOB_TAGS)
@pytest.mark.parametrize(
    ("job_state", "direction"), job_cases(), ids=[f"{s.name}-{d}" for s, d in job_cases()]
)
def test_job_transition(job_state: JobState, direction: str, tag: str) -> None:
    m, job_id = job_in(job_state, direction, world_size_for(tag))
    event = job_event(tag, m, job_id)
    assert observed_job_state(m, job_id) is job_state, "preparing the event moved the job"
    expected = JOB_TRANSITIONS[job_state].get(tag)
    if expected is None:
        assert_illegal_and_unchanged(m.state, event)
        assert observed_job_state(m, job_id) is job_state
    else:
        apply_legal(m.state, event)
        assert observed_job_state(m, job_id, applied=event) is expected
        if tag == "reset":
            assert m.state.jobs[job_id].fenced


@pytest.mark.parametrize("tag", sorted(NON_JOB_TAGS))
@pytest.mark.parametrize(
    ("job_state", "direction"), job_cases(), ids=[f"{s.name}-{d}" for s, d in job_cases()]
)
def test_tags_that_name_no_job_leave_jobs_alone(
    job_state: JobState, direction: str, tag: str
) -> None:
    assert all(tag not in row for row in JOB_TRANSITIONS.values())
    m, job_id = job_in(job_state, direction)
    event = neutral_event(tag, m)
    apply_legal(m.state, event)
    assert observed_job_state(m, job_id) is job_state


# --- the tables themselves -----------------------------------------------------------------


def test_tables_name_only_real_event_tags_and_every_state() -> None:
    tags = set(ALL_TAGS) | FENCED_TAGS
    assert set(BLOCK_TRANSITIONS) == set(BlockState)
    assert set(JOB_TRANSITIONS) == set(JobState)
    for row in [*BLOCK_TRANSITIONS.values(), *JOB_TRANSITIONS.values()]:
        assert set(row) <= tags
    assert set(NON_BLOCK_TAGS) <= tags and set(NON_JOB_TAGS) <= tags


def test_terminal_job_states_accept_only_late_results() -> None:
    for state in (JobState.COMPLETED, JobState.FAILED, JobState.TIMED_OUT, JobState.LIFTED):
        assert JOB_TRANSITIONS[state] == {"late_result_ignored": state}


# --- sequence numbers, unknown jobs, messages ----------------------------------------------


@pytest.mark.parametrize("offset", [-2, -1, 1, 7])
def test_a_gap_or_repeat_in_seq_raises_and_changes_nothing(offset: int) -> None:
    m = block_in(BlockState.RESIDENT)
    event = BlocksTouched(seq=seq(m) + offset, hashes=(H,))
    error = assert_illegal_and_unchanged(m.state, event)
    assert "SEQ" in error.state and "blocks_touched" in error.event
    # the very same event with the right seq applies
    apply_legal(m.state, BlocksTouched(seq=seq(m), hashes=(H,)))


UNKNOWN_JOB = 4242


@pytest.mark.parametrize(
    "make",
    [
        lambda s: JobsSubmitted(seq=s, job_ids=(UNKNOWN_JOB,), now_ms=0.0, deadline_ms=1.0),
        lambda s: RankSucceeded(seq=s, job_id=UNKNOWN_JOB, rank=0),
        lambda s: JobCompleted(
            seq=s,
            rank=0,
            job_id=UNKNOWN_JOB,
            direction="store",
            request_id=None,
            hashes=(H,),
            device_blocks=(D,),
            slots=(0,),
        ),
        lambda s: JobFailed(
            seq=s,
            rank=0,
            error="x",
            job_id=UNKNOWN_JOB,
            direction="load",
            request_id="r",
            hashes=(H,),
            device_blocks=(D,),
            slots=(0,),
        ),
        lambda s: JobTimedOut(
            seq=s,
            now_ms=9.0,
            deadline_ms=9.0,
            job_id=UNKNOWN_JOB,
            direction="store",
            request_id=None,
            hashes=(H,),
            device_blocks=(D,),
            slots=(0,),
        ),
        lambda s: LateResultIgnored(seq=s, job_id=UNKNOWN_JOB, rank=0, ok=True),
        lambda s: Reset(seq=s, abandoned_job_ids=(UNKNOWN_JOB,)),
    ],
    ids=[
        "jobs_submitted",
        "rank_succeeded",
        "job_completed",
        "job_failed",
        "job_timed_out",
        "late_result_ignored",
        "reset",
    ],
)
def test_an_event_for_an_unknown_job_raises(make: Callable[[int], Event]) -> None:
    m = fresh(world_size=2)
    m.blocks_computed("w", [H], [D])
    m.plan_step(1.0)
    assert_illegal_and_unchanged(m.state, make(seq(m)))


def test_the_message_names_the_state_and_the_event() -> None:
    m = block_in(BlockState.STORING)
    event = PinsAcquired(seq=seq(m), request_id="rp", hashes=(H,), num_tokens=TOKENS)
    error = assert_illegal_and_unchanged(m.state, event)
    assert error.state == "STORING"
    assert error.event == f"pins_acquired#{seq(m)}"
    assert "STORING" in str(error) and "pins_acquired" in str(error) and str(H) in str(error)

    m, job_id = job_in(JobState.COMPLETED, "store")
    event = JobsSubmitted(seq=seq(m), job_ids=(job_id,), now_ms=0.0, deadline_ms=1.0)
    error = assert_illegal_and_unchanged(m.state, event)
    assert "jobs_submitted" in str(error) and "TERMINAL" in str(error) and str(job_id) in str(error)

    m, job_id = job_in(JobState.QUEUED, "load")
    event = JobCompleted(seq=seq(m), rank=0, **terminal_fields(m, job_id))
    error = assert_illegal_and_unchanged(m.state, event)
    assert error.state == "QUEUED" and event_name(event) in error.event


def test_a_multi_block_event_is_checked_whole_before_anything_changes() -> None:
    """The second hash is illegal: the first one's pins and recency must not have moved."""
    m = block_in(BlockState.STORING)
    event = PinsAcquired(seq=seq(m), request_id="rp", hashes=(LOADABLE, H), num_tokens=TOKENS)
    assert_illegal_and_unchanged(m.state, event)
    event = BlocksTouched(seq=seq(m), hashes=(LOADABLE, MISS))
    assert_illegal_and_unchanged(m.state, event)
    event = BlocksEvicted(
        seq=seq(m),
        hashes=(SPARE, H),
        slots=(m.state.entries[SPARE].slot, m.state.entries[H].slot),
        reason="explicit",
    )
    assert_illegal_and_unchanged(m.state, event)


def test_a_late_result_for_a_live_job_is_legal_only_as_a_repeat() -> None:
    m, job_id = job_in(JobState.IN_FLIGHT, "store", world_size=2)
    # rank 1 has not reported: its result cannot be "late"
    event = LateResultIgnored(seq=seq(m), job_id=job_id, rank=1, ok=True)
    assert_illegal_and_unchanged(m.state, event)
    m.job_result(job_id, rank=1)
    apply_legal(m.state, LateResultIgnored(seq=seq(m), job_id=job_id, rank=1, ok=True))
    assert m.state.jobs[job_id].state is JobState.IN_FLIGHT


@pytest.mark.parametrize("abandoned", [False, True])
def test_a_terminal_event_must_say_whether_the_job_was_abandoned(abandoned: bool) -> None:
    m, job_id = job_in(JobState.IN_FLIGHT, "store")
    if abandoned:
        m.reset()
    fields = {**terminal_fields(m, job_id), "abandoned": not abandoned}
    assert_illegal_and_unchanged(m.state, JobCompleted(seq=seq(m), rank=0, **fields))
    fields["abandoned"] = abandoned
    apply_legal(m.state, JobCompleted(seq=seq(m), rank=0, **fields))
    assert job_id not in m.state.jobs


def test_every_event_type_has_exactly_one_evolver() -> None:
    # the replay's chunk loop tells events from commands by EVOLVERS: an event type without
    # an evolver would be skipped there as if it were a command
    from kvflow.core.events import EVENT_TYPES
    from kvflow.core.state.apply import EVOLVERS

    assert list(EVOLVERS) == [t for t in EVOLVERS if t in EVENT_TYPES]
    assert sorted(t.__name__ for t in EVOLVERS) == sorted(t.__name__ for t in EVENT_TYPES)
