"""The remote block store against real Redis servers (standalone and a 3-node cluster).

Each failure a real server shows is provoked for real: eviction under ``maxmemory``, OOM under
``noeviction``, foreign and damaged values, a killed server, a hung one.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("xxhash")
from redis_servers import (  # noqa: E402
    RedisServer,
    redis_cluster,  # noqa: F401  (fixtures)
    redis_fresh,  # noqa: F401
    redis_standalone,  # noqa: F401
    require_redis,
)

from kvflow.tiers.entry import HEADER_BYTES, Layout, Miss, decode, encode  # noqa: E402

LAYOUT = Layout(model="test-model", page_bytes=(1024, 512), block_tokens=16)


def pages_of(block_hash: int) -> list[bytes]:
    """Deterministic, block-specific bytes for each region's page."""
    seed = block_hash.to_bytes(9, "little", signed=True)
    return [(seed * (n // 9 + 1))[:n] for n in LAYOUT.page_bytes]


def store_for(target, *, timeout_s: float = 1.0, **kwargs):
    require_redis()
    from kvflow.tiers.redis_store import RedisBlockStore, connect

    cluster = hasattr(target, "nodes")
    client = connect(target.url, cluster=cluster, timeout_s=timeout_s)
    return RedisBlockStore(client, LAYOUT, timeout_s=timeout_s, **kwargs)


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


@pytest.fixture(params=["standalone", "cluster"])
def target(request):
    server = request.getfixturevalue(f"redis_{request.param}")
    yield server
    nodes = getattr(server, "nodes", [server])
    for node in nodes:
        node.cli("FLUSHALL")


def test_round_trip(target) -> None:
    store = store_for(target)
    hashes = [1, -5, 2**64 - 1, -(2**63), 123456789]
    assert store.put([(h, pages_of(h)) for h in hashes], soon()) == [None] * len(hashes)
    got = store.get([*hashes, 42], soon())
    for h, payload in zip(hashes, got):
        assert bytes(payload) == b"".join(pages_of(h))
    assert got[-1] == Miss("absent")
    seen = store.seen([hashes[0], 42], soon())
    assert seen[0] is not None and seen[1] is None
    store.close()


def test_cluster_spreads_keys_over_every_node(redis_cluster) -> None:  # noqa: F811
    store = store_for(redis_cluster)
    assert store.put([(h, pages_of(h)) for h in range(60)], soon()) == [None] * 60
    sizes = [int(node.cli("DBSIZE")) for node in redis_cluster.nodes]
    assert sum(sizes) == 60 and all(s > 0 for s in sizes), sizes
    for node in redis_cluster.nodes:
        node.cli("FLUSHALL")


def test_layouts_never_meet(redis_standalone) -> None:  # noqa: F811
    from kvflow.tiers.redis_store import RedisBlockStore, connect

    store = store_for(redis_standalone)
    other_layout = Layout(model="other-model", page_bytes=LAYOUT.page_bytes, block_tokens=16)
    other = RedisBlockStore(connect(redis_standalone.url), other_layout)
    store.put([(7, pages_of(7))], soon())
    assert other.get([7], soon()) == [Miss("absent")]  # another key altogether
    # ...and a value written under this layout's key by someone else is refused, not served
    store.client.set(store.key(8), encode(other_layout.digest, 8, pages_of(8)))
    assert [m.reason for m in store.get([8], soon())] == ["another layout"]
    assert store.seen([8], soon()) == [None]  # a probe does not offer it either
    redis_standalone.cli("FLUSHALL")


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda v: b"garbage", "short entry"),
        (lambda v: b"XXXX" + v[4:], "not a kvflow entry"),
        (lambda v: v[:4] + b"\x09" + v[5:], "entry format 9, expected 1"),
        (lambda v: v[:-1], "length 1535, expected 1536"),
        (lambda v: v + b"tail", "length 1540, expected 1536"),  # a whole entry, then more
        (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "checksum mismatch"),
        (lambda v: v[:HEADER_BYTES] + os.urandom(len(v) - HEADER_BYTES), "checksum mismatch"),
    ],
)
def test_damaged_or_foreign_values_are_misses(redis_standalone, damage, reason) -> None:  # noqa: F811
    store = store_for(redis_standalone)
    store.put([(9, pages_of(9))], soon())
    value = store.client.get(store.key(9))
    store.client.set(store.key(9), damage(value))
    (miss,) = store.get([9], soon())
    assert miss.reason == reason and miss.seen  # refused, with what it refused
    # a probe offers only a value whose header and length fit (the checksum needs the payload)
    assert (store.seen([9], soon()) == [miss.seen]) == (reason == "checksum mismatch")
    # an entry for block 10 stored under block 9's key is refused too
    store.client.set(store.key(9), encode(LAYOUT.digest, 10, pages_of(10)))
    assert [m.reason for m in store.get([9], soon())] == ["another block"]
    assert store.seen([9], soon()) == [None]
    redis_standalone.cli("FLUSHALL")


