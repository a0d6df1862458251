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
from tier_keys import tier_keys  # noqa: E402

from kvflow.core.names import BlockName, name_of  # noqa: E402
from kvflow.tiers.entry import ENCRYPT, HEADER_BYTES, EntryCodec, Layout, Miss  # noqa: E402

LAYOUT = Layout(model="test-model", page_bytes=(1024, 512), block_tokens=16)
CODEC = EntryCodec(LAYOUT, tier_keys(), ENCRYPT)


def entry_of(block_hash: int, *, codec: EntryCodec = CODEC, name: BlockName | None = None) -> bytes:
    """The value a store writes for ``block_hash`` (under ``name``'s key unless given)."""
    value = memoryview(bytearray(codec.layout.entry_bytes))
    value[:HEADER_BYTES] = codec.seal(name or name_of(block_hash), pages_of(block_hash), os.urandom(12), value[HEADER_BYTES:])
    return bytes(value)


def put(store, hashes) -> list[str | None]:
    return store.put([(name_of(h), pages_of(h)) for h in hashes], soon())


def get(store, hashes, deadline_s: float | None = None) -> list[bytes | Miss]:
    """Each block's payload, or its ``Miss``."""
    into = [[memoryview(bytearray(n)) for n in store.layout.page_bytes] for _ in hashes]
    got = store.get([name_of(h) for h in hashes], into, soon() if deadline_s is None else deadline_s)
    return [g if g is not None else b"".join(bytes(p) for p in pages) for g, pages in zip(got, into)]


def seen(store, hashes) -> list[bytes | None]:
    return store.seen([name_of(h) for h in hashes], soon())


