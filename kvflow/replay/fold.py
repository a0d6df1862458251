"""Replay a trace: fold its events (checking invariants and every checkpoint's state and record
digests), or re-run its commands through today's decision code (``kvflow.replay.redecide``) and stop at
the first divergent event. What a replay finds: ``kvflow.replay.result``.

The fold is the source of truth for "what state did production reach"; ``redecide`` answers
"would today's code have decided the same?" (Temporal's non-determinism check).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kvflow.core.events import EVENT_TYPES
from kvflow.core.state.invariants import check_invariants
from kvflow.log.format import Checkpoint
from kvflow.log.reader import TraceReader
from kvflow.replay.redecide import redecide as redecide_trace
from kvflow.replay.result import Divergence, ReplayResult, apply_event, check_point

__all__ = ["replay", "repro_command"]


def replay(
    path: str | os.PathLike[str],
    *,
    until: int | None = None,
    redecide: bool = False,
    strict: bool = False,
    on_event: Callable[[int, Any], None] | None = None,
) -> ReplayResult:
    """Replay the trace at ``path``. Raises TraceError for unreadable files.

    ``strict`` checks every invariant after every event (slow; the default checks them at each
    checkpoint and at the end). ``on_event(line, event)`` observes each applied event.
    """
    with TraceReader(path) as reader:
        result = ReplayResult(path=reader.path, state=reader.new_state(), redecided=redecide)
        if redecide:
            redecide_trace(reader, result, until, strict, on_event)
        else:
            _fold(reader, result, until, strict, on_event)
        result.warnings.extend(reader.warnings)
    # (the invariants at the end, unless the last checkpoint checked this very state: a closed
    # writer's trace ends on one, and only events change the state)
    state = result.state
    if result.divergence is None and result.stopped_at is None and result.checked_seq != state.last_seq:
        problems = check_invariants(state)
        if problems:
            result.divergence = Divergence(
                "invariant", result.state.last_seq, None, "; ".join(problems[:3])
            )
    return result


_EVENTS = frozenset(EVENT_TYPES)


def _fold(
    reader: TraceReader,
    result: ReplayResult,
    until: int | None,
    strict: bool,
    on_event: Callable[[int, Any], None] | None,
) -> None:
    """Apply every event with every check (``evolve``), count the commands (a fold does not
    use them, but the reader has checked each line) and check every checkpoint; stop at the
    first divergence or at the first event after ``until``."""
    state = result.state
    for line, rec in reader.records():
        if type(rec) in _EVENTS:
            if until is not None and rec.seq > until:
                result.stopped_at = state.last_seq
                return
            if not apply_event(result, line, rec, strict):
                return
            if on_event is not None:
                on_event(line, rec)
        elif type(rec) is Checkpoint:
            if not check_point(result, line, rec, reader):
                return
        else:
            result.commands += 1
    if until is not None and state.last_seq >= until:
        result.stopped_at = state.last_seq


def repro_command(path: str, divergence: Divergence, redecide: bool, strict: bool = False) -> str:
    """The one command that reproduces a divergence (the path shell-quoted)."""
    import shlex

    flags = (" --redecide" if redecide else "") + (" --strict" if strict else "")
    return f"kvflow replay {shlex.quote(path)}{flags} --until {divergence.seq}"
