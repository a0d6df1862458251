"""Writing a trace as the engine runs (DESIGN §5).

Deterministic: the same run gives the same bytes (no timestamps in the header; events carry only
injected time). Records (frozen structs) are kept as they are recorded and encoded in batches
(``SEAL_RECORDS``, and at each checkpoint and flush), one call per batch; each checkpoint
records the digest of every byte before it (``RecordChain``).

What a trace guarantees after a crash (the writer's process killed at any point): everything up
to its last flush is on disk and reads back, plain or gzip (each flush ends a gzip sync point, so
a cut stream decompresses up to it); a line cut in the middle is reported and ignored. The header
is flushed at once. Flushes: every ``flush_records`` records (4,096 by default), at each
``flush()`` (the async engine flushes from a worker thread every ``flush_interval_s``, the vLLM
connector every step) and at ``close()``, which also fsyncs: a closed trace survives a power
loss, an open one only a crash of its process.
"""

from __future__ import annotations

import gzip
import os
from typing import IO, Any, cast

import msgspec

from kvflow._version import __version__
from kvflow.config import Config
from kvflow.trace.format import (
    DEFAULT_CHECKPOINT_EVERY,
    TRACE_FORMAT,
    TRACE_VERSION,
    Checkpoint,
    Header,
    RecordChain,
)

SEAL_RECORDS = 512
"""Records are encoded (and fed to the record chain) in batches of about this many: one C call
for many records, while the records are still in the CPU's caches and before they would live
long enough to keep Python's garbage collector busy (their tuples are tracked until then)."""


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
        self._sealed_records = 0  # records in ``_sealed`` (checkpoints not counted)
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

    def after_command(self, state: Any) -> None:
        # (one comparison each when nothing is due: this runs after every command)
        if state.next_seq > self._checkpoint_after:
            self.checkpoint(state)
        if len(self._pending) >= self._seal_at:
            if len(self._pending) >= self._flush_at:
                self.flush()
            else:
                self._seal()

    def _seal(self) -> None:
        """Encode the pending records (one C call for all of them) and feed the lines to the
        record chain."""
        pending = self._pending
        if pending:
            blob = self._encode_lines(pending)
            self._chain.update(blob)
            self._sealed.append(blob)
            self._sealed_records += len(pending)
            self._rearm()
            pending.clear()  # (the same list: record_command and record_events are its methods)

    def take_pending(self) -> bytes:
        """Detach the encoded lines not yet written (the async engine writes them from a
        worker thread with ``write_bytes``, keeping file I/O off the event loop)."""
        self._seal()
        blob = b"".join(self._sealed)
        self._sealed.clear()
        self._sealed_records = 0
        self._rearm()
        return blob

    def _rearm(self) -> None:
        """How many pending records make ``after_command`` flush (the records not yet written
        reach ``flush_records``) or encode a batch (``SEAL_RECORDS``, or fewer to flush sooner)."""
        self._flush_at = self.flush_records - self._sealed_records if self.auto_flush else 1 << 62
        self._seal_at = min(SEAL_RECORDS, self._flush_at)

    def write_bytes(self, blob: bytes) -> None:
        if blob:
            self._file.write(blob)
            self._file.flush()

    def checkpoint(self, state: Any) -> None:
        if state.last_seq == self._last_checkpoint_seq and self._last_checkpoint_seq:
            return
        self._seal()
        line = self._encoder.encode(
            Checkpoint(seq=state.last_seq, digest=state.digest(), records=self._chain.value())
        ) + b"\n"
        self._chain.update(line)
        self._sealed.append(line)
        self._last_checkpoint_seq = state.last_seq
        self._checkpoint_after = state.last_seq + self.checkpoint_every

    def flush(self) -> None:
        """Hand every recorded line to the operating system (a crash of this process loses
        none of them from then on; a gzip trace ends a sync point here)."""
        self.write_bytes(self.take_pending())

    def close(self, state: Any = None) -> None:
        if self.closed:
            return
        if state is not None:
            self.checkpoint(state)
        self.flush()
        self._file.close()
        self.closed = True
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
