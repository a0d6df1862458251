"""Several ranks: one ``TorchExecutor`` per rank, each in its own process, on ONE shared pool.

In a real engine every worker process already exists and builds its own ``TorchExecutor`` on a
rank view of the shared pool (``HostPool.attach(spec, first_region=rank * R, num_regions=R)``).
``RankGroup`` is the same arrangement run by kvflow itself (tests, benchmarks, a standalone
offload service): it creates the shared pool once, before any rank starts (F10), spawns
``world_size`` processes, fans every ``submit`` out to all of them and collects every rank's
``JobResult`` into one list that ``poll`` hands over (F6).

Pool layout: each rank holds a different shard of the KV cache (tensor parallelism), so the pool
has ``world_size × R`` regions and rank ``k`` owns regions ``[k·R, (k+1)·R)``; a slot number means
the same block on every rank, and no two ranks ever write the same bytes.

Fault injection (tests only): ``fail_job_ids={rank: {job ids}}`` makes that rank's executor fail
those jobs inside its copy path, so a test sees one rank succeed and another fail the same job.

A rank process that dies fails its in-flight jobs at the next ``poll`` (F2: no job waits forever).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import msgspec
import torch

from kvflow.core.commands import JobResult
from kvflow.core.errors import ConfigError, KvflowError, Rejected, UnknownJob
from kvflow.core.jobs import TransferJob
from kvflow.core.values import is_int
from kvflow.executors.torch.host_pool import HostPool, PoolSpec
from kvflow.executors.torch.layout import KVCaches, KVLayout

_JOBS = msgspec.msgpack.Decoder(list[TransferJob])
_ENCODE = msgspec.msgpack.Encoder()


class KVFactory(Protocol):
    """Builds one rank's KV tensors in the rank's process (must be picklable)."""

    def build(self, rank: int, device: torch.device) -> KVCaches: ...

    def meta(self) -> KVCaches:
        """The same shapes on the ``meta`` device: sizes the shared pool without memory."""
        ...


@dataclass(frozen=True)
class RandomKV:
    """A synthetic KV cache of random data seeded by rank (tests and benchmarks).

    ``stacked``: per layer ``[2, num_blocks, *page_shape]`` (K and V, vLLM's layout); otherwise
    per layer ``[num_blocks, *page_shape]``. Data is drawn on the CPU and moved, so the bytes are
    the same whatever the device.
    """

    num_layers: int
    num_blocks: int
    page_shape: tuple[int, ...]
    dtype: str = "float16"
    stacked: bool = True
    seed: int = 0

    def shape(self) -> tuple[int, ...]:
        lead = (2, self.num_blocks) if self.stacked else (self.num_blocks,)
        return lead + tuple(self.page_shape)

    def build(self, rank: int, device: torch.device) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + rank)
        dtype = getattr(torch, self.dtype)
        return [
            torch.randn(self.shape(), generator=gen).to(dtype).to(device)
            for _ in range(self.num_layers)
        ]

    def meta(self) -> list[torch.Tensor]:
        dtype = getattr(torch, self.dtype)
        return [
            torch.empty(self.shape(), dtype=dtype, device="meta") for _ in range(self.num_layers)
        ]


def _rank_device(device_type: str, rank: int) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, rank)


def _rank_main(
    rank: int,
    factory: KVFactory,
    spec: PoolSpec,
    regions_per_rank: int,
    device_type: str,
    checksums: bool,
    fail_job_ids: Collection[int],
    commands: Connection,
    results: Connection,
) -> None:
    """A rank process: build the KV shard, map the pool, serve submits until told to stop."""
    from kvflow.executors.torch.executor import TorchExecutor

    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:  # the forwarder and the command loop share the pipe
            try:
                results.send(message)
            except OSError:
                pass  # the parent is gone; nothing left to tell

    try:
        torch.set_num_threads(max(1, min(4, (os.cpu_count() or 2) // 2)))
        device = _rank_device(device_type, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kv = factory.build(rank, device)
        pool = HostPool.attach(
            spec, device=device, first_region=rank * regions_per_rank, num_regions=regions_per_rank
        )
        executor = TorchExecutor(
            kv,
            spec.cpu_blocks,
            pool=pool,
            rank=rank,
            checksums=checksums,
            fail_job_ids=fail_job_ids,
        )
    except Exception as e:  # noqa: BLE001 - reported to the parent, never a silent hang
        send(("error", rank, f"rank {rank} failed to start: {type(e).__name__}: {e}"))
        return
    send(("ready", rank, str(device)))

    stop = threading.Event()

    def forward() -> None:
        while not stop.is_set():
            for r in executor.wait_any(0.05):
                send(("result", r.job_id, r.rank, r.ok, r.error, r.corrupt))

    forwarder = threading.Thread(target=forward, name=f"kvflow-rank{rank}-fwd", daemon=True)
    forwarder.start()
    while True:
        try:
            message = commands.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if message is None:
            break
        kind, payload = message
        if kind == "submit":
            jobs = _JOBS.decode(payload)
            try:
                executor.submit(jobs)
            except KvflowError as e:
                for job in jobs:
                    send(("result", job.job_id, rank, False, f"rank {rank}: {e}", ()))
        elif kind == "pages":
            blocks = torch.tensor(payload, dtype=torch.int64, device=device)
            data = b"".join(
                r.pages.index_select(0, blocks).cpu().numpy().tobytes()
                for r in executor.layout.regions
            )
            send(("pages", rank, data))
    executor.close()
    stop.set()
    forwarder.join()
    for r in executor.poll():
        send(("result", r.job_id, r.rank, r.ok, r.error, r.corrupt))
    pool.close()


class RankGroup:
    """``world_size`` rank processes sharing one host pool; the engine-facing side of them.

    ``submit(jobs)`` goes to every rank; ``poll()`` returns ``JobResult(job_id, rank, ok, error)``
    from all ranks (a job is done when every rank reported ok: the core's rule). Each rank
    has its own pair of pipes, so a rank killed mid-write cannot wedge the others' channel;
    the parent merges them into one list.
    """

    def __init__(
        self,
        factory: KVFactory,
        cpu_blocks: int,
        world_size: int,
        *,
        device_type: str = "cpu",
        checksums: bool = False,
        fail_job_ids: Mapping[int, Collection[int]] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if not is_int(world_size) or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        if device_type != "cpu":
            count = torch.accelerator.device_count() if hasattr(torch, "accelerator") else 0
            if count < world_size:
                raise ConfigError(
                    f"world_size={world_size} needs {world_size} {device_type} devices, "
                    f"found {count}"
                )
        layout = KVLayout.from_caches(factory.meta())
        self.world_size = world_size
        self.regions_per_rank = layout.num_regions
        self.kv_dtype = layout.kv_dtype  # (part of the lower tiers' layout identity)
        self.pool = HostPool.create(
            layout.page_bytes * world_size, cpu_blocks, device="cpu", shared=True
        )
        if not self.pool.enabled:
            raise ConfigError("cpu_blocks=0: offload disabled, no rank processes are started")
        ctx = mp.get_context("spawn")
        faults = fail_job_ids or {}
        self._cmd: list[Connection] = []
        self._res: list[Connection] = []
        self._procs: list[Any] = []
        child_ends: list[Connection] = []
        for rank in range(world_size):
            cmd_read, cmd_write = ctx.Pipe(duplex=False)
            res_read, res_write = ctx.Pipe(duplex=False)
            self._cmd.append(cmd_write)
            self._res.append(res_read)
            child_ends += [cmd_read, res_write]
            self._procs.append(
                ctx.Process(
                    target=_rank_main,
                    args=(
                        rank,
                        factory,
                        self.pool.spec,
                        self.regions_per_rank,
                        device_type,
                        checksums,
                        frozenset(faults.get(rank, ())),
                        cmd_read,
                        res_write,
                    ),
                    name=f"kvflow-rank{rank}",
                    daemon=True,
                )
            )
        self._pending: list[set[int]] = [set() for _ in range(world_size)]
        self._submitted: set[int] = set()
        self._ready: list[JobResult] = []
        self._pages: dict[int, bytes] = {}
        self._started: dict[int, str] = {}
        self._start_errors: list[str] = []
        self._dead: set[int] = set()
        self._closed = False
        for p in self._procs:
            p.start()
        for end in child_ends:
            end.close()  # only the children hold these now: a dead child reads as EOF here
        try:
            self._await_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.devices = [self._started[r] for r in range(world_size)]

    def _await_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self._started) < self.world_size:
            if self._start_errors:
                raise KvflowError(self._start_errors[0])
            if self._dead:
                raise KvflowError(f"rank {min(self._dead)} exited while starting")
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(self._started))
                raise KvflowError(f"ranks {missing} did not start within {timeout_s} s")
            self._drain(0.05)

    @property
    def host_slots(self) -> int:
        """The shared pool's slots (an engine checks them against its config's, F11)."""
        return self.pool.cpu_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes one block's copy moves, every rank's shard of it (one slot of the pool)."""
        return self.pool.spec.block_bytes

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any = None) -> None:
        """Send ``jobs`` to every rank. ``compute_done`` must be None: events do not cross
        processes; each rank's copies start when the rank receives them."""
        if self._closed:
            raise KvflowError("rank group is closed")
        if compute_done is not None:
            raise ConfigError(
                "RankGroup cannot wait on an engine event across processes; pass None"
            )
        jobs = list(jobs)
        ids = [j.job_id for j in jobs]
        dup = [i for i in ids if i in self._submitted] or [i for i in ids if ids.count(i) > 1]
        if dup:
            raise Rejected(f"job {dup[0]} was already submitted; a job is submitted once (F5)")
        self._submitted.update(ids)
        payload = _ENCODE.encode(jobs)
        for rank in range(self.world_size):
            self._pending[rank].update(ids)  # a dead rank fails them at the next poll (_reap)
            if rank in self._dead:
                continue
            try:
                self._cmd[rank].send(("submit", payload))
            except OSError:
                self._mark_dead(rank)

    def poll(self) -> list[JobResult]:
        """Every rank's results that arrived since the last poll; never blocks."""
        self._drain(0)
        self._reap()
        out, self._ready = self._ready, []
        return out

    def wait(self, job_id: int, timeout_s: float = 60.0) -> list[JobResult]:
        """Block until every rank reported ``job_id``; its results (poll still reports them)."""
        if job_id not in self._submitted:
            raise UnknownJob(f"wait: job {job_id} was never submitted to this rank group")
        deadline = time.monotonic() + timeout_s
        while any(job_id in p for p in self._pending):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not reported by every rank after {timeout_s} s")
            self._drain(0.05)
            self._reap()
        return [r for r in self._ready if r.job_id == job_id]

    def read_device_pages(self, rank: int, blocks: Sequence[int], timeout_s: float = 60.0) -> bytes:
        """Diagnostics: the bytes of ``blocks`` in rank ``rank``'s device KV (region-major)."""
        self._cmd[rank].send(("pages", list(blocks)))
        deadline = time.monotonic() + timeout_s
        while rank not in self._pages:
            if time.monotonic() > deadline or rank in self._dead:
                raise TimeoutError(f"rank {rank} did not answer within {timeout_s} s")
            self._drain(0.05)
        return self._pages.pop(rank)

    def _drain(self, timeout_s: float) -> None:
        """Read whatever the ranks sent; wait up to ``timeout_s`` for the first message."""
        live = [self._res[r] for r in range(self.world_size) if r not in self._dead]
        if not live:
            return
        for ready in mp_connection.wait(live, timeout=timeout_s):
            assert isinstance(ready, Connection)
            conn: Connection = ready
            rank = self._res.index(conn)
            try:
                while conn.poll():
                    self._handle(conn.recv())
            except (EOFError, OSError):
                self._mark_dead(rank)

    def _handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "result":
            _, job_id, rank, ok, error, corrupt = msg
            self._pending[rank].discard(job_id)
            self._ready.append(JobResult(job_id=job_id, rank=rank, ok=ok, error=error, corrupt=corrupt))
        elif msg[0] == "pages":
            self._pages[msg[1]] = msg[2]
        elif msg[0] == "ready":
            self._started[msg[1]] = msg[2]
        elif msg[0] == "error":
            self._start_errors.append(msg[2])

    def _mark_dead(self, rank: int) -> None:
        self._dead.add(rank)

    def _reap(self) -> None:
        """A dead rank fails its in-flight jobs once (F2)."""
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive() and rank not in self._dead and not self._closed:
                self._dead.add(rank)
            if rank in self._dead and self._pending[rank]:
                code = proc.exitcode
                for job_id in sorted(self._pending[rank]):
                    self._ready.append(
                        JobResult(job_id, rank, False, f"rank {rank} process exited (code {code})")
                    )
                self._pending[rank].clear()

    def close(self, timeout_s: float = 30.0) -> None:
        """Let ranks finish in-flight copies, stop them, remove the shared pool."""
        if self._closed:
            return
        for rank, proc in enumerate(self._procs):
            if proc.is_alive() and rank not in self._dead:
                try:
                    self._cmd[rank].send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            if proc.pid is None:
                continue
            while proc.is_alive() and time.monotonic() < deadline:
                self._drain(0.05)
            proc.join(timeout=0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._drain(0)
        self._closed = True
        for conn in self._cmd + self._res:
            conn.close()
        self.pool.close()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KVFactory", "RandomKV", "RankGroup"]
