"""The state's structural invariants: what must hold after every event, whatever happened.

``check_invariants(state)`` returns the violations (empty when consistent). Replay runs it at
every checkpoint and at the end (``--strict``: after every event); the Hypothesis machines run
it after every step. Each section checks its rule over whole tables and walks item by item
only to name the offenders.
"""

from __future__ import annotations

from kvflow.core.jobs import COPYING_DOWN, FILLING
from kvflow.core.state.digest import pair_sum
from kvflow.core.state.model import State, held_by, pending_of
from kvflow.core.state.tables import IN_FLIGHT, LIVE_JOB_STATES, QUEUED


def check_invariants(state: State) -> list[str]:
    """Every structural rule of the state; returns the violations (empty when consistent)."""
    problems: list[str] = []
    cap = state.capacity
    slot_of, pending, pin_count, jobs = state.slot_of, state.pending, state.pin_count, state.jobs

    # slots: free + entries + fenced is exactly 0..cap-1, each once (a fenced load's
    # slot can be both fenced and still owned by its resident entry). The never-used slots
    # (from ``free_slots.fresh`` up) are free by construction: the rest, 0..fresh-1, are each
    # given back, owned or fenced, once (checked without a walk over the never-used ones)
    fenced_slots = state.fenced_slots
    free = state.free_slots
    used = list(free.freed)
    used.extend(slot_of.values())
    if fenced_slots:
        entry_slots = set(slot_of.values())
        used.extend(s for s in fenced_slots if s not in entry_slots)
    n = free.fresh
    if not (
        0 <= n <= cap
        and len(used) == n
        and len(set(used)) == n
        and (not used or (min(used) >= 0 and max(used) < n))
    ):
        _slot_problems(state, problems)
    # the digest's sums kept as the state changed are those of the entries and the free stack
    if state.tally.entries != pair_sum(slot_of, slot_of.values()):
        problems.append("the digest's sum over the entries does not match the entries")
    if free.tally != pair_sum(range(len(free.freed)), free.freed):
        problems.append("the digest's sum over the free slots does not match the free stack")
    for s, jids in fenced_slots.items():
        for jid in jids:
            job = jobs.get(jid)
            if job is None or not job.fenced or s not in job.slots:
                problems.append(f"slot {s} fenced for job {jid}, which is not a fenced job using it")
    # F15: no slot a fenced copy may still use is free or handed to another store
    for jid, job in jobs.items():
        if job.fenced:
            for s in job.slots:
                if jid not in fenced_slots.get(s, ()):
                    problems.append(f"slot {s} of fenced job {jid} is not in the fenced slots")

    # pins: every entry's count is what the requests hold; pinned entries are RESIDENT;
    # pending (STORE_QUEUED / STORING) entries belong to a live store job naming them
    pin_totals: dict[int, int] = {}
    for r in state.requests.values():
        for hashes in (r.offered, *r.loading.values()):
            for h in hashes:
                pin_totals[h] = pin_totals.get(h, 0) + 1
    for job in jobs.values():  # a live copy to a lower tier pins the entries whose slots it reads
        if job.direction in COPYING_DOWN and job.state in (QUEUED, IN_FLIGHT):
            for h in job.hashes:
                pin_totals[h] = pin_totals.get(h, 0) + 1
    entries_ok = (
        pin_count == pin_totals
        and slot_of.keys() >= pin_count.keys()
        and pending.keys().isdisjoint(pin_count)
        and slot_of.keys() >= pending.keys()
    )
    if entries_ok:
        for h, jid in pending.items():
            job = jobs.get(jid)
            if job is None or job.direction not in FILLING or h not in job.hashes:
                entries_ok = False
                break
    if not entries_ok:
        _entry_problems(state, pin_totals, problems)

    # policy tracks exactly the resident entries
    tracked = state.policy.resident()
    resident = slot_of.keys() - pending.keys() if pending else slot_of.keys()  # (a set view)
    if not (len(tracked) == len(resident) and resident == set(tracked)):
        problems.append(f"policy tracks {len(tracked)} blocks, tier has {len(resident)} resident")

    # queued index matches job states; requests list their unfenced jobs
    for jid, job in jobs.items():
        if job.state not in LIVE_JOB_STATES:
            problems.append(f"job {jid} is live in state {job.state.name}")
        if (jid in state.queued) != (job.state is QUEUED):
            problems.append(f"job {jid} queued index disagrees with state {job.state.name}")
        if job.request_id is not None:
            req = state.requests.get(job.request_id)
            listed = req is not None and jid in req.jobs
            if listed == job.fenced:  # a request forgets its job when the job is fenced
                problems.append(f"job {jid} ({job.state.name}) listed by request {job.request_id}: {listed}")
    for jid in state.deferred_touches:  # F14: kept only on a live store job
        job = jobs.get(jid)
        if job is None or job.direction not in FILLING or job.state not in (QUEUED, IN_FLIGHT):
            problems.append(f"a touch is deferred on job {jid}, which is not a live store")
    if len(state.remote) > state.config.remote_blocks:
        problems.append(f"the remote index holds {len(state.remote)} hashes, above remote_blocks")
    if state.disk is not None:
        _disk_problems(state, problems)
    # the indexes of the live jobs: one not kept is built from the jobs when read, so only
    # a kept one can disagree
    if state._held is not None and state._held != held_by(jobs):
        problems.append("device-block holds do not match the live jobs")
    if state._pending is not None and state._pending != pending_of(jobs):
        problems.append("the pending index does not match the live store jobs")
    for r in state.requests.values():
        for jid in r.jobs:
            if jid not in jobs:
                problems.append(f"request {r.request_id} lists job {jid} which is not live")
        if r.offered:
            pins = r.pins
            for h in r.offered:
                if pins.get(h, 0) <= 0:
                    problems.append(f"request {r.request_id} offers block {h} without a pin")
        # the chain's shortcuts (Request.chain_order, chain_whole_at) say what the chain says
        if r.chain_order is not None and r._chain is not None and r.chain_order != tuple(r._chain):
            problems.append(f"request {r.request_id}: its chain's tuple is not its chain")
        if r.chain_whole_at == state.departures and not all(map(state.slot_of.__contains__, r.chain_hashes())):
            problems.append(f"request {r.request_id}: its chain is marked whole on the tier but is not")
    return problems


