"""The disk tier's file on a real file system: entries round-trip, anything wrong in a slot is a
miss, the journal brings back exactly what was durable, and the file system's failures (full,
read-only, I/O errors, the file cut or deleted underneath) are answers, never exceptions.

The full and read-only file systems are real ones (a small ext4 image mounted on a loop device)
where this machine lets root mount one; those tests skip elsewhere, and the same failures are
also driven through ``RLIMIT_FSIZE`` and through the OS calls (``os.preadv``/``os.pwritev``/
``os.fdatasync``) so that they run everywhere.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

pytest.importorskip("xxhash")
pytest.importorskip("numpy")

from tier_keys import tier_keys  # noqa: E402

from kvflow.core.errors import ConfigError  # noqa: E402
from kvflow.core.names import BlockName, name_of  # noqa: E402
from kvflow.tiers.disk_file import ALIGN, DATA, JOURNAL, DiskEntryFile  # noqa: E402
from kvflow.tiers.entry import ENCRYPT, HEADER_BYTES, MAC, EntryCodec, Layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# pages of odd sizes: every entry goes through the aligned bounce buffer
ODD = Layout(model="test-model", page_bytes=(1000, 536), block_tokens=16)
# pages of whole 4 KiB pages, in page-aligned memory: straight from and into the pages
ALIGNED = Layout(model="test-model", page_bytes=(8192, 4096), block_tokens=16)


KEYS = tier_keys()


def codec_of(layout: Layout) -> EntryCodec:
    """Encrypted entries for the bounce layout; authenticated ones in the clear for the aligned
    one (the only mode whose writes go straight from the pages)."""
    return EntryCodec(layout, KEYS, ENCRYPT if layout is ODD else MAC)


def recovered(tier: DiskEntryFile) -> list[tuple[int, int]]:
    """What the journal vouched for at open, as (slot, key)."""
    return [(s, n.key) for s, n in tier.recovered]


def content(block_hash: int, layout: Layout) -> bytes:
    """The payload that belongs to ``block_hash`` (distinct per hash, every byte covered)."""
    seed = (block_hash % 251 + 1).to_bytes(1, "little")
    return (block_hash.to_bytes(16, "little", signed=True) + seed * 48) * (layout.payload_bytes // 64 + 1)


class Pages:
    """Page-aligned host memory shaped as one slot's pages (what a host pool hands over)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.buf = mmap.mmap(-1, max(layout.payload_bytes, 1))
        view = memoryview(self.buf)
        self.pages: list[memoryview] = []
        at = 0
        for size in layout.page_bytes:
            self.pages.append(view[at : at + size])
            at += size

    def fill(self, data: bytes) -> Pages:
        at = 0
        for page in self.pages:
            page[:] = data[at : at + len(page)]
            at += len(page)
        return self

    def bytes(self) -> bytes:
        return b"".join(bytes(p) for p in self.pages)


def src(block_hash: int, layout: Layout) -> list[memoryview]:
    return Pages(layout).fill(content(block_hash, layout)).pages


def dst(layout: Layout) -> Pages:
    return Pages(layout).fill(b"\xee" * layout.payload_bytes)


def load_one(tier: DiskEntryFile, slot: int, block: int | BlockName) -> tuple[str | None, bytes]:
    out = dst(tier.layout)
    name = block if isinstance(block, BlockName) else name_of(block)
    [reason] = tier.load([(slot, name, out.pages)])
    return reason, out.bytes()


@pytest.fixture(params=[ODD, ALIGNED], ids=["bounce", "straight"])
def layout(request: pytest.FixtureRequest) -> Layout:
    return request.param


# -- a real small file system -------------------------------------------------------------


