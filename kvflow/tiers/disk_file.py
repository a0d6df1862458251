"""The disk tier's file: fixed-size slots of framed entries in one preallocated file, and a journal
that says which slot holds which block, so that the tier outlives its process.

A directory holds three files and a lock:

* ``data``: ``slots`` slots of ``slot_bytes`` each, preallocated. A slot is an aligned header
  block (the head of a sealed entry, ``kvflow.tiers.entry``: its header, with the block's full
  hash and tenant, then its tag) then the payload (encrypted, or in the clear under a tag),
  padded to the alignment. Written and read with ``O_DIRECT`` (no page cache: the host pool is
  the cache) by a pool of I/O threads, one entry per ``pwritev``/``preadv``; straight from and
  into the host pool's pages when they are aligned (decrypted in place), else (and to encrypt)
  through an aligned bounce buffer per thread.
* ``journal``: batches of records ``(slot, full hash, tenant)`` or ``(slot, nothing)``, each batch framed
  and checksummed. A store writes its batch's entries, makes them durable (one ``fdatasync``),
  and only then appends their records: a record never names data that a crash could lose. At
  open the journal is replayed (the last record of a slot wins); a torn tail is cut off.
* ``meta.json``: the layout, the slot size and count, and the journal's generation. A directory
  whose meta names anything else starts cold (re-initialised), and says so in ``restart_note``.

Whatever the journal vouches for, a load believes only the sealed entry: a slot whose bytes are
not the asked block, for its tenant, under this layout, sealed by a key this reader holds, whole,
is a miss with a reason (``REASONS``), never data. So a crash at any point (mid-write,
mid-record, mid-compaction), or anyone who can write the files, can cost entries but never serve
a wrong one.

File-system failures are answers, not exceptions: each item of a batch gets ``None`` or a one-line
reason (``"ENOSPC: No space left on device"``), and ``degraded()`` names the last failure of the
file system itself (full, read-only, I/O error, the file truncated or deleted underneath).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import xxhash

from kvflow.core.errors import ConfigError
from kvflow.core.names import BlockName, name_from
from kvflow.tiers.entry import (
    ENCRYPT,
    FORMAT_VERSION,
    HEADER_BYTES,
    NONCE_BYTES,
    EntryCodec,
    Layout,
    Miss,
)

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a page: every device's block fits)
DATA, JOURNAL, META, LOCK = "data", "journal", "meta.json", "lock"
# a journal batch: magic, record count, xxh3-64 of its records (seeded with the generation)
_BATCH = struct.Struct("<4sIQ")
_BATCH_MAGIC = b"KVJB"
# a record: slot, full hash (32 bytes), tenant id (16), 1 = holds the block / 0 = holds nothing
_RECORD = np.dtype([("slot", "<u8"), ("full", "V32"), ("tenant", "V16"), ("holds", "u1"), ("pad", "V7")])
_RECORD_BYTES = _RECORD.itemsize
_MAX_BATCH = 1 << 20  # records per journal batch (a longer list goes as several)
# file-system failures (the tier's own state), as opposed to one entry being wrong
_FS_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.ENOENT,
                        errno.ESTALE, errno.ENXIO, errno.ENODEV})  # fmt: skip

Item = tuple[int, BlockName, Sequence[memoryview]]
_Buffer = memoryview | mmap.mmap | bytes


def slot_bytes_of(layout: Layout) -> int:
    """One slot: the header block, then the payload padded to the alignment."""
    return ALIGN + -(-layout.payload_bytes // ALIGN) * ALIGN


def reason_of(exc: OSError) -> str:
    """``"ENOSPC: No space left on device"``: the errno's name, then what it means."""
    name = errno.errorcode.get(exc.errno or 0, f"errno {exc.errno}")
    return f"{name}: {exc.strerror or exc}"


class Meta(msgspec.Struct, frozen=True):
    format: int
    model: str
    page_bytes: list[int]
    block_tokens: int
    layout_digest: str
    slot_bytes: int
    slots: int
    generation: int  # seeds the journal's checksums: records of another initialisation never count
    kv_dtype: str = ""
    shard: list[int] = msgspec.field(default_factory=lambda: [0, 1])


