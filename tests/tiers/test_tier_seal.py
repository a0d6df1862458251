"""Sealed entries on both shared tiers, against a real ``redis-server`` and a real file system:
every reason a reader refuses a place (a forged or altered entry, an unknown or retired key,
another tenant's, block's or layout's entry, a wrong length or format, an unkeyed entry, a
damaged unkeyed one), key rotation, encryption at rest, the keys' files refused in one line,
and the key material nowhere: not in a ``repr``, a message or a log line.

An attacker here is a second party with plain access to the store (redis-py, or the tier's
files): it plants whole values it built itself, or alters stored ones."""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("xxhash")
pytest.importorskip("cryptography")
from redis_servers import redis_standalone, require_redis  # noqa: E402, F401  (fixtures)
from tier_keys import KEY, NEW_KEY, OTHER_KEY, keys_file, tier_keys  # noqa: E402

from kvflow.core.errors import ConfigError  # noqa: E402
from kvflow.core.names import BlockName, name_of, tenant_id  # noqa: E402
from kvflow.tiers.disk_file import ALIGN, DATA, DiskEntryFile  # noqa: E402
from kvflow.tiers.entry import ENCRYPT, HEADER_BYTES, MAC, NONE, REASONS, EntryCodec, Layout  # noqa: E402
from kvflow.tiers.keys import TierKeys, key_id  # noqa: E402

# whole 4 KiB pages: the disk tier reads straight into them (and decrypts in place)
LAYOUT = Layout(model="seal-model", page_bytes=(4096, 8192), block_tokens=16, kv_dtype="bfloat16")
PATTERN = b"<<plaintext KV of block %d>>"
ALICE, BOB = tenant_id("alice"), tenant_id("bob")
NAME = name_of(7, ALICE)
KEYS = tier_keys(KEY)