def _mount_ext4(image: Path, where: Path, size_mib: int, options: str = "") -> None:
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        pytest.skip("mounting a loop file system needs root, mkfs.ext4 and mount")
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True)
    where.mkdir()
    done = subprocess.run(["mount", "-o", ",".join(filter(None, ["loop", options])), str(image), str(where)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a loop file system here: {done.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB ext4 file system of its own (remounted read-only on an error)."""
    where = tmp_path / "fs"
    _mount_ext4(tmp_path / "fs.img", where, 16, "errors=remount-ro")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill_up(where: Path) -> Path:
    """Write a file until the file system is full."""
    filler = where / "filler"
    chunk = b"\x01" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(chunk[:size])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        os.fsync(f.fileno())
    return filler


def turn_read_only(where: Path) -> None:
    """An error inside ext4 (as a failing disk raises): with errors=remount-ro the file system
    turns read-only under the open tier."""
    device = subprocess.run(["findmnt", "-no", "SOURCE", str(where)], capture_output=True, text=True).stdout.strip()
    trigger = Path("/sys/fs/ext4") / Path(device).name / "trigger_fs_error"
    if not trigger.exists():
        pytest.skip("this kernel cannot trigger an ext4 error")
    trigger.write_text("kvflow test: turn read-only")


# -- round trips --------------------------------------------------------------------------


def test_entries_round_trip_and_other_blocks_are_misses(tmp_path: Path, layout: Layout) -> None:
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(layout), slots=16, io_threads=3) as tier:
        assert tier.direct and tier.direct_note is None and tier.restart_note == "cold: a new disk tier"
        hashes = {slot: (slot * 7919) - 40 for slot in range(12)}  # negative hashes too
        assert tier.store([(s, name_of(h), src(h, layout)) for s, h in hashes.items()]) == [None] * 12
        for s, h in hashes.items():
            assert load_one(tier, s, h) == (None, content(h, layout)[: layout.payload_bytes])
        assert load_one(tier, 3, hashes[4])[0] == "another block"
        assert load_one(tier, 13, 5)[0] == "absent"
        assert tier.degraded() is None
        # a wide hash (the header carries 16 bytes)
        wide = 2**100 + 3
        assert tier.store([(14, name_of(wide), src(wide, layout))]) == [None]
        assert load_one(tier, 14, wide)[0] is None
        assert load_one(tier, 14, 3)[0] == "another block"


def test_bad_items_get_reasons_and_the_rest_of_the_batch_goes_on(tmp_path: Path) -> None:
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4) as tier:
        short = [memoryview(bytearray(10))]
        got = tier.store([(9, name_of(1), src(1, ODD)), (0, name_of(2), short), (1, name_of(3), src(3, ODD)), (1, name_of(4), src(4, ODD))])
        assert got == ["slot 9 outside the tier's 4 slots", "pages of 10 bytes, the layout's block is 1536",
                       None, "slot 1 named twice in one batch"]  # fmt: skip
        assert load_one(tier, 1, 3)[0] is None
        assert recovered(tier) == []


# -- every field of the frame -------------------------------------------------------------

FIELDS = [
    # (offset in the slot, the reason a load gives once that byte is flipped)
    (0, "format"),  # magic
    (4, "format"),  # version
    (5, "format"),  # protection mode
    (6, "unknown key"),  # the sealing key's id
    (10, "forged"),  # nonce
    (22, "another layout"),  # layout digest
    (37, "another layout"),
    (38, "another block"),  # full hash, low and high bytes
    (69, "another block"),
    (70, "another tenant"),  # tenant id
    (85, "another tenant"),
    (86, "length"),  # payload length
    (94, "forged"),  # the tag itself
    (HEADER_BYTES - 1, "forged"),
    (ALIGN, "forged"),  # the payload's first and last bytes
    (ALIGN + 1535, "forged"),
]


@pytest.mark.parametrize("offset, reason", FIELDS)
def test_F20_a_flipped_byte_in_any_field_is_a_miss(tmp_path: Path, offset: int, reason: str) -> None:
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4) as tier:
        assert tier.store([(2, name_of(77), src(77, ODD)), (3, name_of(78), src(78, ODD))]) == [None, None]
        where = 2 * tier.slot_bytes + offset
        with open(tmp_path / "tier" / DATA, "r+b") as f:
            f.seek(where)
            byte = f.read(1)[0]
            f.seek(where)
            f.write(bytes([byte ^ 0xFF]))
        out = dst(ODD)
        [got] = tier.load([(2, name_of(77), out.pages)])
        assert got == reason
        assert out.bytes() == b"\xee" * ODD.payload_bytes  # the bounce path leaves the pages alone
        assert load_one(tier, 3, 78)[0] is None  # the slot beside it is untouched
        assert tier.degraded() is None  # one bad entry is a miss, not a failing file system


def test_F20_a_slot_written_halfway_is_a_miss_not_old_or_new_data(tmp_path: Path, layout: Layout) -> None:
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(layout), slots=2) as tier:
        assert tier.store([(0, name_of(1), src(1, layout))]) == [None]
        new = bytearray(tier.slot_bytes)
        with open(tmp_path / "tier" / DATA, "rb") as f:
            old = f.read(tier.slot_bytes)
        other = DiskEntryFile(tmp_path / "other", codec=codec_of(layout), slots=1)
        assert other.store([(0, name_of(2), src(2, layout))]) == [None]
        other.close()
        new[:] = (tmp_path / "other" / DATA).read_bytes()[: tier.slot_bytes]
        for cut in (HEADER_BYTES, ALIGN, ALIGN + 512, ALIGN + layout.payload_bytes - 1):
            torn = bytes(new[:cut]) + old[cut:]  # the new entry's first `cut` bytes landed
            with open(tmp_path / "tier" / DATA, "r+b") as f:
                f.write(torn)
            assert load_one(tier, 0, 1)[0] in ("another block", "forged")
            assert load_one(tier, 0, 2)[0] in ("another block", "forged")


# -- the journal --------------------------------------------------------------------------


def test_F22_the_journal_brings_back_the_last_word_on_each_slot(tmp_path: Path, layout: Layout) -> None:
    tier = DiskEntryFile(tmp_path / "tier", codec=codec_of(layout), slots=8)
    assert tier.store([(s, name_of(100 + s), src(100 + s, layout)) for s in range(6)]) == [None] * 6
    tier.forget([1, 4])
    assert tier.store([(2, name_of(555), src(555, layout)), (4, name_of(444), src(444, layout))]) == [None, None]
    tier.forget([5])
    tier.close()
    tier.close()  # idempotent
    again = DiskEntryFile(tmp_path / "tier", codec=codec_of(layout), slots=8)
    assert recovered(again) == [(0, 100), (2, 555), (3, 103), (4, 444)]
    assert again.restart_note == "warm: 4 entries recovered from the journal"
    for slot, h in recovered(again):
        assert load_one(again, slot, h) == (None, content(h, layout)[: layout.payload_bytes])
    assert load_one(again, 2, 102)[0] == "another block"  # the overwritten entry is gone
    again.close()


def test_F22_a_torn_journal_tail_is_ignored_and_cut(tmp_path: Path) -> None:
    tier = DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8)
    assert tier.store([(0, name_of(10), src(10, ODD)), (1, name_of(11), src(11, ODD))]) == [None, None]
    tier.close()
    journal = tmp_path / "tier" / JOURNAL
    good = journal.stat().st_size
    tier = DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8)
    assert tier.store([(2, name_of(12), src(12, ODD)), (3, name_of(13), src(13, ODD))]) == [None, None]
    tier.close()
    full = journal.read_bytes()
    for cut in range(good + 1, len(full)):  # every length the second batch could be torn at
        journal.write_bytes(full[:cut])
        with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8) as again:
            assert recovered(again) == [(0, 10), (1, 11)], cut
        assert journal.stat().st_size == good
    # garbage after whole batches, and a batch whose records were damaged
    journal.write_bytes(full + b"\x00" * 40)
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8) as again:
        assert recovered(again) == [(0, 10), (1, 11), (2, 12), (3, 13)]
    damaged = bytearray(full)
    damaged[good + 20] ^= 1
    journal.write_bytes(bytes(damaged))
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8) as again:
        assert recovered(again) == [(0, 10), (1, 11)]


def test_F22_data_without_its_record_is_not_recovered(tmp_path: Path) -> None:
    """The writer dies (SIGKILL) after the batch's data is durable, before its records."""
    script = textwrap.dedent(f"""
        import os, shutil, signal, sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from test_disk_file import ODD, codec_of, name_of, src
        from kvflow.tiers.disk_file import DiskEntryFile
        tier = DiskEntryFile({str(tmp_path / "tier")!r}, codec=codec_of(ODD), slots=8)
        assert tier.store([(0, name_of(10), src(10, ODD))]) == [None]
        shutil.copy({str(tmp_path / "tier" / JOURNAL)!r}, {str(tmp_path / "journal.then")!r})
        real = os.fdatasync
        def then_die(fd):
            real(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        os.fdatasync = then_die
        tier.store([(1, name_of(11), src(11, ODD)), (0, name_of(12), src(12, ODD))])
    """)
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))), capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8) as again:
        # slot 1's data is whole but nothing vouches for it; slot 0 lost its record before
        # block 12 went over block 10
        assert recovered(again) == []
        assert load_one(again, 1, 11)[0] is None
        assert load_one(again, 0, 12)[0] is None
    # had the appends since been lost (a power cut: they are not synced one by one), the
    # journal would name block 10 in slot 0: a miss, never block 12's bytes
    (tmp_path / "journal.then").replace(tmp_path / "tier" / JOURNAL)
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8) as again:
        assert recovered(again) == [(0, 10)]
        assert load_one(again, 0, 10)[0] == "another block"


