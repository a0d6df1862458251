"""The shared tiers' entry format: one block's host-tier bytes, sealed so that a reader can
prove them, for the remote tier (a Redis value) and the disk tier (a slot) alike.

A shared tier holds whatever was last written in a place, or nothing: the server may have
evicted it, another deployment (another model, layout, dtype, rank shard, tenant or key) may
share the keyspace, an older kvflow may have written another format, and anyone who can reach
the server can write there. So an entry carries everything a reader needs to refuse it, and a
tag that only a holder of the key can make:

``head`` = ``header`` then ``tag`` (``HEADER_BYTES`` in all), then the payload:

* ``header``: magic ``KVFL``, format version, protection mode (encrypt / mac / none), the id of
  the key that sealed it (``kvflow.tiers.keys``; zeros without one), a 12-byte random nonce
  (a new one every write: it also tells a rewrite of a place from the value before), the
  layout digest (model, page sizes, block tokens, KV dtype, rank shard), the block's full
  32-byte hash, its tenant's 16-byte id, the payload's length;
* ``tag``: 16 bytes over the header and the payload, under the tenant's key (HKDF of the
  master key and the tenant's id):

  - ``encrypt``: AES-256-GCM (``cryptography``); the payload is the ciphertext and the header
    the associated data: confidential and authenticated;
  - ``mac``: authenticated, stored in the clear: the tag is AES-256-GCM's over an empty
    plaintext with the header and the payload as associated data (GMAC). GMAC rather than a
    keyed BLAKE2 because it runs on the CPU's AES and carry-less multiply instructions, an
    order of magnitude faster (docs/performance.md);
  - ``none``: an unkeyed xxh3-128 checksum of the header and payload: it detects damage, not
    forgery (only for a tier built with ``insecure_no_key=True``).

The tag comes right after the header (not after the payload) so that a disk slot's aligned
header block holds the whole head: one format for both tiers. The nonce is random per entry
(96 bits: no repeat worth counting before far more entries than a key should seal).

A reader checks the header against what it asked for (``EntryCodec.check``: a cheap answer
to a probe), then the tag over the whole entry (``EntryCodec.open``); anything else is a
``Miss`` with a stable reason (``REASONS``), never data. A keyed reader accepts entries sealed
in either keyed mode under any of its keys, and never an unkeyed one (anyone can make those).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvflow.core.errors import ConfigError
from kvflow.core.names import BlockName
from kvflow.tiers.keys import KEY_ID_BYTES, TierKeys

MAGIC = b"KVFL"
FORMAT_VERSION = 2
ENCRYPT, MAC, NONE = "encrypt", "mac", "none"
_MODE_CODE = {ENCRYPT: 1, MAC: 2, NONE: 3}
NONCE_BYTES = 12
TAG_BYTES = 16
# magic, version, mode, key id, nonce, layout digest, full hash, tenant id, payload length
_HEADER = struct.Struct(f"<4sBB{KEY_ID_BYTES}s{NONCE_BYTES}s16s32s16sQ")
HEADER_BYTES = _HEADER.size + TAG_BYTES  # the head: the header, then its tag
_NO_KEY = bytes(KEY_ID_BYTES)

# Why a reader refused a place (a ``Miss``'s reason), stable: tiers count rejections by it.
REASONS = (
    "absent",  # nothing there (a key not set, a slot never written)
    "format",  # not a kvflow entry, another format version or an unknown mode
    "unkeyed",  # an entry without a key's tag, refused by a reader with keys
    "unknown key",  # sealed by a key this reader does not hold (retired, or another deployment's)
    "another layout",  # another model, page sizes, block tokens, KV dtype or rank shard
    "another tenant",  # stored for another tenant
    "another block",  # another block's entry (another full hash)
    "length",  # a value or payload of another length than this layout's entry
    "forged",  # the tag does not prove the bytes: altered, damaged or forged
    "corrupt",  # the checksum of an unkeyed entry does not match: damaged
)
# The reasons a value that was there is refused (a tier's rejections are counted by these).
REJECTED = tuple(r for r in REASONS if r != "absent")


@dataclass(frozen=True)
class Layout:
    """Which KV a block's bytes are: entries written under one layout are read only under it.
    ``shard``: (rank, ranks), the part of every block this process's pool holds."""

    model: str
    page_bytes: tuple[int, ...]
    block_tokens: int
    kv_dtype: str = ""  # the KV's element type(s), e.g. "bfloat16" (the executor's)
    shard: tuple[int, int] = (0, 1)

    @property
    def digest(self) -> bytes:
        """16 bytes naming this layout (a hash of its canonical encoding)."""
        canonical = msgspec.json.encode(
            {"model": self.model, "page_bytes": list(self.page_bytes),
             "block_tokens": self.block_tokens, "format": FORMAT_VERSION,
             "kv_dtype": self.kv_dtype, "shard": list(self.shard)}
        )  # fmt: skip
        return hashlib.blake2b(canonical, digest_size=16).digest()

    @property
    def payload_bytes(self) -> int:
        """A block's payload: its page of every region, back to back."""
        return sum(self.page_bytes)

    @property
    def entry_bytes(self) -> int:
        """A whole entry: its head, then the payload."""
        return HEADER_BYTES + self.payload_bytes