def test_decode_checks_length_before_checksum() -> None:
    value = encode(LAYOUT.digest, 3, pages_of(3))
    assert bytes(decode(value, LAYOUT.digest, 3, LAYOUT.payload_bytes)) == b"".join(pages_of(3))
    assert decode(value, LAYOUT.digest, 3, LAYOUT.payload_bytes + 1) == Miss(
        "length 1536, expected 1537"
    )


def limit_memory(server: RedisServer, room_bytes: int, policy: str) -> None:
    """Let the server hold ``room_bytes`` more than it uses now, then apply ``policy``."""
    info = server.cli("INFO", "memory")
    used = int(next(line for line in info.splitlines() if line.startswith("used_memory:"))[12:])
    server.cli("CONFIG", "SET", "maxmemory", str(used + room_bytes))
    server.cli("CONFIG", "SET", "maxmemory-policy", policy)


def test_server_eviction_under_maxmemory_is_a_miss_never_bad_data(redis_fresh) -> None:  # noqa: F811
    limit_memory(redis_fresh, 400_000, "allkeys-lru")
    store = store_for(redis_fresh)
    hashes = list(range(1000))
    for start in range(0, len(hashes), 50):
        batch = hashes[start : start + 50]
        assert store.put([(h, pages_of(h)) for h in batch], soon()) == [None] * len(batch)
    got = store.get(hashes, soon())
    evicted = [h for h, g in zip(hashes, got) if isinstance(g, Miss)]
    assert 0 < len(evicted) < len(hashes)  # the server silently dropped some
    assert all(g == Miss("absent") for g in got if isinstance(g, Miss))
    for h, g in zip(hashes, got):
        if not isinstance(g, Miss):
            assert bytes(g) == b"".join(pages_of(h))


def test_oom_under_noeviction_fails_that_block_and_checks_every_reply(redis_fresh) -> None:  # noqa: F811
    limit_memory(redis_fresh, 300_000, "noeviction")
    store = store_for(redis_fresh)
    hashes = list(range(400))
    errors = store.put([(h, pages_of(h)) for h in hashes], soon())
    failed = [h for h, e in zip(hashes, errors) if e is not None]
    stored = [h for h, e in zip(hashes, errors) if e is None]
    assert failed and stored
    assert all(errors[h].startswith("OutOfMemoryError") for h in failed)
    got = store.get(hashes, soon())
    for h in failed:  # a failed store is not visible
        assert got[h] == Miss("absent")
    for h in stored:
        assert bytes(got[h]) == b"".join(pages_of(h))
    # room again: the same blocks store
    redis_fresh.cli("FLUSHALL")
    redis_fresh.cli("CONFIG", "SET", "maxmemory", "0")
    assert store.put([(h, pages_of(h)) for h in failed], soon()) == [None] * len(failed)


def test_killed_server_fails_the_batch_and_restart_reconnects(redis_fresh) -> None:  # noqa: F811
    from kvflow.tiers.redis_store import RemoteUnavailable

    store = store_for(redis_fresh, timeout_s=0.2)
    store.put([(1, pages_of(1))], soon())
    redis_fresh.stop()
    started = time.monotonic()
    with pytest.raises(RemoteUnavailable):
        store.get([1], time.monotonic() + 0.5)
    with pytest.raises(RemoteUnavailable):
        store.put([(2, pages_of(2))], time.monotonic() + 0.5)
    assert time.monotonic() - started < 2.0
    redis_fresh.start()  # same port, empty (no persistence)
    assert store.get([1], soon()) == [Miss("absent")]
    assert store.put([(2, pages_of(2))], soon()) == [None]


