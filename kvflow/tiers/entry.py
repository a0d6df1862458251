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
# magic, version, 3 reserved bytes, layout digest, block hash (signed 128-bit), payload length,
# payload checksum (xxh3-64)
_HEADER = struct.Struct("<4sB3x16s16sQQ")
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True)
class Layout:
    """Which KV a block's bytes are: entries written under one layout are read only under it."""

    model: str
    page_bytes: tuple[int, ...]
    block_tokens: int

    @property
    def digest(self) -> bytes:
        """16 bytes naming this layout (a hash of its canonical encoding)."""
        canonical = msgspec.json.encode(
            {"model": self.model, "page_bytes": list(self.page_bytes),
             "block_tokens": self.block_tokens, "format": FORMAT_VERSION}
        )  # fmt: skip
        return hashlib.blake2b(canonical, digest_size=16).digest()

    @property
    def payload_bytes(self) -> int:
        """A block's payload: its page of every region, back to back."""
        return sum(self.page_bytes)


class Miss(msgspec.Struct, frozen=True):
    """A key that holds no usable block, and why (absent, evicted, foreign, stale, corrupt)."""

    reason: str


def key_of(prefix: bytes, layout_digest: bytes, block_hash: int) -> bytes:
    """``<prefix>:<layout 8-byte hex>:<block hash>``: one key per block and layout."""
    return b"%s:%s:%d" % (prefix, layout_digest[:8].hex().encode(), block_hash)


def checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode(layout_digest: bytes, block_hash: int, pages: Sequence[bytes | memoryview]) -> bytes:
    """One entry: header then the block's pages, as one value (written by one ``SET``)."""
    hasher = xxhash.xxh3_64()
    length = 0
    for page in pages:
        hasher.update(page)
        length += len(page)
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, layout_digest, block_hash.to_bytes(16, "little", signed=True),
        length, hasher.intdigest(),
    )  # fmt: skip
    return b"".join([header, *pages])


def decode(
    value: bytes | None, layout_digest: bytes, block_hash: int, payload_bytes: int
) -> memoryview | Miss:
    """The payload of ``value`` if it is this block under this layout, intact; else a ``Miss``."""
    if value is None:
        return Miss("absent")
    if len(value) < HEADER_BYTES:
        return Miss("short entry")
    magic, version, layout, hash_bytes, length, digest = _HEADER.unpack_from(value)
    if magic != MAGIC:
        return Miss("not a kvflow entry")
    if version != FORMAT_VERSION:
        return Miss(f"entry format {version}, expected {FORMAT_VERSION}")
    if layout != layout_digest:
        return Miss("another layout")
    if int.from_bytes(hash_bytes, "little", signed=True) != block_hash:
        return Miss("another block")
    if length != payload_bytes or len(value) != HEADER_BYTES + length:
        return Miss(f"length {len(value) - HEADER_BYTES}, expected {payload_bytes}")
    payload = memoryview(value)[HEADER_BYTES:]
    if checksum(payload) != digest:
        return Miss("checksum mismatch")
    return payload
