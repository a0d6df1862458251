"""The remote tier's executor: remote jobs run in a thread of their own, beside the engine's
device executor, and report through the same ``poll()``.

``RemoteTierExecutor`` wraps the engine's executor (a torch executor with its host pool): jobs
whose direction is ``remote_store`` / ``remote_load`` go to worker threads that talk to the
remote store (``RedisBlockStore``), each with a connection of its own (``connections``);
every other job goes to the wrapped executor unchanged. The engine's step never waits on the
network: ``submit`` only enqueues, ``poll`` only drains the threads' finished results (a
thread-safe queue: F6).

A remote job is split into one part per worker (consecutive blocks), so that one request's blocks
move over every connection at once; the job's outcome is reported once every part is done (it
succeeds only if every part did), so only once the threads are done with its host slots: a
timed-out job's slots stay fenced (F15) until then; the store's own deadline (the job's) bounds
that wait.
Anything the thread hits — a refused write (OOM), a miss (evicted, foreign, damaged entry), a
lost connection, a bug — becomes that job's failure (F2), never an exception in the engine. A
remote job moves every rank's pages of the shared host pool at once, so it answers for every
rank of ``ranks`` (the world's, or this worker's alone when each rank has a pool of its own).

Probes: ``probe(names)`` asks the remote tier which of a lookup's missing blocks it holds (the
heads and lengths of their values: a value that cannot be the block's entry for this reader is
not offered); ``take_probed()`` hands over, for each probe over, the keys it was asked about and
those it found (a key a probe answered absent a moment ago is answered at once, absent again);
``take_found()`` the found keys alone, for an engine that records them (``RemoteFound``).

A value that was loaded and refused (a forged, damaged or foreign payload under a head that
fits) fails its load: the engine drops the block from its remote index. A value a probe can
refuse by its head alone (another tenant's, an unknown key's, an unkeyed one) is not offered.
Either refusal is counted by reason (``remote_rejected()``, the ``REJECTED`` reasons of
``kvflow.tiers.entry``), logged (``kvflow.remote_entry_rejected``) and handed to the engine
(``take_refused()``, which it records in its trace) once per value, and the
value is remembered with its identity (length and head, whose nonce is new for every write):
probes do not offer it again until its key is rewritten, so a bad entry costs one failed load at
most, not one every other request. It is remembered
here rather than deleted from the server: the keyspace is shared, and a value this reader refuses
may be one another deployment still reads (or one this reader's own next store replaces).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import structlog

from kvflow.core.commands import JobResult, TierRefused
from kvflow.core.jobs import REMOTE_LOAD, REMOTE_STORE, TransferJob
from kvflow.core.names import BlockName, tier_names
from kvflow.tiers.entry import REJECTED, Miss
from kvflow.tiers.host_slots import SlotPages
from kvflow.tiers.refusals import Refusals

REMOTE_DIRECTIONS = (REMOTE_STORE, REMOTE_LOAD)
_STOP = object()
# answers a probe or a refused load keeps, at most (then forgotten wholesale: they are hints)
_REMEMBERED = 1_000_000
# what close() waits beyond one store call for the thread to end
_CLOSE_MARGIN_S = 5.0


class _Parts:
    """A remote job split over the workers: its outcome once every part is done."""

    __slots__ = ("job", "left", "error")

    def __init__(self, job: TransferJob, parts: int) -> None:
        self.job = job
        self.left = parts
        self.error: str | None = None


class RemoteTierExecutor:
    """See the module doc. ``open_store()`` builds a store in each worker thread (redis-py
    clients stay in one thread); it is called again after a failure to build one."""

    def __init__(
        self,
        inner: Any,
        open_store: Callable[[], Any],
        slots: SlotPages,
        *,
        job_deadline_ms: float,
        ranks: Sequence[int] = (0,),
        clock: Callable[[], float] = time.monotonic,
        absent_ttl_s: float = 1.0,
        call_timeout_s: float = 60.0,
        connections: int = 1,
    ) -> None:
        """``absent_ttl_s``: a block a probe found absent is not asked about again for this
        long (a request waiting for its turn looks its prefix up every step).
        ``call_timeout_s``: the longest one call to the store can take (its attempts' socket
        timeouts): with the job deadline, it bounds how long ``close`` waits.
        ``connections``: worker threads, each with a store (a connection) of its own.
        ``ranks``: the ranks a remote job's end reports for."""
        self.inner = inner
        self.slots = slots
        self._open_store = open_store
        self._deadline_s = job_deadline_ms / 1000.0
        self._ranks = tuple(ranks)
        self._clock = clock
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        # (keys a probe was asked about, keys it found), one pair per probe over
        self._found: queue.SimpleQueue[tuple[list[int], list[int]]] = queue.SimpleQueue()
        self._log = structlog.get_logger("kvflow")
        self._results_ready = threading.Event()
        self._probing: dict[int, None] = {}  # hashes with a probe in flight (asked once)
        # hash -> until when a probe's "absent" stands (written by the worker thread only)
        self._absent_until: dict[int, float] = {}
        self._absent_ttl_s = absent_ttl_s
        # hash -> identity of the value a load refused (worker thread only)
        self._refused: dict[int, bytes] = {}
        self._close_wait_s = min(self._deadline_s, call_timeout_s) + _CLOSE_MARGIN_S
        self._stopping = threading.Event()
        self._local = threading.local()  # each worker's store
        self._lock = threading.Lock()  # the stats and the jobs' parts, shared by the workers
        self.connections = connections
        self.stats = {
            "remote_stored_blocks": 0, "remote_loaded_blocks": 0, "remote_failed_jobs": 0, "probed_blocks": 0,
        }  # fmt: skip
        self._rejected = dict.fromkeys(REJECTED, 0)  # values refused, by reason (under the lock)
        self._refusals = Refusals("remote")  # what the engine has not taken yet
        self._threads = [
            threading.Thread(target=self._run, name=f"kvflow-remote-{i}", daemon=True) for i in range(connections)
        ]
        for thread in self._threads:
            thread.start()

    def __getattr__(self, name: str) -> Any:
        # (only for names this class does not define: the wrapped executor's own abilities,
        # e.g. a disk tier's, so that tiers stack)
        return getattr(self.__dict__["inner"], name)

    # -- the engine's side (never blocks on the network) ---------------------------------

    @property
    def host_slots(self) -> int:
        """The host slots remote jobs read and write (an engine checks them against its
        config's, F11)."""
        return self.slots.cpu_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: one slot's pages."""
        return sum(self.slots.page_bytes)

    def submit(self, jobs: Sequence[TransferJob], compute_done: Any = None) -> None:
        local = [j for j in jobs if j.direction not in REMOTE_DIRECTIONS]
        if local:
            self.inner.submit(local, compute_done)
        deadline = self._clock() + self._deadline_s
        for job in jobs:
            if job.direction in REMOTE_DIRECTIONS:
                parts = _split(job, self.connections)
                whole = _Parts(job, len(parts))
                for part in parts:
                    self._work.put((part, deadline, whole))

    def probe(self, keys: Sequence[int], names: Sequence[BlockName] = ()) -> None:
        now, absent, probing = self._clock(), self._absent_until, self._probing
        todo = [i for i, k in enumerate(keys) if k not in probing and absent.get(k, 0.0) <= now]
        if len(todo) < len(keys):  # absent a moment ago: answered now (in flight: answered later)
            asking = {keys[i] for i in todo}
            known = [k for k in keys if k not in asking and k not in probing]
            if known:
                self._found.put((known, []))
        if todo:
            asked = [keys[i] for i in todo]
            probing.update(dict.fromkeys(asked))
            # (named in the worker: tier_names)
            work = (tuple(asked), tuple(names[i] for i in todo) if names else ())
            self._work.put((work, now + self._deadline_s, None))

    def remote_rejected(self) -> dict[str, int]:
        """Values refused since the tier was built (each once, by a probe or a load), by reason
        (``REJECTED``)."""
        with self._lock:
            return dict(self._rejected)

    def take_refused(self) -> list[TierRefused]:
        """The values refused since the last call, each once (``kvflow.engine.protocols.
        RefusesEntries``), and those of the tier this one wraps, if it refuses any."""
        return self._refusals.take(self.inner)

    def wait_results(self, timeout_s: float) -> bool:
        """Block (up to ``timeout_s``) until ``poll`` has remote results to hand over: an
        engine with nothing else to do waits here instead of stepping idly."""
        return self._results_ready.wait(timeout_s)

    def probing(self) -> bool:
        """Whether a probe's answer is still to come."""
        return bool(self._probing)

    def take_probed(self) -> tuple[list[int], list[int]]:
        """(the keys probes were asked about and are over for, those of them they found)
        since the last call: a key asked and not found is absent (or could not be asked)."""
        probed: list[int] = []
        found: list[int] = []
        answers = self._found
        while not answers.empty():  # (the engine's thread is the only one that takes)
            asked, there = answers.get_nowait()
            probed.extend(asked)
            found.extend(there)
        return probed, found

    def take_found(self) -> list[int]:
        return self.take_probed()[1]

    def poll(self) -> list[JobResult]:
        results: list[JobResult] = self.inner.poll()
        if not self._results_ready.is_set():  # (set after the results a thread puts: none yet)
            return results
        self._results_ready.clear()  # (before draining: a result put meanwhile sets it again)
        results = list(results)
        done = self._done
        while not done.empty():
            results.append(done.get_nowait())
        return results

    def close(self) -> None:
        """Stop the threads (each finishes the call at hand, bounded by its deadline and socket
        timeouts, and leaves the queued work), then close the wrapped executor."""
        self._stopping.set()
        for _ in self._threads:
            self._work.put(_STOP)
        until = time.monotonic() + self._close_wait_s  # (they stop side by side)
        for thread in self._threads:
            thread.join(timeout=max(0.0, until - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            raise RuntimeError("the remote tier's thread did not stop: its copies may still run")
        self.inner.close()

    # -- the worker thread ----------------------------------------------------------------

    def _run(self) -> None:
        self._local.store = None
        while True:
            item = self._work.get()
            if item is _STOP or self._stopping.is_set():
                break
            work, deadline, whole = item
            if whole is None:
                self._run_probe(work, deadline)
                continue
            ok, error = self._run_job(work, deadline)
            with self._lock:
                whole.left -= 1
                if not ok and whole.error is None:
                    whole.error = error or "failed"
                if whole.left:
                    continue
                if whole.error is not None:
                    self.stats["remote_failed_jobs"] += 1
            ok, error, job_id = whole.error is None, whole.error, whole.job.job_id
            for rank in self._ranks:
                self._done.put(JobResult(job_id=job_id, rank=rank, ok=ok, error=error))
            self._results_ready.set()
        if self._local.store is not None:
            try:
                self._local.store.close()
            except Exception:
                pass

    def _store_or_none(self) -> Any:
        if self._local.store is None:
            self._local.store = self._open_store()
        return self._local.store

    def _count(self, stat: str, n: int) -> None:
        with self._lock:
            self.stats[stat] += n

    def _run_probe(self, work: tuple[tuple[int, ...], tuple[BlockName, ...]], deadline: float) -> None:
        keys, given = work
        found: list[int] = []
        try:
            names = [n for n in tier_names(keys, given) if n.full]
            seen = self._store_or_none().seen(names, deadline)
            self._count("probed_blocks", len(names))
            refused = self._refused
            for name, s in zip(names, seen):
                if isinstance(s, Miss):
                    self._refuse(name, s)
            there = [isinstance(s, bytes) and refused.get(n.key) != s for n, s in zip(names, seen)]
            found = [n.key for n, t in zip(names, there) if t]
            absent, until = self._absent_until, self._clock() + self._absent_ttl_s
            if len(absent) > _REMEMBERED:  # bounded: forget the old answers wholesale
                absent.clear()
            for name, t in zip(names, there):
                if t:
                    absent.pop(name.key, None)
                    refused.pop(name.key, None)  # (rewritten since it was refused)
                else:
                    absent[name.key] = until
        except Exception:
            pass  # a probe that fails finds nothing; the lookup just misses
        finally:
            for key in keys:
                self._probing.pop(key, None)
            self._found.put((list(keys), found))

    def _refuse(self, name: BlockName, miss: Miss, job_id: int = 0) -> None:
        """A value under ``name``'s key refused (by a probe, or the load ``job_id``): counted by
        reason, logged, kept for ``take_refused`` and remembered once per value (a rewrite of
        the key is another value)."""
        with self._lock:  # (several workers may refuse values at once)
            if not miss.seen or self._refused.get(name.key) == miss.seen:
                return
            if len(self._refused) > _REMEMBERED:
                self._refused.clear()
            self._refused[name.key] = miss.seen
            if miss.reason in self._rejected:
                self._rejected[miss.reason] += 1
            self._refusals.add([(name.key, miss.reason, job_id)])
        self._log.warning(
            "kvflow.remote_entry_rejected", reason=miss.reason, block=name.key,
            full_hash=name.full.hex(), tenant=name.tenant.hex(),
        )  # fmt: skip

    def _run_job(self, job: TransferJob, deadline: float) -> tuple[bool, str | None]:
        try:
            names = tier_names(job.hashes, job.names)
            if len(names) != len(job.hashes) or not all(n.full for n in names):
                return False, "a block of the job has no name (forgotten by the engine)"
            store = self._store_or_none()
            if job.direction == REMOTE_STORE:
                errors = store.put([(n, self.slots.read(s)) for n, s in zip(names, job.slots)], deadline)
                bad = [(h, e) for h, e in zip(job.hashes, errors) if e is not None]
                if bad:
                    return False, f"remote store refused {len(bad)} of {len(errors)} blocks: {bad[0][1]}"
                self._count("remote_stored_blocks", len(errors))
                for h in job.hashes:  # rewritten by this very store
                    self._refused.pop(h, None)
                return True, None
            got = store.get(names, [self.slots.read(s) for s in job.slots], deadline)
            misses = [(n, g) for n, g in zip(names, got) if g is not None]
            if misses:
                for name, miss in misses:
                    self._refuse(name, miss, job.job_id)
                name, miss = misses[0]
                return False, f"remote miss on {len(misses)} of {len(got)} blocks (block {name.key}: {miss.reason})"
            self._count("remote_loaded_blocks", len(got))
            return True, None
        except Exception as exc:  # F2: whatever happens is this job's failure
            if not isinstance(exc, _expected_errors()):
                self._local.store = None  # rebuild the client for the next job
            return False, f"{type(exc).__name__}: {exc}"


def _split(job: TransferJob, workers: int) -> list[TransferJob]:
    """``job`` in at most ``workers`` parts of consecutive blocks, as even as can be."""
    n = len(job.hashes)
    parts = min(workers, n)
    if parts <= 1:
        return [job]
    bounds = [n * i // parts for i in range(parts + 1)]
    return [
        msgspec.structs.replace(
            job,
            slots=job.slots[a:b],
            hashes=job.hashes[a:b],
            names=job.names[a:b],
            device_blocks=job.device_blocks[a:b],
        )
        for a, b in zip(bounds, bounds[1:])
    ]


def _expected_errors() -> tuple[type[BaseException], ...]:
    from kvflow.tiers.redis_store import RemoteUnavailable

    return (RemoteUnavailable,)
