"""Streams, events and pinned staging for the torch executor, one code path for every device.

Only ``torch.Stream`` / ``torch.Event`` are used, never ``torch.cuda``: the per-device decisions
(stream priority, how to wait for an event, whether to pin) come from ``DeviceTraits``
(``kvflow.executors.torch.npu``). On CPU there are no streams (``None``): copies are synchronous, so
every helper here accepts ``None`` and does the synchronous thing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from kvflow.executors.torch import npu as adapter
from kvflow.executors.torch.npu import DeviceTraits


def new_stream(device: torch.device, traits: DeviceTraits) -> Any | None:
    """A side stream for one direction's copies (None where the device has no streams)."""
    if not traits.has_streams:
        return None
    return torch.Stream(device=device, **adapter.stream_kwargs(traits))


@contextlib.contextmanager
def on_stream(stream: Any | None, device: torch.device) -> Iterator[None]:
    """Make ``stream`` current, so staging memory is allocated on it (stream-ordered reuse)."""
    if stream is None:
        yield
        return
    if hasattr(stream, "__enter__"):
        with stream:
            yield
        return
    previous = torch.accelerator.current_stream(device)  # torch without Stream.__enter__
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


def wait_for(stream: Any | None, event: Any | None) -> None:
    """Order the copies after the engine's compute (F9) or after another batch."""
    if event is None:
        return
    if stream is None:
        # Without streams (the CPU device) the copy runs now, so it waits here; a wait that
        # raises fails the batch (the caller's except) rather than copying unordered (F9).
        sync = getattr(event, "synchronize", None)
        if sync is not None:
            sync()
        return
    try:
        stream.wait_event(event)
    except TypeError:
        event.wait(stream)


def record_event(stream: Any | None, device: torch.device, *, blocking: bool = False) -> Any | None:
    """An event marking everything enqueued on ``stream`` so far (None without streams);
    ``blocking``: a host thread that synchronizes on it sleeps instead of spinning."""
    if stream is None:
        return None
    event = torch.Event(device=device, blocking=True) if blocking else torch.Event(device=device)
    event.record(stream)
    return event


def compute_done_event(device: torch.device) -> Any | None:
    """An event marking everything enqueued so far on ``device``'s current (compute) stream,
    for copies that must read what it computed (None on the CPU: the work is done already)."""
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event


def event_over(event: Any | None, traits: DeviceTraits) -> bool:
    """Whether ``event`` has happened, without waiting (None: the work is done already); a
    pending answer is never a failure (``adapter.event_state``)."""
    if event is None:
        return True
    return adapter.event_state(traits, bool(event.query())) == "done"


def wait_event(event: Any | None, traits: DeviceTraits) -> None:
    """Block the calling thread until ``event`` has happened, the device's way."""
    if event is None:
        return
    if traits.wait_mode in ("synchronize", "blocking"):
        event.synchronize()
        return
    delay = 20e-6
    while not event_over(event, traits):
        time.sleep(delay)
        delay = min(delay * 2, 200e-6)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, traits: DeviceTraits) -> torch.Tensor:
    """Host staging memory, pinned where the device copies asynchronously from pinned memory."""
    pin = traits.has_streams and traits.pin_strategy != "none"
    return torch.empty(shape, dtype=dtype, pin_memory=pin)
