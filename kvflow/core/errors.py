"""Errors raised by kvflow. Every one has a one-line message meant for a person."""

from __future__ import annotations


class KvflowError(Exception):
    """Base class of every error kvflow raises on purpose."""


class ConfigError(KvflowError, ValueError):
    """A configuration value is invalid (F11)."""


class IllegalTransition(KvflowError):
    """An event is not legal in the current state; the state is unchanged.

    Sticky only for the event that raised: the state itself stays usable, because nothing
    was applied.
    """

    def __init__(self, state: str, event: str, detail: str = "") -> None:
        self.state = state
        self.event = event
        self.detail = detail
        msg = f"illegal transition: event {event} in state {state}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class Rejected(KvflowError):
    """A command was refused by the decision code (F12); nothing was appended."""


class UnknownJob(Rejected):
    """A result or wait named a job id kvflow never issued."""


class UnknownRequest(Rejected):
    """A command named a request kvflow does not know."""


class BlockHeld(Rejected):
    """A device block named by the engine is still held by a live transfer job."""


class EngineClosed(Rejected):
    """A call after ``close()``: the log is closed, so nothing could be recorded."""


class ConcurrentCall(Rejected):
    """A call while another is being decided (a second thread): kvflow's decisions run on one
    thread at a time; the call is refused rather than interleaved into the state and trace."""


class TraceError(KvflowError):
    """A trace or workload file cannot be read; the message names file, line and field."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")


class PolicyError(KvflowError):
    """An eviction policy answered wrongly (a victim that is pinned, not resident, named
    twice, ...) or raised; the message names the policy and what was wrong. A wrong answer is
    refused before any block is evicted (``kvflow.core.decide.victims``)."""


class TransferError(KvflowError):
    """An executor could not perform a copy (becomes a failed outcome, never escapes)."""


def one_line(e: BaseException) -> str:
    """A foreign exception as ``Type: first line of its message``: how the executors quote a
    torch or numpy error inside a failed job's error (a result's error is one line)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
