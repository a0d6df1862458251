"""Executors: what performs the copies that kvflow's decisions ask for.

Importing this package imports no torch: the pure core and the CLI stay usable on machines
without it. ``TorchExecutor``, ``HostPool``, ``KVLayout`` and ``RankGroup`` are loaded on first
use (``from kvflow.executors import TorchExecutor``).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "TorchExecutor": "kvflow.executors.torch_executor",
    "HostPool": "kvflow.executors.host_pool",
    "PoolSpec": "kvflow.executors.host_pool",
    "KVLayout": "kvflow.executors.layout",
    "Region": "kvflow.executors.layout",
    "RankGroup": "kvflow.executors.rank_worker",
    "RandomKV": "kvflow.executors.rank_worker",
    "DeviceTraits": "kvflow.executors.npu",
    "traits_for": "kvflow.executors.npu",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvflow.executors' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