def pages_of(block_hash: int) -> list[bytes]:
    """Deterministic, block-specific bytes for each region's page."""
    seed = block_hash.to_bytes(9, "little", signed=True)
    return [(seed * (n // 9 + 1))[:n] for n in LAYOUT.page_bytes]


def store_for(target, *, timeout_s: float = 1.0, **kwargs):
    require_redis()
    from kvflow.tiers.redis_store import RedisBlockStore, connect

    cluster = hasattr(target, "nodes")
    client = connect(target.url, cluster=cluster, timeout_s=timeout_s)
    return RedisBlockStore(client, kwargs.pop("codec", CODEC), timeout_s=timeout_s, **kwargs)


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
    assert put(store, hashes) == [None] * len(hashes)
    got = get(store, [*hashes, 42])
    for h, payload in zip(hashes, got):
        assert bytes(payload) == b"".join(pages_of(h))
    assert got[-1] == Miss("absent")
    there = seen(store, [hashes[0], 42])
    assert there[0] is not None and there[1] is None
    store.close()


def test_cluster_spreads_keys_over_every_node(redis_cluster) -> None:  # noqa: F811
    store = store_for(redis_cluster)
    assert put(store, range(60)) == [None] * 60
    sizes = [int(node.cli("DBSIZE")) for node in redis_cluster.nodes]
    assert sum(sizes) == 60 and all(s > 0 for s in sizes), sizes
    for node in redis_cluster.nodes:
        node.cli("FLUSHALL")


def test_a_batch_longer_than_one_pipeline_goes_in_several_and_each_block_reads_back(target) -> None:
    store = store_for(target)
    store._per_pipeline = 2  # (PIPELINE_BYTES' worth: 2 entries of this layout)
    hashes = list(range(100, 107))
    assert put(store, hashes) == [None] * len(hashes)
    assert len(store._values) == 2  # the buffers are reused from one pipeline to the next
    assert put(store, hashes[::-1]) == [None] * len(hashes)
    for h, payload in zip(hashes, get(store, hashes)):
        assert bytes(payload) == b"".join(pages_of(h))
    store.close()


def test_a_value_shorter_than_an_entry_is_refused_and_the_connection_stays_usable(target) -> None:
    store = store_for(target)
    put(store, [1, 2, 3])
    key = store.key(name_of(2))
    short = entry_of(2)[: HEADER_BYTES + 100]
    client = store.client
    client.set(key, short)
    got = get(store, [1, 2, 3])
    assert isinstance(got[1], Miss) and got[1].reason == "length"
    assert [bytes(got[0]), bytes(got[2])] == [b"".join(pages_of(1)), b"".join(pages_of(3))]
    assert get(store, [1]) == [b"".join(pages_of(1))]
    store.close()


def test_the_reply_reader_puts_strings_into_their_buffers_and_refuses_a_broken_stream() -> None:
    import socket
    import threading

    import redis

    from kvflow.tiers.redis_store import _Replies

    def replies_of(stream: bytes) -> _Replies:
        ours, theirs = socket.socketpair()
        ours.settimeout(2.0)

        def send() -> None:  # in small pieces: every boundary falls inside something
            for i in range(0, len(stream), 7):
                theirs.sendall(stream[i : i + 7])
            theirs.close()

        threading.Thread(target=send, daemon=True).start()
        return _Replies(ours)

    body = bytes(range(256)) * 200
    reader = replies_of(b":51200\r\n-ERR wrong\r\n$51200\r\n" + body + b"\r\n$51200\r\n" + body + b"\r\n$-1\r\n:0\r\n")
    assert reader.read() == 51200
    error = reader.read()
    assert isinstance(error, redis.ResponseError) and str(error) == "ERR wrong"
    head, pages = bytearray(100), [memoryview(bytearray(51000)), memoryview(bytearray(200))]
    parts: list[bytes] = []
    assert reader.read(head, lambda: (pages, lambda part: parts.append(bytes(part)))) == 51200
    assert bytes(head) + bytes(pages[0]) + bytes(pages[1][:100]) == body  # (the buffers may hold more)
    assert b"".join(parts) == body[100:] and len(parts) > 1  # each part handed over as it was read
    assert bytes(pages[1][100:]) == bytes(100)
    assert reader.read(bytearray(100), lambda: None) == 51200  # read and dropped
    assert reader.read(bytearray(100), lambda: (pages, parts.append)) == 0  # no such value
    assert reader.read() == 0 and reader.read_count == 6 and not reader.pending

    for stream, why in [
        (b"$10\r\n0123456789\r\n", "more than was asked for"),  # longer than its buffers
        (b"$4\r\n0123XY\r\n", "not ended by CRLF"),
        (b"+OK\r\n", "unexpected reply"),
        (b"$10\r\n01234", "closed the connection"),
    ]:
        with pytest.raises(redis.ConnectionError, match=why):
            replies_of(stream).read(bytearray(2), lambda: ([memoryview(bytearray(4))], lambda _: None))


def test_layouts_never_meet(redis_standalone) -> None:  # noqa: F811
    store = store_for(redis_standalone)
    other_layout = Layout(model="other-model", page_bytes=LAYOUT.page_bytes, block_tokens=16)
    other_codec = EntryCodec(other_layout, CODEC.keys, ENCRYPT)
    other = store_for(redis_standalone, codec=other_codec)
    put(store, [7])
    assert get(other, [7]) == [Miss("absent")]  # another key altogether
    # ...and a value written under this layout's key by someone else is refused, not served
    store.client.set(store.key(name_of(8)), entry_of(8, codec=other_codec))
    assert [m.reason for m in get(store, [8])] == ["another layout"]
    assert [m.reason for m in seen(store, [8])] == ["another layout"]  # a probe refuses it too
    redis_standalone.cli("FLUSHALL")


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda v: b"garbage", "length"),
        (lambda v: b"XXXX" + v[4:], "format"),
        (lambda v: v[:4] + b"\x09" + v[5:], "format"),
        (lambda v: v[:-1], "length"),
        (lambda v: v + b"tail", "length"),  # a whole entry, then more
        (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "forged"),
        (lambda v: v[:HEADER_BYTES] + os.urandom(len(v) - HEADER_BYTES), "forged"),
    ],
)
def test_damaged_or_foreign_values_are_misses(redis_standalone, damage, reason) -> None:  # noqa: F811
    store = store_for(redis_standalone)
    put(store, [9])
    value = store.client.get(store.key(name_of(9)))
    store.client.set(store.key(name_of(9)), damage(value))
    (miss,) = get(store, [9])
    assert miss.reason == reason and miss.seen  # refused, with what it refused
    # a probe offers only a value whose head and length fit (the tag needs the payload)
    assert (seen(store, [9]) == [miss.seen]) == (reason == "forged")
    # an entry for block 10 stored under block 9's key is refused too
    store.client.set(store.key(name_of(9)), entry_of(10))
    assert [m.reason for m in get(store, [9])] == ["another block"]
    assert [m.reason for m in seen(store, [9])] == ["another block"]
    redis_standalone.cli("FLUSHALL")


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
        assert put(store, batch) == [None] * len(batch)
    got = get(store, hashes)
    evicted = [h for h, g in zip(hashes, got) if isinstance(g, Miss)]
    assert 0 < len(evicted) < len(hashes)  # the server silently dropped some
    assert [(h, g) for h, g in zip(hashes, got) if isinstance(g, Miss) and g != Miss("absent")] == []
    for h, g in zip(hashes, got):
        if not isinstance(g, Miss):
            assert bytes(g) == b"".join(pages_of(h))


def test_a_value_evicted_between_its_length_and_its_bytes_is_absent_not_refused(redis_fresh) -> None:  # noqa: F811
    # A read is two pipelined commands (STRLEN, GETRANGE); under maxmemory the server evicts
    # before each command, so a key can go between the two: the length says an entry, the read
    # finds nothing. That is a miss like any eviction, never a refusal (which would count as a
    # forged entry and show as an incident).
    store = store_for(redis_fresh)
    put(store, [5])
    (length, got, head, _) = store._reads([name_of(5)], [()], soon())[0]
    assert length == store._entry_bytes and got > 0  # as read when the key is there
    gone = (length, 0, bytearray(len(head)), None)  # as read when it went after STRLEN
    assert store._entry(name_of(5), gone, []) == Miss("absent")


