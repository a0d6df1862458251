"""``kvflow simulate``: a Mooncake workload through the real engine, decisions and a simulated
executor on a virtual clock (the rules: docs/simulate.md, "What a simulated request does").

Sequential mode (the default) follows those rules one request at a time, so that an independent
implementation of those rules gets the same numbers (``tests/reference_sim.py`` is one).
Timed mode keeps every decision rule but lets requests arrive at their ``timestamp``, run
concurrently (prefill time from a token rate) and overlap their transfers; it reports load
and store latency percentiles.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvflow.core.config import MAX_DISK_BLOCKS, Config
from kvflow.core.errors import ConfigError
from kvflow.core.values import is_int
from kvflow.engine.notices import StepReport, merge_reports
from kvflow.engine.sync import SyncEngine
from kvflow.executors.simulated import SimulatedExecutor, TransferModel, VirtualClock
from kvflow.simulate.capacity import (
    DEFAULT_CPU_BLOCKS,
    DEFAULT_DISK_BANDWIDTH_GBPS,
    DEFAULT_DISK_LATENCY_US,
    KvGeometry,
    blocks_for_gb,
    kv_geometry,
)
from kvflow.simulate.workload import WorkloadRequest, read_workload

SUMMARY_KEYS = (
    "requests",
    "prompt_tokens",
    "hit_tokens",
    "cpu_hit_tokens",
    "device_hit_tokens",
    "stored_blocks",
    "loaded_blocks",
    "evicted_blocks",
    "failed_jobs",
)


@dataclass
class SimOptions:
    """What one simulation runs with. The CPU tier is sized by ``cpu_blocks`` or by ``cpu_gb``
    (GB of KV cache, rounded down to whole blocks), :data:`DEFAULT_CPU_BLOCKS` when neither is
    given; a block's bytes come from the KV geometry: a known ``model`` (in ``kv_dtype``) or
    ``kv_bytes_per_token``, see :mod:`kvflow.simulate.capacity`."""

    cpu_blocks: int | None = None
    device_blocks: int = 0
    policy: str = "lru"
    store: str = "eager"
    block_tokens: int = 512
    fault_rate: float = 0.0
    seed: int = 0
    mode: str = "sequential"  # or "timed"
    cpu_gb: float | None = None
    model: str | None = None  # a name of kvflow.simulate.capacity.MODELS
    kv_dtype: str | None = None  # with model: bf16 unless told
    kv_bytes_per_token: int | None = None  # instead of model
    bandwidth_gbps: float = 55.5
    latency_us: float = 20.0
    prefill_tokens_per_ms: float = 10.0  # timed mode: prefill speed of the simulated engine
    job_deadline_ms: float = 30_000.0
    hang_jobs: tuple[int, ...] = ()
    record: str | None = None
    remote_blocks: int = 0  # the remote index's capacity (kvflow.simulate.fleet sets it)
    remote_store_mode: str = "write_through"
    # a disk tier below the CPU tier: its size in GB of KV (None or 0: none), its read and
    # write bandwidth and per-job latency, and when blocks go there
    disk_gb: float | None = None
    disk_bandwidth_gbps: float = DEFAULT_DISK_BANDWIDTH_GBPS
    disk_latency_us: float = DEFAULT_DISK_LATENCY_US
    disk_store_mode: str = "ahead_of_eviction"

    def geometry(self) -> KvGeometry:
        return kv_geometry(self.model, self.kv_dtype, self.kv_bytes_per_token)

    @property
    def bytes_per_block(self) -> int:
        """The bytes of one block of ``block_tokens`` tokens, all layers (what a transfer moves)."""
        return self.geometry().bytes_per_block(self.block_tokens)

    def capacity_blocks(self) -> int:
        """The CPU tier's capacity in blocks, from whichever of ``cpu_blocks`` / ``cpu_gb`` was given."""
        if self.cpu_gb is None:
            return DEFAULT_CPU_BLOCKS if self.cpu_blocks is None else self.cpu_blocks
        if self.cpu_blocks is not None:
            raise ConfigError("give the CPU capacity once: --cpu-blocks or --cpu-gb, not both")
        return blocks_for_gb(self.cpu_gb, self.bytes_per_block)

    def disk_blocks(self) -> int:
        """The disk tier's capacity in blocks (0: no disk tier)."""
        return 0 if self.disk_gb is None else blocks_for_gb(self.disk_gb, self.bytes_per_block, "--disk-gb")

    def disk_model(self) -> TransferModel | None:
        """How long a disk job takes (None without a disk tier)."""
        if not self.disk_blocks():
            return None
        return TransferModel(self.bytes_per_block, self.disk_bandwidth_gbps, self.disk_latency_us)

    def validate(self) -> None:
        if self.cpu_blocks is not None and (not is_int(self.cpu_blocks) or self.cpu_blocks < 0):
            raise ConfigError(f"--cpu-blocks must be a whole number >= 0 (0 disables offload), got {self.cpu_blocks!r}")
        if not is_int(self.device_blocks) or self.device_blocks < 0:
            raise ConfigError(f"--device-blocks must be a whole number >= 0, got {self.device_blocks!r}")
        if not is_int(self.block_tokens) or self.block_tokens <= 0:
            raise ConfigError(f"--block-tokens must be a whole number > 0, got {self.block_tokens!r}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ConfigError(f"--fault-rate must be within 0..1, got {self.fault_rate!r}")
        if self.mode not in ("sequential", "timed"):
            raise ConfigError(f"--mode must be sequential or timed, got {self.mode!r}")
        if not math.isfinite(self.prefill_tokens_per_ms) or self.prefill_tokens_per_ms <= 0:
            raise ConfigError(f"--prefill-tokens-per-ms must be a finite number > 0, got {self.prefill_tokens_per_ms}")
        self.capacity_blocks()  # (and the geometry it needs)
        if self.disk_blocks() > MAX_DISK_BLOCKS:
            raise ConfigError(
                f"--disk-gb {self.disk_gb:g} is {self.disk_blocks():,} blocks, more than a disk tier's "
                f"{MAX_DISK_BLOCKS:,}"
            )
        if self.disk_blocks() and not self.capacity_blocks():
            raise ConfigError("--disk-gb needs a CPU tier: blocks reach the disk through it")
        for name, least in (("disk_bandwidth_gbps", "> 0"), ("disk_latency_us", ">= 0")):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not number or value < 0 or (value == 0 and least == "> 0"):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number {least}, got {value!r}")

    def config(self) -> Config:
        return Config(
            cpu_blocks=self.capacity_blocks(),
            block_tokens=self.block_tokens,
            policy=self.policy,
            store_mode=self.store,
            job_deadline_ms=self.job_deadline_ms,
            remote_blocks=self.remote_blocks,
            remote_store_mode=self.remote_store_mode,
            disk_blocks=self.disk_blocks(),
            disk_store_mode=self.disk_store_mode,
        )

    def described(self) -> dict[str, Any]:
        """What the summary's ``config`` says: the options as run, the geometry and the sizes
        derived from it (the CPU tier in blocks and in bytes)."""
        blocks = self.capacity_blocks()
        bytes_per_block = self.bytes_per_block
        return {
            "cpu_blocks": blocks,
            "cpu_gb": self.cpu_gb,
            "cpu_bytes": blocks * bytes_per_block,
            "kv": self.geometry().as_dict(),
            "bytes_per_block": bytes_per_block,
            "device_blocks": self.device_blocks,
            "policy": self.policy,
            "store": self.store,
            "block_tokens": self.block_tokens,
            "fault_rate": self.fault_rate,
            "seed": self.seed,
            **(
                {
                    "disk_blocks": self.disk_blocks(),
                    "disk_gb": self.disk_gb,
                    "disk_bytes": self.disk_blocks() * bytes_per_block,
                    "disk_bandwidth_gbps": self.disk_bandwidth_gbps,
                    "disk_latency_us": self.disk_latency_us,
                    "disk_store_mode": self.disk_store_mode,
                }
                if self.disk_blocks()
                else {}
            ),
        }


class DeviceCache:
    """The device prefix cache of the simulation's rule 1: LRU over hashes, capacity ``M`` (0 holds nothing)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def prefix_hits(self, hashes: tuple[int, ...], cap: int) -> int:
        n = 0
        lru = self._lru
        for h in hashes[:cap]:
            if h not in lru:
                break
            n += 1
        return n

    def use(self, hashes: tuple[int, ...]) -> list[int]:
        """Touch ``hashes`` deepest first (head most recent); return what falls out, LRU first."""
        lru = self._lru
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        evicted: list[int] = []
        while len(lru) > self.capacity:
            evicted.append(lru.popitem(last=False)[0])
        return evicted


@dataclass
class _Totals:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    device_hit_tokens: int = 0
    remote_hit_tokens: int = 0  # of the cpu hits, those the remote tier brought
    disk_hit_tokens: int = 0  # of the cpu hits, those the disk tier brought


class _Ids:
    """Fresh device block ids (the simulated engine never reuses one)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> tuple[int, ...]:
        start = self.next
        self.next += n
        return tuple(range(start, start + n))


class Simulation:
    def __init__(self, options: SimOptions) -> None:
        options.validate()
        self.options = options
        self.config = options.config()
        self.bytes_per_block = options.bytes_per_block
        self.clock = VirtualClock()
        self.executor: Any = self._wrap(
            SimulatedExecutor(
                self.clock,
                TransferModel(self.bytes_per_block, options.bandwidth_gbps, options.latency_us),
                fault_rate=options.fault_rate,
                seed=options.seed,
                hang_jobs=options.hang_jobs,
                disk=options.disk_model(),
                disk_slots=self.config.disk_blocks,
            )
        )
        meta = {
            "tool": "kvflow simulate",
            "mode": options.mode,
            "device_blocks": options.device_blocks,
            "fault_rate": options.fault_rate,
            "seed": options.seed,
            "kv": options.geometry().as_dict(),
            # (the copy model, so that ``kvflow what-if`` reruns the trace as it ran)
            "bandwidth_gbps": options.bandwidth_gbps,
            "latency_us": options.latency_us,
            "prefill_tokens_per_ms": options.prefill_tokens_per_ms,
            **(
                {"disk_bandwidth_gbps": options.disk_bandwidth_gbps, "disk_latency_us": options.disk_latency_us}
                if self.config.disk
                else {}
            ),
        }
        self.engine = SyncEngine(
            self.config,
            self.executor,
            clock=self.clock,
            trace_path=options.record,
            trace_meta=meta,
            bytes_per_block=self.bytes_per_block,
            checkpoint_every=1_000,
        )
        self.device = DeviceCache(options.device_blocks)
        self.ids = _Ids()
        self.totals = _Totals()
        self.lazy = options.store == "lazy"

    def _wrap(self, executor: SimulatedExecutor) -> Any:
        """The executor the engine drives (a fleet instance puts its remote tier beside it)."""
        return executor

    def _request_id(self, req: WorkloadRequest) -> str:
        """The id the engine knows the request by: ``r`` and its line in the workload."""
        return f"r{req.line}"

    def _device_hits(self, req: WorkloadRequest, full: tuple[int, ...], cap: int) -> int:
        """The device hits of rule 1: the longest prefix of ``full`` (at most ``cap`` blocks) in
        the device cache."""
        return self.device.prefix_hits(full, cap)

    # -- sequential ---------------------------------------------------------------------

    def _run_until_idle(self) -> StepReport:
        engine, executor, clock = self.engine, self.executor, self.clock
        merged = engine.step()
        while engine.has_live_jobs():
            due = executor.next_completion_ms()
            if due is None:  # a hung job: jump to the earliest deadline
                due = engine.manager.next_deadline_ms()
            if due is None:  # (cannot happen: step() submitted every queued job)
                break
            clock.advance_to(due)
            merge_reports(merged, engine.step())
        return merged

    def _sequential_request(self, req: WorkloadRequest) -> None:
        B = self.config.block_tokens
        engine = self.engine
        L = req.input_length
        full = req.hash_ids[: L // B]
        cap = max(0, (L - 1) // B)
        rid = self._request_id(req)
        d = self._device_hits(req, full, cap)
        r = self._before_lookup(rid, full, L, d)
        c = engine.lookup(rid, full, L, d)
        if c:
            engine.accept_hits(rid, self.ids.take(c))  # (touches the hits deepest first: rule 2)
            report = self._run_until_idle()
            if report.loads_failed:
                c = r = 0  # a failed load's blocks are computed, not hit
        brought = min(r, c) * B  # (what the hook brought, if hit)
        if self.config.disk:
            self.totals.disk_hit_tokens += brought
        else:
            self.totals.remote_hit_tokens += brought
        if not self.lazy and self.config.enabled and full:
            engine.blocks_computed(rid, full, self.ids.take(len(full)))
            self._run_until_idle()
        engine.finish_request(rid)  # (touches its chain deepest first: rule 4)
        evicted = self.device.use(full)
        if self.lazy and evicted and self.config.enabled:
            engine.device_blocks_evicting(evicted, self.ids.take(len(evicted)))
            self._run_until_idle()
        self._count(L, d, c)

    def _before_lookup(self, rid: str, full: tuple[int, ...], L: int, d: int) -> int:
        """Before the lookup that counts, the request waits for what a lower tier holds past
        its CPU-tier hits: a first lookup queues the disk load of that run, which runs to its
        end (the disk's time is spent), so the lookup that counts hits those blocks on the CPU
        tier. Returns how many of the blocks the CPU tier offers now and did not before the
        disk brought: a disk run may join blocks the CPU tier held to the prefix, and those
        hit on the CPU tier (kvflow.simulate.fleet's instances fetch from their shared remote
        tier here)."""
        if not self.config.disk:
            return 0
        engine = self.engine
        loaded = engine.counters.disk_blocks_loaded
        before = engine.lookup(rid, full, L, d)
        engine.accept_hits(rid, [])
        self._run_until_idle()
        after = engine.lookup(rid, full, L, d)
        engine.accept_hits(rid, [])
        return min(after - before, engine.counters.disk_blocks_loaded - loaded)

    def _count(self, L: int, d: int, c: int) -> None:
        B = self.config.block_tokens
        t = self.totals
        t.requests += 1
        t.prompt_tokens += L
        t.device_hit_tokens += d * B
        t.cpu_hit_tokens += c * B
        t.hit_tokens += (d + c) * B

    def run_sequential(self, requests: Iterable[WorkloadRequest], progress: Callable[[], None] | None = None) -> None:
        for req in requests:
            self._sequential_request(req)
            if progress is not None:
                progress()

    # -- timed ---------------------------------------------------------------------------

    def run_timed(self, requests: Iterable[WorkloadRequest], progress: Callable[[], None] | None = None) -> None:
        """Arrivals at ``timestamp``; prefill takes ``uncached tokens / rate``; transfers
        overlap. Each decision follows the same rules as the sequential mode."""
        engine, clock, executor = self.engine, self.clock, self.executor
        B = self.config.block_tokens
        agenda: list[tuple[float, int, str, Any]] = []
        order = 0
        waiting_load: dict[int, _Live] = {}
        waiting_store: dict[int, _Live] = {}
        waiting_disk: list[_Live] = []  # requests whose next blocks are on their way from disk
        source = iter(requests)
        pending_arrival: WorkloadRequest | None = next(source, None)

        def schedule(at: float, what: str, live: Any) -> None:
            nonlocal order
            order += 1
            heapq.heappush(agenda, (at, order, what, live))

        def start_compute(live: _Live) -> None:
            uncached = live.req.input_length - (live.d + live.c) * B
            schedule(clock.now_ms + uncached / self.options.prefill_tokens_per_ms, "computed", live)

        def look_up(live: _Live) -> None:
            """The lookup that counts: its hits load, or its blocks are computed."""
            live.c = engine.lookup(live.rid, live.full, live.req.input_length, live.d)
            if live.c:
                job = engine.accept_hits(live.rid, self.ids.take(live.c))  # (touches the hits)
                assert job is not None
                waiting_load[job] = live
            else:
                start_compute(live)

        def end(live: _Live) -> None:
            if live.before_disk >= 0 and live.c > live.before_disk:  # (the load landed)
                self.totals.disk_hit_tokens += (live.c - live.before_disk) * B
            engine.finish_request(live.rid)  # (touches its chain deepest first: rule 4)
            evicted = self.device.use(live.full)
            if self.lazy and evicted and self.config.enabled:
                engine.device_blocks_evicting(evicted, self.ids.take(len(evicted)))
            self._count(live.req.input_length, live.d, live.c)
            if progress is not None:
                progress()

        while True:
            # what happens next: an arrival, an agenda item, a transfer completing, a deadline
            candidates = []
            if pending_arrival is not None:
                candidates.append(pending_arrival.timestamp_ms)
            if agenda:
                candidates.append(agenda[0][0])
            due = executor.next_completion_ms()
            if due is not None:
                candidates.append(due)
            elif engine.has_live_jobs():
                deadline = engine.manager.next_deadline_ms()
                if deadline is not None:
                    candidates.append(deadline)
            if not candidates:
                break
            clock.advance_to(min(candidates))
            now = clock.now_ms
            while pending_arrival is not None and pending_arrival.timestamp_ms <= now:
                req = pending_arrival
                pending_arrival = next(source, None)
                live = _Live(req, self._request_id(req), req.hash_ids[: req.input_length // B])
                cap = max(0, (req.input_length - 1) // B)
                live.d = self._device_hits(req, live.full, cap)
                if self.config.disk:
                    # the blocks past its hits that the disk holds come first: it waits for them
                    hits = engine.lookup(live.rid, live.full, req.input_length, live.d)
                    if engine.arriving(live.full, req.input_length, live.d):
                        engine.accept_hits(live.rid, [])
                        live.before_disk = hits
                        waiting_disk.append(live)
                        continue
                    engine.accept_hits(live.rid, [])
                look_up(live)
            while agenda and agenda[0][0] <= now:
                _, _, what, live = heapq.heappop(agenda)
                if what == "computed":
                    job = None
                    if not self.lazy and self.config.enabled and live.full:
                        job = engine.blocks_computed(live.rid, live.full, self.ids.take(len(live.full)))
                    if job is None:
                        end(live)
                    else:
                        waiting_store[job] = live
            report = engine.step()
            if waiting_disk:  # (a disk load landed, failed or timed out: they look up again)
                arrived = [w for w in waiting_disk if not engine.arriving(w.full, w.req.input_length, w.d)]
                for live in arrived:
                    waiting_disk.remove(live)
                    look_up(live)
            for _, job_id in report.loads_finished:
                start_compute(waiting_load.pop(job_id))
            for failure in report.loads_failed:
                live = waiting_load.pop(failure.job_id)
                live.c = 0
                start_compute(live)
            for job_id in report.stores_finished:
                live_s = waiting_store.pop(job_id, None)
                if live_s is not None:
                    end(live_s)
            for job_id, _ in report.stores_failed:
                live_s = waiting_store.pop(job_id, None)
                if live_s is not None:
                    end(live_s)
            if agenda and agenda[0][0] <= clock.now_ms:
                continue
            # submit what the agenda items above queued, at this same instant
            if engine.manager.state.queued:
                engine.step()

    # -- driver --------------------------------------------------------------------------

    def run(self, path: str, progress: Callable[[], None] | None = None) -> dict[str, Any]:
        requests = read_workload(path, self.config.block_tokens)
        try:
            if self.options.mode == "timed":
                self.run_timed(requests, progress)
            else:
                self.run_sequential(requests, progress)
        finally:
            self.engine.close()
        return {"workload": str(path), **self.summary()}

    def summary(self) -> dict[str, Any]:
        t = self.totals
        c = self.engine.counters
        out: dict[str, Any] = {
            "requests": t.requests,
            "prompt_tokens": t.prompt_tokens,
            "hit_tokens": t.hit_tokens,
            "cpu_hit_tokens": t.cpu_hit_tokens,
            "device_hit_tokens": t.device_hit_tokens,
            "stored_blocks": c.blocks_stored,
            "loaded_blocks": c.blocks_loaded,
            "evicted_blocks": c.blocks_evicted,
            "failed_jobs": c.jobs_failed + c.jobs_timed_out,
            "hit_rate": (t.hit_tokens / t.prompt_tokens) if t.prompt_tokens else 0.0,
            "rejected_blocks": c.blocks_rejected,
            "timed_out_jobs": c.jobs_timed_out,
            "jobs": c.jobs_submitted,
            "bytes_stored": c.bytes_stored,
            "bytes_loaded": c.bytes_loaded,
            "events": self.engine.manager.state.last_seq,
            "sim_time_ms": self.clock.now_ms,
            "mode": self.options.mode,
            "config": self.options.described(),
        }
        if self.config.disk:
            busy = self.executor.stats.busy_ms
            out.update(
                hit_tokens_cpu=t.cpu_hit_tokens - t.disk_hit_tokens,
                hit_tokens_disk=t.disk_hit_tokens,
                disk_stored_blocks=c.disk_blocks_stored,
                disk_loaded_blocks=c.disk_blocks_loaded,
                disk_bytes_stored=c.disk_bytes_stored,
                disk_bytes_loaded=c.disk_bytes_loaded,
                disk_store_ms=busy["disk_store"],
                disk_load_ms=busy["disk_load"],
                cpu_store_ms=busy["store"],
                cpu_load_ms=busy["load"],
            )
        if self.options.mode == "timed":
            out.update(self.engine.latencies.summary())
        return out


@dataclass
class _Live:
    req: WorkloadRequest
    rid: str
    full: tuple[int, ...]
    d: int = 0
    c: int = 0
    before_disk: int = -1  # the CPU-tier hits before its disk run came (-1: it waited for none)


def simulate(path: str, options: SimOptions, progress: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run one simulation and return its summary (the ``--json`` object)."""
    return Simulation(options).run(path, progress)


SWEEP_UNITS = {"cpu_blocks": "blocks", "cpu_gb": "GB", "disk_gb": "disk GB"}
"""The three kinds of capacity a sweep takes (the keyword of :func:`sweep`) and the ``unit``
its result names them by."""


def sweep(
    path: str,
    base: SimOptions,
    cpu_blocks: Sequence[int] = (),
    cpu_gb: Sequence[float] = (),
    policies: Sequence[str] = ("lru", "arc"),
    on_run: Callable[[str, float, dict[str, Any]], None] | None = None,
    disk_gb: Sequence[float] = (),
) -> dict[str, Any]:
    """Run ``base`` at each capacity of one kind, under each of ``policies``: its CPU tier at
    each of ``cpu_blocks`` or of ``cpu_gb`` (GB of KV cache), or its disk tier at each of
    ``disk_gb`` (the CPU tier as ``base`` gives it); ``on_run(policy, capacity, summary)``
    after each run. Every capacity and policy is checked before the first run (F11). Returns
    the ``--json`` object of ``kvflow simulate --sweep``: the unit (:data:`SWEEP_UNITS`), the
    capacities, and per policy one summary per capacity."""
    given: dict[str, list[Any]] = {
        kind: list(caps) for kind, caps in (("cpu_blocks", cpu_blocks), ("cpu_gb", cpu_gb), ("disk_gb", disk_gb)) if caps
    }
    if len(given) != 1:
        raise ConfigError(
            "a sweep needs capacities of one kind: CPU blocks (--sweep), CPU GB (--sweep-gb) "
            "or disk GB (--sweep-disk-gb)"
        )
    ((kind, capacities),) = given.items()

    def sized(cap: Any, policy: str) -> SimOptions:
        # a CPU size replaces both of base's CPU sizes (it is given once); a disk size the disk's
        options = replace(base, policy=policy, record=None)
        if kind == "disk_gb":
            return replace(options, disk_gb=cap)
        return replace(options, cpu_blocks=cap if kind == "cpu_blocks" else None, cpu_gb=cap if kind == "cpu_gb" else None)

    runs = {policy: [sized(cap, policy) for cap in capacities] for policy in policies}
    for options in (o for row in runs.values() for o in row):
        options.validate()
        options.config()
    results: dict[str, list[dict[str, Any]]] = {}
    for policy, row in runs.items():
        for cap, options in zip(capacities, row):
            summary = simulate(path, options)
            results.setdefault(policy, []).append(summary)
            if on_run is not None:
                on_run(policy, cap, summary)
    return {
        "workload": str(path),
        "mode": base.mode,
        "unit": SWEEP_UNITS[kind],
        "capacities": capacities,
        "results": results,
    }
