"""Decisions of the remote tier (behind the CPU tier): what a lookup loads from it, what is
copied to it, and what a probe of it found. Pure.

The remote tier is reached only through host slots: a *remote load* fills CPU-tier entries
(ABSENT -> STORE_QUEUED -> STORING -> RESIDENT, exactly a store's lifecycle: visible only when
it completes, gone if it fails), and a *remote store* reads resident entries (pinned by the job
while it reads, exactly a load's hold). Both are jobs with the lifecycle, deadline, fences and
events of every other job, so replay, ``incidents`` and ``inspect`` need nothing new.

The remote index (``state.remote``) is what this instance knows to be there: its own remote
stores once they complete, and what probes found (``RemoteFound``). A remote load that fails
drops its hashes from the index at once, so a dead key is tried once, not in a loop.

A shared tier (remote or disk) that refuses a value it found (``TierRefused``: forged, another
tenant's, under a retired key ...) has it recorded (``EntriesRefused``), and whatever its index
still holds of it dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvflow.core.commands import RemoteFound, TierRefused
from kvflow.core.decide.checks import Emit
from kvflow.core.decide.store import _admission, eviction
from kvflow.core.decide.victims import checked_victims
from kvflow.core.errors import Rejected
from kvflow.core.events import EntriesRefused, RemoteIndexed, RemoteLoadQueued, RemoteStoreQueued
from kvflow.core.jobs import REMOTE_STORE, SHARED_TIERS
from kvflow.core.state.model import State


def remote_run(state: State, window: Sequence[int]) -> list[int]:
    """The blocks of ``window`` (a lookup's blocks after its CPU-tier hits) to load from the
    remote tier: in prefix order, those the remote index holds, up to the first block that is
    neither there nor already on its way to the CPU tier (a block beyond a gap is no hit)."""
    slot_of, remote = state.slot_of, state.remote
    run = []
    for h in window:
        if h in slot_of:
            continue  # pending here already (being stored or loaded from the remote tier)
        if h not in remote:
            break
        run.append(h)
    return run


def host_slots_for(state: State, run: Sequence[int], emit: Emit) -> list[int]:
    """The blocks of ``run`` (a lower tier's, bound for the CPU tier) that get a host slot: each
    takes a free one, else evicts the policy's next victim (emitted), never a pinned block (the
    request's hits are pinned) nor one of the run (F16); what finds no slot is not loaded."""
    if not run:
        return []
    admitted, _, victims, _, _ = _admission(state, run, run)
    if victims:
        emit(eviction(state, victims, "capacity"))
    return list(admitted)


def remote_loads(state: State, window: Sequence[int], emit: Emit) -> int | None:
    """Queue the remote load of ``remote_run(window)``: each block takes a free slot, else
    evicts the policy's next victim, never a pinned block (the request's hits are pinned) nor
    one of the run (F16); what finds no slot is not loaded."""
    if not state.config.remote:
        return None
    admitted = host_slots_for(state, remote_run(state, window), emit)
    if not admitted:
        return None
    job_id = state.next_job_id
    emit(
        RemoteLoadQueued(
            seq=state.next_seq, job_id=job_id, hashes=tuple(admitted), slots=state.next_slots(len(admitted))
        )
    )
    return job_id


def write_through(state: State, hashes: Sequence[int], emit: Emit) -> int | None:
    """``remote_store_mode="write_through"``: blocks whose CPU-tier store just completed are
    copied to the remote tier, unless it holds them already."""
    if not state.config.remote or state.config.remote_store_mode != "write_through":
        return None
    remote = state.remote
    todo = [h for h in hashes if h not in remote and state.is_resident(h)]
    if not todo:
        return None
    return _remote_store(state, todo, emit)


def _remote_store(state: State, hashes: Sequence[int], emit: Emit) -> int:
    todo = tuple(hashes)
    job_id = state.next_job_id
    emit(RemoteStoreQueued(seq=state.next_seq, job_id=job_id, hashes=todo, slots=state.slots_of(todo)))
    return job_id


def coldest_window(state: State) -> int:
    """``ahead_of_eviction``: how many of the policy's coldest blocks are kept on the remote
    tier (an eighth of the CPU tier), so that the tier rarely evicts a block it alone holds."""
    return max(1, state.config.cpu_blocks // 8)


def push_ahead_of_eviction(state: State, emit: Emit) -> None:
    """``remote_store_mode="ahead_of_eviction"``: once the CPU tier has fewer free slots than
    ``coldest_window``, its coldest resident blocks that the remote tier lacks (and no live
    remote store is copying) are copied there. Pinned by that job, they are not evicted until
    it ends; eviction takes the next victim meanwhile.

    The policy is asked for the window again only when something it depends on changed since
    a question that found nothing to copy (``pushes_settled``): an engine whose tier is full
    and idle asks nothing at each step."""
    window = coldest_window(state)
    if not state.config.remote or len(state.free_slots) >= window:
        return None
    key = pushes_key(state, REMOTE_STORE, state.tally.remote.digest())
    if state.pushes_settled.get(REMOTE_STORE) == key:
        return None
    todo = coldest_lacking(state, window, state.remote, REMOTE_STORE)
    if todo:
        _remote_store(state, todo, emit)
    else:
        state.pushes_settled[REMOTE_STORE] = key
    return None


def coldest_lacking(state: State, window: int, lower: Collection[int], direction: str) -> list[int]:
    """The CPU tier's ``window`` coldest resident blocks that a lower tier (its index
    ``lower``) lacks and no live job of ``direction`` is copying there, coldest first."""
    coldest = checked_victims(state, min(window, state.num_resident()), {}) or []
    copying = {h for job in state.jobs.values() if job.direction == direction for h in job.hashes}
    return [h for h in coldest if h not in lower and h not in copying]


def pushes_key(state: State, direction: str, lower: bytes) -> tuple[bytes, bytes, tuple[int, ...]]:
    """What a copy ahead of eviction decides from besides the free slots: the policy's order
    and the lower tier's index (their running digests: kvflow.core.state.digest) and the live
    copies of ``direction``. While it is the same, the coldest window and what the lower tier
    lacks of it are the same, so a question that found nothing to copy need not be asked
    again (``State.pushes_settled``)."""
    return (
        state.tally.order.digest(),
        lower,
        tuple(jid for jid, job in state.jobs.items() if job.direction == direction),
    )


def probe_candidates(state: State, window: Sequence[int]) -> list[int]:
    """Which blocks of a lookup's ``window`` after its hits are worth asking the remote tier
    about: those neither on the CPU tier (resident or on their way) nor in the remote index
    (the engine's probe answers with ``RemoteFound``)."""
    if not state.config.remote:
        return []
    slot_of, remote = state.slot_of, state.remote
    out = []
    for h in window:
        if h in slot_of or h in remote:
            continue
        out.append(h)
    return out


def decide_remote_found(state: State, cmd: RemoteFound, emit: Emit) -> int:
    if not state.config.remote:
        return 0
    new = tuple(h for h in dict.fromkeys(cmd.block_hashes) if h not in state.remote)
    if new:
        emit(RemoteIndexed(seq=state.next_seq, hashes=new))
    return len(new)


def decide_tier_refused(state: State, cmd: TierRefused, emit: Emit) -> int:
    """Record what a shared tier refused (``EntriesRefused``); those of its hashes the tier's
    index holds leave it, except a disk entry whose slot a job is using (that load's failure
    drops it). Returns how many left an index."""
    n = len(cmd.block_hashes)
    if cmd.tier not in SHARED_TIERS:
        raise Rejected(f"a refusal names no shared tier: {cmd.tier!r} (one of {', '.join(SHARED_TIERS)})")
    if len(cmd.reasons) != n or len(cmd.job_ids) != n:
        raise Rejected(f"a refusal of {n} blocks with {len(cmd.reasons)} reasons and {len(cmd.job_ids)} job ids")
    if not all(type(r) is str for r in cmd.reasons):
        raise Rejected("a refusal's reasons must be strings")
    if not all(type(j) is int and j >= 0 for j in cmd.job_ids):
        raise Rejected("a refusal's job ids must be ints >= 0 (0: refused by a probe)")
    disk = state.disk
    if (cmd.tier == "remote" and not state.config.remote) or (cmd.tier == "disk" and disk is None):
        raise Rejected(f"a refusal by the {cmd.tier} tier, which this configuration has not")
    if not n:
        return 0
    unique = dict.fromkeys(cmd.block_hashes)
    if cmd.tier == "remote":
        dropped = tuple(h for h in unique if h in state.remote)
    else:
        assert disk is not None
        slot_of, busy = disk.slot_of, disk.busy
        dropped = tuple(h for h in unique if h in slot_of and slot_of[h] not in busy)
    emit(
        EntriesRefused(
            seq=state.next_seq, tier=cmd.tier, hashes=cmd.block_hashes, reasons=cmd.reasons,
            job_ids=cmd.job_ids, dropped=dropped,
        )
    )  # fmt: skip
    return len(dropped)