class Miss(msgspec.Struct, frozen=True):
    """A place that holds no usable block, and why (one of ``REASONS``, or the server's or file
    system's error). ``seen`` identifies a value that was there and was refused (empty when
    none was)."""

    reason: str
    seen: bytes = b""


def codec_for(
    layout: Layout, *, keys: object, encrypt: object, insecure_no_key: object, tier: str
) -> EntryCodec:
    """The codec a tier's settings ask for, checked (one line each): with ``keys``, encryption
    unless ``encrypt=False`` (then mac); without, only by name (``insecure_no_key=True``)."""
    if keys is not None and not isinstance(keys, TierKeys):
        raise ConfigError(f"{tier}: keys must be TierKeys (TierKeys.from_file or from_env), got {type(keys).__name__}")
    if not isinstance(encrypt, (bool, type(None))):
        raise ConfigError(f"{tier}: encrypt must be True, False or None, got {encrypt!r}")
    if not isinstance(insecure_no_key, bool):
        raise ConfigError(f"{tier}: insecure_no_key must be True or False, got {insecure_no_key!r}")
    if keys is None:
        if not insecure_no_key:
            raise ConfigError(
                f"the {tier} needs a key: keys=TierKeys.from_file(PATH) or TierKeys.from_env(NAME); "
                "insecure_no_key=True for a private single-tenant deployment"
            )
        if encrypt:
            raise ConfigError(f"{tier}: encrypt=True needs keys")
        return EntryCodec(layout, None, NONE)
    if insecure_no_key:
        raise ConfigError(f"{tier}: keys and insecure_no_key=True together: give one")
    return EntryCodec(layout, keys, MAC if encrypt is False else ENCRYPT)


def check_shard(shard: object, tier: str) -> tuple[int, int]:
    """``(rank, ranks)`` with ``0 <= rank < ranks``, or a one-line ``ConfigError``."""
    if (
        not isinstance(shard, tuple) or len(shard) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
        or not 0 <= shard[0] < shard[1]
    ):  # fmt: skip
        raise ConfigError(f"{tier}: shard must be (rank, ranks) with 0 <= rank < ranks, got {shard!r}")
    return shard[0], shard[1]


