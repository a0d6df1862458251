"""Two logs in memory (``kvflow.log.protocol.Log``): ``NullLog`` keeps nothing and ``MemoryLog``
keeps a list (tests, tools, short runs). ``TraceWriter`` (``kvflow.log.writer``) writes a trace
file.
"""

from __future__ import annotations

from typing import cast

from kvflow.core.commands import COMMAND_TYPES, Command
from kvflow.core.config import Config
from kvflow.core.events import EVENT_TYPES, Event
from kvflow.core.state.model import State

__all__ = ["MemoryLog", "NullLog"]


class NullLog:
    """Keeps nothing: what a long-running engine uses when it records no trace (the state is
    the only thing it needs; a retained log would grow without bound)."""

    def record_command(self, command: Command) -> None:
        pass

    def record_events(self, events: list[Event]) -> None:
        pass

    def after_command(self, state: State) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, state: State | None = None) -> None:
        pass


class MemoryLog:
    """Commands and events kept in a list; the default log of a bare OffloadManager (tests,
    tools, short runs). It grows with every event: long-running engines use a trace file or
    NullLog."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.records: list[Command | Event] = []

    def record_command(self, command: Command) -> None:
        self.records.append(command)

    def record_events(self, events: list[Event]) -> None:
        self.records.extend(events)

    def after_command(self, state: State) -> None:
        pass

    def flush(self) -> None:
        pass

    def events(self) -> list[Event]:
        return [cast(Event, r) for r in self.records if isinstance(r, EVENT_TYPES)]

    def commands(self) -> list[Command]:
        return [cast(Command, r) for r in self.records if isinstance(r, COMMAND_TYPES)]

    def close(self, state: State | None = None) -> None:
        pass

