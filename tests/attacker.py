"""An attacker on a shared Redis: a process of its own that reaches the server with plain redis-py,
and knows what anyone can read (kvflow's entry format and key layout, a model's public shape, the
prompts whose blocks a victim will look up), but holds none of the victim's keys. Run by
tests/tiers/test_remote_attacks.py:

    python tests/attacker.py URL rewrite [N]                  every kvflow value (or the first N, in
                                                              key order): its head kept, its
                                                              payload replaced, its tag recomputed
                                                              as an unkeyed entry's checksum
    python tests/attacker.py URL unkey                        every kvflow value turned into a valid
                                                              unkeyed entry of the attacker's bytes
    python tests/attacker.py URL prewrite LAYOUT.json HASH... entries for blocks not stored yet:
                                                              unkeyed, and sealed with a key of the
                                                              attacker's own
    python tests/attacker.py URL copy FROM_HEX TO_HEX         every value of one tenant (or layout)
                                                              copied under another's key
    python tests/attacker.py URL save FILE                    every kvflow value, kept for later
    python tests/attacker.py URL restore FILE                 the saved values written back

URL is redis-py's: credentials in it, TLS files as query arguments (``?ssl_ca_certs=...``).
Prints one JSON line: what it wrote.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import redis
import xxhash

from kvflow.core.names import name_of
from kvflow.tiers.entry import _HEADER, HEADER_BYTES, TAG_BYTES, EntryCodec, Layout
from kvflow.tiers.keys import TierKeys

ATTACKER_BYTE = 0x41  # what the attacker's payloads are made of
UNKEYED = 3  # the mode byte of an entry without a key (the format is public)


def _kvflow_keys(server: redis.Redis) -> list[bytes]:
    return sorted(server.scan_iter(match=b"kvflow:*", count=1000))


def _unkeyed(header: bytes, payload: bytes) -> bytes:
    """An unkeyed entry: the header, then xxh3-128 of header and payload, then the payload."""
    return header + xxhash.xxh3_128_digest(header + payload) + payload


def main() -> int:
    url, action, *args = sys.argv[1:]
    server = redis.Redis.from_url(url)
    wrote = 0
    if action in ("rewrite", "unkey"):
        keys = _kvflow_keys(server)
        for key in keys[: int(args[0])] if args else keys:
            value = server.get(key)
            header = bytearray(value[: HEADER_BYTES - TAG_BYTES])
            payload = bytes([ATTACKER_BYTE]) * (len(value) - HEADER_BYTES)
            if action == "unkey":
                header[5] = UNKEYED  # (magic 4 bytes, version, then the mode)
                header[6:10] = bytes(4)  # no key id
            server.set(key, _unkeyed(bytes(header), payload))
            wrote += 1
    elif action == "prewrite":
        spec = json.loads(Path(args[0]).read_text())
        layout = Layout(spec["model"], tuple(spec["page_bytes"]), spec["block_tokens"], spec["kv_dtype"])
        own = Path(args[0]).with_suffix(".keys")
        own.write_text(os.urandom(32).hex() + "\n")
        own.chmod(0o600)
        prefix = b"kvflow:" + layout.digest.hex().encode()
        payload = bytes([ATTACKER_BYTE]) * layout.payload_bytes
        hashes = [int(h) for h in args[1:]]
        for i, h in enumerate(hashes):
            name = name_of(h)
            key = b"%s:%s:%s" % (prefix, name.tenant.hex().encode(), name.full.hex().encode())
            if i % 2:  # sealed with the attacker's own key: a valid entry, of an unknown key
                codec = EntryCodec(layout, TierKeys.from_file(own), "mac")
                server.set(key, codec.seal(name, [payload], os.urandom(12)) + payload)
            else:  # unkeyed, its checksum right
                header = _HEADER.pack(b"KVFL", 2, UNKEYED, bytes(4), os.urandom(12), layout.digest, name.full,
                                      name.tenant, layout.payload_bytes)  # fmt: skip
                server.set(key, _unkeyed(header, payload))
            wrote += 1
    elif action == "copy":
        source, target = args[0].encode(), args[1].encode()
        for key in _kvflow_keys(server):
            if source in key:
                server.set(key.replace(source, target), server.get(key))
                wrote += 1
    elif action == "save":
        values = {key.hex(): server.get(key).hex() for key in _kvflow_keys(server)}
        Path(args[0]).write_text(json.dumps(values))
        wrote = len(values)
    elif action == "restore":
        for key, value in json.loads(Path(args[0]).read_text()).items():
            server.set(bytes.fromhex(key), bytes.fromhex(value))
            wrote += 1
    else:
        raise SystemExit(f"unknown action {action!r}")
    print(json.dumps({"action": action, "wrote": wrote}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