@pytest.mark.parametrize("failing", ["the first append", "the record"])
def test_a_store_whose_journal_cannot_be_written_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    tier = DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4)
    assert tier.store([(0, name_of(1), src(1, ODD))]) == [None]
    journal_fd = tier._journal_fd
    real = os.pwritev
    appends = []

    def journal_full(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if fd == journal_fd:
            appends.append(offset)
            # the store first drops slot 0's record (it is about to be overwritten), then
            # writes the data, then appends the new records
            if failing == "the first append" or len(appends) > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", journal_full)
    assert tier.store([(0, name_of(2), src(2, ODD)), (1, name_of(3), src(3, ODD))]) == ["ENOSPC: No space left on device (the journal)"] * 2
    assert tier.degraded() == "ENOSPC: No space left on device (the journal)"
    monkeypatch.undo()
    tier.close()
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4) as again:
        if failing == "the first append":  # nothing was written
            assert recovered(again) == [(0, 1)]
            assert load_one(again, 0, 1)[0] is None
        else:  # written, durable, unrecorded
            assert recovered(again) == []
            assert load_one(again, 0, 2)[0] is None and load_one(again, 1, 3)[0] is None


def test_a_long_journal_is_compacted_to_what_it_vouches_for(tmp_path: Path) -> None:
    tier = DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4)
    for i in range(700):  # 2,800 records: beyond 2 x slots + 1,024, so compacted on the way
        assert tier.store([(s, name_of(i * 4 + s), src(i * 4 + s, ODD)) for s in range(4)]) == [None] * 4
    tier.forget([2])
    tier.close()
    assert (tmp_path / "tier" / JOURNAL).stat().st_size < 2_000 * 32
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4) as again:
        assert recovered(again) == [(0, 2796), (1, 2797), (3, 2799)]
        assert all(load_one(again, s, h)[0] is None for s, h in recovered(again))


