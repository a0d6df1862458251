"""The event log: what the manager records its commands and events into.

Three kinds: ``NullLog`` keeps nothing, ``MemoryLog`` keeps a list (tests, tools, short runs),
and ``TraceWriter`` writes a trace file (``kvflow.log``: its format, writer and reader). The
trace names are re-exported here, where the engine and the tools have always found them.
"""

from __future__ import annotations

from typing import Any, cast

from kvflow.core.commands import COMMAND_TYPES, Command
from kvflow.core.config import Config
from kvflow.core.events import EVENT_TYPES, Event

__all__ = ["MemoryLog", "NullLog"]


class NullLog:
    """Keeps nothing: what a long-running engine uses when it records no trace (the state is
    the only thing it needs; a retained log would grow without bound)."""

    def record_command(self, command: Command) -> None:
        pass

    def record_events(self, events: list[Event]) -> None:
        pass

    def after_command(self, state: Any) -> None:
        pass

    def close(self, state: Any = None) -> None:
        pass


class MemoryLog:
    """Commands and events kept in a list; the default log of a bare OffloadManager (tests,
    tools, short runs). It grows with every event: long-running engines use a trace file or
    NullLog."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.records: list[Any] = []

    def record_command(self, command: Command) -> None:
        self.records.append(command)

    def record_events(self, events: list[Event]) -> None:
        self.records.extend(events)

    def after_command(self, state: Any) -> None:
        pass

    def events(self) -> list[Event]:
        return [cast(Event, r) for r in self.records if isinstance(r, EVENT_TYPES)]

    def commands(self) -> list[Command]:
        return [cast(Command, r) for r in self.records if isinstance(r, COMMAND_TYPES)]

    def close(self, state: Any = None) -> None:
        pass

