"""The torch executor: batched KV page copies between a device KV cache and the host pool.

One code path for CUDA, Ascend NPU and the CPU device, over ``torch.Stream`` / ``torch.Event``
(``kvflow.executors.npu`` holds the few per-device decisions). What one ``submit`` does, per
direction (all of the call's store jobs together, all of its load jobs together):

* **store**: the store stream waits on the engine's compute-done event (F9); per KV region one
  device gather (``index_select``) of the pages into a staging buffer, then one copy per run of
  consecutive slots straight into the pool's range; one event is recorded for the whole batch.
* **load**: the load stream waits on the compute-done event (F9); per region one copy per run
  into a device staging buffer, then one ``index_copy_`` into the engine's device blocks.
* Slots that do not form a few runs (``max_runs``) go through ``scatter``: ``"uva"`` (CUDA, the
  default there) lets a device kernel gather/scatter the pinned pool directly through unified
  addressing; ``"host"`` (the fallback: NPU, CPU) stages in pinned host memory and scatters or
  gathers on the CPU (stores in the completion thread, loads in the caller).

Pairs are sorted by slot first, so a job whose slots are a permutation of a run is one run.

Completion (F6): a thread per direction waits for each batch's event (query with a short sleep on
CUDA, ``synchronize`` on NPU, nothing on CPU where copies are synchronous), runs the batch's host
side (host scatter, checksum check) and puts one ``JobResult`` per job on ONE ``SimpleQueue``;
``poll``/``wait`` read it from the engine's thread. Any exception in a copy becomes a failed
result for the jobs of that batch and the executor keeps serving (F2); a job with a bad index
fails alone, before anything is launched (on CUDA an out-of-range index would kill the context).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from kvflow.errors import ConfigError, KvflowError, Rejected, TransferError, UnknownJob
from kvflow.events import LOAD, STORE, JobResult, TransferJob
from kvflow.executors import npu as adapter
from kvflow.executors.host_pool import HostPool
from kvflow.executors.layout import KVCaches, KVLayout, word_bytes

ScatterMode = Literal["auto", "runs", "host", "uva"]
Finish = Callable[[], dict[int, str]]

HISTORY = 100_000  # finished results kept for wait() and duplicate detection


@dataclass
class _Batch:
    """One direction's share of one submit call, as the completion thread sees it."""

    direction: str
    jobs: list[TransferJob]
    event: Any | None
    finish: Finish | None = None
    keepalive: list[Any] = field(default_factory=list)
    error: str | None = None  # set when launching failed: every job fails with it


@dataclass
class _Lane:
    direction: str
    stream: Any | None
    pending: queue.SimpleQueue[_Batch | None]
    thread: threading.Thread | None = None
    last_event: Any | None = None


@dataclass
class _Plan:
    """A direction's pairs, sorted by slot, and the runs of consecutive slots among them."""

    jobs: list[TransferJob]
    device_blocks: np.ndarray
    slots: np.ndarray
    owner: np.ndarray  # index into jobs for each pair
    runs: list[tuple[int, int, int]]  # (first pair, length, first slot)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slot numbers in a sorted array."""
    n = len(slots)
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [(int(a), int(b - a), int(slots[a])) for a, b in zip(starts, ends, strict=True)]