def test_oom_under_noeviction_fails_that_block_and_checks_every_reply(redis_fresh) -> None:  # noqa: F811
    limit_memory(redis_fresh, 300_000, "noeviction")
    store = store_for(redis_fresh)
    hashes = list(range(400))
    errors = put(store, hashes)
    failed = [h for h, e in zip(hashes, errors) if e is not None]
    stored = [h for h, e in zip(hashes, errors) if e is None]
    assert failed and stored
    assert all(errors[h].startswith("OutOfMemoryError") for h in failed)
    got = get(store, hashes)
    for h in failed:  # a failed store is not visible
        assert got[h] == Miss("absent")
    for h in stored:
        assert bytes(got[h]) == b"".join(pages_of(h))
    # room again: the same blocks store
    redis_fresh.cli("FLUSHALL")
    redis_fresh.cli("CONFIG", "SET", "maxmemory", "0")
    assert put(store, failed) == [None] * len(failed)


def test_killed_server_fails_the_batch_and_restart_reconnects(redis_fresh) -> None:  # noqa: F811
    from kvflow.tiers.redis_store import RemoteUnavailable

    store = store_for(redis_fresh, timeout_s=0.2)
    put(store, [1])
    redis_fresh.stop()
    started = time.monotonic()
    with pytest.raises(RemoteUnavailable):
        get(store, [1], time.monotonic() + 0.5)
    with pytest.raises(RemoteUnavailable):
        store.put([(name_of(2), pages_of(2))], time.monotonic() + 0.5)
    assert time.monotonic() - started < 2.0
    redis_fresh.start()  # same port, empty (no persistence)
    assert get(store, [1]) == [Miss("absent")]
    assert put(store, [2]) == [None]


def test_hung_server_never_holds_a_call_past_its_deadline(redis_fresh) -> None:  # noqa: F811
    """redis-py's default retries stretched a 0.2 s timeout to 6.4 s; here a hung server costs
    at most the deadline (plus one socket timeout when the first attempt starts late)."""
    from kvflow.tiers.redis_store import ATTEMPTS, RemoteUnavailable

    store = store_for(redis_fresh, timeout_s=0.2)
    put(store, [1])
    redis_fresh.pause()
    try:
        for deadline_s in (0.3, 1.0):
            started = time.monotonic()
            with pytest.raises(RemoteUnavailable):
                get(store, [1], started + deadline_s)
            elapsed = time.monotonic() - started
            # one socket timeout at least; at most the attempts that fit, never the deadline
            assert 0.2 <= elapsed < min(deadline_s, ATTEMPTS * 0.2) + 0.25, (deadline_s, elapsed)
    finally:
        redis_fresh.resume()
    assert bytes(get(store, [1])[0]) == b"".join(pages_of(1))


def test_cluster_node_killed_fails_within_the_deadline(redis_cluster) -> None:  # noqa: F811
    """Last in the module: it leaves the shared cluster with a node down."""
    from kvflow.tiers.redis_store import RemoteUnavailable

    store = store_for(redis_cluster, timeout_s=0.2)
    hashes = list(range(30))
    put(store, hashes)
    victim = redis_cluster.nodes[2]
    victim.stop()
    started = time.monotonic()
    try:
        got = get(store, hashes, started + 1.0)
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
    put(store, [1])  # a good entry, then 128 MiB more behind it
    redis_fresh.cli("SETRANGE", store.key(name_of(1)).decode(), str(big), "x")
    redis_fresh.cli("SETRANGE", store.key(name_of(2)).decode(), str(big), "x")  # zeros, then "x"
    store.close()
    script = f"""
import json, resource, time, tracemalloc
from tier_keys import tier_keys
from kvflow.core.names import name_of
from kvflow.tiers.entry import ENCRYPT, EntryCodec, Layout
from kvflow.tiers.redis_store import RedisBlockStore, connect
LAYOUT = Layout(model={LAYOUT.model!r}, page_bytes={LAYOUT.page_bytes!r}, block_tokens={LAYOUT.block_tokens})
codec = EntryCodec(LAYOUT, tier_keys(), ENCRYPT)
store = RedisBlockStore(connect({redis_fresh.url!r}, timeout_s=30.0), codec, timeout_s=30.0)
names = [name_of(1), name_of(2)]
into = [[memoryview(bytearray(n)) for n in LAYOUT.page_bytes] for _ in names]
store.seen(names, time.monotonic() + 60)  # (connected, modules imported)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
for _ in range(3):
    misses = store.get(names, into, time.monotonic() + 60)
    seen = store.seen(names, time.monotonic() + 60)
peak = tracemalloc.get_traced_memory()[1]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps([[m.reason for m in misses], [m.reason for m in seen], peak, (after - before) * 1024]))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    reasons, seen, peak, grown = json.loads(out.stdout)
    assert reasons == ["length", "format"]
    assert seen == ["length", "format"]
    assert peak < 8 << 20 and grown < 32 << 20, (peak, grown)  # not one 128 MiB value read

