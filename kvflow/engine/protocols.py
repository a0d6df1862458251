"""What the engine needs from an executor, and the abilities an executor may have beyond it
(and the one contract of an event subscriber that names its events).

The abilities are structural (``typing.Protocol``): an executor has one by having its members,
without importing the engine (executors and tiers import only ``kvflow.core``). The engine
checks them once, when it is built (:func:`check_executor`): a configuration that needs an
ability its executor lacks is refused there, with one line naming the ability.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvflow.core.commands import JobResult, TierRefused
from kvflow.core.config import Config
from kvflow.core.errors import ConfigError
from kvflow.core.jobs import TransferJob
from kvflow.core.names import BlockName


@runtime_checkable
class Executor(Protocol):
    """What the engine needs from every executor (torch, simulated, or a rank group).

    * ``submit`` accepts jobs (or raises: then none of them was accepted);
    * ``poll`` returns results; **every accepted job gets one result per rank once that
      rank's copy is over** — also after the job timed out in the engine: that late result
      is what lifts the job's fence (F15), so a copy still running never has its memory
      handed out again;
    * ``close`` returns only once no copy can run any more (the engine then ends every
      fence)."""

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any = None) -> None: ...

    def poll(self) -> list[JobResult]: ...

    def close(self) -> None: ...


@runtime_checkable
class OwnsHostPool(Protocol):
    """An executor whose copies address the slots of a host pool. ``host_slots``, how many
    the pool has, must be the config's ``cpu_blocks`` (F11: every slot the decisions hand
    out exists, and no slot goes unused)."""

    @property
    def host_slots(self) -> int: ...


@runtime_checkable
class KnowsBlockBytes(Protocol):
    """An executor that knows how many bytes one block's copy moves (its KV layout's, or its
    transfer model's): the engine's byte counters use it unless told otherwise."""

    @property
    def block_bytes(self) -> int: ...


@runtime_checkable
class KeepsTime(Protocol):
    """An executor whose copies take time on a clock of its own (a simulated one): the engine
    reads that clock unless it is given another, so that deadlines and copies agree."""

    @property
    def clock(self) -> Callable[[], float]: ...


@runtime_checkable
class ProbesRemoteTier(Protocol):
    """An executor beside a remote tier (``kvflow.tiers``): ``probe`` asks the tier, off the
    engine's thread, which of the blocks of these keys it holds (by full name: ``names``, or
    none when every key is its own hash, ``kvflow.core.names.tier_names``); ``take_found``
    hands over the keys of what the probes found since the last call. A config with a remote
    tier (``remote_blocks > 0``) needs it."""

    def probe(self, keys: Sequence[int], names: Sequence[BlockName] = ()) -> None: ...

    def take_found(self) -> list[int]: ...


@runtime_checkable
class ServesDiskTier(Protocol):
    """An executor that runs the disk tier's jobs (``disk_store`` / ``disk_load``):
    ``disk_entries`` lists what the tier held when it was opened, ``(disk slot, block name)``
    pairs its journal vouches for (a warm restart; the engine indexes them when it is built);
    ``disk_problem`` says what is wrong with the tier now (a full or read-only file system, a
    file gone or failing), or None. A config with a disk tier (``disk_blocks > 0``) needs it,
    with exactly ``disk_blocks`` slots."""

    @property
    def disk_slots(self) -> int: ...

    def disk_entries(self) -> list[tuple[int, BlockName]]: ...

    def disk_problem(self) -> str | None: ...


@runtime_checkable
class RefusesEntries(Protocol):
    """An executor beside a shared tier (remote, disk) that proves the entries it reads:
    ``take_refused`` hands over the values it refused since the last call, each value once
    (one ``TierRefused`` per tier; a tier stacked on another hands over both tiers'). The
    engine records them when its executor has the ability: the trace then shows every
    refusal, a probe's included (nothing was loaded, so no job failed)."""

    def take_refused(self) -> list[TierRefused]: ...


def check_executor(config: Config, executor: object) -> None:
    """Refuse (``ConfigError``, one line) an executor that is not one, or that lacks an
    ability ``config`` needs, or whose host pool does not match ``config``."""
    if not isinstance(executor, Executor):
        missing = [name for name in ("submit", "poll", "close") if not hasattr(executor, name)]
        raise ConfigError(f"{type(executor).__name__} is not an executor: it lacks {', '.join(missing)}")
    if isinstance(executor, OwnsHostPool) and executor.host_slots != config.cpu_blocks:
        raise ConfigError(
            f"config cpu_blocks={config.cpu_blocks} but the executor's host pool has {executor.host_slots} "
            "slots: build both from the same number"
        )
    if config.remote and not isinstance(executor, ProbesRemoteTier):
        raise ConfigError(
            f"config remote_blocks={config.remote_blocks} needs an executor that probes a remote tier "
            f"(probe, take_found); {type(executor).__name__} does not: wrap it with kvflow.tiers.redis_store.redis_tier"
        )
    if config.disk:
        if not isinstance(executor, ServesDiskTier):
            raise ConfigError(
                f"config disk_blocks={config.disk_blocks} needs an executor that serves a disk tier "
                f"(disk_slots, disk_entries, disk_problem); {type(executor).__name__} does not: "
                "wrap it with kvflow.tiers.disk_executor.disk_tier"
            )
        if executor.disk_slots != config.disk_blocks:
            raise ConfigError(
                f"config disk_blocks={config.disk_blocks} but the executor's disk tier has {executor.disk_slots} "
                "slots: build both from the same number"
            )


@runtime_checkable
class SelectsEvents(Protocol):
    """A subscriber that names the event types it takes (``OffloadManager.subscribe`` hands it
    only those, keeping the other events free of the call)."""

    @property
    def event_types(self) -> tuple[type, ...]: ...

    def __call__(self, event: Any) -> None: ...