def test_hung_server_never_holds_a_call_past_its_deadline(redis_fresh) -> None:  # noqa: F811
    """redis-py's default retries stretched a 0.2 s timeout to 6.4 s; here a hung server costs
    at most the deadline (plus one socket timeout when the first attempt starts late)."""
    from kvflow.tiers.redis_store import ATTEMPTS, RemoteUnavailable

    store = store_for(redis_fresh, timeout_s=0.2)
    store.put([(1, pages_of(1))], soon())
    redis_fresh.pause()
    try:
        for deadline_s in (0.3, 1.0):
            started = time.monotonic()
            with pytest.raises(RemoteUnavailable):
                store.get([1], started + deadline_s)
            elapsed = time.monotonic() - started
            # one socket timeout at least; at most the attempts that fit, never the deadline
            assert 0.2 <= elapsed < min(deadline_s, ATTEMPTS * 0.2) + 0.25, (deadline_s, elapsed)
    finally:
        redis_fresh.resume()
    assert bytes(store.get([1], soon())[0]) == b"".join(pages_of(1))


def test_cluster_node_killed_fails_within_the_deadline(redis_cluster) -> None:  # noqa: F811
    """Last in the module: it leaves the shared cluster with a node down."""
    from kvflow.tiers.redis_store import RemoteUnavailable

    store = store_for(redis_cluster, timeout_s=0.2)
    hashes = list(range(30))
    store.put([(h, pages_of(h)) for h in hashes], soon())
    victim = redis_cluster.nodes[2]
    victim.stop()
    started = time.monotonic()
    try:
        got = store.get(hashes, started + 1.0)
    except RemoteUnavailable:
        got = None
    assert time.monotonic() - started < 1.5
    if got is not None:  # served what the live nodes hold; the rest are misses, never bad data
        for h, g in zip(hashes, got):
            assert isinstance(g, Miss) or bytes(g) == b"".join(pages_of(h))
    victim.start(cluster=True)


def test_huge_values_under_kvflow_keys_are_refused_unread(redis_fresh) -> None:  # noqa: F811
    """Two 128 MiB values under kvflow's keys (one behind a well-formed entry): a load and a
    probe of them take the reader's memory up by far less than one of them (measured in a
    process of its own: its peak RSS and tracemalloc's peak)."""
    import json
    import subprocess
    import sys

    store = store_for(redis_fresh)
    big = 128 << 20
    store.put([(1, pages_of(1))], soon())  # a good entry, then 128 MiB more behind it
    redis_fresh.cli("SETRANGE", store.key(1).decode(), str(big), "x")
    redis_fresh.cli("SETRANGE", store.key(2).decode(), str(big), "x")  # zeros, then "x"
    store.close()
    script = f"""
import json, resource, time, tracemalloc
from kvflow.tiers.entry import Layout
from kvflow.tiers.redis_store import RedisBlockStore, connect
LAYOUT = Layout(model={LAYOUT.model!r}, page_bytes={LAYOUT.page_bytes!r}, block_tokens={LAYOUT.block_tokens})
store = RedisBlockStore(connect({redis_fresh.url!r}, timeout_s=30.0), LAYOUT, timeout_s=30.0)
store.seen([1], time.monotonic() + 60)  # (connected, modules imported)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
for _ in range(3):
    misses = store.get([1, 2], time.monotonic() + 60)
    seen = store.seen([1, 2], time.monotonic() + 60)
peak = tracemalloc.get_traced_memory()[1]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps([[m.reason for m in misses], seen, peak, (after - before) * 1024]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    reasons, seen, peak, grown = json.loads(out.stdout)
    assert reasons == [f"length {big + 1 - HEADER_BYTES}, expected 1536", "not a kvflow entry"]
    assert seen == [None, None]
    assert peak < 8 << 20 and grown < 32 << 20, (peak, grown)  # not one 128 MiB value read
