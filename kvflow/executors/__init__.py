"""Executors: what performs the copies that kvflow's decisions ask for.

- ``simulated``: ``SimulatedExecutor``, copies as time on a virtual clock (simulation, tests);
- ``torch/``: ``TorchExecutor`` over real KV tensors on a CUDA, NPU or CPU device, its host
  pool, KV layout, copy paths and rank workers.

This package is also the face users import executors from: ``from kvflow.executors import
TorchExecutor`` loads torch on first use only, so the core and the CLI stay usable without it.

May import: ``kvflow.core``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "SimulatedExecutor": "kvflow.executors.simulated",
    "VirtualClock": "kvflow.executors.simulated",
    "TorchExecutor": "kvflow.executors.torch.executor",
    "HostPool": "kvflow.executors.torch.host_pool",
    "PoolSpec": "kvflow.executors.torch.host_pool",
    "KVLayout": "kvflow.executors.torch.layout",
    "Region": "kvflow.executors.torch.layout",
    "RankGroup": "kvflow.executors.torch.ranks",
    "RandomKV": "kvflow.executors.torch.ranks",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvflow.executors' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
