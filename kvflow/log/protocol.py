"""The ``Log`` protocol: what the manager records its commands and events into.

Three logs implement it: ``NullLog`` and ``MemoryLog`` (``kvflow.log.memory``) and
``TraceWriter`` (``kvflow.log.writer``); an embedding engine may hand the manager its own.
"""

from __future__ import annotations

from typing import Protocol

from kvflow.core.commands import Command
from kvflow.core.events import Event
from kvflow.core.state.model import State


class Log(Protocol):
    """Where the manager records what it decided, command by command.

    For each command that applied an event (or answered a query worth recording), the
    manager calls ``record_command``, then ``record_events`` with the events it applied, then
    ``after_command`` with the state after them (a trace file checkpoints there). ``flush``
    makes what was recorded durable (a serving engine calls it once a step: its process may
    end without a shutdown); ``close`` ends the log, with the final state when there is one.
    """

    def record_command(self, command: Command) -> None: ...

    def record_events(self, events: list[Event]) -> None: ...

    def after_command(self, state: State) -> None: ...

    def flush(self) -> None: ...

    def close(self, state: State | None = None) -> None: ...
