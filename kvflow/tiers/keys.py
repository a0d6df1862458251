"""The shared tiers' keys: master keys from a file or an environment variable, and the
per-tenant keys derived from them.

A keys file holds one master key per line, 64 hexadecimal digits (32 bytes, e.g. the output of
``openssl rand -hex 32``); ``#`` starts a comment, blank lines are skipped. The **first** key
writes every new entry; the others only read (rotation: put a new key first, keep the old ones
until every entry they wrote is gone or no longer wanted, then delete their lines). An
environment variable holds the same keys, separated by newlines or commas.

The file must be readable by its owner alone (no permission for group or others, as ``ssh``
asks of a private key): a key anyone on the host can read protects nothing.

Each key is known by its *id*, 4 bytes of a keyed digest of the key itself (so an id names a
key without a registry of ids, and says nothing of it): entries carry the id of the key that
wrote them, and a reader with no key of that id refuses them (``"unknown key"``). The key an
entry is sealed with is derived per tenant: HKDF-SHA256 of the master key, with an ``info``
naming kvflow and the tenant's id, so a tenant's entries prove nothing under another tenant.

The key material appears in no message, ``repr``, log line or trace: errors name the file or
variable and the line, never what is on it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Sequence

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvflow.core.errors import ConfigError

KEY_BYTES = 32
KEY_ID_BYTES = 4
_INFO = b"kvflow shared tier entry key v1 tenant="
_CACHED = 4096  # derived keys kept (then forgotten wholesale: they are derived again)


def key_id(master: bytes) -> bytes:
    """The id of ``master``: 4 bytes of a keyed digest, which reveal nothing usable of it."""
    return hashlib.blake2b(master, digest_size=KEY_ID_BYTES, person=b"kvflow-key-id").digest()


class TierKeys:
    """Master keys of the shared tiers (see the module doc): build with ``from_file`` or
    ``from_env``. ``writer`` is the id of the key new entries are sealed with."""

    __slots__ = ("_masters", "_derived", "source", "writer", "ids")

    def __init__(self, masters: Sequence[bytes], source: str) -> None:
        if not masters:
            raise ConfigError(f"{source}: no key")
        self._masters = {key_id(m): bytes(m) for m in masters}
        if len(self._masters) != len(masters):
            raise ConfigError(f"{source}: two keys share an id (a key given twice?)")
        self._derived: dict[tuple[bytes, bytes], bytes] = {}
        self.source = source
        self.ids = tuple(self._masters)
        self.writer = self.ids[0]

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TierKeys:
        """The keys in the file ``path`` (one per line; the first writes)."""
        where = f"keys file {os.fspath(path)}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ConfigError(f"{where}: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{where}: not a regular file")
            if st.st_mode & 0o077:
                raise ConfigError(
                    f"{where}: readable or writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                    f"chmod 600 {os.fspath(path)}"
                )
            with open(fd, "rb", closefd=False) as f:
                raw = f.read(1 << 20)
        finally:
            os.close(fd)
        lines = raw.split(b"\n")
        return cls(_parse([(f"line {i}", line) for i, line in enumerate(lines, 1)], where), where)

    @classmethod
    def from_env(cls, name: str) -> TierKeys:
        """The keys in the environment variable ``name`` (separated by newlines or commas)."""
        where = f"environment variable {name}"
        value = os.environ.get(name)
        if value is None:
            raise ConfigError(f"{where}: not set")
        parts = value.encode().replace(b",", b"\n").split(b"\n")
        return cls(_parse([(f"key {i}", part) for i, part in enumerate(parts, 1)], where), where)

    def derived(self, kid: bytes, tenant: bytes) -> bytes | None:
        """The key of tenant ``tenant`` under the master key ``kid`` (None: no such key)."""
        cached = self._derived.get((kid, tenant))
        if cached is not None:
            return cached
        master = self._masters.get(kid)
        if master is None:
            return None
        key = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_INFO + tenant).derive(master)
        if len(self._derived) >= _CACHED:
            self._derived.clear()
        self._derived[(kid, tenant)] = key
        return key

    def __repr__(self) -> str:
        return f"TierKeys({self.source}, {len(self.ids)} key(s), writer id {self.writer.hex()})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("TierKeys are not pickled (their keys would travel with them)")


def _parse(lines: Sequence[tuple[str, bytes]], where: str) -> list[bytes]:
    keys: list[bytes] = []
    for at, line in lines:
        text = line.split(b"#", 1)[0].strip()
        if not text:
            continue
        if len(text) != 2 * KEY_BYTES:
            raise ConfigError(f"{where}: {at}: a key is {2 * KEY_BYTES} hexadecimal digits, this is {len(text)} characters")
        try:
            key = bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise ConfigError(f"{where}: {at}: not hexadecimal") from None
        if key in keys:
            raise ConfigError(f"{where}: {at}: the same key as an earlier line")
        keys.append(key)
    if not keys:
        raise ConfigError(f"{where}: no key (one per line, {2 * KEY_BYTES} hexadecimal digits)")
    return keys