class _Failed(Exception):
    """A file-level failure of one call: every item gets ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DiskEntryFile:
    """See the module doc. ``store``/``load`` are called by one thread at a time; their items run
    concurrently on ``io_threads`` threads (the queue depth)."""

    recovered: list[tuple[int, BlockName]]
    restart_note: str
    direct: bool
    direct_note: str | None

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        codec: EntryCodec,
        slots: int,
        io_threads: int = 4,
        direct: bool = True,
        preallocate: bool = True,
    ) -> None:
        """``codec`` seals and opens the entries (their layout, keys and mode). ``preallocate``:
        reserve the data file's blocks now (``posix_fallocate``), so that a full file system
        later fails only journal appends, never an entry's write."""
        if slots < 1 or io_threads < 1:
            raise ConfigError(f"{directory}: slots and io_threads must be at least 1 (got {slots}, {io_threads})")
        self.path = Path(directory)
        self.codec = codec
        self.layout = layout = codec.layout
        self.slots = slots
        self.slot_bytes = slot_bytes_of(layout)
        self.io_threads = io_threads
        self._digest = layout.digest
        self._closed = False
        self._degraded: str | None = None  # the last failure of the file system (what degraded() says)
        self._broken: str | None = None  # the data file is gone or cut: every call fails with this
        self._read_only: str | None = None  # no writes: stores fail with this, loads go on
        self._journal_lock = threading.Lock()
        self._local = threading.local()
        self._buffers: list[mmap.mmap] = []
        self._buffers_lock = threading.Lock()
        # the journal's view of every slot (compaction rewrites it): holds?, full hash, tenant
        self._holds = np.zeros(slots, dtype=np.uint8)
        self._fulls = np.zeros(slots, dtype="V32")
        self._tenants = np.zeros(slots, dtype="V16")
        self._journal_records = 0
        self._lock_fd = self._data_fd = self._journal_fd = -1
        self.writable = True
        try:
            self._open(preallocate, direct)
        except OSError as exc:
            self._close_fds()
            raise ConfigError(f"{exc.filename or self.path}: cannot open the disk tier: {reason_of(exc)}") from None
        except BaseException:
            self._close_fds()
            raise
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvflow-disk-io")

    # -- opening --------------------------------------------------------------------------

    def _open(self, preallocate: bool, direct: bool) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _open_file(self.path / LOCK, os.O_RDWR | os.O_CREAT, readonly_ok=True)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{self.path}: the disk tier is in use by another process") from None
        meta = self._read_meta()
        wanted = (FORMAT_VERSION, self._digest.hex(), self.slot_bytes, self.slots)
        size_ok = _size(self.path / DATA) == self.slots * self.slot_bytes
        if isinstance(meta, Meta) and (meta.format, meta.layout_digest, meta.slot_bytes, meta.slots) == wanted and size_ok:
            self._generation = meta.generation
            self._open_data(direct)
            kept = self._replay_journal()
            self.restart_note = f"warm: {kept} entries recovered from the journal"
        else:
            self.restart_note = self._cold_note(meta, size_ok)
            self._initialise(preallocate)
            self._open_data(direct)
            self._replay_journal()
        held = np.flatnonzero(self._holds)
        self.recovered = [(int(s), name_from(self._fulls[s].tobytes(), self._tenants[s].tobytes())) for s in held]

    def _read_meta(self) -> Meta | None | str:
        try:
            return msgspec.json.decode((self.path / META).read_bytes(), type=Meta)
        except FileNotFoundError:
            return None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return f"unreadable meta ({exc})"

    def _cold_note(self, meta: Meta | None | str, size_ok: bool) -> str:
        if meta is None:
            return "cold: a new disk tier"
        if isinstance(meta, str):
            return f"cold: re-initialised, {meta}"
        was = []
        if meta.format != FORMAT_VERSION:
            was.append(f"entry format {meta.format} (now {FORMAT_VERSION})")
        if meta.layout_digest != self._digest.hex():
            now = self.layout
            was.append(f"layout {meta.model} {meta.kv_dtype or '-'} {meta.page_bytes} x{meta.block_tokens} tokens "
                       f"rank {meta.shard[0]} of {meta.shard[1]} (now {now.model} {now.kv_dtype or '-'} "
                       f"{list(now.page_bytes)} x{now.block_tokens} tokens rank {now.shard[0]} of {now.shard[1]})")  # fmt: skip
        if meta.slot_bytes != self.slot_bytes:
            was.append(f"slot size {meta.slot_bytes} (now {self.slot_bytes})")
        if meta.slots != self.slots:
            was.append(f"{meta.slots} slots (now {self.slots})")
        if not was and not size_ok:
            was.append("a data file of the wrong size")
        return "cold: re-initialised, the directory held " + ", ".join(was)

    def _initialise(self, preallocate: bool) -> None:
        """A new tier: the old journal goes first (no record may outlive the data it names),
        then the data file, then the meta that vouches for both."""
        (self.path / META).unlink(missing_ok=True)
        self._generation = int.from_bytes(os.urandom(8), "little")
        fd = os.open(self.path / JOURNAL, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(self.path / DATA, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 0)
            size = self.slots * self.slot_bytes
            if preallocate:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        exc.filename = str(self.path / DATA)
                        raise
                    os.ftruncate(fd, size)  # a file system without fallocate: a sparse file
            else:
                os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
        meta = Meta(
            format=FORMAT_VERSION, model=self.layout.model, page_bytes=list(self.layout.page_bytes),
            block_tokens=self.layout.block_tokens, layout_digest=self._digest.hex(),
            slot_bytes=self.slot_bytes, slots=self.slots, generation=self._generation,
            kv_dtype=self.layout.kv_dtype, shard=list(self.layout.shard),
        )  # fmt: skip
        _replace(self.path / META, msgspec.json.encode(meta))

    def _open_data(self, direct: bool) -> None:
        self.direct, self.direct_note = False, None if direct else "buffered I/O + fdatasync (direct=False)"
        path = self.path / DATA
        if direct:
            self._data_fd = _open_file(path, os.O_RDWR | os.O_DIRECT, readonly_ok=True)
            try:
                _probe_direct(self._data_fd)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self._data_fd)
                self.direct_note = f"buffered I/O + fdatasync: the file system refuses O_DIRECT ({reason_of(exc)})"
        if not self.direct:
            self._data_fd = _open_file(path, os.O_RDWR, readonly_ok=True)
        self.writable = fcntl.fcntl(self._data_fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        if not self.writable:
            self._read_only = self._fail("EROFS: Read-only file system (the disk tier serves loads only)")
        self._data_ino = os.fstat(self._data_fd).st_ino

    def _replay_journal(self) -> int:
        """Replay the journal into ``_holds``/``_fulls``/``_tenants``; cut a torn tail; compact a long one.
        Returns the slots it vouches for."""
        path = self.path / JOURNAL
        self._journal_fd = _open_file(path, os.O_RDWR | os.O_CREAT, readonly_ok=True)
        with open(self._journal_fd, "rb", closefd=False) as f:
            at, good = 0, 0
            while True:
                head = f.read(_BATCH.size)
                if len(head) < _BATCH.size:
                    break
                magic, count, digest = _BATCH.unpack(head)
                body = f.read(count * _RECORD_BYTES) if magic == _BATCH_MAGIC else b""
                if magic != _BATCH_MAGIC or len(body) != count * _RECORD_BYTES or \
                        xxhash.xxh3_64_intdigest(body, seed=self._generation) != digest:  # fmt: skip
                    break
                records = np.frombuffer(body, dtype=_RECORD)
                if count and int(records["slot"].max()) >= self.slots:
                    break
                self._holds[records["slot"]] = records["holds"]  # (a batch names a slot once)
                self._fulls[records["slot"]] = records["full"]
                self._tenants[records["slot"]] = records["tenant"]
                at += _BATCH.size + len(body)
                good += count
            end = f.seek(0, os.SEEK_END)
        self._journal_end, self._journal_records = at, good
        held = int(np.count_nonzero(self._holds))
        if self.writable:
            if end != at:
                os.ftruncate(self._journal_fd, at)  # a torn tail: the records it held never counted
                os.fsync(self._journal_fd)
            if good > 2 * held + 1024:
                self._compact()
        return held

    # -- the calls ------------------------------------------------------------------------

    def store(self, items: Sequence[Item]) -> list[str | None]:
        """Write each ``(slot, block name, pages)``, sealed; make the batch durable; then
        journal it."""
        reasons: list[str | None] = [None] * len(items)
        try:
            self._check_file(writing=True)
        except _Failed as failed:
            return [failed.reason] * len(items)
        todo = self._admit(items, reasons, once=True)
        # a slot about to be overwritten first loses its record: a crash mid-write then leaves
        # the slot unrecovered rather than recovered under a block it no longer holds
        held = [slot for _, (slot, _, _) in todo if self._holds[slot]]
        if held:
            unrecorded = self._append([(s, None) for s in held])
            if unrecorded is not None:
                for i, _ in todo:
                    reasons[i] = unrecorded
                return reasons
        results = list(self._pool.map(self._write_one, [item for _, item in todo]))
        written = []
        for (i, _), result in zip(todo, results):
            reasons[i] = result
            if result is None:
                written.append(i)
        if written:
            try:
                os.fdatasync(self._data_fd)
            except OSError as exc:
                reason = self._os_failure(exc)
                for i in written:
                    reasons[i] = reason
                written = []
        if written:
            unrecorded = self._append([(items[i][0], items[i][1]) for i in written])
            if unrecorded is not None:
                for i in written:
                    reasons[i] = unrecorded
            elif all(r is None for r in reasons) and self._broken is None and self._read_only is None:
                self._degraded = None  # the file system takes writes again (space was freed)
        return reasons

    def load(self, items: Sequence[Item]) -> list[str | None]:
        """Read each ``(slot, block name, destination pages)``; fill the pages only with an entry
        that proves to be that block, whole; else a miss reason (``REASONS``, or the file
        system's; the pages' bytes then mean nothing: they may hold part of what was read)."""
        reasons: list[str | None] = [None] * len(items)
        try:
            self._check_file(writing=False)
        except _Failed as failed:
            return [failed.reason] * len(items)
        todo = self._admit(items, reasons, once=False)
        for (i, _), result in zip(todo, self._pool.map(self._read_one, [item for _, item in todo])):
            reasons[i] = result
        if any(r is not None and r.startswith("short read") for r in reasons):
            try:
                self._check_file(writing=False)  # a short read: was the file cut underneath?
            except _Failed:
                pass
        return reasons

    def forget(self, slots: Sequence[int]) -> None:
        """Journal that these slots hold nothing (the tier evicted them): a restart does not
        bring them back."""
        if self._closed or not self.writable:
            return
        unique = list(dict.fromkeys(s for s in slots if 0 <= s < self.slots))
        if unique:
            self._append([(s, None) for s in unique])

    def degraded(self) -> str | None:
        """The last failure of the file system itself (full, read-only, I/O error, the data file
        truncated or deleted underneath), or None."""
        return self._degraded

    def close(self) -> None:
        """Finish the I/O at hand, make the journal durable, release the directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if self.writable and self._journal_fd >= 0:
            try:
                os.fdatasync(self._journal_fd)
            except OSError:
                pass
        self._close_fds()
        with self._buffers_lock:
            for buf in self._buffers:
                buf.close()
            self._buffers.clear()

    def __enter__(self) -> DiskEntryFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- items ----------------------------------------------------------------------------

    def _admit(self, items: Sequence[Item], reasons: list[str | None], *, once: bool) -> list[tuple[int, Item]]:
        """The items worth doing, their pages as flat byte views: in range, the layout's size,
        contiguous pages, and (``once``: stores) a slot named once."""
        seen: set[int] = set()
        todo: list[tuple[int, Item]] = []
        want = self.layout.payload_bytes
        for i, (slot, name, pages) in enumerate(items):
            views = [memoryview(p) for p in pages]
            size = sum(v.nbytes for v in views)
            if not 0 <= slot < self.slots:
                reasons[i] = f"slot {slot} outside the tier's {self.slots} slots"
            elif once and slot in seen:
                reasons[i] = f"slot {slot} named twice in one batch"
            elif size != want:
                reasons[i] = f"pages of {size} bytes, the layout's block is {want}"
            elif not all(v.c_contiguous for v in views):
                reasons[i] = "a page that is not contiguous"
            else:
                seen.add(slot)
                todo.append((i, (slot, name, [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views])))
        return todo

    def _write_one(self, item: Item) -> str | None:
        slot, name, pages = item
        offset = slot * self.slot_bytes
        nonce = os.urandom(NONCE_BYTES)
        try:
            if self._aligned(pages) and self.codec.mode != ENCRYPT:  # (ciphertext needs a buffer)
                block = self._buffer("head", ALIGN)
                block[:HEADER_BYTES] = self.codec.seal(name, pages, nonce)
                _full(os.pwritev, self._data_fd, [block, *pages], offset)
            else:
                bounce = self._buffer("bounce", self.slot_bytes)
                payload = memoryview(bounce)[ALIGN : ALIGN + self.layout.payload_bytes]
                bounce[:HEADER_BYTES] = self.codec.seal(name, pages, nonce, payload)
                _full(os.pwritev, self._data_fd, [bounce], offset)
        except OSError as exc:
            return self._os_failure(exc)
        except _Short as short:
            return f"short write ({short})"
        return None

    def _read_one(self, item: Item) -> str | None:
        slot, name, pages = item
        offset = slot * self.slot_bytes
        try:
            if self._aligned(pages, writable=True):
                block = self._buffer("head", ALIGN)
                _full(os.preadv, self._data_fd, [block, *pages], offset)
                head = memoryview(block)[:HEADER_BYTES]
                miss = self.codec.open(head, name, pages, pages)  # (decrypted in place)
            else:
                bounce = self._buffer("bounce", self.slot_bytes)
                _full(os.preadv, self._data_fd, [bounce], offset)
                view = memoryview(bounce)
                head = view[:HEADER_BYTES]
                payload = [view[ALIGN : ALIGN + self.layout.payload_bytes]]
                miss = self.codec.open(head, name, payload, payload)  # (in place: the pages only get what is proven)
                if miss is None:
                    at = ALIGN
                    for page in pages:
                        page[:] = view[at : at + len(page)]
                        at += len(page)
            return None if miss is None else _miss_reason(head, miss)
        except OSError as exc:
            return self._os_failure(exc)
        except _Short as short:
            return f"short read ({short})"

    def _aligned(self, pages: Sequence[memoryview], writable: bool = False) -> bool:
        """Whether the pages can go to ``O_DIRECT`` as they are (else: the bounce buffer)."""
        if not self.direct:
            return not writable or not any(p.readonly for p in pages)
        for page in pages:
            if len(page) % ALIGN or (writable and page.readonly):
                return False
            if np.frombuffer(page, dtype=np.uint8).ctypes.data % ALIGN:
                return False
        return True

    def _buffer(self, kind: str, size: int) -> mmap.mmap:
        """This thread's aligned buffer of ``kind`` (anonymous memory: page-aligned)."""
        buf: mmap.mmap | None = getattr(self._local, kind, None)
        if buf is None:
            buf = mmap.mmap(-1, size)
            setattr(self._local, kind, buf)
            with self._buffers_lock:
                self._buffers.append(buf)
        return buf

    # -- the journal ----------------------------------------------------------------------

    def _append(self, entries: Sequence[tuple[int, BlockName | None]]) -> str | None:
        """Append records ``(slot, block name or None)``, one batch per ``_MAX_BATCH``; on a
        failure the journal is cut back to where it was (no torn batch ahead of later ones)."""
        with self._journal_lock:
            for start in range(0, len(entries), _MAX_BATCH):
                part = entries[start : start + _MAX_BATCH]
                records = np.zeros(len(part), dtype=_RECORD)
                records["slot"] = [s for s, _ in part]
                records["full"] = [n.full if n is not None else b"" for _, n in part]
                records["tenant"] = [n.tenant if n is not None else b"" for _, n in part]
                records["holds"] = [n is not None for _, n in part]
                body = records.tobytes()
                head = _BATCH.pack(_BATCH_MAGIC, len(part), xxhash.xxh3_64_intdigest(body, seed=self._generation))
                try:
                    _full(os.pwritev, self._journal_fd, [head, body], self._journal_end)
                except (OSError, _Short) as exc:
                    try:
                        os.ftruncate(self._journal_fd, self._journal_end)
                    except OSError:
                        pass
                    if isinstance(exc, _Short):
                        return self._fail(f"short write of the journal ({exc})")
                    return self._os_failure(exc, what="the journal")
                self._journal_end += len(head) + len(body)
                self._journal_records += len(part)
                self._holds[records["slot"]] = records["holds"]
                self._fulls[records["slot"]] = records["full"]
                self._tenants[records["slot"]] = records["tenant"]
            if self._journal_records > 2 * self.slots + 1024:
                try:
                    self._compact()
                except OSError as exc:
                    self._os_failure(exc, what="the journal's compaction")
        return None

    def _compact(self) -> None:
        """Rewrite the journal as one batch of the slots it vouches for (a new file renamed over
        the old: a crash leaves one or the other, whole)."""
        held = np.flatnonzero(self._holds)
        records = np.zeros(len(held), dtype=_RECORD)
        records["slot"], records["holds"] = held, 1
        records["full"], records["tenant"] = self._fulls[held], self._tenants[held]
        data = b"".join(
            _BATCH.pack(_BATCH_MAGIC, len(chunk), xxhash.xxh3_64_intdigest(chunk.tobytes(), seed=self._generation))
            + chunk.tobytes()
            for chunk in (records[i : i + _MAX_BATCH] for i in range(0, max(len(records), 1), _MAX_BATCH))
        )  # fmt: skip
        _replace(self.path / JOURNAL, data)
        fd = os.open(self.path / JOURNAL, os.O_RDWR)
        os.close(self._journal_fd)
        self._journal_fd, self._journal_end, self._journal_records = fd, len(data), len(held)

    # -- failures -------------------------------------------------------------------------

    def _check_file(self, *, writing: bool) -> None:
        """Raise ``_Failed`` when the tier cannot serve this call at all: closed, read-only, or
        its data file deleted, replaced or truncated underneath (each sets ``degraded``)."""
        if self._closed:
            raise _Failed("the disk tier is closed")
        if self._broken is not None:
            raise _Failed(self._broken)
        if writing and self._read_only is not None:
            raise _Failed(self._read_only)
        data = self.path / DATA
        try:
            st = os.fstat(self._data_fd)
            there = os.stat(data)
        except FileNotFoundError:
            there = None
        except OSError as exc:
            raise _Failed(self._os_failure(exc)) from None
        if there is None or st.st_nlink == 0 or there.st_ino != self._data_ino or not stat.S_ISREG(there.st_mode):
            self._broken = self._fail(f"ENOENT: the data file {data} was deleted or replaced underneath")
        elif st.st_size < self.slots * self.slot_bytes:
            self._broken = self._fail(f"the data file {data} was truncated underneath to {st.st_size} bytes "
                                      f"(expected {self.slots * self.slot_bytes})")  # fmt: skip
        if self._broken is not None:
            raise _Failed(self._broken)

    def _os_failure(self, exc: OSError, what: str | None = None) -> str:
        """The reason for an item; a failure of the file system also marks the tier degraded."""
        reason = reason_of(exc) + (f" ({what})" if what else "")
        if exc.errno in _FS_ERRNOS:
            self._fail(reason)
        if exc.errno == errno.EROFS and self._read_only is None:
            self._read_only = reason
        return reason

    def _fail(self, reason: str) -> str:
        """Mark the tier degraded (a failure that stays, broken or read-only, is not replaced
        by a passing one)."""
        if self._broken is None and self._read_only is None:
            self._degraded = reason
        return reason

    def _close_fds(self) -> None:
        for name in ("_data_fd", "_journal_fd", "_lock_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, -1)


class _Short(Exception):
    """A read or write that moved fewer bytes than asked (the end of the file, or a refusal)."""


def _full(
    call: Callable[[int, list[memoryview], int], int], fd: int, buffers: Sequence[_Buffer], offset: int
) -> None:
    """``preadv``/``pwritev`` all of ``buffers`` at ``offset``, going on after a partial
    transfer; ``_Short`` when one moves nothing (the end of the file)."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(len(v) for v in views)
    done = 0
    while views:
        moved = call(fd, views, offset + done)
        if moved <= 0:
            raise _Short(f"{done} of {total} bytes")
        done += moved
        while views and moved >= len(views[0]):
            moved -= len(views[0])
            views.pop(0)
        if views and moved:
            views[0] = views[0][moved:]


def _miss_reason(head: memoryview, miss: Miss) -> str:
    """A head that is all zeros is a slot never written (or cut short): nothing there, not a
    foreign entry."""
    if miss.reason == "format" and not any(head):
        return "absent"
    return miss.reason


def _open_file(path: Path, flags: int, *, readonly_ok: bool) -> int:
    """Open ``path``; on a read-only file system (or a file we may only read) fall back to
    ``O_RDONLY`` when ``readonly_ok``: the tier then serves loads only."""
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        if not readonly_ok or exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not path.exists():
            raise
        return os.open(path, (flags & ~(os.O_RDWR | os.O_CREAT | os.O_WRONLY)) | os.O_RDONLY)


def _probe_direct(fd: int) -> None:
    """One aligned ``O_DIRECT`` read: a file system that accepts the flag at open but not the
    I/O (EINVAL) is found now, not at the first entry."""
    buf = mmap.mmap(-1, ALIGN)
    try:
        os.preadv(fd, [buf], 0)
    finally:
        buf.close()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a new file made durable, renamed over, the
    directory made durable."""
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
