"""The disk tier's executor: disk jobs run in a thread of their own, beside the engine's device
executor, and report through the same ``poll()``.

``DiskTierExecutor`` wraps the engine's executor (a torch executor with its host pool, or one
already wrapped by another tier): jobs whose direction is ``disk_store`` / ``disk_load`` go to
one worker thread that reads and writes the tier's file (``kvflow.tiers.disk_file``, whose own
I/O threads keep several blocks in flight); every other job goes to the wrapped executor
unchanged, and so does every attribute this wrapper does not define (a remote tier's probes, the
host pool), so tiers stack: ``redis_tier(disk_tier(executor, ...), ...)``.

The engine's step never waits on the disk: ``submit`` only enqueues, ``poll`` only drains the
thread's finished results. A job's outcome is reported only once the thread is done with its
host slots and disk slots, so a timed-out job stays fenced (F15) until then. Whatever the file
system does — a full disk, a read-only mount, a file truncated or deleted underneath, an I/O
error, an entry that does not validate — becomes that job's failure, never an exception in the
engine, and never data: a load reports only what validated. A disk job moves every rank's
pages of the shared host pool at once, so it answers for every rank.

A load refused by the entry's seal (forged, another tenant's, another key's ...) fails its
job, so the engine drops the block from its disk index; it is counted by reason
(``disk_rejected()``, the ``REJECTED`` reasons of ``kvflow.tiers.entry``) and handed to the
engine (``take_refused()``, which it records in its trace).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

import structlog

from kvflow.core.commands import JobResult, TierRefused
from kvflow.core.config import Config
from kvflow.core.errors import ConfigError
from kvflow.core.jobs import DISK_LOAD, DISK_STORE, TransferJob
from kvflow.core.names import BlockName, tier_names
from kvflow.tiers.disk_file import DiskEntryFile
from kvflow.tiers.entry import REJECTED, Layout, check_shard, codec_for
from kvflow.tiers.host_slots import OwnsPool, SlotPages
from kvflow.tiers.keys import TierKeys
from kvflow.tiers.refusals import Refusals

_log = structlog.get_logger("kvflow")

DISK_DIRECTIONS = (DISK_STORE, DISK_LOAD)
_STOP = object()


class DiskTierExecutor:
    """See the module doc."""

    def __init__(self, inner: Any, disk: DiskEntryFile, slots: SlotPages, *, ranks: Sequence[int] = (0,)) -> None:
        """``ranks``: the ranks whose results a disk job's end reports (every rank of the
        world when one host pool serves them all; a vLLM worker, its own)."""
        self.inner = inner
        self.disk = disk
        self.slots = slots
        self._ranks = tuple(ranks)
        # one thread per direction, so that a load never waits behind a long spill of stores
        # (their slots are disjoint: the decisions never hand out a disk slot a copy uses)
        self._work: dict[str, queue.SimpleQueue[Any]] = {d: queue.SimpleQueue() for d in DISK_DIRECTIONS}
        self._done: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        # (each key is written by one thread: a store's or a load's)
        self.stats = dict.fromkeys(
            ("disk_stored_blocks", "disk_loaded_blocks", "disk_store_failed_jobs", "disk_load_failed_jobs"), 0
        )
        self._rejected = dict.fromkeys(REJECTED, 0)  # entries refused, by reason (the load thread's)
        self._refusals = Refusals("disk")  # what the engine has not taken yet
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, args=(self._work[d],), name=f"kvflow-{d.replace('_', '-')}", daemon=True)
            for d in DISK_DIRECTIONS
        ]
        for thread in self._threads:
            thread.start()

    def __getattr__(self, name: str) -> Any:
        # (only for names this class does not define: the wrapped executor's own abilities)
        return getattr(self.__dict__["inner"], name)

    # -- the disk tier (kvflow.engine.protocols.ServesDiskTier) ---------------------------

    @property
    def disk_slots(self) -> int:
        return self.disk.slots

    def disk_entries(self) -> list[tuple[int, BlockName]]:
        """What the tier held when it was opened: ``(disk slot, block name)`` pairs its
        journal vouches for."""
        return list(self.disk.recovered)

    def disk_problem(self) -> str | None:
        return self.disk.degraded()

    def disk_rejected(self) -> dict[str, int]:
        """Entries refused by loads since the tier was opened, by reason (``REJECTED``: a
        slot found empty is no entry)."""
        return dict(self._rejected)

    def take_refused(self) -> list[TierRefused]:
        """The entries loads refused since the last call (``kvflow.engine.protocols.
        RefusesEntries``), and those of the tier this one wraps, if it refuses any."""
        return self._refusals.take(self.inner)

    # -- the engine's side (never blocks on the disk) ------------------------------------

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any = None) -> None:
        local = [j for j in jobs if j.direction not in DISK_DIRECTIONS]
        if local:
            self.inner.submit(local, compute_done)
        for job in jobs:
            if job.direction in DISK_DIRECTIONS:
                self._work[job.direction].put(job)

    def poll(self) -> list[JobResult]:
        results = list(self.inner.poll())
        while True:
            try:
                results.append(self._done.get_nowait())
            except queue.Empty:
                return results

    def close(self) -> None:
        """Finish the disk jobs at hand, stop the thread, close the file, then the wrapped
        executor."""
        if not self._closed:
            self._closed = True
            for work in self._work.values():
                work.put(_STOP)
            for thread in self._threads:
                thread.join()
            self.disk.close()
        self.inner.close()

    # -- the worker threads ---------------------------------------------------------------

    def _run(self, work: queue.SimpleQueue[Any]) -> None:
        while True:
            job = work.get()
            if job is _STOP:
                return
            ok, error = self._run_job(job)
            if not ok:
                self.stats[f"{job.direction}_failed_jobs"] += 1
            for rank in self._ranks:
                self._done.put(JobResult(job_id=job.job_id, rank=rank, ok=ok, error=error))

    def _run_job(self, job: TransferJob) -> tuple[bool, str | None]:
        try:
            names = tier_names(job.hashes, job.names)
            if len(names) != len(job.hashes) or not all(n.full for n in names):
                return False, "a block of the job has no name (forgotten by the engine)"
            items = [(d, n, self.slots.read(s)) for d, n, s in zip(job.disk_slots, names, job.slots)]
            if job.direction == DISK_STORE:
                errors = self.disk.store(items)
                verb, counter = "disk store", "disk_stored_blocks"
            else:
                errors = self.disk.load(items)
                verb, counter = "disk load", "disk_loaded_blocks"
            bad = [(h, e) for h, e in zip(job.hashes, errors) if e is not None]
            if job.direction == DISK_LOAD:
                # (a refused entry leaves the disk's index with its failed load: once per entry)
                refused = [(h, reason, job.job_id) for h, reason in bad if reason in self._rejected]
                for h, reason, _ in refused:
                    self._rejected[reason] += 1
                    name = names[job.hashes.index(h)]
                    _log.warning(
                        "kvflow.disk_entry_rejected", reason=reason, block=h, full_hash=name.full.hex(),
                        tenant=name.tenant.hex(), slot=job.disk_slots[job.hashes.index(h)],
                    )  # fmt: skip
                if refused:
                    self._refusals.add(refused)
            if bad:
                h, reason = bad[0]
                return False, f"{verb} failed on {len(bad)} of {len(errors)} blocks (block {h}: {reason})"
            self.stats[counter] += len(errors)
            return True, None
        except Exception as exc:  # F2: whatever happens is this job's failure
            return False, f"{type(exc).__name__}: {exc}"


def disk_tier(
    executor: object,
    config: Config,
    path: str | os.PathLike[str],
    *,
    model: str,
    io_threads: int = 4,
    direct: bool = True,
    ranks: Sequence[int] | None = None,
    keys: TierKeys | None = None,
    encrypt: bool | None = None,
    insecure_no_key: bool = False,
    shard: tuple[int, int] = (0, 1),
) -> DiskTierExecutor:
    """``executor`` (with its host pool) behind a disk tier in the directory ``path``: the
    executor to hand to ``SyncEngine`` with ``config`` (whose ``disk_blocks`` is the tier's
    size in blocks). ``model`` names the KV's model and dtype: with the pool's page sizes and
    ``config.block_tokens`` it is the layout identity every entry is framed and checked with;
    a directory written under another layout starts empty. ``io_threads`` blocks are read or
    written at once; ``direct`` uses ``O_DIRECT`` where the file system allows it. ``ranks``:
    whose results a disk job reports (default: every rank of ``config.world_size``, one host
    pool serving them all); ``shard``: (rank, ranks), this pool's part of every block when each
    rank has a pool (and a directory) of its own, part of the layout identity.

    Entries are sealed with ``keys`` (``kvflow.tiers.keys.TierKeys``): encrypted, or with
    ``encrypt=False`` authenticated in the clear. Without keys the tier refuses to start unless
    ``insecure_no_key=True`` (a private, single-tenant deployment: entries then carry a
    checksum anyone who can write the files can recompute)."""
    if not config.disk:
        raise ConfigError("the disk tier needs config.disk_blocks > 0")
    if not isinstance(executor, OwnsPool) or not executor.pool.enabled:
        raise ConfigError("the disk tier needs an executor with a host pool (cpu_blocks > 0)")
    slots = SlotPages.of_pool(executor.pool)
    layout = Layout(
        model=model, page_bytes=slots.page_bytes, block_tokens=config.block_tokens, kv_dtype=executor.kv_dtype,
        shard=check_shard(shard, "disk tier"),
    )  # fmt: skip
    codec = codec_for(layout, keys=keys, encrypt=encrypt, insecure_no_key=insecure_no_key, tier="disk tier")
    disk = DiskEntryFile(path, codec=codec, slots=config.disk_blocks, io_threads=io_threads, direct=direct)
    return DiskTierExecutor(executor, disk, slots, ranks=range(config.world_size) if ranks is None else ranks)
