"""``kvflow what-if``: the workload a trace saw, rebuilt from its recorded commands, driven through
the real decision code again under another configuration (the simulation of ``run.py``).

What is rebuilt, from each request's last ``lookup`` (requests in the order they first looked up,
each once it finished): its id, its full blocks' hashes, its prompt tokens and the blocks the
engine's device cache gave it; its arrival time is the engine time recorded last before that
lookup (a ``plan_step`` or ``tick``: traces record no other time). Everything else is
the simulation's: the requests run as ``kvflow simulate`` runs a workload (docs/simulate.md), in
the recorded mode unless told, with the recorded configuration for every option not given.

A trace recorded by ``kvflow simulate`` names its options in its header (its ``meta``), so
the rebuilt workload runs exactly as the original did, and ``what-if`` with a configuration
gives exactly what ``simulate`` gives for that configuration on the original workload. A trace
of an engine (the vLLM connector, an engine embedding ``SyncEngine``) keeps its device hits as
recorded unless ``--device-blocks`` asks for a simulated device cache, runs sequentially
unless told, and its transfers succeed unless ``--fault-rate`` says otherwise (its recorded
failures were the hardware's, which a rerun cannot replay); the geometry is kvflow's default
unless given.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

from kvflow.core.commands import COMMAND_TYPES, FinishRequest, Lookup, PlanStep, Tick
from kvflow.core.config import Config
from kvflow.core.errors import ConfigError
from kvflow.log.reader import TraceReader
from kvflow.simulate.capacity import GB
from kvflow.simulate.run import SimOptions, Simulation
from kvflow.simulate.workload import WorkloadRequest

SIMULATE_TOOL = "kvflow simulate"
"""The ``meta.tool`` of a trace ``kvflow simulate`` recorded."""


class RecordedRequest(WorkloadRequest, frozen=True):
    """A request rebuilt from a trace: ``line`` is its last lookup's line in the trace."""

    request_id: str
    device_hit_blocks: int


def recorded_options(reader: TraceReader) -> tuple[SimOptions, bool]:
    """The simulation options the trace ran with, as far as its header says, and whether its
    device hits were a simulated device cache's (a ``kvflow simulate`` trace) rather than an
    engine's own (kept as recorded)."""
    config: Config = reader.config
    meta = reader.header.meta
    simulated = meta.get("tool") == SIMULATE_TOOL
    recorded_kv = meta.get("kv")
    kv: dict[str, Any] = recorded_kv if isinstance(recorded_kv, dict) else {}
    model = kv.get("model") if kv.get("source") == "model" else None
    options = SimOptions(
        cpu_blocks=config.cpu_blocks,
        block_tokens=config.block_tokens,
        policy=config.policy,
        store=config.store_mode,
        job_deadline_ms=config.job_deadline_ms,
        disk_store_mode=config.disk_store_mode,
        model=model,
        kv_dtype=kv.get("kv_dtype") if model is not None else None,
        kv_bytes_per_token=kv.get("bytes_per_token") if kv.get("source") == "kv_bytes_per_token" else None,
    )
    if simulated:
        known = {f.name for f in fields(SimOptions)}
        given = {k: meta[k] for k in ("mode", "device_blocks", "fault_rate", "seed", "bandwidth_gbps", "latency_us",
                                      "prefill_tokens_per_ms", "disk_bandwidth_gbps", "disk_latency_us")
                 if k in meta and k in known}
        options = replace(options, **given)
    if config.disk_blocks:  # (GB that round down to the recorded blocks: the tier as it was)
        options = replace(options, disk_gb=config.disk_blocks * options.bytes_per_block / GB)
    return options, simulated


def with_changes(recorded: SimOptions, changes: dict[str, Any]) -> SimOptions:
    """The recorded options with those given (``changes``: SimOptions fields, None for not
    given). A size given once replaces the recorded one in whatever unit (``cpu_blocks`` or
    ``cpu_gb``), a geometry given replaces the recorded one."""
    given = {k: v for k, v in changes.items() if v is not None}
    unknown = set(given) - {f.name for f in fields(SimOptions)}
    if unknown:
        raise ConfigError(f"what-if: unknown options {sorted(unknown)}")
    if "cpu_blocks" in given or "cpu_gb" in given:
        recorded = replace(recorded, cpu_blocks=None, cpu_gb=None)
    if "model" in given or "kv_bytes_per_token" in given:
        recorded = replace(recorded, model=None, kv_dtype=None, kv_bytes_per_token=None)
    if recorded.disk_gb is not None and ("disk_gb" not in given) and ({"model", "kv_bytes_per_token"} & set(given)):
        # the disk keeps its blocks, whatever a block now weighs
        blocks = round(recorded.disk_gb * GB) // recorded.bytes_per_block
        given["disk_gb"] = blocks * replace(recorded, **given).bytes_per_block / GB
    options = replace(recorded, **given)
    disk_model = [k for k in ("disk_bandwidth_gbps", "disk_latency_us", "disk_store_mode") if k in given]
    if disk_model and not options.disk_gb:
        flag = "--" + disk_model[0].replace("_mode", "").replace("_", "-")
        raise ConfigError(f"{flag} applies to a disk tier: give --disk-gb (the trace was recorded without one)")
    return options


