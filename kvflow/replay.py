"""Replay a trace: fold its events (checking invariants and every checkpoint's state and record
digests), or re-run its commands through today's decision code (``kvflow.redecide``) and stop at
the first divergent event. What a replay finds: ``kvflow.replay_result``.

The fold is the source of truth for "what state did production reach"; ``redecide`` answers
"would today's code have decided the same?" (Temporal's non-determinism check).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.errors import IllegalTransition
from kvflow.events import COMMAND_TYPES, EVENT_TYPES
from kvflow.redecide import redecide as redecide_trace
from kvflow.replay_result import Divergence, ReplayResult, apply_event, check_point
from kvflow.state import State, check_invariants, evolve
from kvflow.trace.format import CHAINED_SINCE, Checkpoint
from kvflow.trace.reader import TraceReader

__all__ = ["Divergence", "ReplayResult", "replay", "repro_command"]


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
    reader = TraceReader(path)
    with reader:
        result = ReplayResult(path=str(path), state=State(reader.config), redecided=redecide)
        if redecide:
            redecide_trace(reader, result, until, strict, on_event)
        else:
            # a fold does not use the commands, but a malformed line must still stop the replay
            # with its file and line (DESIGN §5): they are skimmed where a checkpoint's record
            # digest vouches for their bytes, and decoded in full everywhere else
            if strict or on_event is not None:
                _fold(reader, result, until, strict, on_event)
            else:
                _fold_chunks(reader, result, until)
        result.warnings.extend(reader.warnings)
    if result.divergence is None and result.stopped_at is None:
        problems = check_invariants(result.state)
        if problems:
            result.divergence = Divergence(
                "invariant", result.state.last_seq, None, "; ".join(problems[:3])
            )
    return result


_KIND: dict[type, int] = {
    **{t: 0 for t in EVENT_TYPES},
    **{t: 1 for t in COMMAND_TYPES},
    Checkpoint: 2,
}


def _fold(
    reader: TraceReader,
    result: ReplayResult,
    until: int | None,
    strict: bool,
    on_event: Callable[[int, Any], None] | None,
) -> None:
    """The fold record by record: ``--strict`` invariants after every event, observers."""
    state = result.state
    kinds = _KIND
    for line, rec in reader.records():
        kind = kinds[type(rec)]
        if kind == 0:
            if until is not None and rec.seq > until:
                result.stopped_at = state.last_seq
                return
            if not apply_event(result, line, rec, strict):
                return
            if on_event is not None:
                on_event(line, rec)
        elif kind == 1:
            result.commands += 1
        elif not check_point(result, line, rec, reader):
            return
    if until is not None and state.last_seq >= until:
        result.stopped_at = state.last_seq


_EVENT_TYPE_SET = frozenset(EVENT_TYPES)


_HOLD_RECORDS = 1 << 17  # records a fold holds back at most, waiting for their checkpoint


def _fold_chunks(reader: TraceReader, result: ReplayResult, until: int | None) -> None:
    """``_fold`` without strict checks or observers, chunk by chunk: the loop over a decoded
    chunk touches each record once, and line numbers are looked up only when needed.

    In a chained trace (version 3 on) the records before a checkpoint are held until it is
    read. Where its record digest vouches for them (their bytes are what the live engine
    wrote), their events are applied as the live engine applied them, without the per-block
    legality checks (``evolve(..., check=False)``: the engine's own decisions from this very
    state), and the checkpoint then compares state digest, record digest and invariants.
    Everywhere else (older versions, a trace that does not verify, records after the last
    checkpoint, more than _HOLD_RECORDS of them) every event is checked as it is applied."""
    limit = until if until is not None else float("inf")
    chunks = reader.record_chunks(skim_commands=True)
    if reader.version < CHAINED_SINCE:
        for numbers, recs in chunks:
            if not _fold_chunk(reader, result, limit, numbers, recs, True):
                return
    else:
        held: list[tuple[Sequence[int], list[Any]]] = []
        count = 0
        for numbers, recs in chunks:
            start = 0
            if Checkpoint in set(map(type, recs)):
                for k in [k for k, rec in enumerate(recs) if type(rec) is Checkpoint]:
                    held.append((numbers[start : k + 1], recs[start : k + 1]))
                    vouched = reader.mismatch is None or reader.mismatch[0] > numbers[k]
                    if not _fold_segment(reader, result, limit, held, vouched):
                        return
                    held, count, start = [], 0, k + 1
            if start < len(recs):
                held.append((numbers[start:], recs[start:]))
                count += len(recs) - start
            if count > _HOLD_RECORDS:
                for part in held:
                    if not _fold_chunk(reader, result, limit, *part, True):
                        return
                held, count = [], 0
        for part in held:  # after the last checkpoint: nothing vouches for them
            if not _fold_chunk(reader, result, limit, *part, True):
                return
    if until is not None and result.state.last_seq >= until:
        result.stopped_at = result.state.last_seq


def _fold_segment(
    reader: TraceReader, result: ReplayResult, limit: float, held: list[tuple[Sequence[int], list[Any]]], vouched: bool
) -> bool:
    """Fold the records up to a checkpoint (its own included). A vouched segment is applied
    unchecked from a copy of the state; should anything go wrong in it (a divergence at the
    checkpoint, an event today's code cannot apply), it is folded again from that copy with
    every event checked, so that the divergence reported is the one a checked fold finds."""
    if vouched:
        before = (result.state.copy(), result.events, result.commands, result.checkpoints)
        try:
            if all(_fold_chunk(reader, result, limit, *part, False) for part in held):
                return True
        except Exception:  # noqa: BLE001  (an event the unchecked path cannot apply)
            pass
        result.state, result.events, result.commands, result.checkpoints = before
        result.divergence = result.stopped_at = None
    return all(_fold_chunk(reader, result, limit, *part, True) for part in held)


def _fold_chunk(
    reader: TraceReader, result: ReplayResult, limit: float, numbers: Sequence[int], recs: list[Any], check: bool
) -> bool:
    """Fold one chunk of records; False at a divergence or at ``limit`` (``--until``)."""
    state = result.state
    events = _EVENT_TYPE_SET
    i = -1
    applied = commands = 0
    try:
        for rec in recs:
            i += 1
            kind = type(rec)
            if kind in events:
                if rec.seq > limit:
                    result.stopped_at = state.last_seq
                    return False
                evolve(state, rec, check)
                applied += 1
            elif kind is Checkpoint:
                result.events += applied
                applied = 0
                if not check_point(result, numbers[i], rec, reader):
                    return False
            else:
                commands += 1
    except IllegalTransition as exc:
        rec = recs[i]
        result.divergence = Divergence("illegal", rec.seq, numbers[i], str(exc), recorded=rec)
        return False
    finally:
        result.events += applied
        result.commands += commands
    return True


def repro_command(path: str, divergence: Divergence, redecide: bool, strict: bool = False) -> str:
    """The one command that reproduces a divergence (the path shell-quoted)."""
    import shlex

    flags = (" --redecide" if redecide else "") + (" --strict" if strict else "")
    return f"kvflow replay {shlex.quote(path)}{flags} --until {divergence.seq}"
