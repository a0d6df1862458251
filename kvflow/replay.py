"""Replay a trace: fold its events (checking invariants and every checkpoint digest), or
re-run its commands through today's decision code and stop at the first divergent event.

The fold is the source of truth for "what state did production reach"; ``redecide`` answers
"would today's code have decided the same?" (Temporal's non-determinism check).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from kvflow.decide import decide
from kvflow.errors import IllegalTransition, KvflowError
from kvflow.events import COMMAND_TYPES, EVENT_TYPES, Event, event_name
from kvflow.state import State, check_invariants, evolve
from kvflow.trace.format import CHAINED_SINCE, Checkpoint
from kvflow.trace.reader import TraceReader


@dataclass
class Divergence:
    """The first place where replay disagrees with the trace."""

    kind: str  # "illegal", "checkpoint", "records", "invariant", "redecide"
    seq: int
    line: int | None
    message: str
    recorded: Any = None
    produced: Any = None
    command: Any = None
    digest_before: str | None = None
    digest_recorded: str | None = None
    digest_produced: str | None = None
    command_line: int | None = None

    def to_dict(self) -> dict[str, Any]:
        import msgspec

        def enc(x: Any) -> Any:
            return None if x is None else msgspec.to_builtins(x)

        return {
            "kind": self.kind,
            "seq": self.seq,
            "line": self.line,
            "message": self.message,
            "command": enc(self.command),
            "recorded": enc(self.recorded),
            "produced": enc(self.produced),
            "digest_before": self.digest_before,
            "digest_recorded": self.digest_recorded,
            "digest_produced": self.digest_produced,
            "command_line": self.command_line,
        }


@dataclass
class ReplayResult:
    path: str
    state: State
    events: int = 0
    commands: int = 0
    checkpoints: int = 0
    redecided: bool = False
    stopped_at: int | None = None
    divergence: Divergence | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "events": self.events,
            "commands": self.commands,
            "checkpoints_verified": self.checkpoints,
            "redecided": self.redecided,
            "last_seq": self.state.last_seq,
            "digest": self.state.digest(),
            "stopped_at": self.stopped_at,
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
            "warnings": self.warnings,
            "resident_blocks": self.state.num_resident(),
            "free_slots": len(self.state.free_slots),
            "live_jobs": len(self.state.jobs),
        }


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
            _redecide(reader, result, until, strict, on_event)
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


def _check_point(result: ReplayResult, line: int, cp: Checkpoint, reader: TraceReader) -> bool:
    """The state digest, the record digest (the trace's bytes up to here, read by ``reader``)
    and the invariants at a checkpoint."""
    state = result.state
    if reader.mismatch is not None and reader.mismatch[0] <= line:
        result.divergence = Divergence("records", cp.seq, reader.mismatch[0], reader.mismatch[1])
        return False
    if cp.seq != state.last_seq:
        result.divergence = Divergence(
            "checkpoint", cp.seq, line, f"checkpoint at seq {cp.seq} but the fold is at seq {state.last_seq}"
        )
        return False
    digest = state.digest()
    if digest != cp.digest:
        result.divergence = Divergence(
            "checkpoint",
            cp.seq,
            line,
            f"state digest {digest} differs from the recorded {cp.digest}",
            digest_recorded=cp.digest,
            digest_produced=digest,
        )
        return False
    problems = check_invariants(state)
    if problems:
        result.divergence = Divergence("invariant", cp.seq, line, "; ".join(problems[:3]))
        return False
    result.checkpoints += 1
    return True


def _apply(result: ReplayResult, line: int, event: Event, strict: bool) -> bool:
    state = result.state
    try:
        evolve(state, event)
    except IllegalTransition as exc:
        result.divergence = Divergence("illegal", event.seq, line, str(exc), recorded=event)
        return False
    result.events += 1
    if strict:
        problems = check_invariants(state)
        if problems:
            result.divergence = Divergence("invariant", event.seq, line, "; ".join(problems[:3]), recorded=event)
            return False
    return True


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
            if not _apply(result, line, rec, strict):
                return
            if on_event is not None:
                on_event(line, rec)
        elif kind == 1:
            result.commands += 1
        elif not _check_point(result, line, rec, reader):
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
                if not _check_point(result, numbers[i], rec, reader):
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


class _Redecider:
    """Runs one recorded command through ``decide`` and lines its events up with the trace."""

    def __init__(self, result: ReplayResult) -> None:
        self.result = result
        self.command: Any = None
        self.command_line = 0
        self.produced: list[Event] = []
        self.matched = 0
        self.digest_before: str | None = None
        self._pending: Event | None = None  # the event today's code decided next
        self._refused: str | None = None

    def start(self, line: int, command: Any) -> bool:
        if not self.finish():
            return False
        state = self.result.state
        self.command, self.command_line = command, line
        self.digest_before = None
        self.matched = 0
        self.produced = []
        self._refused = None
        # Run the decision against a scratch copy lazily: decisions read the state as each
        # event is applied, so we drive the generator against the live state one event at a
        # time, in step with the recorded events (see ``event``).
        self._gen = decide(state, command)
        self._pending = self._next()
        return self.result.divergence is None

    def _next(self) -> Event | None:
        try:
            return next(self._gen)
        except StopIteration:
            return None
        except KvflowError as exc:
            self._refused = str(exc)
            return None

    def event(self, line: int, recorded: Event) -> bool:
        result = self.result
        if self.command is None:
            result.divergence = Divergence(
                "redecide", recorded.seq, line, "an event appears before any command", recorded=recorded
            )
            return False
        produced = self._pending
        if produced != recorded:
            self._diverge(line, recorded, produced)
            return False
        if not _apply(result, line, recorded, False):
            return False
        self.matched += 1
        self._pending = self._next_after_apply()
        return True

    def _next_after_apply(self) -> Event | None:
        try:
            return self._gen.send(None)
        except StopIteration:
            return None
        except KvflowError as exc:
            self._refused = str(exc)
            return None

    def cut_short(self) -> bool:
        """Does the current command have events today's code decided that were not read?"""
        return self.command is not None and self.result.divergence is None and self._pending is not None

    def finish(self) -> bool:
        """The recorded events of the current command are over: today's code must agree."""
        if self.command is None or self.result.divergence is not None:
            return self.result.divergence is None
        if self._pending is not None:
            self._diverge(None, None, self._pending)
            return False
        self.command = None
        return True

    def _diverge(self, line: int | None, recorded: Event | None, produced: Event | None) -> None:
        state = self.result.state
        seq = recorded.seq if recorded is not None else (produced.seq if produced is not None else state.next_seq)
        refused = self._refused
        if recorded is not None and produced is None:
            what = "today's code produced no event here" + (f" (it refused the command: {refused})" if refused else "")
        elif recorded is None:
            what = f"today's code produced an extra {event_name(produced)} event"
        elif type(recorded) is not type(produced):
            what = f"recorded {event_name(recorded)} but today's code produced {event_name(produced)}"
        else:
            fields = [
                f for f in recorded.__struct_fields__ if getattr(recorded, f) != getattr(produced, f)
            ]
            what = f"{event_name(recorded)} differs in {', '.join(fields)}"
        digest_before = state.digest()
        digest_recorded = digest_produced = None
        if recorded is not None:
            probe = state.copy()
            try:
                digest_recorded = evolve(probe, recorded).digest()
            except IllegalTransition:
                digest_recorded = "(illegal)"
        if produced is not None:
            probe = state.copy()
            try:
                digest_produced = evolve(probe, produced).digest()
            except IllegalTransition:
                digest_produced = "(illegal)"
        self.result.divergence = Divergence(
            "redecide",
            seq,
            line,
            what,
            recorded=recorded,
            produced=produced,
            command=self.command,
            digest_before=digest_before,
            digest_recorded=digest_recorded,
            digest_produced=digest_produced,
            command_line=self.command_line,
        )


def _redecide(
    reader: TraceReader,
    result: ReplayResult,
    until: int | None,
    strict: bool,
    on_event: Callable[[int, Any], None] | None,
) -> None:
    state = result.state
    redecider = _Redecider(result)
    for line, rec in reader.records():
        if isinstance(rec, Checkpoint):
            if not _check_point(result, line, rec, reader):
                return
        elif isinstance(rec, COMMAND_TYPES):
            if until is not None and state.last_seq >= until:
                result.stopped_at = state.last_seq
                return
            result.commands += 1
            if not redecider.start(line, rec):
                return
        elif isinstance(rec, EVENT_TYPES):
            rec = cast(Event, rec)
            if until is not None and rec.seq > until:
                result.stopped_at = state.last_seq
                return
            if not redecider.event(line, rec):
                return
            if strict and check_invariants(state):
                result.divergence = Divergence("invariant", rec.seq, line, "; ".join(check_invariants(state)[:3]))
                return
            if on_event is not None:
                on_event(line, rec)
    if reader.complete or not redecider.cut_short():
        redecider.finish()
    else:
        # a trace cut short (a crash) may end inside a command: its remaining events were
        # never written, which is no divergence; the re-decision ends with the command before
        result.stopped_at = state.last_seq
        result.warnings.append(
            f"{result.path}:{redecider.command_line}: the trace ends inside this command "
            f"({redecider.matched} of its events recorded, today's code decides more): "
            "re-decided up to the last complete command before it"
        )


def repro_command(path: str, divergence: Divergence, redecide: bool, strict: bool = False) -> str:
    """The one command that reproduces a divergence (the path shell-quoted)."""
    import shlex

    flags = (" --redecide" if redecide else "") + (" --strict" if strict else "")
    return f"kvflow replay {shlex.quote(path)}{flags} --until {divergence.seq}"
