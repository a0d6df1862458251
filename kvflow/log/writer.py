"""Writing a trace as the engine runs (the format: docs/debugging.md, "The trace format").

Deterministic: the same run gives the same bytes (no timestamps in the header; events carry only
injected time). Records (frozen structs) are kept as they are recorded and encoded in batches
(``SEAL_RECORDS``, and at each checkpoint and flush), one call per batch; each checkpoint
records the digest of every byte before it (``RecordChain``).

Where the work is done: encoding and the state digests in the engine's thread (they read live
objects); the record digest and the file writes, which read only finished bytes and release the
GIL, in the writer's own thread when the writer flushes by itself (``auto_flush``, the sync
engine's and the vLLM connector's writers): the engine's thread hands each encoded batch over
and goes on. The worker takes what it is given in order, so the bytes, the record digests and
the checkpoint lines are the same as if the engine's thread had done it all. A writer whose
owner writes for it (``auto_flush=False``: the async engine, with ``take_pending``) does
everything in the calling thread.

What a trace guarantees after a crash (the writer's process killed at any point): everything up
to its last completed write is on disk and reads back, plain or gzip (each write ends a gzip sync
point, so a cut stream decompresses up to it); a line cut in the middle is reported and ignored.
The header is written at once. Writes: every ``flush_records`` records (4,096 by default; the
worker writes them as soon as it gets to them), at each ``flush()``, which returns once
everything recorded is written (the async engine flushes from a worker thread every
``flush_interval_s``, the vLLM connector every step) and at ``close()``, which also fsyncs: a
closed trace survives a power loss, an open one only a crash of its process.
"""

from __future__ import annotations

import gzip
import os
import queue
import threading
from typing import IO, Any, cast

import msgspec

from kvflow._version import __version__
from kvflow.core.config import Config
from kvflow.log.format import (
    DEFAULT_CHECKPOINT_EVERY,
    TRACE_FORMAT,
    TRACE_VERSION,
    Checkpoint,
    Header,
    RecordChain,
)

SEAL_RECORDS = 512
"""Records are encoded (and handed on to the record chain) in batches of about this many: one C
call for many records, while the records are still in the CPU's caches and before they would
live long enough to keep Python's garbage collector busy (their tuples are tracked until then)."""

QUEUED_AT_MOST = 64
"""Items (mostly batches of ``SEAL_RECORDS``) the worker may have queued before the engine's
thread waits for it."""

_WRITE = object()  # worker's queue: write what came before (a flush)
_STOP = object()  # worker's queue: write what came before, then end