def _slot_problems(state: State, problems: list[str]) -> None:
    """Name the slots that are out of range, owned twice or missing."""
    cap, fresh = state.capacity, state.free_slots.fresh
    owner: dict[int, str] = {}
    found = len(problems)

    def own(slot: int, who: str) -> None:
        if not 0 <= slot < cap:
            problems.append(f"slot {slot} outside 0..{cap - 1} ({who})")
        elif slot >= fresh:
            problems.append(f"slot {slot} was never handed out (free from {fresh} up) but is {who}")
        elif slot in owner:
            problems.append(f"slot {slot} owned twice: {owner[slot]} and {who}")
        else:
            owner[slot] = who

    if not 0 <= fresh <= cap:
        problems.append(f"the never-used free slots start at {fresh}, outside 0..{cap}")
    for s in state.free_slots.freed:
        own(s, "free")
    for h, slot in state.slot_of.items():
        own(slot, f"block {h}")
    entry_slots = set(state.slot_of.values())
    for s, jids in state.fenced_slots.items():
        if s not in entry_slots:
            own(s, f"fence of jobs {list(jids)}")
    if len(owner) != fresh and len(problems) == found:
        problems.append(f"free + used + fenced = {len(owner) + cap - fresh} != capacity {cap}")


def _entry_problems(state: State, pin_totals: dict[int, int], problems: list[str]) -> None:
    """Name the entries whose pins or pending job are wrong."""
    for h in state.slot_of:
        pins = state.pin_count.get(h, 0)
        jid = state.pending.get(h)
        job = state.jobs.get(jid) if jid is not None else None
        if jid is None:
            name = "RESIDENT"
        else:
            name = "STORE_QUEUED" if job is not None and job.state is QUEUED else "STORING"
        if pins < 0:
            problems.append(f"block {h} has negative pins {pins}")
        if pins != pin_totals.get(h, 0):
            problems.append(f"block {h} has {pins} pins but requests hold {pin_totals.get(h, 0)}")
        if pins and jid is not None:
            problems.append(f"block {h} is pinned in state {name}")
        if jid is not None and (job is None or job.direction not in FILLING or h not in job.hashes):
            problems.append(f"block {h} ({name}) has no live store job")
    for h in pin_totals:
        if h not in state.slot_of:
            problems.append(f"pins on block {h} which is not on the tier")
    for h in state.pin_count:
        if h not in state.slot_of and h not in pin_totals:
            problems.append(f"pins on block {h} which is not on the tier")


def _disk_problems(state: State, problems: list[str]) -> None:
    """Every disk slot is exactly one of: free, holding an indexed block, used by a job (a
    job's slot may also hold its indexed block: a load reads it); jobs hold the slots they name."""
    disk = state.disk
    assert disk is not None
    capacity = state.config.disk_blocks
    free, indexed, busy = list(disk.free), list(disk.slot_of.values()), disk.busy
    if len(set(free)) != len(free) or not set(free).isdisjoint(indexed) or not set(free).isdisjoint(busy):
        problems.append("a free disk slot is also held")
    if len(set(indexed)) != len(indexed):
        problems.append("two indexed blocks share a disk slot")
    if len(set(free) | set(indexed) | set(busy)) != capacity:
        problems.append("disk slots are lost or out of range")
    holders = {s: jid for jid, job in state.jobs.items() for s in job.disk_slots}
    if holders != busy:
        problems.append("the disk slots in use do not match the disk jobs")