def recorded_workload(path: str | os.PathLike[str]) -> Iterator[RecordedRequest]:
    """The requests of the trace at ``path``, rebuilt from their last lookup, in the order they
    first looked up, each once it finished (or at the end of the trace). Streams: it holds only
    the requests that have looked up and not finished, and those behind the oldest of them."""
    with TraceReader(path) as reader:
        now_ms = 0.0
        # first-lookup order (None: still live); an OrderedDict finds its first entry at once,
        # where a dict emptied from the front scans every slot it has freed
        waiting: OrderedDict[str, RecordedRequest | None] = OrderedDict()
        latest: dict[str, RecordedRequest] = {}
        for line, rec in reader.records():
            kind = type(rec)
            if kind not in COMMAND_TYPES:
                continue
            if kind is PlanStep or kind is Tick:
                now_ms = max(now_ms, rec.now_ms)
            elif kind is Lookup:
                rid = rec.request_id
                finished = waiting.get(rid)
                if finished is not None:  # finished, and looked up again: a new request of that id
                    yield from _ready(waiting)
                    if rid in waiting:  # (behind an older request still live: it goes first)
                        del waiting[rid]
                        yield finished
                latest[rid] = RecordedRequest(
                    line, now_ms, rec.num_tokens, 0, rec.block_hashes, rid, rec.device_hit_blocks
                )
                waiting.setdefault(rid, None)
            elif kind is FinishRequest and not rec.preempted and rec.request_id in latest:
                waiting[rec.request_id] = latest.pop(rec.request_id)
                yield from _ready(waiting)
        for rid in waiting:
            req = waiting[rid] if waiting[rid] is not None else latest.get(rid)
            if req is not None:
                yield req


def _ready(waiting: OrderedDict[str, RecordedRequest | None]) -> Iterator[RecordedRequest]:
    """The finished requests at the head of ``waiting`` (in first-lookup order)."""
    while waiting:
        rid = next(iter(waiting))
        req = waiting[rid]
        if req is None:
            return
        del waiting[rid]
        yield req


class WhatIf(Simulation):
    """The simulation of a rebuilt workload: requests keep their recorded ids, and, unless a
    device cache is simulated, their recorded device hits."""

    def __init__(self, options: SimOptions, recorded_device: bool) -> None:
        super().__init__(options)
        self.recorded_device = recorded_device

    def _request_id(self, req: WorkloadRequest) -> str:
        return req.request_id if isinstance(req, RecordedRequest) else super()._request_id(req)

    def _device_hits(self, req: WorkloadRequest, full: tuple[int, ...], cap: int) -> int:
        if self.recorded_device and isinstance(req, RecordedRequest):
            return min(req.device_hit_blocks, len(full))
        return super()._device_hits(req, full, cap)


def what_if(path: str | os.PathLike[str], changes: dict[str, Any], record: str | None = None) -> dict[str, Any]:
    """Rerun the workload of the trace at ``path`` with the recorded options changed by
    ``changes`` (SimOptions fields; None: as recorded), recording the rerun at ``record``.
    Returns the simulation's summary (``kvflow simulate --json``'s keys) with ``trace`` and
    ``device_hits`` ("simulated" or "as recorded")."""
    if record is not None and os.path.exists(record) and os.path.samefile(record, path):
        raise ConfigError(f"--record {record} is the trace being rerun: write the rerun elsewhere")
    with TraceReader(path) as reader:
        recorded, simulated = recorded_options(reader)
    options = replace(with_changes(recorded, changes), record=record)
    recorded_device = not simulated and changes.get("device_blocks") is None
    sim = WhatIf(options, recorded_device)
    requests = recorded_workload(path)
    try:
        if options.mode == "timed":
            sim.run_timed(requests)
        else:
            sim.run_sequential(requests)
    finally:
        sim.engine.close()
    return {"trace": str(path), **sim.summary(), "device_hits": "as recorded" if recorded_device else "simulated"}
