"""Decisions: the business rules. ``decide(state, command, emit)`` hands each event to ``emit``.

Each decider is a plain function ``decide_x(state, cmd, emit) -> answer``. ``emit(event)``
applies the event at once (the caller's: ``OffloadManager`` evolves, records and observes it;
``replay --redecide`` compares it with the recorded one), so a decision always reads the state
its earlier events produced (an eviction frees the slots the next store takes). The return
value is the command's answer (hit count, job id, jobs to submit).

Rule: a decider validates everything *before its first emit* and raises a
:class:`~kvflow.core.errors.Rejected` subclass for a bad call (F12), so a refused command appends
nothing. Pure: no I/O, no clock, no randomness, no logging.

The deciders live in ``lookup`` (lookup and loads), ``store`` (stores, touches, eviction, bad
blocks), ``jobs`` (planning, results, deadlines, finish, reset, fences) and ``remote`` (the
remote tier); ``checks`` holds the checks they share. This module maps each command to its decider.
"""

from __future__ import annotations

from typing import Any

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
from kvflow.core.decide.checks import Emit
from kvflow.core.decide.disk import decide_disk_restored
from kvflow.core.decide.jobs import (
    decide_end_fences,
    decide_finish,
    decide_job_result,
    decide_job_results,
    decide_plan_step,
    decide_reset,
    decide_tick,
)
from kvflow.core.decide.lookup import decide_accept_hits, decide_lookup
from kvflow.core.decide.remote import decide_remote_found, decide_tier_refused
from kvflow.core.decide.store import (
    Decider,
    decide_blocks_computed,
    decide_device_evicting,
    decide_evict,
    decide_invalidate,
    decide_touch,
    evict_unpinned_bad,
)
from kvflow.core.state.model import State

DECIDERS: dict[type, Decider] = {
    Lookup: decide_lookup,
    AcceptHits: decide_accept_hits,
    BlocksComputed: decide_blocks_computed,
    DeviceBlocksEvicting: decide_device_evicting,
    Touch: decide_touch,
    Evict: decide_evict,
    PlanStep: decide_plan_step,
    JobResult: decide_job_result,
    JobResults: decide_job_results,
    Tick: decide_tick,
    FinishRequest: decide_finish,
    ResetAll: decide_reset,
    Invalidate: decide_invalidate,
    EndFences: decide_end_fences,
    RemoteFound: decide_remote_found,
    DiskRestored: decide_disk_restored,
    TierRefused: decide_tier_refused,
}


# a decision that can release pins is followed by the eviction of bad blocks it unpinned
# (F17); the others (stores, touches, planning) are left as they are
UNPINNING = frozenset({Lookup, AcceptHits, JobResult, JobResults, Tick, FinishRequest})


def after_decision(state: State, command: Command, emit: Emit) -> None:
    """F17: after a decision that can release pins, the remembered bad blocks whose last pin
    went are evicted. Blocks become remembered bad only through an executor outcome that
    names them (``drop_corrupt``), so a caller may skip this call while ``state.bad`` is
    empty (the manager does: it is empty on nearly every call)."""
    if state.bad and type(command) in UNPINNING:
        evict_unpinned_bad(state, emit)


def decide(state: State, command: Command, emit: Emit) -> Any:
    """Decide ``command``, handing each event to ``emit``; returns the answer (see the module
    docstring for the protocol)."""
    answer = DECIDERS[type(command)](state, command, emit)
    after_decision(state, command, emit)
    return answer


__all__ = ["decide", "after_decision", "DECIDERS"]
