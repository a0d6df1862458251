"""What a replay finds: the result, the first divergence, and the checks a fold and a re-decision
share (a checkpoint's digests and invariants, one event applied)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.core.errors import IllegalTransition
from kvflow.core.events import Event
from kvflow.core.state.apply import evolve
from kvflow.core.state.invariants import check_invariants
from kvflow.core.state.model import State
from kvflow.log.format import Checkpoint
from kvflow.log.reader import TraceReader


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
    checked_seq: int | None = None  # the seq of the last checkpoint whose checks all passed

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


def check_point(result: ReplayResult, line: int, cp: Checkpoint, reader: TraceReader) -> bool:
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
    result.checked_seq = cp.seq
    return True


def apply_event(result: ReplayResult, line: int, event: Event, strict: bool) -> bool:
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