class TorchExecutor:
    """Moves KV pages for ``TransferJob``s; results come back through ``poll``/``wait``.

    ``kv_caches``: the engine's KV tensors (see ``layout.py``). ``cpu_blocks``: slots of the host
    pool this executor allocates (``0`` disables offload; ignored when ``pool`` is given, e.g. a
    rank's view of a shared pool). ``checksums``: record a per-slot checksum at store, verify at
    load. ``fail_job_ids``: fault injection for tests: a batch holding one of these jobs raises
    inside the copy path, as a real copy error would. ``max_runs``: above this many runs of
    consecutive slots per batch, use ``scatter`` instead of one copy per run and region.
    ``staging_bytes``: the most device staging memory one batch allocates at a time.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        cpu_blocks: int,
        *,
        device: torch.device | str | None = None,
        rank: int = 0,
        pool: HostPool | None = None,
        checksums: bool = False,
        block_dim: int | None = None,
        max_runs: int = 16,
        scatter: ScatterMode = "auto",
        staging_bytes: int = 256 << 20,
        fail_job_ids: Collection[int] = (),
    ) -> None:
        self.layout = KVLayout.from_caches(kv_caches, block_dim=block_dim)
        self.device = self.layout.device
        if device is not None and torch.device(device) != self.device:
            if not (
                torch.device(device).index is None and torch.device(device).type == self.device.type
            ):
                raise ConfigError(f"device={device} but the KV cache is on {self.device}")
        self.traits = adapter.traits_for(self.device.type)
        self.rank = rank
        self.checksums = checksums
        self.max_runs = int(max_runs)
        self._fail_job_ids = frozenset(int(j) for j in fail_job_ids)
        if scatter not in ("auto", "runs", "host", "uva"):
            raise ConfigError(f"scatter must be auto, runs, host or uva, not {scatter!r}")
        if scatter == "uva" and self.device.type != "cuda":
            raise ConfigError(
                "scatter='uva' needs a CUDA device (kernels reading pinned host memory)"
            )
        self.scatter: ScatterMode = scatter

        if pool is None:
            pool = HostPool.create(self.layout.page_bytes, cpu_blocks, device=self.device)
            self._owns_pool = True
        else:
            self._owns_pool = False
            if pool.enabled and pool.page_bytes != self.layout.page_bytes:
                raise ConfigError(
                    f"host pool regions {list(pool.page_bytes)[:4]}... do not match the KV layout "
                    f"{list(self.layout.page_bytes)[:4]}... ({pool.num_regions} vs "
                    f"{self.layout.num_regions} regions)"
                )
        self.pool = pool
        self._host_views: list[torch.Tensor] = []
        self._uva_views: list[torch.Tensor] = []
        if pool.enabled:
            self._host_views = [
                pool.region(i, r.word_dtype) for i, r in enumerate(self.layout.regions)
            ]
            if self.scatter == "uva" or (
                self.scatter == "auto" and self.device.type == "cuda" and pool.pinned
            ):
                try:
                    self._uva_views = [_device_alias(v, self.device) for v in self._host_views]
                except ConfigError:
                    if self.scatter == "uva":
                        raise
        if self.scatter == "auto":
            # Measured on H200 (tools/bench_transfer_results.md): device kernels through UVA keep
            # scattered slots at 0.82-0.88 of the link with no CPU work; host staging costs a CPU
            # memcpy per byte (22-38 GB/s end to end). Host staging is the portable fallback.
            self.scatter = "uva" if self._uva_views else "host"
        self._cs_mult = None
        self._cs_table = np.zeros(max(pool.cpu_blocks, 0), dtype=np.int64)
        self._cs_valid = np.zeros(max(pool.cpu_blocks, 0), dtype=bool)
        if checksums:
            mult = torch.arange(1, 2 * self.layout.num_regions, 2, dtype=torch.int64)
            self._cs_mult = mult.view(-1, 1).to(self.device)

        # Batched single-run path: regions of one word type and page size are handled a chunk
        # at a time (one staging tensor, one _foreach_copy_), which halves the Python calls per
        # region; chunks keep device staging under staging_bytes.
        self._batched = True
        self.staging_bytes = int(staging_bytes)
        self._pages = [r.pages for r in self.layout.regions]
        self._words = [int(r.pages.shape[1]) for r in self.layout.regions]
        self._dtypes = [r.word_dtype for r in self.layout.regions]
        self._wbytes = [word_bytes(d) for d in self._dtypes]

        self._channel: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        self._finished: OrderedDict[int, JobResult] = OrderedDict()
        self._ready: list[JobResult] = []
        self._closed = False
        self._counters = {
            "bytes_stored": 0,
            "bytes_loaded": 0,
            "jobs_submitted": 0,
            "jobs_completed": 0,
            "jobs_failed": 0,
            "submissions": 0,
        }
        self._lanes: dict[str, _Lane] = {d: self._start_lane(d) for d in (STORE, LOAD)}

    # --- streams and events (device-agnostic) ---------------------------------------------

    def _start_lane(self, direction: str) -> _Lane:
        stream = None
        if self.traits.has_streams:
            stream = torch.Stream(device=self.device, **adapter.stream_kwargs(self.traits))
        lane = _Lane(direction, stream, queue.SimpleQueue())
        lane.thread = threading.Thread(
            target=self._complete_loop,
            args=(lane,),
            name=f"kvflow-{direction}-r{self.rank}",
            daemon=True,
        )
        lane.thread.start()
        return lane

    @contextlib.contextmanager
    def _on(self, stream: Any | None) -> Iterator[None]:
        """Make ``stream`` current, so staging memory is allocated on it (stream-ordered reuse)."""
        if stream is None:
            yield
            return
        if hasattr(stream, "__enter__"):
            with stream:
                yield
            return
        previous = torch.accelerator.current_stream(self.device)  # torch without Stream.__enter__
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    def _wait_for(self, stream: Any | None, event: Any | None) -> None:
        """Order the copies after the engine's compute (F9) or after another batch."""
        if event is None:
            return
        if stream is None:
            sync = getattr(event, "synchronize", None)
            if sync is not None:
                with contextlib.suppress(RuntimeError):
                    sync()
            return
        try:
            stream.wait_event(event)
        except TypeError:
            event.wait(stream)

    def _record(self, stream: Any | None) -> Any | None:
        if stream is None:
            return None
        event = torch.Event(device=self.device)
        event.record(stream)
        return event

    def _wait_event(self, event: Any | None) -> None:
        if event is None:
            return
        if self.traits.wait_mode == "synchronize":
            event.synchronize()
            return
        delay = 20e-6
        while adapter.event_state(self.traits, bool(event.query())) == "pending":
            time.sleep(delay)
            delay = min(delay * 2, 200e-6)

    def _pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        pin = self.traits.has_streams and self.traits.pin_strategy != "none"
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    # --- public API ---------------------------------------------------------------------------

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any | None = None) -> None:
        """Launch ``jobs`` after ``compute_done`` (a ``torch.Event`` the engine recorded).

        Raises ``Rejected`` (nothing launched) when a job id was already submitted (F5), and
        ``ConfigError`` when offload is disabled. Every other problem becomes a failed result.
        """
        if self._closed:
            raise KvflowError("executor is closed; create a new one")
        if not self.pool.enabled:
            raise ConfigError(
                "offload is disabled (cpu_blocks=0): there is no host pool to copy to"
            )
        jobs = list(jobs)
        with self._lock:
            seen: set[int] = set()
            for job in jobs:
                if not isinstance(job, TransferJob):
                    raise TypeError(f"submit() takes TransferJob objects, not {type(job).__name__}")
                jid = job.job_id
                if jid in seen or jid in self._in_flight or jid in self._finished:
                    raise Rejected(f"job {jid} was already submitted; a job is submitted once (F5)")
                seen.add(jid)
            self._in_flight.update(seen)
            self._counters["jobs_submitted"] += len(jobs)
            self._counters["submissions"] += 1
        plans: dict[str, _Plan | None] = {}
        for direction in (STORE, LOAD):
            mine = [j for j in jobs if j.direction == direction]
            plans[direction] = self._plan(direction, mine) if mine else None
        for job in jobs:
            if job.direction not in (STORE, LOAD):
                self._fail_now(job, f"job {job.job_id}: unknown direction {job.direction!r}")

        store_plan, load_plan = plans[STORE], plans[LOAD]
        store_event = None
        if store_plan is not None:
            store_event = self._launch(STORE, store_plan, compute_done, None)
        if load_plan is not None:
            after = None
            if store_plan is not None and _overlaps(store_plan, load_plan):
                after = store_event  # same blocks or slots in both directions: load after store
            self._launch(LOAD, load_plan, compute_done, after)

    def poll(self) -> list[JobResult]:
        """Every result that arrived since the last poll (each exactly once); never blocks."""
        with self._lock:
            self._drain()
            out, self._ready = self._ready, []
        return out

    def wait(self, job_id: int, timeout_s: float | None = None) -> JobResult:
        """Block until ``job_id`` is terminal and return its result (``poll`` still reports it).

        Raises ``UnknownJob`` for an id never submitted (F12), ``TimeoutError`` after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._drain()
                done = self._finished.get(job_id)
                if done is not None:
                    return done
                if job_id not in self._in_flight:
                    raise UnknownJob(f"wait: job {job_id} was never submitted to this executor")
            remaining = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if remaining <= 0:
                raise TimeoutError(f"job {job_id} not finished after {timeout_s} s")
            try:
                result = self._channel.get(timeout=remaining)
            except queue.Empty:
                continue
            with self._lock:
                self._accept(result)

    def wait_any(self, timeout_s: float | None = None) -> list[JobResult]:
        """Block until at least one result is ready (or ``timeout_s``), then poll."""
        with self._lock:
            self._drain()
            if self._ready:
                out, self._ready = self._ready, []
                return out
        try:
            first = self._channel.get(timeout=timeout_s)
        except queue.Empty:
            return []
        with self._lock:
            self._accept(first)
            self._drain()
            out, self._ready = self._ready, []
        return out

    def close(self) -> None:
        """Finish in-flight copies, stop the completion threads and free the host pool we own."""
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes.values():
            lane.pending.put(None)
        for lane in self._lanes.values():
            if lane.thread is not None:
                lane.thread.join()
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> TorchExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, int]:
        """Counters: bytes stored/loaded (successful jobs), jobs submitted/completed/failed."""
        with self._lock:
            return dict(self._counters)

    @property
    def bytes_stored(self) -> int:
        return self.stats["bytes_stored"]

    @property
    def bytes_loaded(self) -> int:
        return self.stats["bytes_loaded"]

    @property
    def jobs_completed(self) -> int:
        return self.stats["jobs_completed"]

    @property
    def jobs_failed(self) -> int:
        return self.stats["jobs_failed"]

    def memory_stats(self) -> dict[str, Any]:
        """The device allocator's statistics (from torch.npu on NPU, torch.accelerator else)."""
        return adapter.memory_stats(torch, self.device, self.traits)

    def stream(self, direction: str) -> Any | None:
        """The stream copies of ``direction`` run on (None on CPU): engines and benchmarks can
        record their own events after kvflow's copies."""
        return self._lanes[direction].stream

    def last_event(self, direction: str) -> Any | None:
        """The event of the last batch launched in ``direction`` (None on CPU): an engine can make
        its compute stream wait on the last load instead of waiting for the result on the host."""
        return self._lanes[direction].last_event

    # --- results channel ----------------------------------------------------------------------

    def _emit(self, job: TransferJob, ok: bool, error: str | None) -> None:
        self._channel.put(JobResult(job_id=job.job_id, rank=self.rank, ok=ok, error=error))

    def _fail_now(self, job: TransferJob, error: str) -> None:
        """A job refused before launch: counted, then reported like any failure."""
        with self._lock:
            self._counters["jobs_failed"] += 1
        self._emit(job, False, error)

    def _drain(self) -> None:
        while True:
            try:
                result = self._channel.get_nowait()
            except queue.Empty:
                return
            self._accept(result)

    def _accept(self, result: JobResult) -> None:
        """Caller holds the lock."""
        self._in_flight.discard(result.job_id)
        self._finished[result.job_id] = result
        if len(self._finished) > HISTORY:
            self._finished.popitem(last=False)
        self._ready.append(result)

    # --- planning -----------------------------------------------------------------------------

    def _check_job(self, job: TransferJob) -> tuple[np.ndarray, np.ndarray] | str:
        """The job's index arrays, or why it cannot run (it then fails alone, nothing launched)."""
        if len(job.device_blocks) != len(job.slots):
            return (
                f"job {job.job_id}: {len(job.device_blocks)} device blocks "
                f"but {len(job.slots)} slots"
            )
        count = len(job.slots)
        try:
            dev = np.fromiter(job.device_blocks, dtype=np.int64, count=count)
            slots = np.fromiter(job.slots, dtype=np.int64, count=count)
        except (TypeError, ValueError, OverflowError) as e:
            return f"job {job.job_id}: block ids must be integers ({_first_line(e)})"
        if len(dev) == 0:
            return dev, slots
        nb, cb = self.layout.num_blocks, self.pool.cpu_blocks
        if dev.min() < 0 or dev.max() >= nb:
            bad = int(dev[(dev < 0) | (dev >= nb)][0])
            return f"job {job.job_id}: device block {bad} out of range [0, {nb})"
        if slots.min() < 0 or slots.max() >= cb:
            bad = int(slots[(slots < 0) | (slots >= cb)][0])
            return f"job {job.job_id}: slot {bad} out of range [0, {cb})"
        key = slots if job.direction == STORE else dev
        if count > 1 and not (key[1:] > key[:-1]).all():  # not strictly increasing: look closer
            ordered = np.sort(key)
            if (ordered[1:] == ordered[:-1]).any():
                what = (
                    "a slot appears twice in one store"
                    if job.direction == STORE
                    else "a device block appears twice in one load"
                )
                return f"job {job.job_id}: {what}"
        return dev, slots

    def _plan(self, direction: str, jobs: list[TransferJob]) -> _Plan | None:
        """Validate and merge a direction's jobs; bad jobs fail now, alone."""
        kept: list[TransferJob] = []
        devs: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        taken: set[int] = set()  # slots (store) / device blocks (load) claimed by earlier jobs
        for job in jobs:
            checked = self._check_job(job)
            if isinstance(checked, str):
                self._fail_now(job, checked)
                continue
            dev, sl = checked
            if len(jobs) > 1:
                keys = (sl if direction == STORE else dev).tolist()
                clash = taken.intersection(keys)
                if clash:
                    what = "slot" if direction == STORE else "device block"
                    self._fail_now(
                        job,
                        f"job {job.job_id}: {what} {min(clash)} is also written by "
                        "an earlier job of the same submit",
                    )
                    continue
                taken.update(keys)
            kept.append(job)
            devs.append(dev)
            slots.append(sl)
        if not kept:
            return None
        dev_all = np.concatenate(devs)
        slot_all = np.concatenate(slots)
        owner = np.repeat(np.arange(len(kept)), [len(d) for d in devs])
        if len(slot_all) > 1 and not (slot_all[1:] > slot_all[:-1]).all():
            order = np.argsort(slot_all, kind="stable")
            dev_all, slot_all, owner = dev_all[order], slot_all[order], owner[order]
        return _Plan(kept, dev_all, slot_all, owner, _runs(slot_all))

    # --- launching ----------------------------------------------------------------------------

    def _launch(
        self, direction: str, plan: _Plan, compute_done: Any | None, after: Any | None
    ) -> Any | None:
        """Enqueue one direction's copies; a raise here fails the batch, never the caller (F2)."""
        lane = self._lanes[direction]
        batch = _Batch(direction, plan.jobs, None)
        try:
            injected = [j.job_id for j in plan.jobs if j.job_id in self._fail_job_ids]
            if injected:
                raise TransferError(f"injected fault for job {injected[0]} (fail_job_ids)")
            if len(plan.slots) == 0:
                batch.finish = None
            elif direction == STORE:
                batch.finish = self._launch_store(lane, plan, compute_done, batch.keepalive)
            else:
                batch.finish = self._launch_load(lane, plan, compute_done, after, batch.keepalive)
            batch.event = self._record(lane.stream)
            lane.last_event = batch.event
        except Exception as e:  # noqa: BLE001 - F2: every copy error becomes a failed result
            batch.error = f"{direction} launch failed on {self.device}: {_first_line(e)}"
        lane.pending.put(batch)
        return batch.event

    def _chunks(self, n: int) -> Iterator[tuple[int, int]]:
        """Ranges [a, b) of regions with one word type and size, each within staging_bytes."""
        a, count = 0, len(self._pages)
        while a < count:
            per_region = n * self._words[a] * self._wbytes[a]
            limit = max(1, self.staging_bytes // max(1, per_region))
            b = a + 1
            while (
                b < count
                and b - a < limit
                and self._words[b] == self._words[a]
                and self._dtypes[b] == self._dtypes[a]
            ):
                b += 1
            yield a, b
            a = b

    def _regions_unbatched(self, single: bool, scattered: bool) -> Sequence[Any]:
        """The regions the per-region loop still has to do (none when the batched path ran)."""
        return () if (single and not scattered and self._batched) else self.layout.regions

    def _launch_indices(
        self, plan: _Plan, scattered: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Device-side index tensors of a batch (on the current stream): device blocks, the
        slots when GPU kernels address the pinned pool directly, and a checksum buffer."""
        idx = torch.from_numpy(plan.device_blocks).to(self.device, non_blocking=True)
        slot_idx = None
        if scattered and self.scatter == "uva":
            slot_idx = torch.from_numpy(plan.slots).to(self.device, non_blocking=True)
        sums = None
        if self.checksums:
            n = len(plan.slots)
            sums = torch.empty((self.layout.num_regions, n), dtype=torch.int64, device=self.device)
        return idx, slot_idx, sums

    def _scattered(self, plan: _Plan) -> bool:
        return self.scatter != "runs" and len(plan.runs) > self.max_runs

    def _launch_store(
        self, lane: _Lane, plan: _Plan, compute_done: Any, keep: list[Any]
    ) -> Finish | None:
        slots, runs, n = plan.slots, plan.runs, len(plan.slots)
        scattered = self._scattered(plan)
        self._cs_valid[slots] = False  # the slots' content is about to change
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        cs_host = None
        with self._on(lane.stream):
            self._wait_for(lane.stream, compute_done)
            idx, slot_idx, sums = self._launch_indices(plan, scattered)
            single = len(runs) == 1
            if single and not scattered and self._batched:
                s0 = runs[0][2]
                for a, b in self._chunks(n):
                    staging = torch.empty(
                        (b - a, n, self._words[a]), dtype=self._dtypes[a], device=self.device
                    )
                    parts = staging.unbind(0)
                    for k in range(a, b):
                        torch.index_select(self._pages[k], 0, idx, out=parts[k - a])
                    if sums is not None:
                        torch.sum(staging, 2, dtype=torch.int64, out=sums[a:b])
                    dst = [self._host_views[k][s0 : s0 + n] for k in range(a, b)]
                    torch._foreach_copy_(dst, parts, non_blocking=True)
            for r, region in enumerate(self._regions_unbatched(single, scattered)):
                staging = torch.index_select(region.pages, 0, idx)
                if sums is not None:
                    torch.sum(staging, 1, dtype=torch.int64, out=sums[r])
                host = self._host_views[r]
                if not scattered:
                    if single:
                        s0 = runs[0][2]
                        host[s0 : s0 + n].copy_(staging, non_blocking=True)
                    else:
                        for a, length, s in runs:
                            host[s : s + length].copy_(staging[a : a + length], non_blocking=True)
                elif self.scatter == "uva":
                    assert slot_idx is not None
                    self._uva_views[r].index_copy_(0, slot_idx, staging)
                else:
                    pinned = self._pinned_empty(tuple(staging.shape), staging.dtype)
                    pinned.copy_(staging, non_blocking=True)
                    staged.append((host, pinned))
            if sums is not None:
                assert self._cs_mult is not None
                cs = (sums * self._cs_mult).sum(0)
                cs_host = self._pinned_empty((n,), torch.int64)
                cs_host.copy_(cs, non_blocking=True)
        keep.extend(p for _, p in staged)

        def finish() -> dict[int, str]:
            if staged:
                slot_t = torch.from_numpy(slots)
                for host, pinned in staged:
                    host.index_copy_(0, slot_t, pinned)
            if cs_host is not None:
                self._cs_table[slots] = cs_host.numpy()
                self._cs_valid[slots] = True
            return {}

        return finish if (staged or cs_host is not None) else None

    def _launch_load(
        self, lane: _Lane, plan: _Plan, compute_done: Any, after: Any, keep: list[Any]
    ) -> Finish | None:
        slots, runs, n = plan.slots, plan.runs, len(plan.slots)
        scattered = self._scattered(plan)
        expected = valid = None
        if self.checksums:
            expected, valid = self._cs_table[slots].copy(), self._cs_valid[slots].copy()
        cs_host = None
        slot_cpu = torch.from_numpy(slots) if scattered and self.scatter == "host" else None
        with self._on(lane.stream):
            self._wait_for(lane.stream, compute_done)
            self._wait_for(lane.stream, after)
            idx, slot_idx, sums = self._launch_indices(plan, scattered)
            single = len(runs) == 1
            if single and not scattered and self._batched:
                s0 = runs[0][2]
                for a, b in self._chunks(n):
                    staging = torch.empty(
                        (b - a, n, self._words[a]), dtype=self._dtypes[a], device=self.device
                    )
                    parts = staging.unbind(0)
                    torch._foreach_copy_(
                        parts,
                        [self._host_views[k][s0 : s0 + n] for k in range(a, b)],
                        non_blocking=True,
                    )
                    if sums is not None:
                        torch.sum(staging, 2, dtype=torch.int64, out=sums[a:b])
                    for k in range(a, b):
                        self._pages[k].index_copy_(0, idx, parts[k - a])
            for r, region in enumerate(self._regions_unbatched(single, scattered)):
                host = self._host_views[r]
                if not scattered:
                    if single:
                        s0 = runs[0][2]
                        staging = host[s0 : s0 + n].to(self.device, non_blocking=True)
                    else:
                        staging = torch.empty(
                            (n, host.shape[1]), dtype=host.dtype, device=self.device
                        )
                        for a, length, s in runs:
                            staging[a : a + length].copy_(host[s : s + length], non_blocking=True)
                elif self.scatter == "uva":
                    assert slot_idx is not None
                    staging = torch.index_select(self._uva_views[r], 0, slot_idx)
                else:
                    assert slot_cpu is not None
                    pinned = self._pinned_empty((n, host.shape[1]), host.dtype)
                    torch.index_select(host, 0, slot_cpu, out=pinned)
                    keep.append(pinned)
                    staging = pinned.to(self.device, non_blocking=True)
                if sums is not None:
                    torch.sum(staging, 1, dtype=torch.int64, out=sums[r])
                region.pages.index_copy_(0, idx, staging)
            if sums is not None:
                assert self._cs_mult is not None
                cs = (sums * self._cs_mult).sum(0)
                cs_host = self._pinned_empty((n,), torch.int64)
                cs_host.copy_(cs, non_blocking=True)
        if cs_host is None:
            return None
        assert expected is not None and valid is not None

        def finish() -> dict[int, str]:
            got = cs_host.numpy()
            bad = np.flatnonzero((got != expected) | ~valid)
            errors: dict[int, str] = {}
            for pos in bad.tolist():
                job = plan.jobs[int(plan.owner[pos])]
                if job.job_id in errors:
                    continue
                slot, block = int(slots[pos]), int(plan.device_blocks[pos])
                errors[job.job_id] = (
                    f"checksum mismatch: slot {slot} -> device block {block} "
                    "(host copy corrupted; recompute)"
                    if valid[pos]
                    else f"no checksum recorded for slot {slot}: never stored by this executor"
                )
            return errors

        return finish

    # --- completion thread --------------------------------------------------------------------

    def _complete_loop(self, lane: _Lane) -> None:
        """Wait for each batch in launch order and publish its results (F6: one channel)."""
        block_bytes = self.layout.block_bytes
        while True:
            batch = lane.pending.get()
            if batch is None:
                return
            errors: dict[int, str] = {}
            if batch.error is not None:
                errors = {j.job_id: batch.error for j in batch.jobs}
            else:
                try:
                    self._wait_event(batch.event)
                    if batch.finish is not None:
                        errors = batch.finish()
                except Exception as e:  # noqa: BLE001 - F2
                    msg = f"{batch.direction} copy failed on {self.device}: {_first_line(e)}"
                    errors = {j.job_id: msg for j in batch.jobs}
            batch.keepalive.clear()
            ok_bytes = 0
            with self._lock:
                for job in batch.jobs:
                    if job.job_id in errors:
                        self._counters["jobs_failed"] += 1
                    else:
                        self._counters["jobs_completed"] += 1
                        ok_bytes += len(job.slots) * block_bytes
                key = "bytes_stored" if batch.direction == STORE else "bytes_loaded"
                self._counters[key] += ok_bytes
            for job in batch.jobs:
                err = errors.get(job.job_id)
                self._emit(job, err is None, err)


def _overlaps(store: _Plan, load: _Plan) -> bool:
    """Do a store and a load of one submit touch the same device blocks or slots?"""
    return bool(
        np.intersect1d(store.device_blocks, load.device_blocks).size
        or np.intersect1d(store.slots, load.slots).size
    )


class _CudaArray:
    """``__cuda_array_interface__`` over pinned host memory: a CUDA tensor aliasing the pool."""

    def __init__(self, host: torch.Tensor) -> None:
        self._host = host
        typestr = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}[word_bytes(host.dtype)]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "strides": tuple(s * host.element_size() for s in host.stride()),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 2,
        }


def _device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over a pinned host region (UVA), so kernels gather/scatter it directly."""
    try:
        alias = torch.as_tensor(_CudaArray(host), device=device)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"scatter='uva' unavailable: cannot map the pinned pool ({_first_line(e)})"
        ) from None
    if alias.data_ptr() != host.data_ptr():
        raise ConfigError("scatter='uva' unavailable: device pointer differs from the host pointer")
    return alias
