"""The host slots a lower tier reads and writes: each slot's pages in the executor's host pool,
as memoryviews, so the tier's copies need no torch (the pool is shared with the device copies)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


class HostPoolPages(Protocol):
    """What the remote tier reads of a host pool (``kvflow.executors.torch.host_pool.HostPool``)."""

    @property
    def enabled(self) -> bool: ...

    @property
    def page_bytes(self) -> tuple[int, ...]: ...

    def region(self, index: int) -> Any: ...


@runtime_checkable
class OwnsPool(Protocol):
    """An executor with a host pool (the torch executor): what the lower tiers are built on.
    ``kv_dtype`` names the KV's element type(s): entries of another are never read."""

    @property
    def pool(self) -> HostPoolPages: ...

    @property
    def kv_dtype(self) -> str: ...


class SlotPages:
    """Each host slot's pages (one per region of the pool), read and written in place.
    ``regions[r]`` is a ``[slots, page_bytes[r]]`` uint8 array: row ``s`` is slot ``s``."""

    def __init__(self, regions: Sequence[np.ndarray]) -> None:
        self.regions = list(regions)
        self.page_bytes = tuple(int(r.shape[1]) for r in self.regions)
        self.cpu_blocks = int(self.regions[0].shape[0]) if self.regions else 0

    @classmethod
    def of_pool(cls, pool: HostPoolPages) -> SlotPages:
        """The slots of a ``HostPool`` (kvflow.executors.torch.host_pool)."""
        return cls([pool.region(r).numpy() for r in range(len(pool.page_bytes))])

    def read(self, slot: int) -> list[memoryview]:
        return [r[slot].data for r in self.regions]

    def write(self, slot: int, payload: memoryview) -> None:
        at = 0
        for region, pb in zip(self.regions, self.page_bytes):
            region[slot] = np.frombuffer(payload, np.uint8, count=pb, offset=at)
            at += pb