def pages_of(block: int) -> list[bytes]:
    """Recognisable bytes: the pattern, over and over (so a leak of them shows)."""
    unit = PATTERN % block
    return [(unit * (n // len(unit) + 1))[:n] for n in LAYOUT.page_bytes]


def codec(keys: TierKeys | None = KEYS, mode: str = ENCRYPT, layout: Layout = LAYOUT) -> EntryCodec:
    return EntryCodec(layout, keys, mode if keys is not None else NONE)


def entry(writer: EntryCodec, name: BlockName, block: int = 7) -> bytearray:
    """A whole entry (head, then payload) as ``writer`` seals it: what an attacker plants."""
    out = memoryview(bytearray(writer.layout.entry_bytes))
    out[:HEADER_BYTES] = writer.seal(name, pages_of(block), os.urandom(12), out[HEADER_BYTES:])
    return bytearray(out)


def flipped(at: int) -> Any:
    def damage(value: bytearray) -> bytearray:
        value[at] ^= 0x01
        return value

    return damage


class RemoteSide:
    """The places of the remote tier: keys of a real Redis."""

    def __init__(self, server: Any) -> None:
        require_redis()
        from kvflow.tiers.redis_store import connect

        self.server = server
        self.client = connect(server.url)

    def store_for(self, reader: EntryCodec) -> Any:
        from kvflow.tiers.redis_store import RedisBlockStore, connect

        return RedisBlockStore(connect(self.server.url), reader)

    def plant(self, reader: EntryCodec, at: BlockName, value: bytes) -> None:
        self.client.set(self.store_for(reader).key(at), bytes(value))

    def write(self, writer: EntryCodec, name: BlockName, block: int = 7) -> None:
        assert self.store_for(writer).put([(name, pages_of(block))], time.monotonic() + 5) == [None]

    def read(self, reader: EntryCodec, name: BlockName) -> tuple[str | None, bytes]:
        pages = [memoryview(bytearray(n)) for n in LAYOUT.page_bytes]
        [got] = self.store_for(reader).get([name], [pages], time.monotonic() + 5)
        return (None if got is None else got.reason), b"".join(bytes(p) for p in pages)

    def stored_bytes(self) -> bytes:
        return b"".join(self.client.get(k) for k in self.client.keys("*"))

    def close(self) -> None:
        self.server.cli("FLUSHALL")
        self.client.close()


class DiskSide:
    """The places of the disk tier: slot 0 of a real directory (reopened per reader)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory

    def _open(self, c: EntryCodec) -> DiskEntryFile:
        return DiskEntryFile(self.path, codec=c, slots=2)

    def plant(self, reader: EntryCodec, at: BlockName, value: bytes) -> None:
        with self._open(reader):  # (a tier of this layout: the data file's size is its)
            pass
        with open(self.path / DATA, "r+b") as f:
            f.write(bytes(value[:HEADER_BYTES]))
            f.seek(ALIGN)
            f.write(bytes(value[HEADER_BYTES:]))

    def write(self, writer: EntryCodec, name: BlockName, block: int = 7) -> None:
        with self._open(writer) as tier:
            assert tier.store([(0, name, [memoryview(p) for p in pages_of(block)])]) == [None]

    def read(self, reader: EntryCodec, name: BlockName) -> tuple[str | None, bytes]:
        import mmap

        buf = mmap.mmap(-1, LAYOUT.payload_bytes)  # page-aligned, as a host pool's pages
        view = memoryview(buf)
        pages = [view[:4096], view[4096:]]
        with self._open(reader) as tier:
            [reason] = tier.load([(0, name, pages)])
        data = bytes(buf)
        del pages, view
        buf.close()
        return reason, data

    def stored_bytes(self) -> bytes:
        return (self.path / DATA).read_bytes()

    def close(self) -> None:
        pass


@pytest.fixture(params=["remote", "disk"])
def side(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "remote":
        place: Any = RemoteSide(request.getfixturevalue("redis_standalone"))
    else:
        place = DiskSide(tmp_path / "tier")
    yield place
    place.close()


# -- every reason a reader refuses ------------------------------------------------------------

# (what is planted under NAME's place, the reader, the reason)
PLANTED = {
    "forged payload": (lambda: flipped(HEADER_BYTES + 100)(entry(codec(), NAME)), codec(), "forged"),
    "forged nonce": (lambda: flipped(10)(entry(codec(), NAME)), codec(), "forged"),
    "forged tag": (lambda: flipped(HEADER_BYTES - 1)(entry(codec(), NAME)), codec(), "forged"),
    "mac entry altered": (lambda: flipped(HEADER_BYTES)(entry(codec(mode=MAC), NAME)), codec(), "forged"),
    "another deployment's key": (lambda: entry(codec(tier_keys(OTHER_KEY)), NAME), codec(), "unknown key"),
    "another tenant's entry": (lambda: entry(codec(), name_of(7, BOB)), codec(), "another tenant"),
    "another block's entry": (lambda: entry(codec(), name_of(8, ALICE)), codec(), "another block"),
    "fp16 writer, bf16 reader": (
        lambda: entry(codec(layout=Layout(LAYOUT.model, LAYOUT.page_bytes, 16, kv_dtype="float16")), NAME),
        codec(), "another layout",
    ),
    "another rank's shard": (
        lambda: entry(codec(layout=Layout(LAYOUT.model, LAYOUT.page_bytes, 16, "bfloat16", shard=(1, 2))), NAME),
        codec(), "another layout",
    ),
    "length field": (lambda: flipped(86)(entry(codec(), NAME)), codec(), "length"),
    "not kvflow's": (lambda: bytearray(b"GIF89a") + entry(codec(), NAME)[6:], codec(), "format"),
    "another format version": (lambda: flipped(4)(entry(codec(), NAME)), codec(), "format"),
    "an attacker's unkeyed entry": (lambda: entry(codec(None), NAME, block=666), codec(), "unkeyed"),
    "keyed entry, keyless reader": (lambda: entry(codec(), NAME), codec(None), "unknown key"),
    "unkeyed entry damaged": (lambda: flipped(HEADER_BYTES + 5)(entry(codec(None), NAME)), codec(None), "corrupt"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_F20_every_entry_not_sealed_for_this_reader_and_block_is_refused_with_its_reason(side: Any, case: str) -> None:
    make, reader, reason = PLANTED[case]
    assert reason in REASONS
    side.plant(reader, NAME, make())
    got, data = side.read(reader, NAME)
    assert got == reason
    if isinstance(side, RemoteSide) and case.startswith(("another", "fp16", "not", "an attacker", "keyed", "length")):
        assert PATTERN[:10] not in data  # refused by its head: nothing of it reached the pages
    # (a disk load reads a slot straight into the pages: they hold nothing meaningful after a
    # refusal, and the load fails: the engine never uses them)
    # positive control: the block written as it should be is served, byte for byte
    side.write(codec(reader.keys, MAC if reader.keys else NONE), NAME)
    assert side.read(reader, NAME) == (None, b"".join(pages_of(7)))


def test_F20_nothing_there_is_absent(side: Any) -> None:
    if isinstance(side, DiskSide):
        side.write(codec(), name_of(1))  # (slot 0 written, slot 1 never)
        with DiskEntryFile(side.path, codec=codec(), slots=2) as tier:
            import mmap

            buf = mmap.mmap(-1, LAYOUT.payload_bytes)
            assert tier.load([(1, NAME, [memoryview(buf)[:4096], memoryview(buf)[4096:]])]) == ["absent"]
    else:
        assert side.read(codec(), NAME)[0] == "absent"


def test_F20_a_remote_value_of_another_length_is_refused(redis_standalone) -> None:  # noqa: F811
    side = RemoteSide(redis_standalone)
    try:
        for value in (entry(codec(), NAME)[:-1], entry(codec(), NAME) + b"more", b"short"):
            side.plant(codec(), NAME, value)
            assert side.read(codec(), NAME)[0] == "length"
    finally:
        side.close()


def test_a_tenant_never_reads_another_tenants_block(side: Any) -> None:
    """Alice's block 7 and Bob's block 7 are two blocks: each reads only its own."""
    alice, bob = name_of(7, ALICE), name_of(7, BOB)
    side.write(codec(), alice, block=1)
    assert side.read(codec(), alice) == (None, b"".join(pages_of(1)))
    if isinstance(side, RemoteSide):  # another key altogether
        assert side.read(codec(), bob)[0] == "absent"
    else:  # the same slot, asked for Bob's block
        assert side.read(codec(), bob)[0] == "another tenant"


# -- rotation -------------------------------------------------------------------------------------


def test_rotation_old_entries_read_until_their_key_is_retired(side: Any) -> None:
    old_era = codec(tier_keys(KEY))
    side.write(old_era, NAME)
    rotated = codec(tier_keys(NEW_KEY, KEY))  # the new key first: it writes, the old one reads
    assert side.read(rotated, NAME) == (None, b"".join(pages_of(7)))
    side.write(rotated, NAME, block=9)
    head = side.stored_bytes()
    assert key_id(NEW_KEY) in head and key_id(KEY) not in head[:HEADER_BYTES]  # written under the new key
    retired = codec(tier_keys(NEW_KEY))
    assert side.read(retired, NAME) == (None, b"".join(pages_of(9)))
    side.write(old_era, NAME)  # an entry of the old key, read after its retirement
    assert side.read(retired, NAME)[0] == "unknown key"


# -- encryption at rest ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [ENCRYPT, MAC])
def test_encrypted_entries_hold_no_plaintext_at_rest(side: Any, mode: str) -> None:
    side.write(codec(mode=mode), NAME)
    at_rest = side.stored_bytes()
    assert (PATTERN % 7 in at_rest) == (mode == MAC)  # (mac: authenticated, in the clear)
    assert side.read(codec(), NAME) == (None, b"".join(pages_of(7)))  # either mode reads


# -- the keys ------------------------------------------------------------------------------------


def test_keys_file_first_key_writes_and_comments_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# rotation of June\n{NEW_KEY.hex()}  # writes\n\n{KEY.hex().upper()}\n")
    path.chmod(0o600)
    keys = TierKeys.from_file(path)
    assert keys.writer == key_id(NEW_KEY) and keys.ids == (key_id(NEW_KEY), key_id(KEY))
    os.environ["KVFLOW_TEST_TIER_KEYS"] = f"{KEY.hex()},{OTHER_KEY.hex()}"
    try:
        assert TierKeys.from_env("KVFLOW_TEST_TIER_KEYS").ids == (key_id(KEY), key_id(OTHER_KEY))
    finally:
        del os.environ["KVFLOW_TEST_TIER_KEYS"]


BAD_FILES = [
    ("", 0o600, "no key"),
    ("# only a comment\n\n", 0o600, "no key"),
    (KEY.hex()[:-2] + "\n", 0o600, "line 1: a key is 64 hexadecimal digits, this is 62 characters"),
    ("zz" + KEY.hex()[2:] + "\n", 0o600, "line 1: not hexadecimal"),
    (f"{KEY.hex()}\n{NEW_KEY.hex()}\n{KEY.hex()}\n", 0o600, "line 3: the same key as an earlier line"),
    (KEY.hex() + "\n", 0o640, "readable or writable by group or others (mode 0640); chmod 600"),
    (KEY.hex() + "\n", 0o604, "readable or writable by group or others"),
]


@pytest.mark.parametrize("text, mode, message", BAD_FILES)
def test_a_bad_keys_file_is_refused_in_one_line_that_never_shows_a_key(
    tmp_path: Path, text: str, mode: int, message: str
) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    with pytest.raises(ConfigError) as err:
        TierKeys.from_file(path)
    said = str(err.value)
    assert said.startswith(f"keys file {path}: ") and message in said and "\n" not in said
    for key in (KEY, NEW_KEY):
        assert key.hex() not in said.lower() and key.hex()[2:] not in said.lower()


def test_a_missing_keys_file_or_variable_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^keys file .*/nowhere: No such file or directory$"):
        TierKeys.from_file(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"^environment variable KVFLOW_TEST_UNSET_KEYS: not set$"):
        TierKeys.from_env("KVFLOW_TEST_UNSET_KEYS")
    os.environ["KVFLOW_TEST_BAD_KEYS"] = f"{KEY.hex()},{KEY.hex()[:10]}"
    try:
        with pytest.raises(ConfigError) as err:
            TierKeys.from_env("KVFLOW_TEST_BAD_KEYS")
        assert "key 2: a key is 64 hexadecimal digits" in str(err.value) and KEY.hex()[:10] not in str(err.value)
    finally:
        del os.environ["KVFLOW_TEST_BAD_KEYS"]


def test_the_key_material_shows_nowhere(tmp_path: Path) -> None:
    keys = TierKeys.from_file(keys_file(tmp_path, NEW_KEY, KEY))
    shown = repr(keys) + str(keys) + repr(codec(keys).keys) + str(vars(codec(keys)).get("layout"))
    for key in (KEY, NEW_KEY):
        assert key.hex() not in shown.lower() and repr(key) not in shown
    with pytest.raises(TypeError):
        pickle.dumps(keys)


def test_keys_derived_per_tenant_differ(tmp_path: Path) -> None:
    keys = TierKeys.from_file(keys_file(tmp_path, KEY))
    a, b = keys.derived(keys.writer, ALICE), keys.derived(keys.writer, BOB)
    assert a is not None and b is not None and a != b and KEY not in (a, b)
    assert keys.derived(key_id(OTHER_KEY), ALICE) is None