class EntryCodec:
    """Seals and opens the entries of one layout, with ``keys`` (modes encrypt, mac) or
    without (mode none). Safe to share between threads."""

    def __init__(self, layout: Layout, keys: TierKeys | None, mode: str) -> None:
        if mode not in _MODE_CODE or (keys is None) != (mode == NONE):
            raise ConfigError(f"entry mode {mode!r} with{'out' if keys is None else ''} keys")
        self.layout = layout
        self.keys = keys
        self.mode = mode
        self._code = _MODE_CODE[mode]
        self._digest = layout.digest
        self._payload_bytes = layout.payload_bytes
        self._writer = keys.writer if keys is not None else _NO_KEY
        self._kids = frozenset(keys.ids) if keys is not None else frozenset()
        self._ciphers: dict[tuple[bytes, bytes], algorithms.AES] = {}

    def seal(
        self,
        name: BlockName,
        pages: Sequence[bytes | memoryview],
        nonce: bytes,
        out: memoryview | None = None,
    ) -> bytes:
        """The head of ``name``'s entry holding ``pages`` (a payload of the layout's length),
        sealed with ``nonce`` (``NONCE_BYTES`` random bytes, new for every write). The payload
        that follows the head is written into ``out`` when given (the ciphertext, or the pages
        as they are); encrypt mode needs ``out`` (its payload is not the pages)."""
        header = _HEADER.pack(
            MAGIC, FORMAT_VERSION, self._code, self._writer, nonce, self._digest, name.full, name.tenant,
            self._payload_bytes,
        )  # fmt: skip
        if self.mode == NONE:
            hasher = xxhash.xxh3_128(header)
            for page in pages:
                hasher.update(page)
            if out is not None:
                _copy(pages, out)
            return header + hasher.digest()
        enc = Cipher(self._cipher(self._writer, name.tenant), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(header)
        if self.mode == MAC:
            for page in pages:
                enc.authenticate_additional_data(page)
            if out is not None:
                _copy(pages, out)
        else:
            if out is None:
                raise ValueError("encrypt mode seals into out")
            at = 0
            for page in pages:
                size = len(memoryview(page).cast("B"))
                enc.update_into(page, out[at : at + size])
                at += size
        enc.finalize()
        return header + enc.tag

    def check(self, head: bytes | bytearray | memoryview, name: BlockName) -> Miss | None:
        """Whether ``head`` (at least ``HEADER_BYTES``) can be ``name``'s entry under this
        layout for this reader, by its header alone (the tag is checked by ``open``)."""
        if len(head) < HEADER_BYTES:
            return Miss("length")
        magic, version, code, kid, _nonce, layout, full, tenant, length = _HEADER.unpack_from(head)
        if magic != MAGIC or version != FORMAT_VERSION or code not in _CODES:
            return Miss("format")
        if code == _MODE_CODE[NONE]:
            if self.keys is not None:
                return Miss("unkeyed")
        elif kid not in self._kids:
            return Miss("unknown key")
        if layout != self._digest:
            return Miss("another layout")
        if tenant != name.tenant:
            return Miss("another tenant")
        if full != name.full:
            return Miss("another block")
        if length != self._payload_bytes:
            return Miss("length")
        return None

    def open(
        self,
        head: bytes | bytearray | memoryview,
        name: BlockName,
        src: Sequence[memoryview],
        dst: Sequence[memoryview],
    ) -> Miss | None:
        """Prove the entry whose head is ``head`` and whose payload is ``src`` (buffers back to
        back) to be ``name``'s, and put its plaintext in the pages ``dst`` (``dst`` may be
        ``src`` itself: decrypted in place). None when proven; else the ``Miss`` (``dst`` then
        holds nothing meaningful)."""
        opening = self.opening(head, name)
        if isinstance(opening, Miss):
            return opening
        pairs = _pairs(src, dst)
        for s, d in pairs:
            opening.update(s, d)
        miss = opening.finish()
        if miss is None and opening.code != _MODE_CODE[ENCRYPT] and src is not dst:
            _copy_pairs(pairs)  # (in the clear: copied once proven)
        return miss

    def opening(self, head: bytes | bytearray | memoryview, name: BlockName) -> Opening | Miss:
        """The proof of the entry whose head is ``head`` as ``name``'s, to be fed its payload
        in order as it arrives (``Opening``), or the ``Miss`` its head alone shows."""
        miss = self.check(head, name)
        if miss is not None:
            return miss
        header = bytes(head[: _HEADER.size])
        tag = bytes(head[_HEADER.size : HEADER_BYTES])
        _magic, _version, code, kid, nonce, _layout, _full, tenant, _length = _HEADER.unpack(header)
        if code == _MODE_CODE[NONE]:
            return Opening(code, tag, xxhash.xxh3_128(header))
        dec = Cipher(self._cipher(kid, tenant), modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(header)
        return Opening(code, tag, dec)

    def _cipher(self, kid: bytes, tenant: bytes) -> algorithms.AES:
        cipher = self._ciphers.get((kid, tenant))
        if cipher is None:
            assert self.keys is not None
            key = self.keys.derived(kid, tenant)
            if key is None:
                raise ValueError("no key of this id")  # (check refused it first)
            if len(self._ciphers) >= 4096:
                self._ciphers.clear()
            cipher = self._ciphers[(kid, tenant)] = algorithms.AES(key)
        return cipher


_CODES = frozenset(_MODE_CODE.values())


class Opening:
    """An entry's payload being proven (``EntryCodec.opening``): ``update`` with each part of
    it in order, then ``finish``: None when the tag proves every byte, else the ``Miss``.
    Until then the plaintext a part was decrypted into is unproven: nothing of it may be
    served unless ``finish`` says so."""

    __slots__ = ("code", "_tag", "_ctx")

    def __init__(self, code: int, tag: bytes, ctx: Any) -> None:
        self.code = code
        self._tag = tag
        self._ctx = ctx

    def update(self, src: memoryview, dst: memoryview) -> None:
        """The next part of the payload, ``src``: decrypted into ``dst`` (which may be ``src``
        itself: in place); in the clear (mac, none) it is only authenticated (``dst`` is not
        written: the caller copies the parts once proven)."""
        if self.code == _MODE_CODE[ENCRYPT]:
            self._ctx.update_into(src, dst)
        elif self.code == _MODE_CODE[MAC]:
            self._ctx.authenticate_additional_data(src)
        else:
            self._ctx.update(src)

    def finish(self) -> Miss | None:
        if self.code == _MODE_CODE[NONE]:
            return None if self._ctx.digest() == self._tag else Miss("corrupt")
        try:
            self._ctx.finalize()
        except InvalidTag:
            return Miss("forged")
        return None


def _copy(pages: Sequence[bytes | memoryview], out: memoryview) -> None:
    at = 0
    for page in pages:
        view = memoryview(page).cast("B")
        out[at : at + len(view)] = view
        at += len(view)


def _pairs(src: Sequence[memoryview], dst: Sequence[memoryview]) -> list[tuple[memoryview, memoryview]]:
    """(source, destination) per page of ``dst``: ``src`` is either pages of the same sizes
    or one buffer holding them back to back."""
    flat_dst = [memoryview(d).cast("B") for d in dst]
    flat_src = [memoryview(s).cast("B") for s in src]
    if [len(s) for s in flat_src] == [len(d) for d in flat_dst]:
        return list(zip(flat_src, flat_dst))
    if len(flat_src) != 1 or len(flat_src[0]) != sum(len(d) for d in flat_dst):
        raise ValueError("a payload and pages of different lengths")
    out, at = [], 0
    for d in flat_dst:
        out.append((flat_src[0][at : at + len(d)], d))
        at += len(d)
    return out


def _copy_pairs(pairs: Sequence[tuple[memoryview, memoryview]]) -> None:
    for s, d in pairs:
        d[:] = s
