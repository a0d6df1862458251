"""Configuration: everything the decisions depend on, validated up front (F11)."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from kvflow.core.errors import ConfigError
from kvflow.core.values import is_int

STORE_MODES = ("eager", "lazy")
# When blocks go to the remote tier: as soon as their CPU-tier store completes (write-through),
# or when they come near eviction from the CPU tier (ahead of eviction: the policy's coldest)
REMOTE_STORE_MODES = ("write_through", "ahead_of_eviction")
# The most remote-tier hashes a state remembers (its remote index costs ~100 bytes a hash)
MAX_REMOTE_BLOCKS = 1 << 26
# When blocks go to the disk tier: when they come near eviction from the CPU tier (spill: the
# policy's coldest, before their slot is reused), or as soon as their CPU-tier store completes
DISK_STORE_MODES = ("ahead_of_eviction", "write_through")
# The most disk-tier entries (a 30 TB disk holds about 15 M blocks of 2 MiB)
MAX_DISK_BLOCKS = 1 << 28
# Rank acknowledgements are kept as a bit mask that traces record as a 64-bit integer.
MAX_WORLD_SIZE = 64


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """Decision configuration. Recorded in every trace header; replay uses it verbatim.

    ``cpu_blocks`` is the CPU tier's capacity in blocks; ``0`` disables offload.
    ``block_tokens`` is the number of tokens per KV block. ``job_deadline_ms`` bounds how
    long a submitted job may stay in flight before it times out (F2).
    ``policy`` is the eviction policy: ``"lru"``, ``"arc"``, or a class of one's own named
    ``"package.module:ClassName"`` (a subclass of ``kvflow.Policy``; see docs/policies.md).

    ``remote_blocks`` turns on the remote tier behind the CPU tier (``kvflow.tiers``): the
    most remote hashes kvflow remembers (oldest forgotten first); ``0``: no remote tier.
    ``remote_store_mode`` says when blocks are copied there.
    ``disk_blocks`` turns on the disk tier behind the CPU tier (``kvflow.tiers.disk_executor``):
    its capacity in blocks, whose slots kvflow assigns (the least recently used entry goes
    first); ``0``: no disk tier. ``disk_store_mode`` says when blocks are copied there.
    ``chain_recency`` (a logic flag): kvflow keeps each request's chain (the full-block
    hashes its lookups and stores name, in prefix order) and applies the chain's recency
    itself (F14; docs/simulate.md, rules 2 and 4): ``accept_hits`` touches the hits it loads deepest
    first, ``finish_request`` touches the chain's blocks on the tier deepest first with
    ``reuse=False``. Off, recency comes only from the engine's ``touch`` calls (how traces
    recorded before the flag existed were decided: their headers lack it and read as off).
    """

    cpu_blocks: int
    block_tokens: int = 16
    policy: str = "lru"
    store_mode: str = "eager"
    world_size: int = 1
    job_deadline_ms: float = 30_000.0
    remote_blocks: int = 0
    remote_store_mode: str = "write_through"
    chain_recency: bool = True
    disk_blocks: int = 0
    disk_store_mode: str = "ahead_of_eviction"

    def __post_init__(self) -> None:
        validate_config(self)

    @property
    def enabled(self) -> bool:
        return self.cpu_blocks > 0

    @property
    def remote(self) -> bool:
        return self.remote_blocks > 0

    @property
    def disk(self) -> bool:
        return self.disk_blocks > 0

    def to_dict(self) -> dict[str, Any]:
        out = msgspec.structs.asdict(self)
        if not self.remote:  # (traces without a remote tier keep the header they always had)
            del out["remote_blocks"], out["remote_store_mode"]
        if not self.disk:
            del out["disk_blocks"], out["disk_store_mode"]
        return out


# The largest tier a Config may name (2**32 slots). A state costs per entry, not per slot (the
# never-used free slots are a range: kvflow.core.state.slots), so only what is stored costs
# memory; trace readers build their Config from the header, so they refuse a larger one too.
MAX_CPU_BLOCKS = 1 << 32


def validate_config(config: Config) -> None:
    """Raise ConfigError with a one-line message for the first bad field."""
    from kvflow.core.policies.registry import policy_class  # late: policies import nothing heavy

    if not is_int(config.cpu_blocks) or config.cpu_blocks < 0:
        raise ConfigError(
            f"cpu_blocks must be a whole number >= 0 (0 disables offload), got {config.cpu_blocks!r}"
        )
    if config.cpu_blocks > MAX_CPU_BLOCKS:  # (what a trace reader accepts: the same bound)
        raise ConfigError(f"cpu_blocks must be at most {MAX_CPU_BLOCKS:,}, got {config.cpu_blocks:,}")
    if not is_int(config.block_tokens) or config.block_tokens <= 0:
        raise ConfigError(f"block_tokens must be a whole number > 0, got {config.block_tokens!r}")
    policy_class(config.policy)  # a built-in's name, or a class of one's own ("module:Class")
    if config.store_mode not in STORE_MODES:
        raise ConfigError(
            f"store_mode must be one of {', '.join(STORE_MODES)}, got {config.store_mode!r}"
        )
    if not is_int(config.world_size) or not 1 <= config.world_size <= MAX_WORLD_SIZE:
        raise ConfigError(
            f"world_size must be a whole number within 1..{MAX_WORLD_SIZE}, got {config.world_size!r}"
        )
    deadline = config.job_deadline_ms
    if (
        isinstance(deadline, bool)
        or not isinstance(deadline, (int, float))
        or not math.isfinite(deadline)
        or deadline <= 0
    ):
        raise ConfigError(f"job_deadline_ms must be a finite number > 0, got {deadline!r}")
    if not is_int(config.remote_blocks) or not 0 <= config.remote_blocks <= MAX_REMOTE_BLOCKS:
        raise ConfigError(
            f"remote_blocks must be a whole number within 0..{MAX_REMOTE_BLOCKS:,} "
            f"(0: no remote tier), got {config.remote_blocks!r}"
        )
    if config.remote_store_mode not in REMOTE_STORE_MODES:
        raise ConfigError(
            f"remote_store_mode must be one of {', '.join(REMOTE_STORE_MODES)}, "
            f"got {config.remote_store_mode!r}"
        )
    if not is_int(config.disk_blocks) or not 0 <= config.disk_blocks <= MAX_DISK_BLOCKS:
        raise ConfigError(
            f"disk_blocks must be a whole number within 0..{MAX_DISK_BLOCKS:,} "
            f"(0: no disk tier), got {config.disk_blocks!r}"
        )
    if config.disk_store_mode not in DISK_STORE_MODES:
        raise ConfigError(
            f"disk_store_mode must be one of {', '.join(DISK_STORE_MODES)}, "
            f"got {config.disk_store_mode!r}"
        )
    if type(config.chain_recency) is not bool:
        raise ConfigError(f"chain_recency must be true or false, got {config.chain_recency!r}")


# Logic flags added after traces were first recorded, with the value that decided those
# traces: a trace header without the flag reads as that value, so the trace re-decides exactly
# as it was recorded.
FLAGS_BEFORE_THEY_EXISTED: dict[str, Any] = {"chain_recency": False}


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build a Config from a trace header, with one-line errors; a logic flag the header
    lacks reads as the value that decided traces recorded before it existed."""
    try:
        return msgspec.convert({**FLAGS_BEFORE_THEY_EXISTED, **data}, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}") from None
