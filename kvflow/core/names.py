"""Block names: the engine's block hashes at full width, with their tenant, and the 64-bit keys
the decisions use.

An engine names a block by its hash: an integer of up to 256 bits (vLLM's SHA-256 block hashes
whole), taken modulo 2**256, optionally for a tenant (vLLM's ``cache_salt``). The decisions,
the trace and the CPU tier work with 64-bit *keys*:

* a hash that fits a signed 64-bit integer, without a tenant, is its own key (traces of such
  engines read as they always did, and a key says which block it is);
* any other hash, or any hash with a tenant, gets a *derived* key: 63 bits of a BLAKE2b digest
  of its full name, placed in ``[2**63, 2**64)``, a range no key of the first kind uses.

So two names can share a key only as two derived keys, and :class:`BlockNames` remembers the
full name behind every derived key the tiers know: a second name arriving with a key already
taken is a *collision*, detected and refused (that block is treated as absent), never served.
The shared tiers (disk, remote) key and authenticate entries by the full name, never by the key.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Sequence

import msgspec

from kvflow.core.errors import Rejected

HASH_BYTES = 32  # a full hash: 256 bits
TENANT_BYTES = 16  # a tenant's id: 128 bits of a digest of its name
NO_TENANT = bytes(TENANT_BYTES)
_KEY_MIN, _KEY_MAX = -(2**63), 2**63  # keys of the first kind: their own hash
_DERIVED = 2**63  # derived keys: [2**63, 2**64)
_HASH_MIN, _HASH_MOD = -(2**255), 2**256
_PRUNE_FLOOR = 1 << 16


class BlockName(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One block as the shared tiers know it: ``full``, the engine's hash modulo 2**256 (32
    bytes, little-endian), and ``tenant``, the id of the tenant it was stored for
    (``NO_TENANT`` for none); ``key``, the 64-bit key the decisions use for it."""

    key: int
    full: bytes
    tenant: bytes = NO_TENANT


def tenant_id(tenant: str | None) -> bytes:
    """The 16-byte id of a tenant (``NO_TENANT`` for None or ""): a keyed digest of its name,
    so the name itself (a salt that may be secret) is stored nowhere."""
    if tenant is None or tenant == "":
        return NO_TENANT
    if not isinstance(tenant, str):
        raise Rejected(f"tenant must be a string, got {type(tenant).__name__}")
    return hashlib.blake2b(
        tenant.encode(), digest_size=TENANT_BYTES, person=b"kvflow-tenant"
    ).digest()


def full_hash(block_hash: int) -> bytes:
    """A hash at full width: 32 bytes, little-endian, modulo 2**256."""
    return (block_hash % _HASH_MOD).to_bytes(HASH_BYTES, "little")


def derived_key(full: bytes, tenant: bytes) -> int:
    digest = hashlib.blake2b(tenant + full, digest_size=8, person=b"kvflow-key").digest()
    return _DERIVED + (int.from_bytes(digest, "little") >> 1)


def name_of(block_hash: int, tenant: bytes = NO_TENANT) -> BlockName:
    """The name (and key) of ``block_hash`` for the tenant with id ``tenant``."""
    full = full_hash(block_hash)
    if tenant == NO_TENANT and _KEY_MIN <= block_hash < _KEY_MAX:
        return BlockName(block_hash, full, tenant)
    return BlockName(derived_key(full, tenant), full, tenant)


def name_from(full: bytes, tenant: bytes = NO_TENANT) -> BlockName:
    """The name (and key) of the block whose full hash is ``full`` (32 bytes, as a tier stores
    it) for the tenant with id ``tenant``."""
    return name_of(int.from_bytes(full, "little", signed=True), tenant)


def is_own_key(key: int) -> bool:
    """Whether ``key`` is its own hash (no tenant): its name needs no table."""
    return _KEY_MIN <= key < _KEY_MAX


def all_own_keys(keys: Sequence[int]) -> bool:
    """Whether every one of ``keys`` (ints) is its own hash (``is_own_key``)."""
    return len(keys) == 0 or (min(keys) >= _KEY_MIN and max(keys) < _KEY_MAX)


def own_name(key: int) -> BlockName:
    """The name of a key that is its own hash (``is_own_key``): no tenant."""
    return BlockName(key, full_hash(key), NO_TENANT)


