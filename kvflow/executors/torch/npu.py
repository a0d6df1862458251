"""The few places where devices differ, decided from the device-type string alone.

The executor has one code path over ``torch.Stream`` / ``torch.Event``; this module says what
to ask of each device. Ascend NPUs (torch-npu registers ``npu`` as the PrivateUse1 backend) differ
from CUDA in three ways that matter here:

* **no stream priorities**: ``torch.npu.Stream`` takes no priority, so streams are created
  without the keyword (CUDA: priority 0, the *lowest* CUDA priority, so copies yield to compute);
* **memory statistics** are not reachable through ``torch.accelerator`` on every torch-npu
  version: they are read from ``torch.npu``;
* **task queue**: with ``TASK_QUEUE_ENABLE`` on (torch-npu's default), kernels and event records
  are queued on the host and dispatched later by a torch-npu thread, so ``event.query()`` reads
  False until the record is dispatched even when the copy is long finished. A poll must
  therefore never treat "not yet" as a failure: a poll that finds an event pending leaves the
  batch for a later poll, and a blocking wait sleeps in ``event.synchronize()``.

CUDA batch events are created with the blocking-sync flag: a blocking ``wait`` sleeps in the
driver, without the GIL, until the copy is done (without the flag ``synchronize()`` spins a
core). ``poll`` only queries them, from the caller's own thread.

Everything here is a pure decision from strings and an environment mapping, so it is tested on
CPU with fake device types; nothing imports torch-npu.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

WaitMode = Literal["inline", "query", "synchronize", "blocking"]
PinStrategy = Literal["none", "cuda_host_register", "pin_memory"]
StatsSource = Literal["none", "torch.accelerator", "torch.npu"]


@dataclass(frozen=True)
class DeviceTraits:
    """What the executor asks of one device type."""

    device_type: str
    has_streams: bool  # False: copies run synchronously in the caller (CPU device)
    stream_priority: int | None  # None: create streams without a priority argument
    wait_mode: WaitMode  # how a blocking wait waits for a submission's event
    pin_strategy: PinStrategy  # how the host pool is page-locked
    memory_stats: StatsSource
    task_queue: bool  # NPU host-side task queue on: event.query() lags dispatch


def task_queue_enabled(environ: Mapping[str, str]) -> bool:
    """torch-npu's task queue is on unless ``TASK_QUEUE_ENABLE`` is ``0`` (levels 1, 2: on)."""
    return environ.get("TASK_QUEUE_ENABLE", "1").strip() not in ("0", "")


def traits_for(device_type: str, environ: Mapping[str, str] | None = None) -> DeviceTraits:
    """The decisions for ``device_type`` (``cpu``, ``cuda``, ``npu`` or another accelerator)."""
    env = os.environ if environ is None else environ
    if device_type in ("cpu", "meta"):
        return DeviceTraits(device_type, False, None, "inline", "none", "none", False)
    if device_type == "cuda":
        return DeviceTraits(
            device_type, True, 0, "blocking", "cuda_host_register", "torch.accelerator", False
        )
    if device_type == "npu":
        tq = task_queue_enabled(env)
        return DeviceTraits(
            device_type, True, None, "synchronize" if tq else "query", "pin_memory", "torch.npu", tq
        )
    # Other accelerators (xpu, other PrivateUse1 backends): the most conservative choices.
    return DeviceTraits(
        device_type, True, None, "synchronize", "pin_memory", "torch.accelerator", False
    )


def stream_kwargs(traits: DeviceTraits) -> dict[str, Any]:
    """Keyword arguments for ``torch.Stream`` on this device (no ``priority`` on NPU)."""
    return {} if traits.stream_priority is None else {"priority": traits.stream_priority}


def event_state(traits: DeviceTraits, queried: bool) -> Literal["done", "pending"]:
    """What a False ``event.query()`` means: only ever "pending", never a failure.

    Under the NPU task queue a False answer can also mean "not dispatched yet"; either way the
    batch stays in flight (a poll asks again later), and only a raised error fails a job.
    """
    del traits  # same answer everywhere; kept so the rule is stated (and tested) in one place
    return "done" if queried else "pending"


def memory_stats(torch_module: Any, device: Any, traits: DeviceTraits) -> dict[str, Any]:
    """The device allocator's statistics, from where this device type exposes them."""
    if traits.memory_stats == "none":
        return {}
    if traits.memory_stats == "torch.npu":
        npu = getattr(torch_module, "npu", None)
        return dict(npu.memory_stats(device)) if npu is not None else {}
    acc = getattr(torch_module, "accelerator", None)
    if acc is not None and hasattr(acc, "memory_stats"):
        return dict(acc.memory_stats(device))
    backend = getattr(torch_module, traits.device_type, None)
    if backend is not None and hasattr(backend, "memory_stats"):
        return dict(backend.memory_stats(device))
    return {}