# -- opening ------------------------------------------------------------------------------


def test_another_layout_or_size_starts_cold_and_says_so(tmp_path: Path) -> None:
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4) as tier:
        assert tier.store([(0, name_of(1), src(1, ODD))]) == [None]
    other = Layout(model="another-model", page_bytes=ODD.page_bytes, block_tokens=16)
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(other), slots=4) as tier:
        assert recovered(tier) == []
        assert tier.restart_note.startswith("cold: re-initialised, the directory held layout test-model")
        assert load_one(tier, 0, 1)[0] == "absent"
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(other), slots=6) as tier:
        assert tier.restart_note == "cold: re-initialised, the directory held 4 slots (now 6)"
    (tmp_path / "tier" / "meta.json").write_text("{not json")
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(other), slots=6) as tier:
        assert tier.restart_note.startswith("cold: re-initialised, unreadable meta")


def test_a_directory_it_cannot_use_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^.*file/tier.*: cannot open the disk tier: (ENOTDIR|EEXIST)") as err:
        DiskEntryFile(tmp_path / "file" / "tier", codec=codec_of(ODD), slots=4)
    assert "\n" not in str(err.value)
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4):
        with pytest.raises(ConfigError, match="in use by another process"):
            DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4)


def test_a_file_system_refusing_o_direct_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.preadv

    def refuse(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:  # as a file system without O_DIRECT answers
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse)
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ALIGNED), slots=4) as tier:
        assert not tier.direct
        assert tier.direct_note == "buffered I/O + fdatasync: the file system refuses O_DIRECT (EINVAL: Invalid argument)"
        assert tier.store([(1, name_of(5), src(5, ALIGNED))]) == [None]
        assert load_one(tier, 1, 5) == (None, content(5, ALIGNED)[: ALIGNED.payload_bytes])
    with DiskEntryFile(tmp_path / "tier2", codec=codec_of(ODD), slots=4, direct=False) as tier:
        assert not tier.direct and tier.direct_note == "buffered I/O + fdatasync (direct=False)"
        assert tier.store([(1, name_of(5), src(5, ODD))]) == [None]
        assert load_one(tier, 1, 5)[0] is None


