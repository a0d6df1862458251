"""kvflow: an event-sourced KV-cache offload engine between accelerator and host memory.

This module is kvflow's public face: what an embedding engine needs is importable from here
(``from kvflow import SyncEngine, Config``), and so is ``Policy``, the base class of an
eviction policy of one's own. Names load on first use, so ``import kvflow`` imports neither
torch nor the engine until they are asked for. Executors have their own face,
``kvflow.executors``.

The rooms (each folder's ``__init__`` says what it holds and what it may import):
``core`` (pure: commands, events, state machine, decisions, policies), ``log`` (in-memory logs
and trace files), ``engine`` (the step loop and its façades), ``executors``, ``tiers``,
``integrations``, ``replay``, ``inspect``, ``simulate`` and ``cli``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvflow._version import __version__

if TYPE_CHECKING:
    from kvflow.core.commands import JobResult
    from kvflow.core.config import Config
    from kvflow.core.errors import (
        BlockHeld,
        ConcurrentCall,
        ConfigError,
        EngineClosed,
        IllegalTransition,
        KvflowError,
        PolicyError,
        Rejected,
        TraceError,
        TransferError,
        UnknownJob,
        UnknownRequest,
    )
    from kvflow.core.jobs import TransferJob
    from kvflow.core.policies.base import Policy
    from kvflow.engine.async_engine import Engine
    from kvflow.engine.notices import Fence, LoadFailure, Notices, StepReport
    from kvflow.engine.protocols import Executor
    from kvflow.engine.sync import SyncEngine

_PUBLIC = {
    "SyncEngine": "kvflow.engine.sync",
    "Engine": "kvflow.engine.async_engine",
    "Config": "kvflow.core.config",
    "StepReport": "kvflow.engine.notices",
    "Executor": "kvflow.engine.protocols",
    "Notices": "kvflow.engine.notices",
    "LoadFailure": "kvflow.engine.notices",
    "Fence": "kvflow.engine.notices",
    "TransferJob": "kvflow.core.jobs",
    "JobResult": "kvflow.core.commands",
    "Policy": "kvflow.core.policies.base",
    **{
        name: "kvflow.core.errors"
        for name in (
            "KvflowError",
            "ConfigError",
            "IllegalTransition",
            "Rejected",
            "UnknownJob",
            "UnknownRequest",
            "BlockHeld",
            "EngineClosed",
            "ConcurrentCall",
            "TraceError",
            "TransferError",
            "PolicyError",
        )
    },
}

__all__ = [
    "__version__",
    "SyncEngine",
    "Engine",
    "Config",
    "StepReport",
    "Executor",
    "Notices",
    "LoadFailure",
    "Fence",
    "TransferJob",
    "JobResult",
    "Policy",
    "KvflowError",
    "ConfigError",
    "IllegalTransition",
    "Rejected",
    "UnknownJob",
    "UnknownRequest",
    "BlockHeld",
    "EngineClosed",
    "ConcurrentCall",
    "TraceError",
    "TransferError",
    "PolicyError",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
