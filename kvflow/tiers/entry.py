"""The remote entry format: one block's host-tier bytes, framed so that a read can prove them.

A remote store holds whatever was last written under a key, or nothing: the server may have
evicted it (Redis under ``maxmemory`` drops keys silently), another deployment with another model
or layout may share the keyspace, an older kvflow may have written another format. So an entry
carries, ahead of the payload, everything a reader needs to refuse it: a magic and a format
version, the layout identity (model + page sizes: which KV this is), the block hash it claims to
hold, the payload length, and a checksum of the payload. ``decode`` returns the payload only if
every field matches what the reader expects; anything else is a *miss* with a reason, never data.

The key is content-addressed: the block hash plus the layout identity, so two deployments with the
same layout share entries and different layouts never meet. No cluster hash tag: each entry is one
``SET`` of one key, atomic on its own, so keys may spread over every slot of a Redis Cluster.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import xxhash

MAGIC = b"KVFL"
FORMAT_VERSION = 1
# magic, version, 3 bytes of write stamp, layout digest, block hash (signed 128-bit), payload
# length, payload checksum (xxh3-64). The stamp is no part of what a reader checks (readers of
# this format have always skipped those bytes): it makes each write of a key tell from the last,
# so a reader that refused a value sees when the key is rewritten, even with the same bytes.
_HEADER = struct.Struct("<4sB3s16s16sQQ")
NO_STAMP = bytes(3)
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True)
class Layout:
    """Which KV a block's bytes are: entries written under one layout are read only under it."""

    model: str
    page_bytes: tuple[int, ...]
    block_tokens: int
    kv_dtype: str = ""  # the KV's element type(s), e.g. "bfloat16" (the executor's)

    @property
    def digest(self) -> bytes:
        """16 bytes naming this layout (a hash of its canonical encoding)."""
        canonical = msgspec.json.encode(
            {"model": self.model, "page_bytes": list(self.page_bytes),
             "block_tokens": self.block_tokens, "format": FORMAT_VERSION}
            | ({"kv_dtype": self.kv_dtype} if self.kv_dtype else {})
        )  # fmt: skip
        return hashlib.blake2b(canonical, digest_size=16).digest()

    @property
    def payload_bytes(self) -> int:
        """A block's payload: its page of every region, back to back."""
        return sum(self.page_bytes)


class Miss(msgspec.Struct, frozen=True):
    """A key that holds no usable block, and why (absent, evicted, foreign, stale, corrupt).
    ``seen`` identifies a value that was there and was refused (empty when none was)."""

    reason: str
    seen: bytes = b""


def key_of(prefix: bytes, layout_digest: bytes, block_hash: int) -> bytes:
    """``<prefix>:<layout 8-byte hex>:<block hash>``: one key per block and layout."""
    return b"%s:%s:%d" % (prefix, layout_digest[:8].hex().encode(), block_hash)


def checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def checksum_pages(pages: Sequence[bytes | memoryview]) -> tuple[int, int]:
    """(length, checksum) of a payload given as its pages, back to back."""
    hasher = xxhash.xxh3_64()
    length = 0
    for page in pages:
        hasher.update(page)
        length += len(page)
    return length, hasher.intdigest()


def hash_bytes(block_hash: int) -> bytes:
    """A block hash as entries (and the disk tier's journal) carry it: 16 bytes, signed (a
    hash may be negative; a wider hash than today's 64 bits still fits)."""
    return block_hash.to_bytes(16, "little", signed=True)


def hash_from(raw: bytes | memoryview) -> int:
    return int.from_bytes(raw, "little", signed=True)


def header(
    layout_digest: bytes, block_hash: int, length: int, digest: int, stamp: bytes = NO_STAMP
) -> bytes:
    """The ``HEADER_BYTES`` that go ahead of a payload of ``length`` bytes with checksum ``digest``."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, stamp, layout_digest, hash_bytes(block_hash), length, digest)


def header_miss(
    value: bytes | memoryview, layout_digest: bytes, block_hash: int, payload_bytes: int
) -> int | Miss:
    """The payload checksum that the header at the start of ``value`` promises, if it names
    this block under this layout at this length; else a ``Miss`` saying which field is wrong."""
    if len(value) < HEADER_BYTES:
        return Miss("short entry")
    magic, version, _stamp, layout, raw_hash, length, digest = _HEADER.unpack_from(value)
    if magic != MAGIC:
        return Miss("not a kvflow entry")
    if version != FORMAT_VERSION:
        return Miss(f"entry format {version}, expected {FORMAT_VERSION}")
    if layout != layout_digest:
        return Miss("another layout")
    if hash_from(raw_hash) != block_hash:
        return Miss("another block")
    if length != payload_bytes:
        return Miss(f"length {length}, expected {payload_bytes}")
    return int(digest)


def encode(
    layout_digest: bytes, block_hash: int, pages: Sequence[bytes | memoryview], stamp: bytes = NO_STAMP
) -> bytes:
    """One entry: header then the block's pages, as one value (written by one ``SET``)."""
    length, digest = checksum_pages(pages)
    return b"".join([header(layout_digest, block_hash, length, digest, stamp), *pages])


def decode(
    value: bytes | None, layout_digest: bytes, block_hash: int, payload_bytes: int
) -> memoryview | Miss:
    """The payload of ``value`` if it is this block under this layout, intact; else a ``Miss``."""
    if value is None:
        return Miss("absent")
    digest = header_miss(value, layout_digest, block_hash, payload_bytes)
    if isinstance(digest, Miss):
        return digest
    if len(value) != HEADER_BYTES + payload_bytes:
        return Miss(f"length {len(value) - HEADER_BYTES}, expected {payload_bytes}")
    payload = memoryview(value)[HEADER_BYTES:]
    if checksum(payload) != digest:
        return Miss("checksum mismatch")
    return payload