# -- the file cut or deleted underneath ---------------------------------------------------


@pytest.mark.parametrize("how", ["truncate", "delete", "replace"])
def test_F20_a_data_file_cut_or_deleted_underneath_degrades_the_tier(tmp_path: Path, layout: Layout, how: str) -> None:
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(layout), slots=8) as tier:
        assert tier.store([(s, name_of(s + 1), src(s + 1, layout)) for s in range(4)]) == [None] * 4
        data = tmp_path / "tier" / DATA
        if how == "truncate":
            os.truncate(data, tier.slot_bytes * 2)
        else:
            data.unlink()
            if how == "replace":
                data.write_bytes(b"\x00" * tier.slot_bytes * 8)
        out = dst(layout)
        got = tier.load([(0, name_of(1), out.pages), (3, name_of(4), out.pages)])
        word = "truncated underneath to" if how == "truncate" else "deleted or replaced underneath"
        assert all(r is not None and word in r for r in got), got
        assert out.bytes() == b"\xee" * layout.payload_bytes
        assert tier.degraded() == got[0]
        assert tier.store([(5, name_of(6), src(6, layout))]) == [got[0]]
        tier.forget([1])  # no crash either


def test_a_cut_between_the_check_and_the_read_is_a_short_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8) as tier:
        assert tier.store([(6, name_of(7), src(6, ODD))]) == [None]
        real = os.preadv

        def cut_first(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
            os.truncate(tmp_path / "tier" / DATA, tier.slot_bytes)
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", cut_first)
        [got] = tier.load([(6, name_of(7), dst(ODD).pages)])
        assert got == f"short read (0 of {tier.slot_bytes} bytes)"
        assert tier.degraded() is not None and "truncated underneath" in tier.degraded()  # type: ignore[operator]


# -- I/O errors and short reads at the OS calls -------------------------------------------


def test_F20_eio_and_short_reads_are_misses(tmp_path: Path, layout: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(layout), slots=8) as tier:
        assert tier.store([(s, name_of(s), src(s, layout)) for s in range(3)]) == [None] * 3
        real = os.preadv
        mode = {"what": "eio"}

        def faulty(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
            if tier.slot_bytes <= offset < 2 * tier.slot_bytes:
                if mode["what"] == "eio":
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                if mode["what"] == "short":  # the first half, then the end of the file
                    mode["what"] = "eof"
                    first = buffers[0]
                    return real(fd, [first[: len(first) // 2]], offset)
                if mode["what"] == "eof":
                    return 0
                if mode["what"] == "partial":  # a read that stops early but goes on when asked
                    mode["what"] = "fine"
                    return real(fd, [buffers[0][:ALIGN]], offset)
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", faulty)
        out0, out1 = dst(layout), dst(layout)
        got = tier.load([(0, name_of(0), out0.pages), (1, name_of(1), out1.pages)])
        assert got == [None, "EIO: Input/output error"]
        assert out0.bytes() == content(0, layout)[: layout.payload_bytes]
        assert tier.degraded() == "EIO: Input/output error"
        mode["what"] = "short"
        assert load_one(tier, 1, 1)[0] == f"short read ({ALIGN // 2 if layout is ALIGNED else tier.slot_bytes // 2} of {tier.slot_bytes} bytes)"
        mode["what"] = "partial"
        assert load_one(tier, 1, 1) == (None, content(1, layout)[: layout.payload_bytes])
        monkeypatch.undo()
        assert tier.store([(4, name_of(4), src(4, layout))]) == [None]
        assert tier.degraded() is None  # a batch that went through: the file system is well again


def test_eio_on_write_or_sync_fails_the_batch_unrecorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8)
    data_fd = tier._data_fd
    real_write, real_sync = os.pwritev, os.fdatasync

    def eio_write(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if fd == data_fd and offset == 2 * tier.slot_bytes:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_write(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", eio_write)
    assert tier.store([(1, name_of(1), src(1, ODD)), (2, name_of(2), src(2, ODD))]) == [None, "EIO: Input/output error"]

    def eio_sync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", eio_sync)
    assert tier.store([(3, name_of(3), src(3, ODD))]) == ["EIO: Input/output error"]
    monkeypatch.setattr(os, "fdatasync", real_sync)
    tier.close()
    with DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=8) as again:
        assert recovered(again) == [(1, 1)]


# -- a full file system -------------------------------------------------------------------


def test_a_full_file_system_fails_journal_appends_then_recovers(small_fs: Path) -> None:
    """Real ENOSPC: the data file's blocks were reserved when the tier was made, so only the
    journal's growth meets the full disk; the tier says so and goes on once space is freed."""
    tier = DiskEntryFile(small_fs / "tier", codec=codec_of(ODD), slots=256)
    assert tier.store([(0, name_of(1), src(1, ODD))]) == [None]
    filler = fill_up(small_fs)
    results: list[str | None] = []
    for i in range(400):  # 400 records outgrow the journal's allocated block
        results += tier.store([(i % 256, name_of(1000 + i), src(1000 + i, ODD))])
        if results[-1] is not None:
            break
    assert results[-1] == "ENOSPC: No space left on device (the journal)"
    assert tier.degraded() == "ENOSPC: No space left on device (the journal)"
    assert load_one(tier, 0, 1)[0] in (None, "another block")  # loads go on
    filler.unlink()
    assert tier.store([(5, name_of(5), src(5, ODD))]) == [None]
    assert tier.degraded() is None
    tier.close()
    with DiskEntryFile(small_fs / "tier", codec=codec_of(ODD), slots=256) as again:
        assert (5, 5) in recovered(again)
        assert all(load_one(again, s, h)[0] is None for s, h in recovered(again))


def test_a_full_file_system_fails_sparse_writes_and_a_tier_too_big(small_fs: Path) -> None:
    tier = DiskEntryFile(small_fs / "sparse", codec=codec_of(ALIGNED), slots=2048, preallocate=False)  # 32 MiB, sparse
    filler = fill_up(small_fs)
    got = tier.store([(s, name_of(s), src(s, ALIGNED)) for s in range(8)])
    assert "ENOSPC: No space left on device" in got
    assert tier.degraded() == "ENOSPC: No space left on device"
    filler.unlink()
    tier.close()
    with pytest.raises(ConfigError, match=r"tier/data: cannot open the disk tier: ENOSPC: No space left on device$"):
        DiskEntryFile(small_fs / "tier", codec=codec_of(ALIGNED), slots=2048)  # 32 MiB on a 16 MiB disk


def test_a_file_size_limit_fails_the_journal_not_the_process(tmp_path: Path) -> None:
    """``RLIMIT_FSIZE`` (EFBIG) where no small file system can be mounted: the same path."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from test_disk_file import ODD, codec_of, name_of, src, load_one
        from kvflow.core.errors import ConfigError
        from kvflow.tiers.disk_file import DiskEntryFile
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (32768, 32768))
        try:
            DiskEntryFile({str(tmp_path / "big")!r}, codec=codec_of(ODD), slots=5)  # 40 KiB of slots
        except ConfigError as exc:
            print(exc)
        tier = DiskEntryFile({str(tmp_path / "tier")!r}, codec=codec_of(ODD), slots=4)  # 32 KiB of slots
        results = []
        for i in range(1000):  # the journal outgrows 32 KiB before it is long enough to compact
            results += tier.store([(i % 4, name_of(i), src(i, ODD))])
            if results[-1] is not None:
                break
        print(results[-1]); print(tier.degraded()); print(load_one(tier, (i - 1) % 4, i - 1)[0])
        tier.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{tmp_path / 'big' / 'data'}: cannot open the disk tier: EFBIG: File too large",
        *["EFBIG: File too large (the journal)"] * 2,
        "None",
    ]


# -- a read-only file system --------------------------------------------------------------


def test_a_file_system_turning_read_only_fails_stores_and_keeps_loads(small_fs: Path) -> None:
    tier = DiskEntryFile(small_fs / "tier", codec=codec_of(ALIGNED), slots=16)
    assert tier.store([(s, name_of(s), src(s, ALIGNED)) for s in range(4)]) == [None] * 4
    turn_read_only(small_fs)
    got = tier.store([(5, name_of(5), src(5, ALIGNED))])
    assert got[0] is not None and got[0].startswith("EROFS: Read-only file system")
    assert tier.degraded() == got[0]
    assert load_one(tier, 2, 2) == (None, content(2, ALIGNED)[: ALIGNED.payload_bytes])
    assert tier.store([(6, name_of(6), src(6, ALIGNED))]) == got  # it stays read-only
    tier.close()
    # the next process opens it read-only: warm, loads only
    with DiskEntryFile(small_fs / "tier", codec=codec_of(ALIGNED), slots=16) as again:
        assert recovered(again) == [(0, 0), (1, 1), (2, 2), (3, 3)]
        assert again.degraded() == "EROFS: Read-only file system (the disk tier serves loads only)"
        assert load_one(again, 3, 3)[0] is None
        assert again.store([(7, name_of(7), src(7, ALIGNED))]) == [again.degraded()]
    with pytest.raises(ConfigError, match="EROFS"):  # another layout cannot start cold there
        DiskEntryFile(small_fs / "tier", codec=codec_of(ODD), slots=16)


def test_erofs_at_the_os_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same answer where no file system can be remounted: EROFS from the write itself."""
    tier = DiskEntryFile(tmp_path / "tier", codec=codec_of(ODD), slots=4)
    assert tier.store([(0, name_of(1), src(1, ODD))]) == [None]

    def read_only(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "pwritev", read_only)
    assert tier.store([(1, name_of(2), src(2, ODD))]) == ["EROFS: Read-only file system"]
    monkeypatch.undo()
    assert tier.store([(1, name_of(2), src(2, ODD))]) == ["EROFS: Read-only file system"]  # it stays
    assert tier.degraded() == "EROFS: Read-only file system"
    assert load_one(tier, 0, 1)[0] is None
    tier.close()
