"""Rendering trace records as text: one human-readable line per record or incident.

Pure formatting: nothing here reads a trace or folds state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from kvflow.core.commands import (
    AcceptHits,
    BlocksComputed,
    DeviceBlocksEvicting,
    DiskRestored,
    Evict,
    FinishRequest,
    JobResult,
    Lookup,
    PlanStep,
    RemoteFound,
    ResetAll,
    Tick,
    TierRefused,
    Touch,
)
from kvflow.core.events import (
    BlocksEvicted,
    BlocksTouched,
    ChainExtended,
    DiskEvicted,
    DiskIndexed,
    DiskLoadQueued,
    DiskStoreQueued,
    EntriesRefused,
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
from kvflow.log.format import Checkpoint

if TYPE_CHECKING:
    from kvflow.inspect.incidents import Incident


def exact_ms(t: float) -> str:
    """A time in ms at the full resolution the trace holds: the shortest text that reads back
    as the same float (``1653390.125``), whole numbers without ``.0`` (``60``)."""
    value = float(t)
    return str(int(value)) if value.is_integer() else repr(value)


def few(values: Any, limit: int = 4) -> str:
    """``[1, 2, 3, 4, +5 more]``: a list short enough for one line."""
    values = list(values)
    shown = ", ".join(str(v) for v in values[:limit])
    if len(values) > limit:
        shown += f", +{len(values) - limit} more"
    return f"[{shown}]"


def _req(request_id: str | None) -> str:
    return "no request" if request_id is None else f"request {request_id}"


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _refusals(hashes: Any, reasons: Any, job_ids: Any, limit: int = 4) -> str:
    """``block (reason, by job N or a probe)`` for the first ``limit`` refusals."""
    shown = [
        f"{h} ({reason}, {f'load job {j}' if j else 'probe'})" for h, reason, j in list(zip(hashes, reasons, job_ids))[:limit]
    ]
    if len(hashes) > limit:
        shown.append(f"+{len(hashes) - limit} more")
    return "[" + ", ".join(shown) + "]"


def describe(record: Any) -> str:
    """One human-readable line for a command, event or checkpoint."""
    r = record
    kind = type(r)
    if kind is StoreQueued:
        return (
            f"store job {r.job_id} queued for {_req(r.request_id)}: {_blocks(len(r.hashes))} "
            f"{few(r.hashes)} from device blocks {few(r.device_blocks)} into slots {few(r.slots)}"
        )
    if kind is LoadQueued:
        return (
            f"load job {r.job_id} queued for {_req(r.request_id)}: {_blocks(len(r.hashes))} "
            f"{few(r.hashes)} from slots {few(r.slots)} into device blocks {few(r.device_blocks)}"
        )
    if kind is RemoteLoadQueued:
        return (
            f"remote_load job {r.job_id} queued: {_blocks(len(r.hashes))} {few(r.hashes)} "
            f"from the remote tier into slots {few(r.slots)}"
        )
    if kind is RemoteStoreQueued:
        return (
            f"remote_store job {r.job_id} queued: {_blocks(len(r.hashes))} {few(r.hashes)} "
            f"from slots {few(r.slots)} to the remote tier (pinned while copied)"
        )
    if kind is DiskLoadQueued:
        return (
            f"disk_load job {r.job_id} queued: {_blocks(len(r.hashes))} {few(r.hashes)} "
            f"from disk slots {few(r.disk_slots)} into slots {few(r.slots)}"
        )
    if kind is DiskStoreQueued:
        return (
            f"disk_store job {r.job_id} queued: {_blocks(len(r.hashes))} {few(r.hashes)} "
            f"from slots {few(r.slots)} to disk slots {few(r.disk_slots)} (pinned while copied)"
        )
    if kind is DiskEvicted:
        return (
            f"disk tier dropped {_blocks(len(r.hashes))} {few(r.hashes)} from disk slots "
            f"{few(r.disk_slots)} ({r.reason})"
        )
    if kind is DiskIndexed:
        return f"disk tier holds {_blocks(len(r.hashes))} {few(r.hashes)} in disk slots {few(r.disk_slots)} (restored)"
    if kind is DiskRestored:
        return f"warm restart: the disk tier's journal vouches for {_blocks(len(r.block_hashes))} {few(r.block_hashes)}"
    if kind is EntriesRefused:
        dropped = f"; dropped from its index: {few(r.dropped)}" if r.dropped else ""
        return f"{r.tier} tier REFUSED {_blocks(len(r.hashes))} {_refusals(r.hashes, r.reasons, r.job_ids)}{dropped}"
    if kind is TierRefused:
        return (
            f"the {r.tier} tier refused {_blocks(len(r.block_hashes))} "
            f"{_refusals(r.block_hashes, r.reasons, r.job_ids)}"
        )
    if kind is RemoteIndexed:
        return f"remote tier holds {_blocks(len(r.hashes))} {few(r.hashes)} (a probe found them)"
    if kind is RemoteFound:
        return f"probe of the remote tier found {_blocks(len(r.block_hashes))} {few(r.block_hashes)}"
    if kind is JobsSubmitted:
        return (
            f"jobs {few(r.job_ids, 8)} submitted at {exact_ms(r.now_ms)} ms, deadline {exact_ms(r.deadline_ms)} ms"
        )
    if kind is RankSucceeded:
        return f"job {r.job_id}: rank {r.rank} succeeded; waiting for the other ranks"
    if kind is JobCompleted:
        return f"{r.direction} job {r.job_id} completed ({_req(r.request_id)}, {_blocks(len(r.hashes))})"
    if kind is JobFailed:
        if r.rank < 0:
            return f"{r.direction} job {r.job_id} CANCELLED ({r.error}; {_req(r.request_id)})"
        fence = "; memory FENCED until every rank reports" if r.fenced else ""
        return f"{r.direction} job {r.job_id} FAILED on rank {r.rank}: {r.error} ({_req(r.request_id)}){fence}"
    if kind is JobTimedOut:
        fence = "; memory FENCED until the copy reports over" if r.fenced else ""
        return (
            f"{r.direction} job {r.job_id} TIMED OUT at {exact_ms(r.now_ms)} ms "
            f"(deadline {exact_ms(r.deadline_ms)} ms; {_req(r.request_id)}){fence}"
        )
    if kind is FenceLifted:
        return (
            f"fence of job {r.job_id} lifted ({r.reason}): slots {few(r.slots)} and device blocks "
            f"{few(r.device_blocks)} may be reused"
        )
    if kind is LateResultIgnored:
        outcome = "ok" if r.ok else f"error: {r.error}"
        return f"late result for ended job {r.job_id} from rank {r.rank} ({outcome}): ignored"
    if kind is BlocksEvicted:
        return f"evicted ({r.reason}) {_blocks(len(r.hashes))} {few(r.hashes)} from slots {few(r.slots)}"
    if kind is BlocksTouched:
        return f"touched {_blocks(len(r.hashes))} {few(r.hashes)} (last = most recent)"
    if kind is StoreRejected:
        return f"store of {_blocks(len(r.hashes))} {few(r.hashes)} for {_req(r.request_id)} rejected: {r.reason}"
    if kind is PinsAcquired:
        if not r.hashes:
            return f"lookup miss for request {r.request_id} ({r.num_tokens} tokens)"
        return (
            f"lookup hit: request {r.request_id} pinned {_blocks(len(r.hashes))} "
            f"{few(r.hashes)} ({r.num_tokens} tokens)"
        )
    if kind is PinsReleased:
        return f"request {r.request_id} released its offered pins on {_blocks(len(r.hashes))} {few(r.hashes)}"
    if kind is RequestFinished:
        return f"request {r.request_id} {'preempted' if r.preempted else 'finished'}"
    if kind is RequestOpened:
        return f"request {r.request_id} first seen (its blocks were all on the tier already)"
    if kind is ChainExtended:
        return f"request {r.request_id}'s chain names {_blocks(len(r.hashes))} {few(r.hashes)} (its finish touches them)"
    if kind is RequestResumed:
        return f"request {r.request_id} came back after its preemption (its earlier jobs finish on their own)"
    if kind is RequestClosed:
        return f"request {r.request_id} closed (no pins, no live jobs)"
    if kind is Reset:
        return f"RESET: tier cleared; in-flight jobs abandoned: {few(r.abandoned_job_ids, 8)}"
    if kind is Lookup:
        return (
            f"lookup for request {r.request_id}: {_blocks(len(r.block_hashes))} "
            f"{few(r.block_hashes)}, {r.num_tokens} tokens, device hit {r.device_hit_blocks}"
        )
    if kind is AcceptHits:
        return f"request {r.request_id} accepts {len(r.device_blocks)} hits into device blocks {few(r.device_blocks)}"
    if kind is BlocksComputed:
        return (
            f"{_req(r.request_id)} computed {_blocks(len(r.block_hashes))} {few(r.block_hashes)} "
            f"in device blocks {few(r.device_blocks)}"
        )
    if kind is DeviceBlocksEvicting:
        return (
            f"device cache drops {_blocks(len(r.block_hashes))} {few(r.block_hashes)} "
            f"from device blocks {few(r.device_blocks)}"
        )
    if kind is Touch:
        return f"touch {_blocks(len(r.block_hashes))} {few(r.block_hashes)}"
    if kind is Evict:
        return f"evict {_blocks(r.num_blocks)} on request"
    if kind is PlanStep:
        return f"plan step at {exact_ms(r.now_ms)} ms"
    if kind is JobResult:
        outcome = "ok" if r.ok else f"error: {r.error}"
        return f"executor result: job {r.job_id} rank {r.rank} {outcome}"
    if kind is Tick:
        return f"tick at {exact_ms(r.now_ms)} ms"
    if kind is FinishRequest:
        return f"request {r.request_id} {'preempted' if r.preempted else 'finished'} by the engine"
    if kind is ResetAll:
        return "reset requested by the engine"
    if kind is Checkpoint:
        return f"checkpoint: digest {r.digest} at seq {r.seq}"
    return event_name(r)


def to_builtins(record: Any) -> Any:
    """A record as plain JSON data, its ``type`` tag included."""
    return msgspec.to_builtins(record)


def recovery_summary(incident: Incident) -> str:
    """The recovery of one incident in one line."""
    rec = incident.recovery
    parts = []
    if "fenced_slots_released" in rec:
        parts.append(f"fenced slots released {few(rec['fenced_slots_released'], 6)}")
    if "slots_freed" in rec:
        parts.append(f"slots freed {few(rec['slots_freed'], 6)}")
    if "hashes_never_visible" in rec:
        parts.append(f"{len(rec['hashes_never_visible'])} hashes never visible")
    if "dropped_from_remote_index" in rec:
        parts.append(f"{len(rec['dropped_from_remote_index'])} dropped from the remote index")
    if "dropped_from_disk_index" in rec:
        parts.append(f"{len(rec['dropped_from_disk_index'])} dropped from the disk index")
    if "entries_kept_resident" in rec:
        parts.append(f"{len(rec['entries_kept_resident'])} entries kept resident")
    if "evicted_as_corrupt" in rec:
        parts.append(f"{len(rec['evicted_as_corrupt'])} evicted as corrupt")
    if "pins_released" in rec:
        parts.append(f"{rec['pins_released']} pins released")
    if "recompute_device_blocks" in rec:
        parts.append(f"recompute device blocks {few(rec['recompute_device_blocks'], 6)}")
    if incident.abandoned_at_seq is not None:
        parts.append(f"abandoned by reset at seq {incident.abandoned_at_seq}")
    if incident.fenced:
        lifted = incident.fence_lifted
        if lifted is None:
            parts.append("FENCED to the end of the trace: the copy never reported over (its slots and device blocks still fenced)")
        else:
            parts.append(
                f"fenced until seq {lifted['seq']} ({lifted['reason']}): device blocks "
                f"{few(lifted['device_blocks_released'], 6)} released then"
            )
    if not incident.verified:
        parts.append("(not verified: the trace stopped folding)")
    return "; ".join(parts)
