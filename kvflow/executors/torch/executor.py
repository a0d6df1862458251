"""The torch executor: batched KV page copies between a device KV cache and the host pool.

One code path for CUDA, Ascend NPU and the CPU device, over ``torch.Stream`` / ``torch.Event``
(``kvflow.executors.torch.npu`` holds the few per-device decisions). This module is the executor's job
bookkeeping: it accepts jobs and tracks them until each has exactly one result. The rest is
split by job:

* ``transfer_plan``: a ``submit`` validates each job and merges all of its store jobs together,
  all of its load jobs together, sorted by slot (a job with a bad index fails alone, before
  anything is launched: on CUDA an out-of-range index would kill the context);
* ``page_copies``: the copy kernels that move one such batch per direction (runs, UVA or host
  scatter, checksums); ``copy_setup`` picks the path and builds its tables, ``staged_copies``
  holds the staged path;
* ``streams``: the streams and events the copies are ordered with; ``uva``: device aliases of
  the pinned pool.

When a submit stores and loads the same blocks or slots, the load waits for the store's event.

Completion (F6): the thread that asks learns. ``poll`` queries the event of each direction's
oldest batches in launch order, without blocking, and delivers every batch whose copies are
over: it runs the batch's host side (host scatter, checksum check) and puts one ``JobResult``
per job on ONE channel (``result_channel``), batches found over together in launch order. A
blocking ``wait`` sleeps on the job's event (in the driver, without the GIL, on CUDA) and then
delivers the same way. No other thread has to run for a result to arrive: a completion thread
waking from its event needs the GIL, and an engine whose scheduler spins on ``step()`` holds it
for up to the interpreter's switch interval, so the engine learnt late of copies long over
(docs/performance.md, "Results at the engine's own poll"). Every phase of a batch, the staged path's chunks too, is enqueued on its
stream by ``submit``, so nothing but the host side is left for the delivery. Any exception in a
copy becomes a failed result for the jobs of that batch and the executor keeps serving (F2).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.core.commands import JobResult
from kvflow.core.errors import ConfigError, KvflowError, TransferError, one_line
from kvflow.core.jobs import LOAD, STORE, TransferJob
from kvflow.executors.torch import npu as adapter
from kvflow.executors.torch import page_kernel
from kvflow.executors.torch.copy_setup import Failures, Finish, ScatterMode
from kvflow.executors.torch.host_pool import HostPool
from kvflow.executors.torch.layout import KVCaches, KVLayout
from kvflow.executors.torch.page_copies import PageCopies
from kvflow.executors.torch.page_kernel import DEFAULT_PROGRAMS
from kvflow.executors.torch.result_channel import ResultChannel
from kvflow.executors.torch.streams import event_over, new_stream, record_event, wait_event
from kvflow.executors.torch.transfer_plan import Plan, overlaps, plan_jobs
from kvflow.executors.torch.uva import device_alias

# tools/bench_transfer.py builds UVA views itself when it switches scatter modes on a live executor
_device_alias = device_alias


@dataclass
class _Batch:
    """One direction's share of one submit call, until its results are delivered."""

    seq: int  # launch order over both directions
    direction: str
    jobs: list[TransferJob]
    event: Any | None
    finish: Finish | None = None
    keepalive: list[Any] = field(default_factory=list)
    error: str | None = None  # set when launching failed or the copy raised: every job fails


@dataclass
class _Lane:
    direction: str
    stream: Any | None
    # launched, results not delivered yet, in launch order (one stream: they end in this order)
    running: deque[_Batch] = field(default_factory=deque)
    last_event: Any | None = None


