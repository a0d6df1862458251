"""The eviction-policy interface.

A policy is *part of the state*: it is mutated only by ``evolve`` (through ``insert``,
``touch`` and ``remove``) so that folding a log rebuilds it exactly. ``victims`` is a pure
query used by ``decide``. Policies are deterministic: no sets iterated, no clocks, no random.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Policy(Protocol):
    name: str

    def insert(self, block_hash: int) -> None:
        """``block_hash`` became RESIDENT (a store completed). It is the most recent."""

    def touch(self, block_hash: int) -> None:
        """``block_hash`` (resident) was used: it becomes the most recent."""

    def refresh(self, block_hash: int) -> None:
        """Reorder only: ``block_hash`` becomes the most recent without counting as a new
        use (LRU: same as touch; ARC: stays in its list)."""

    def remove(self, block_hash: int) -> None:
        """``block_hash`` left the tier (evicted / reset)."""

    # Bulk forms, one call per event: each must equal the single-hash method applied to
    # every hash in order (the policy tests check it).
    def insert_many(self, hashes: tuple[int, ...]) -> None: ...

    def admit_new_many(self, hashes: tuple[int, ...]) -> None:
        """``insert_many`` of hashes the caller knows to be new to the policy and named once
        (the state's stores): the policy may skip ``insert_many``'s checks."""

    def touch_many(self, hashes: tuple[int, ...]) -> None: ...

    def refresh_many(self, hashes: tuple[int, ...]) -> None: ...

    def remove_many(self, hashes: tuple[int, ...]) -> None: ...

    def victims(self, num_blocks: int, pinned: Callable[[int], bool] | None) -> list[int] | None:
        """The ``num_blocks`` hashes to evict, in eviction order, skipping the ``pinned``
        ones, or ``None`` if fewer than ``num_blocks`` resident hashes are unpinned
        (all-or-nothing, F8). ``pinned=None``: nothing is pinned (no call per hash).
        Does not mutate."""

    def resident(self) -> list[int]:
        """The resident hashes the policy tracks, in a deterministic order."""

    def snapshot(self) -> object:
        """A deterministic, msgspec-encodable picture of the policy state (for digests)."""

    def clear(self) -> None:
        """Forget everything (reset)."""

    def __len__(self) -> int: ...
