"""Re-deciding a trace: every recorded command and executor outcome runs through today's
``decide``, in step with the recorded events, until the first event that differs (Temporal's
non-determinism check). A trace cut short by a crash ends cleanly at its last complete command.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from kvflow.commands import COMMAND_TYPES
from kvflow.decide import decide
from kvflow.errors import IllegalTransition, KvflowError
from kvflow.events import EVENT_TYPES, Event, event_name
from kvflow.replay_result import Divergence, ReplayResult, apply_event, check_point
from kvflow.state import check_invariants, evolve
from kvflow.trace.format import Checkpoint
from kvflow.trace.reader import TraceReader


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
        if not apply_event(result, line, recorded, False):
            return False
        self.matched += 1
        self._pending = self._next_afterapply_event()
        return True

    def _next_afterapply_event(self) -> Event | None:
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


def redecide(
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
            if not check_point(result, line, rec, reader):
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
