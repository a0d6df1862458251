"""Re-deciding a trace: every recorded command and executor outcome runs through today's
``decide``, in step with the recorded events, until the first event that differs (Temporal's
non-determinism check). A trace cut short by a crash ends cleanly at its last complete command.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from kvflow.core.commands import COMMAND_TYPES
from kvflow.core.decide.dispatch import decide
from kvflow.core.errors import IllegalTransition, KvflowError
from kvflow.core.events import EVENT_TYPES, Event, event_name
from kvflow.core.state.apply import evolve
from kvflow.core.state.invariants import check_invariants
from kvflow.log.format import Checkpoint
from kvflow.log.reader import TraceReader
from kvflow.replay.result import Divergence, ReplayResult, apply_event, check_point


class _Stop(Exception):
    """Raised by the comparing ``emit`` to end the re-decision: a divergence, a check that
    failed, ``--until`` reached or the end of the trace (``result`` says which)."""


class _UnreadableTrace(Exception):
    """A trace error met while a decision runs: carried past the decider, which would take
    a ``KvflowError`` for its own refusal, and raised again as it was."""

    def __init__(self, error: KvflowError) -> None:
        super().__init__(str(error))
        self.error = error


class _Redecider:
    """Runs each recorded command through ``decide`` with an ``emit`` that reads the next
    recorded event, compares it with the one today's code decided and applies it, so the
    decision goes on against the state the recording reached (Temporal's replayer)."""

    def __init__(
        self,
        result: ReplayResult,
        reader: TraceReader,
        until: int | None,
        strict: bool,
        on_event: Callable[[int, Any], None] | None,
    ) -> None:
        self.result = result
        self.reader = reader
        self.records = reader.records()
        self.until = until
        self.strict = strict
        self.on_event = on_event
        self.command: Any = None
        self.command_line = 0
        self.matched = 0
        self.refused: str | None = None  # why today's code refused the current command
        self.cut_short = False  # the trace ended inside the current command

    def run(self) -> None:
        """Every record in order; stops at the first divergence (``result.divergence``)."""
        result = self.result
        state = result.state
        try:
            for line, rec in self.records:
                if isinstance(rec, Checkpoint):
                    self._checkpoint(line, rec)
                elif isinstance(rec, COMMAND_TYPES):
                    self._command(line, rec)
                elif isinstance(rec, EVENT_TYPES):
                    # an event no decision asked for: before any command, or beyond what
                    # today's code decided for the command before it
                    rec = cast(Event, rec)
                    self._check_until(rec)
                    if self.command is None:
                        result.divergence = Divergence(
                            "redecide", rec.seq, line, "an event appears before any command", recorded=rec
                        )
                    else:
                        self._diverge(line, rec, None)
                    return
        except _Stop:
            pass
        if self.cut_short:
            # a trace cut short (a crash) may end inside a command: its remaining events were
            # never written, which is no divergence; the re-decision ends with the command before
            result.stopped_at = state.last_seq
            result.warnings.append(
                f"{result.path}:{self.command_line}: the trace ends inside this command "
                f"({self.matched} of its events recorded, today's code decides more): "
                "re-decided up to the last complete command before it"
            )

    def _checkpoint(self, line: int, cp: Checkpoint) -> None:
        if not check_point(self.result, line, cp, self.reader):
            raise _Stop

    def _check_until(self, recorded: Event) -> None:
        if self.until is not None and recorded.seq > self.until:
            self.result.stopped_at = self.result.state.last_seq
            raise _Stop

    def _until_reached(self) -> bool:
        """``--until``: the state has reached it (then the re-decision stops there)."""
        if self.until is not None and self.result.state.last_seq >= self.until:
            self.result.stopped_at = self.result.state.last_seq
            return True
        return False

    def _command(self, line: int, command: Any) -> None:
        result = self.result
        state = result.state
        if self._until_reached():
            raise _Stop
        result.commands += 1
        self.command, self.command_line = command, line
        self.matched = 0
        self.refused = None
        try:
            decide(state, command, self._emit)
        except _UnreadableTrace as unreadable:
            raise unreadable.error from None
        except KvflowError as exc:
            self.refused = str(exc)

    def _emit(self, produced: Event) -> None:
        """Today's code decided ``produced``: the trace's next event must be the same."""
        result = self.result
        while True:
            try:
                line, rec = next(self.records)
            except StopIteration:
                break
            except KvflowError as exc:  # (the reader's: a malformed line)
                raise _UnreadableTrace(exc) from exc
            if isinstance(rec, Checkpoint):
                self._checkpoint(line, rec)
                continue
            if isinstance(rec, COMMAND_TYPES):
                # the recorded events of the command are over: ``produced`` is one too many
                if not self._until_reached():
                    result.commands += 1
                    self._diverge(None, None, produced)
                raise _Stop
            if isinstance(rec, EVENT_TYPES):
                recorded = cast(Event, rec)
                self._check_until(recorded)
                if produced != recorded:
                    self._diverge(line, recorded, produced)
                    raise _Stop
                if not apply_event(result, line, recorded, False):
                    raise _Stop
                self.matched += 1
                if self.strict:
                    problems = check_invariants(result.state)
                    if problems:
                        result.divergence = Divergence("invariant", recorded.seq, line, "; ".join(problems[:3]))
                        raise _Stop
                if self.on_event is not None:
                    self.on_event(line, recorded)
                return
        # the trace ends here, inside the command
        if self.reader.complete:
            self._diverge(None, None, produced)
        else:
            self.cut_short = True
        raise _Stop

    def _diverge(self, line: int | None, recorded: Event | None, produced: Event | None) -> None:
        state = self.result.state
        seq = recorded.seq if recorded is not None else (produced.seq if produced is not None else state.next_seq)
        refused = self.refused
        if produced is None:  # (never both None)
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
    _Redecider(result, reader, until, strict, on_event).run()
