"""What a shared tier refused and has not handed to the engine yet.

A tier's executor notes each value it refuses (once per value: the tier counts and logs it
then too) from its worker threads; the engine's step takes them (``take_refused``, the
``kvflow.engine.protocols.RefusesEntries`` ability) and records them in its trace. Tiers
stack (one executor wraps another), so a tier hands over its own refusals and those of the
tier it wraps.
"""

from __future__ import annotations

import threading
from typing import Any

from kvflow.core.commands import TierRefused
from kvflow.core.jobs import SharedTier

# refusals kept for the engine, at most: beyond, the older half is dropped (they were counted
# and logged already), so an engine that never takes them does not make them grow
KEPT = 100_000


class Refusals:
    """The refusals of one tier (``tier``) not taken yet; safe to add to from any thread."""

    def __init__(self, tier: SharedTier) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._kept: list[tuple[int, str, int]] = []  # (key, reason, job id or 0 for a probe)

    def add(self, refused: list[tuple[int, str, int]]) -> None:
        """``(key, reason, job id)`` of values refused (job id 0: by a probe)."""
        with self._lock:
            if len(self._kept) + len(refused) > KEPT:
                del self._kept[: KEPT // 2]
            self._kept.extend(refused)

    def take(self, inner: Any) -> list[TierRefused]:
        """The wrapped executor ``inner``'s refusals (when it is a tier that refuses), then
        this tier's, as one ``TierRefused`` each; forgotten here."""
        mine: list[tuple[int, str, int]] = []
        if self._kept:  # (the engine asks every step: the lock only when there is something)
            with self._lock:
                mine, self._kept = self._kept, []
        take_inner = getattr(inner, "take_refused", None)
        out: list[TierRefused] = take_inner() if take_inner is not None else []
        if mine:
            keys, reasons, jobs = zip(*mine)
            out.append(TierRefused(tier=self.tier, block_hashes=keys, reasons=reasons, job_ids=jobs))
        return out