class TorchExecutor(PageCopies):
    """Moves KV pages for ``TransferJob``s; results come back through ``poll``/``wait``.

    ``kv_caches``: the engine's KV tensors (see ``layout.py``). ``cpu_blocks``: slots of the host
    pool this executor allocates (``0`` disables offload; ignored when ``pool`` is given, e.g. a
    rank's view of a shared pool). ``checksums``: record a per-slot checksum at store, verify at
    load. ``fail_job_ids``: fault injection for tests: a batch holding one of these jobs raises
    inside the copy path, as a real copy error would. ``max_runs``: above this many runs of
    consecutive slots per batch, use ``scatter`` instead of one copy per run and region (default
    0 for the ``kernel``, ``staged`` and ``batch`` scatters: every batch in one launch or call;
    16 for the others). ``scatter``: ``auto`` (default: on CUDA, ``batch`` for pages of 512 KiB
    and up where the driver has cuMemcpyBatchAsync, one call per batch straight between the
    device pages and the pool; smaller pages ``staged`` with Triton, over a page-first pool: the
    page kernel for loads in groups, whole blocks on the copy engines otherwise; UVA kernels
    without either; ``host`` staging on NPU and CPU), or one of
    ``runs``, ``host``, ``uva``, ``kernel``, ``batch``, ``staged``. ``staging_bytes``: the most device staging memory one batch allocates
    at a time (the ``staged`` path keeps that much per direction, allocated once).
    ``load_groups``: a scattered load is launched in this many groups of consecutive regions
    (e.g. one per layer), each with its own event (``load_events``), so an engine can run layer
    ``i`` once its pages have landed. ``copy_programs``: programs (thread blocks) of the page
    kernel; 0 (the default): one per multiprocessor for loads and half that for stores, which
    both directions at once need to fill the link (each program is 4 warps waiting on the
    link, so compute kernels still share every multiprocessor).
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
        max_runs: int | None = None,
        scatter: ScatterMode = "auto",
        staging_bytes: int = 64 << 20,
        load_groups: int = 1,
        copy_programs: int = DEFAULT_PROGRAMS,
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
        self.load_groups = int(load_groups)
        self.copy_programs = int(copy_programs)
        if self.load_groups < 1 or self.copy_programs < 0:
            raise ConfigError(
                f"load_groups must be >= 1 and copy_programs >= 0, got {load_groups}, "
                f"{copy_programs}"
            )
        self._fail_job_ids = frozenset(int(j) for j in fail_job_ids)
        if scatter not in ("auto", "runs", "host", "uva", "kernel", "batch", "staged"):
            raise ConfigError(
                f"scatter must be auto, runs, host, uva, kernel, batch or staged, not {scatter!r}"
            )
        if scatter == "uva" and self.device.type != "cuda":
            raise ConfigError(
                "scatter='uva' needs a CUDA device (kernels reading pinned host memory)"
            )
        self.scatter: ScatterMode = scatter

        if pool is None:
            pool = HostPool.create(
                self.layout.page_bytes, cpu_blocks, device=self.device,
                page_first=self._wants_page_first(scatter),
            )
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
        self._init_copies(staging_bytes, max_runs)

        self._results = ResultChannel(rank)
        self._lock = threading.Lock()  # the counters and the lanes' running batches
        self._delivering = threading.Lock()  # one thread delivers at a time: each batch once
        self._seq = itertools.count()
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


    @property
    def kv_dtype(self) -> str:
        """The KV tensors' element type(s) ("bfloat16"): part of the lower tiers' layout identity."""
        return self.layout.kv_dtype
    def _wants_page_first(self, scatter: str) -> bool:
        """Lay the pool out slot by slot for the staged path (CUDA with the page kernel)."""
        if scatter == "staged":
            return True
        return (
            scatter == "auto"
            and page_kernel.available(self.device)
            and self.traits.pin_strategy == "cuda_host_register"
            and all(r.word_dtype == torch.int64 for r in self.layout.regions)
        )

    # --- lanes: one stream per direction -------------------------------------------------------

    def _start_lane(self, direction: str) -> _Lane:
        return _Lane(direction, new_stream(self.device, self.traits))

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
        self._results.claim(jobs)
        with self._lock:
            self._counters["jobs_submitted"] += len(jobs)
            self._counters["submissions"] += 1
        plans: dict[str, Plan | None] = {}
        nb, cb = self.layout.num_blocks, self.pool.cpu_blocks
        for direction in (STORE, LOAD):
            mine = [j for j in jobs if j.direction == direction]
            plans[direction] = plan_jobs(direction, mine, nb, cb, self._fail_now) if mine else None
        for job in jobs:
            if job.direction not in (STORE, LOAD):
                self._fail_now(job, f"job {job.job_id}: unknown direction {job.direction!r}")

        store_plan, load_plan = plans[STORE], plans[LOAD]
        store_event = None
        both = store_plan is not None and load_plan is not None  # both directions copy at once
        if store_plan is not None:
            store_event = self._launch(STORE, store_plan, compute_done, None, both)
        if load_plan is not None:
            after = None
            if store_plan is not None and overlaps(store_plan, load_plan):
                after = store_event  # same blocks or slots in both directions: load after store
            self._launch(LOAD, load_plan, compute_done, after, both)

    def poll(self) -> list[JobResult]:
        """The results of every copy over by now (each exactly once); never blocks: the
        calling thread queries the copies' events itself (F6)."""
        self._deliver(block=False)
        return self._results.poll()

    def wait(self, job_id: int, timeout_s: float | None = None) -> JobResult:
        """Block until ``job_id`` is terminal and return its result (``poll`` still reports it).

        Without ``timeout_s`` the thread sleeps on the job's event (in the driver on CUDA);
        with one it queries the events with short sleeps until then. Raises ``UnknownJob`` for
        an id never submitted (F12), ``TimeoutError`` after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        nap = _Nap()
        while True:
            self._deliver(block=True)
            done = self._results.finished(job_id)
            if done is not None:
                return done
            event = self._event_of(job_id) if deadline is None else None
            if event is not None:
                try:
                    wait_event(event, self.traits)
                except Exception:  # noqa: BLE001 - the delivery reports the copy's failure (F2)
                    pass
                continue
            if not nap.sleep(deadline):
                raise TimeoutError(f"job {job_id} not finished after {timeout_s} s")

    def wait_any(self, timeout_s: float | None = None) -> list[JobResult]:
        """Block until at least one result is ready (or ``timeout_s``), then poll."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        nap = _Nap()
        while True:
            self._deliver(block=True)
            out = self._results.poll()
            if out or not nap.sleep(deadline):
                return out

    def close(self) -> None:
        """Finish in-flight copies, deliver their results (``poll`` still returns them) and
        free the host pool we own."""
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes.values():
            for batch in list(lane.running):
                try:
                    wait_event(batch.event, self.traits)
                except Exception:  # noqa: BLE001 - the delivery reports the copy's failure (F2)
                    pass
        self._deliver(block=True)
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> TorchExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def host_slots(self) -> int:
        """The host pool's slots (an engine checks them against its config's, F11)."""
        return self.pool.cpu_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes one block's copy moves: its page in every region of this executor's KV."""
        return self.layout.block_bytes

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

    # --- results ---------------------------------------------------------------------------

    def _fail_now(self, job: TransferJob, error: str) -> None:
        """A job refused before launch: counted, then reported like any failure."""
        with self._lock:
            self._counters["jobs_failed"] += 1
        self._results.put(job, False, error)

    # --- launching ----------------------------------------------------------------------------

    def _launch(
        self,
        direction: str,
        plan: Plan,
        compute_done: Any | None,
        after: Any | None,
        both: bool = False,
    ) -> Any | None:
        """Enqueue one direction's copies; a raise here fails the batch, never the caller (F2)."""
        lane = self._lanes[direction]
        other = self._lanes[LOAD if direction == STORE else STORE]
        both_ways = both or self._copying(other)  # the other direction copies too
        batch = _Batch(next(self._seq), direction, plan.jobs, None)
        try:
            injected = [j.job_id for j in plan.jobs if j.job_id in self._fail_job_ids]
            if injected:
                raise TransferError(f"injected fault for job {injected[0]} (fail_job_ids)")
            if len(plan.slots) == 0:
                batch.finish = None
            elif direction == STORE:
                batch.finish = self._launch_store(
                    lane.stream, plan, compute_done, batch.keepalive, both_ways
                )
            else:
                batch.finish = self._launch_load(
                    lane.stream, plan, compute_done, after, batch.keepalive, both_ways
                )
            batch.event = record_event(
                lane.stream, self.device, blocking=self.traits.wait_mode == "blocking"
            )
            lane.last_event = batch.event
        except Exception as e:  # noqa: BLE001 - F2: every copy error becomes a failed result
            batch.error = f"{direction} launch failed on {self.device}: {one_line(e)}"
        with self._lock:
            lane.running.append(batch)
        return batch.event

    # --- delivery: the thread that asks finds the copies that are over ----------------------

    def _over(self, batch: _Batch) -> bool:
        """Whether ``batch``'s copies are over (a query, never a wait); a query that raises
        ends the batch as failed."""
        if batch.error is not None or batch.event is None:
            return True
        try:
            return event_over(batch.event, self.traits)
        except Exception as e:  # noqa: BLE001 - F2: the copy's error becomes failed results
            batch.error = f"{batch.direction} copy failed on {self.device}: {one_line(e)}"
            return True

    def _copying(self, lane: _Lane) -> bool:
        """Whether ``lane`` still has copies in flight (its last batch's event is pending)."""
        with self._lock:
            last = lane.running[-1] if lane.running else None
        return last is not None and last.error is None and last.event is not None and not (
            self._over(last)
        )

    def _event_of(self, job_id: int) -> Any | None:
        """The event of the in-flight batch holding ``job_id`` (None if none or no event)."""
        with self._lock:
            for lane in self._lanes.values():
                for batch in lane.running:
                    if batch.event is not None and any(j.job_id == job_id for j in batch.jobs):
                        return batch.event
        return None

    def _deliver(self, *, block: bool) -> None:
        """Deliver every batch whose copies are over: each lane's in launch order (one stream:
        a later batch is never over before an earlier one), those found together in launch
        order over both directions. ``block=False`` (``poll``): when another thread is
        delivering, leave it to that thread rather than wait; its results reach the next poll.
        """
        if not self._delivering.acquire(blocking=block):
            return
        try:
            done: list[_Batch] = []
            with self._lock:
                for lane in self._lanes.values():
                    while lane.running and self._over(lane.running[0]):
                        done.append(lane.running.popleft())
            for batch in sorted(done, key=lambda b: b.seq):
                self._finish(batch)
        finally:
            self._delivering.release()

    def _finish(self, batch: _Batch) -> None:
        """Run ``batch``'s host side and put one result per job (its copies are over)."""
        errors: Failures = {}
        if batch.error is not None:
            errors = {j.job_id: (batch.error, ()) for j in batch.jobs}
        elif batch.finish is not None:
            try:
                errors = batch.finish()
            except Exception as e:  # noqa: BLE001 - F2
                msg = f"{batch.direction} copy failed on {self.device}: {one_line(e)}"
                errors = {j.job_id: (msg, ()) for j in batch.jobs}
        batch.keepalive.clear()
        ok_bytes = 0
        block_bytes = self.layout.block_bytes
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
            failure = errors.get(job.job_id)
            if failure is None:
                self._results.put(job, True, None)
            else:
                self._results.put(job, False, failure[0], failure[1])


class _Nap:
    """Short sleeps of a blocking wait that queries events: from 20 us doubling to 1 ms (the
    waiting thread gives the GIL up while it sleeps); ``sleep`` answers False, without
    sleeping, once ``deadline`` (a monotonic time, None: never) has passed."""

    def __init__(self) -> None:
        self.delay = 20e-6

    def sleep(self, deadline: float | None) -> bool:
        pause = self.delay
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            pause = min(pause, left)
        time.sleep(pause)
        self.delay = min(self.delay * 2, 1e-3)
        return True
