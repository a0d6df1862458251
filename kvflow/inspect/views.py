"""State as JSON-ready data: the whole state at a seq, or one followed thing narrowed out
of it (and its few-word view for ``before -> after``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvflow.core.jobs import ranks_in
from kvflow.core.state.model import State
from kvflow.inspect.render import few
from kvflow.inspect.walk import _Walk

if TYPE_CHECKING:
    from kvflow.inspect.history import Selector


def entry_dict(block_hash: int, state: State) -> dict[str, Any]:
    entry = state.entries.get(block_hash)
    if entry is None:
        return {"hash": block_hash, "state": "ABSENT"}
    return {
        "hash": block_hash,
        "state": entry.state.name,
        "slot": entry.slot,
        "pins": entry.pins,
        "job": entry.job_id or None,
    }


def job_dict(job: Any) -> dict[str, Any]:
    return {
        "job": job.job_id,
        "direction": job.direction,
        "state": job.state.name,
        "request": job.request_id,
        "blocks": len(job.hashes),
        "hashes": list(job.hashes),
        "device_blocks": list(job.device_blocks),
        "slots": list(job.slots),
        "deadline_ms": job.deadline_ms if job.deadline_ms else None,
        "ranks_succeeded": list(ranks_in(job.acks)),
        "abandoned": job.abandoned,
        # F15: outcome known, copy perhaps still running; its slots and device blocks wait
        "fenced": job.fenced,
        "ranks_reported": list(ranks_in(job.reported)),
    }


def request_dict(req: Any) -> dict[str, Any]:
    return {
        "request": req.request_id,
        "pins": {str(h): n for h, n in req.pins.items()},
        "offered": list(req.offered),
        "jobs": list(req.jobs),
        "finished": req.finished,
        "preempted": req.preempted,
    }


def state_to_dict(state: State) -> dict[str, Any]:
    """The whole state as JSON-ready data (entries by slot, jobs by id)."""
    entries = sorted(state.entries, key=lambda h: state.entries[h].slot)
    return {
        "seq": state.last_seq,
        "digest": state.digest(),
        "capacity": state.capacity,
        "policy": state.config.policy,
        "resident_blocks": state.num_resident(),
        "free_slots": len(state.free_slots),
        "entries": [entry_dict(h, state) for h in entries],
        "pins": {
            rid: {str(h): n for h, n in req.pins.items()}
            for rid, req in sorted(state.requests.items())
            if req.pins
        },
        "requests": [request_dict(state.requests[rid]) for rid in sorted(state.requests)],
        "jobs": [job_dict(state.jobs[jid]) for jid in sorted(state.jobs)],
        "fenced_slots": [{"slot": s, "job": list(j)} for s, j in sorted(state.fenced_slots.items())],
        "held_device_blocks": [
            {"device_block": d, "job": j} for d, j in sorted(state.held.items())
        ],
        "recency_coldest_first": state.policy.resident(),
        # (a trace with a remote tier only: what this instance knew the remote tier held)
        **({"remote_index": list(state.remote)} if state.config.remote else {}),
        # (a trace with a disk tier only: block -> disk slot, least recently used first)
        **(
            {"disk_index": [{"hash": h, "disk_slot": s} for h, s in state.disk.slot_of.items()],
             "disk_free_slots": len(state.disk.free)}
            if state.disk is not None
            else {}
        ),
    }


def _slot_owner(state: State, slot: int, walk: _Walk) -> tuple[str, Any]:
    """Who owns a slot: ("fenced", [fenced job ids]), ("block", hash) or ("free", None).
    An entry takes its slot when it is admitted and keeps it, so its owner is one of the
    blocks the trace admitted into it (``walk.filled``): asked of the state, each at once."""
    if slot in state.fenced_slots:
        return "fenced", list(state.fenced_slots[slot])
    slot_of = state.slot_of
    for h in (walk.filled or {}).get(slot, ()):
        if slot_of.get(h) == slot:
            return "block", h
    if slot in state.free_slots:
        return "free", None
    return "unknown", None


def focus_dict(selector: Selector, state: State, walk: _Walk) -> dict[str, Any]:
    """The followed thing's state (the state at one seq, narrowed)."""
    jobs = walk.jobs
    out: dict[str, Any] = {"seq": state.last_seq}
    if selector.block is not None:
        h = selector.block
        out.update(entry_dict(h, state))
        out["pins_by_request"] = {
            rid: req.pins[h] for rid, req in sorted(state.requests.items()) if h in req.pins
        }
        out["live_jobs"] = [job_dict(j) for jid, j in sorted(state.jobs.items()) if h in j.hashes]
    elif selector.job is not None:
        job = state.jobs.get(selector.job)
        if job is not None:
            out.update(job_dict(job))
        else:
            info = jobs.get(selector.job)
            ended = None if info is None else info.ended
            out.update(
                {
                    "job": selector.job,
                    "state": (ended or "not queued yet").upper().replace(" ", "_"),
                }
            )
    elif selector.request is not None:
        req = state.requests.get(selector.request)
        if req is not None:
            out.update(request_dict(req))
        else:
            out.update({"request": selector.request, "state": "UNKNOWN (not seen yet, or closed)"})
    elif selector.slot is not None:
        owner, who = _slot_owner(state, selector.slot, walk)
        out.update({"slot": selector.slot, "owner": owner})
        if owner == "block":
            out["entry"] = entry_dict(who, state)
        elif owner == "fenced":
            out["jobs"] = who
    return out


def _view(selector: Selector, state: State, walk: _Walk) -> str:
    """The followed thing in a few words (for before -> after)."""
    jobs = walk.jobs
    if selector.block is not None:
        entry = state.entries.get(selector.block)
        if entry is None:
            return "ABSENT"
        pins = f" pins {entry.pins}" if entry.pins else ""
        return f"{entry.state.name} slot {entry.slot}{pins}"
    if selector.job is not None:
        job = state.jobs.get(selector.job)
        if job is not None:
            return job.state.name
        info = jobs.get(selector.job)
        return "NEW" if info is None or info.ended is None else info.ended.upper()
    if selector.request is not None:
        req = state.requests.get(selector.request)
        if req is None:
            return "not live"
        done = ", finished" if req.finished else ""
        return f"pins {sum(req.pins.values())}, live jobs {few(req.jobs)}{done}"
    if selector.slot is None:
        return ""  # (a selector names one of block, job, request or slot)
    owner, who = _slot_owner(state, selector.slot, walk)
    if owner == "block":
        return f"block {who} ({state.entries[who].state.name})"
    if owner == "fenced":
        return f"fenced by job{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}"
    return owner