def tier_names(keys: Sequence[int], names: Sequence[BlockName]) -> tuple[BlockName, ...]:
    """The full names of the blocks a shared tier is asked about (a job's, a probe's), whose
    keys are ``keys``: ``names`` as the engine gave them, or, when it gave none (it leaves them
    out when every key is its own hash: ``all_own_keys``), each key's own name. A derived key
    the engine did not name gets an empty name: the tier fails that job rather than guess."""
    if names:
        return tuple(names)
    return tuple(own_name(k) if is_own_key(k) else BlockName(k, b"") for k in keys)


def checked_hashes(values: Sequence[int]) -> list[int]:
    """Block hashes as plain ints (numpy integers converted), each in [-2**255, 2**256);
    anything else is refused in one line."""
    try:
        out = list(map(operator.index, values))
    except TypeError:
        raise Rejected(f"block hashes must be integers, got {list(values)[:4]!r}") from None
    for i, h in enumerate(out):
        if not _HASH_MIN <= h < _HASH_MOD:
            raise Rejected(
                f"block hashes[{i}] must be within [-2**255, 2**256) (256 bits), got {h.bit_length()} bits"
            )
    return out


class BlockNames:
    """The names behind the derived keys the tiers hold (see the module doc).

    ``keys`` turns an engine call's hashes into keys, stopping at the first collision;
    ``add`` remembers the names of blocks a tier takes (a store, a probe, a warm restart);
    ``name`` gives a key's name back (for the shared tiers' jobs and probes). The table
    forgets the names of keys no tier holds any more (``prune``, called by the engine's step):
    it keeps every key the state still knows and every key named since the previous prune, so
    a probe's answer or a store on its way finds its names.
    """

    def __init__(self) -> None:
        self.table: dict[int, BlockName] = {}
        self._recent: dict[int, None] = {}
        self.collisions = 0  # names refused because another one holds their key
        self._prune_at = _PRUNE_FLOOR

    def keys(
        self, block_hashes: Sequence[int], tenant: bytes = NO_TENANT
    ) -> tuple[tuple[int, ...], list[BlockName]] | None:
        """The keys of ``block_hashes`` (checked) for ``tenant``, up to the first one whose key
        another name holds (``collisions`` counts it), and the names among them the table does
        not hold yet (for ``add`` once the call is accepted); None when every hash is its own
        key (the common case: the hashes are the keys, no name to remember)."""
        if not len(block_hashes):
            return None
        if tenant == NO_TENANT:
            try:
                if all_own_keys(block_hashes):
                    return None
            except TypeError:
                pass  # (named by checked_hashes)
        keys: list[int] = []
        fresh: dict[int, BlockName] = {}
        table = self.table
        for h in checked_hashes(block_hashes):
            name = name_of(h, tenant)
            key = name.key
            if not is_own_key(key):
                known = table.get(key) or fresh.get(key)
                if known is None:
                    fresh[key] = name
                elif known != name:
                    self.collisions += 1
                    break
            keys.append(key)
        return tuple(keys), list(fresh.values())

    def fits(self, name: BlockName) -> bool:
        """Whether ``name`` is what its key stands for (no other name holds the key, and the
        key is the one its full hash and tenant give)."""
        if is_own_key(name.key):
            return name == name_of(int.from_bytes(name.full, "little", signed=True))
        known = self.table.get(name.key)
        return (
            known == name if known is not None else name.key == derived_key(name.full, name.tenant)
        )

    def add(self, names: Sequence[BlockName]) -> None:
        """Remember these names (each one ``fits``: a tier vouches for them, a warm restart)."""
        for name in names:
            if not is_own_key(name.key):
                self.table[name.key] = name
                self._recent[name.key] = None

    def name(self, key: int) -> BlockName | None:
        """The name behind ``key`` (None for a derived key forgotten)."""
        if is_own_key(key):
            return own_name(key)
        return self.table.get(key)

    def prune(self, knows: Callable[[int], bool]) -> int:
        """Forget the names of keys ``knows`` says no tier holds, once the table has grown past
        twice its size after the last prune; returns how many were forgotten."""
        table = self.table
        if len(table) < self._prune_at:
            return 0
        recent = self._recent
        kept = {k: n for k, n in table.items() if k in recent or knows(k)}
        forgotten = len(table) - len(kept)
        self.table, self._recent = kept, {}
        self._prune_at = max(_PRUNE_FLOOR, 2 * len(kept))
        return forgotten
