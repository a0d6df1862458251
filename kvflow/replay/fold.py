"""Replay a trace: fold its events (checking invariants and every checkpoint's state and record
digests), or re-run its commands through today's decision code (``kvflow.replay.redecide``) and stop at
the first divergent event. What a replay finds: ``kvflow.replay.result``.

The fold is the source of truth for "what state did production reach"; ``redecide`` answers
"would today's code have decided the same?" (Temporal's non-determinism check).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.core.commands import COMMAND_TYPES
from kvflow.core.errors import IllegalTransition, TraceError
from kvflow.core.events import EVENT_TYPES
from kvflow.core.state.apply import EVOLVERS, evolve
from kvflow.core.state.invariants import check_invariants
from kvflow.core.state.model import State
from kvflow.log.format import CHAINED_SINCE, TRUSTED_FORMS, Checkpoint
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
                trusted = float("inf")
                while True:
                    try:
                        _fold_chunks(reader, result, until, trusted)
                        break
                    except _CheckEverything as again:  # again, checking more (at last, all)
                        trusted = again.trusted if again.trusted < trusted else 0
                    except TraceError:
                        if trusted < float("inf"):
                            raise
                        # the first fold numbers lines by their records (TraceReader.record_chunks):
                        # read again, counting lines after the last verified checkpoint
                        trusted = result.checked_through
                    reader.close()
                    reader = TraceReader(path)
                    result = ReplayResult(path=str(path), state=State(reader.config))
        result.warnings.extend(reader.warnings)
        reader.close()  # (the one a second fold opened; closing twice is harmless)
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


class _CheckEverything(Exception):
    """Something went wrong where events were applied unchecked: fold again, checking every
    event after ``trusted`` (the last line a checkpoint vouched for)."""

    def __init__(self, trusted: int) -> None:
        super().__init__(trusted)
        self.trusted = trusted


def _fold_chunks(reader: TraceReader, result: ReplayResult, until: int | None, trusted: float) -> None:
    """``_fold`` without strict checks or observers, chunk by chunk: the loop over a decoded
    chunk touches each record once, and line numbers are looked up only when needed.

    Events on lines up to ``trusted`` are applied as the live engine applied them, without
    the per-block legality checks (``evolve(..., check=False)``: the engine's own decisions
    from this very state); every later event is checked. ``replay`` first trusts the whole of
    a chained trace (version 3 on) and lets the checkpoints judge: each compares the state
    digest, the digest of the bytes before it (so the events are what the engine wrote) and
    the invariants. Should anything go wrong where events were applied unchecked (a divergence,
    an event today's code cannot apply, records after the last checkpoint), _CheckEverything
    says up to where the checkpoints vouched, and ``replay`` folds again from the start,
    checking every event after that line. What it reports then is what a checked fold reports;
    the one thing only a checked fold (``--strict``) would see is an event the checks refuse
    in a stretch whose checkpoint still matches the state the recording engine reached (the
    recording engine applied it unchecked too). The reader decodes the chunks up to ``trusted``
    faster (``TraceReader.record_chunks``' ``trusted_through``)."""
    if reader.version < CHAINED_SINCE:
        trusted = 0
    for numbers, recs in reader.record_chunks(skim_commands=True, trusted_through=trusted):
        if not recs or numbers[-1] > trusted:
            if not _fold_chunk(reader, result, until, numbers, recs, True):
                return
            continue
        try:
            folded = _fold_chunk(reader, result, until, numbers, recs, False)
        except Exception:  # noqa: BLE001  (an event the unchecked path cannot apply)
            raise _CheckEverything(result.checked_through) from None
        if not folded:
            if result.divergence is not None:
                raise _CheckEverything(result.checked_through)
            return  # --until
    if reader.unverified and trusted > result.checked_through:
        raise _CheckEverything(result.checked_through)  # the records no checkpoint vouched for
    if until is not None and result.state.last_seq >= until:
        result.stopped_at = result.state.last_seq


Step = Callable[[State, Any, bool], None]

_STEPS: dict[type, Step] = {
    **EVOLVERS,
    **{form: EVOLVERS[event] for form, event in TRUSTED_FORMS.items()},
}
"""What the chunk fold does with each record type that advances the seq: the events' evolvers
(``evolve`` without its seq check); an event in a form of its own (``TRUSTED_FORMS``, only in
chunks applied unchecked) goes to its event's evolver, which reads a job end's payload from
the job."""
_FOLD_STEPS: dict[type, Any] = {**_STEPS, Checkpoint: False}
"""``_STEPS``, and False for a checkpoint: what ``_fold_chunk`` looks a record's type up in. A
command is in neither (``dict.get`` gives None): an event is told by one truth test, and the
rest by one more."""


def _fold_chunk(
    reader: TraceReader, result: ReplayResult, until: int | None, numbers: Sequence[int], recs: list[Any], check: bool
) -> bool:
    """Fold one chunk of records; False at a divergence or at the first event after ``until``
    (``--until``: the chunk is cut there first, so that the loop tests no limit). Job ends
    without their payload come only in chunks the reader was told are trusted (unchecked).

    The loop touches each record once and does nothing with a command: the commands are
    counted from the chunk's length (the records before the end or the stop, less the
    events, each of which advances the seq by one, and the checkpoints); a record's index is
    looked up only when a line number is needed or the fold stops."""
    state = result.state
    steps = _FOLD_STEPS  # (evolve's body inlined below: no call per event)
    rec: Any = None
    # the next seq is counted here and stored in the state before anything reads it (a
    # checkpoint's digest, a stop, the end): no evolver reads it
    seq = applied_from = chunk_from = state.next_seq
    checkpoints = 0  # the checkpoints of this chunk that passed
    done = -1  # the records the loop is through with (-1 until it ends: those before ``rec``)
    folded = recs if until is None else recs[: _first_after(recs, until)]
    try:
        for rec in folded:
            step = steps.get(type(rec))
            if step:  # (an event)
                if rec.seq != seq:
                    state.next_seq = seq
                    evolve(state, rec, check)  # (raises the gapless-seq error)
                step(state, rec, check)
                seq += 1
            elif step is not None:  # (a checkpoint; None: a command)
                state.next_seq = seq
                result.events += seq - applied_from
                applied_from = seq
                if not check_point(result, _line_of(numbers, recs, rec), rec, reader):
                    return False
                checkpoints += 1
            # (else a command: counted below)
        done = len(folded)
    except IllegalTransition as exc:
        result.divergence = Divergence("illegal", rec.seq, _line_of(numbers, recs, rec), str(exc), recorded=rec)
        return False
    finally:
        state.next_seq = seq
        result.events += seq - applied_from
        if done < 0:  # (stopped at ``rec``)
            done = _index_of(recs, rec)
        result.commands += done - (seq - chunk_from) - checkpoints
    if len(folded) < len(recs):  # (stopped before the event after ``until``)
        result.stopped_at = state.last_seq
        return False
    return True


def _first_after(recs: list[Any], until: int) -> int:
    """The index of the first event of ``recs`` whose seq is after ``until`` (else their number)."""
    steps = _STEPS
    return next((i for i, rec in enumerate(recs) if type(rec) in steps and rec.seq > until), len(recs))


def _index_of(recs: list[Any], rec: Any) -> int:
    """The index of ``rec`` in ``recs`` (by identity: records are distinct objects)."""
    return next(i for i, other in enumerate(recs) if other is rec)


def _line_of(numbers: Sequence[int], recs: list[Any], rec: Any) -> int:
    """The line number of ``rec``, one of ``recs``."""
    return numbers[_index_of(recs, rec)]


def repro_command(path: str, divergence: Divergence, redecide: bool, strict: bool = False) -> str:
    """The one command that reproduces a divergence (the path shell-quoted)."""
    import shlex

    flags = (" --redecide" if redecide else "") + (" --strict" if strict else "")
    return f"kvflow replay {shlex.quote(path)}{flags} --until {divergence.seq}"