class TraceWriter:
    """Writes a trace file as the manager runs (the log of an engine given ``trace_path``)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config,
        *,
        meta: dict[str, Any] | None = None,
        checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
        auto_flush: bool = True,
        flush_records: int = 4096,
    ) -> None:
        self.path = str(path)
        self.auto_flush = auto_flush
        self.flush_records = max(1, flush_records)
        self.config = config
        self.checkpoint_every = max(1, checkpoint_every)
        self._encoder = msgspec.json.Encoder()
        self._encode_lines = self._encoder.encode_lines
        raw: IO[bytes]
        if self.path.endswith(".gz"):
            raw = cast(IO[bytes], gzip.GzipFile(self.path, "wb", compresslevel=6, mtime=0))
        else:
            raw = open(self.path, "wb")
        self._file = raw
        self._pending: list[Any] = []  # records not yet encoded (they are frozen structs)
        # The manager calls the two record methods once per command: they are the pending
        # list's own C methods, so recording runs no Python code. What after_command needs to
        # know follows from the list's length and the state's seq (events are numbered without
        # gaps from the first, so the events since a checkpoint are the seqs after it).
        self.record_command = self._pending.append
        self.record_events = self._pending.extend
        self._sealed: list[bytes] = []  # fed to the chain, not yet written
        self._sealed_records = 0  # records encoded and not yet written (checkpoints not counted)
        self._rearm()
        self._last_checkpoint_seq = 0
        self._checkpoint_after = self.checkpoint_every  # the last seq that needs no checkpoint yet
        self.closed = False
        header = Header(
            format=TRACE_FORMAT,
            version=TRACE_VERSION,
            kvflow=__version__,
            config=config.to_dict(),
            meta=dict(meta or {}),
        )
        first = self._encoder.encode(header) + b"\n"
        self._chain = RecordChain(first)
        self._file.write(first)
        self._file.flush()  # on disk at once: a writer killed before its first flush leaves a readable trace
        # the worker's queue: encoded batches (bytes), checkpoints ((seq, state digest)),
        # _WRITE and _STOP, in the order the engine's thread made them
        self._queue: queue.Queue[Any] | None = None
        self._failure: BaseException | None = None  # what stopped the worker, raised to the caller
        self._worker: threading.Thread | None = None
        self._stop_sent = False
        if auto_flush:
            # (bounded: an engine that outruns its disk waits for it, as it did writing itself)
            self._queue = queue.Queue(maxsize=QUEUED_AT_MOST)
            self._worker = threading.Thread(target=self._work, name="kvflow-trace", daemon=True)
            self._worker.start()

    def after_command(self, state: Any) -> None:
        # (one comparison each when nothing is due: this runs after every command)
        if state.next_seq > self._checkpoint_after:
            self.checkpoint(state)
        if len(self._pending) >= self._seal_at:
            self._seal()
            if self._sealed_records >= self.flush_records and self.auto_flush:
                self._hand_over(_WRITE)  # (not waited for: the worker writes while the engine runs)
                self._sealed_records = 0
                self._rearm()

    def _seal(self) -> None:
        """Encode the pending records (one C call for all of them) and pass the lines on to
        the record chain."""
        pending = self._pending
        if pending:
            blob = self._encode_lines(pending)
            self._sealed_records += len(pending)
            self._rearm()
            pending.clear()  # (the same list: record_command and record_events are its methods)
            self._hand_over(blob)

    def _rearm(self) -> None:
        """How many pending records make ``after_command`` encode a batch: ``SEAL_RECORDS``, or
        fewer where the records not yet written then reach ``flush_records``."""
        flush_at = self.flush_records - self._sealed_records if self.auto_flush else 1 << 62
        self._seal_at = min(SEAL_RECORDS, flush_at)

    def _hand_over(self, item: Any) -> None:
        """Give an encoded batch, a checkpoint or a write to the worker, or (no worker) do it."""
        if self._queue is not None:
            self._queue.put(item)  # (after a failure the worker only takes it off the queue)
        else:
            self._take([item])
        if self._failure is not None:
            raise self._failure

    def _take(self, items: list[Any]) -> None:
        """Chain the encoded batches and checkpoints, and write what was chained at each
        _WRITE or _STOP, in order (in the worker's thread where there is one). Consecutive
        batches are chained in one update: where the worker fell behind, it catches up with
        one hash and one write, each of which lets the engine's thread run meanwhile."""
        batches: list[bytes] = []
        for item in items:
            if type(item) is bytes:
                batches.append(item)
                continue
            if batches:
                self._chain_batches(batches)
                batches = []
            if type(item) is tuple:
                seq, digest = item
                checkpoint = Checkpoint(seq=seq, digest=digest, records=self._chain.value())
                line = self._encoder.encode(checkpoint) + b"\n"
                self._chain.update(line)
                self._sealed.append(line)
            else:  # _WRITE, _STOP
                blob = b"".join(self._sealed)
                self._sealed.clear()
                self.write_bytes(blob)
        if batches:
            self._chain_batches(batches)

    def _chain_batches(self, batches: list[bytes]) -> None:
        blob = b"".join(batches) if len(batches) > 1 else batches[0]
        self._chain.update(blob)
        self._sealed.append(blob)

    def _work(self) -> None:
        """The worker: chain and write what the engine's thread hands over, until _STOP, taking
        everything queued at once. After a failure (a full disk) it only empties the queue: the
        failure is raised in the engine's thread at its next hand-over, and nothing after it is
        written."""
        assert self._queue is not None
        get, get_now, done = self._queue.get, self._queue.get_nowait, self._queue.task_done
        while True:
            items = [get()]
            while items[-1] is not _STOP:
                try:
                    items.append(get_now())
                except queue.Empty:
                    break
            try:
                if self._failure is None:
                    self._take(items)
            except BaseException as failure:  # (handed to the engine's thread)
                self._failure = failure
            finally:
                for _ in items:
                    done()
            if items[-1] is _STOP:
                return

    def take_pending(self) -> bytes:
        """Detach the encoded lines not yet written (the async engine writes them from a
        worker thread with ``write_bytes``, keeping file I/O off the event loop). Only for a
        writer without its own worker (``auto_flush=False``)."""
        if self._queue is not None:
            raise RuntimeError("take_pending: this writer writes in its own thread (auto_flush)")
        self._seal()
        blob = b"".join(self._sealed)
        self._sealed.clear()
        self._sealed_records = 0
        self._rearm()
        return blob

    def write_bytes(self, blob: bytes) -> None:
        if blob:
            self._file.write(blob)
            self._file.flush()

    def checkpoint(self, state: Any) -> None:
        if state.last_seq == self._last_checkpoint_seq and self._last_checkpoint_seq:
            return
        self._seal()
        self._hand_over((state.last_seq, state.digest()))  # (the record digest is the worker's)
        self._last_checkpoint_seq = state.last_seq
        self._checkpoint_after = state.last_seq + self.checkpoint_every

    def flush(self) -> None:
        """Hand every recorded line to the operating system, and return once it has them (a
        crash of this process loses none of them from then on; a gzip trace ends a sync point
        here)."""
        self._finish(_WRITE)

    def _finish(self, last: Any) -> None:
        """Encode what is pending, write everything, and wait for the worker to be done."""
        self._seal()
        self._sealed_records = 0
        self._rearm()
        self._stop_sent = last is _STOP
        self._hand_over(last)
        if self._queue is not None:
            self._queue.join()
            if self._failure is not None:
                raise self._failure

    def close(self, state: Any = None) -> None:
        if self.closed:
            return
        try:
            if state is not None:
                self.checkpoint(state)
            self._finish(_STOP)
        finally:
            self.closed = True
            if self._worker is not None:
                if not self._stop_sent and self._queue is not None:
                    self._queue.put(_STOP)  # (it ends, whatever failed)
                self._worker.join()
            self._file.close()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # (the file was removed or replaced meanwhile: nothing of ours to sync)
        try:
            os.fsync(fd)  # a closed trace survives a power loss too
        except OSError:
            pass  # a pipe or a device file: there is no disk to reach
        finally:
            os.close(fd)
