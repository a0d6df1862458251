"""The remote block store on Redis (standalone or Redis Cluster), through redis-py.

What a real server does, and what this client does about it:

- **Evicted, foreign, stale or forged entries.** Every value is sealed (encrypted or
  authenticated under the tenant's key) and proven on read (``kvflow.tiers.entry``): anything
  that is not this block, for this tenant, under this layout, sealed by a key this reader holds,
  is a ``Miss`` — never data. A key is ``<prefix>:<layout>:<tenant>:<full hash>``, so blocks of
  different tenants or layouts never share one (no cluster hash tag: each entry is one ``SET``
  of one key, atomic on its own, so keys may spread over every slot of a Redis Cluster).
- **No half-written entry.** One block is one ``SET`` of one key: Redis applies it whole or not at
  all, so a reader sees the old value, the new one, or none.
- **OOM under ``noeviction``.** The server refuses the ``SET``; that block's store failed (its
  hash never becomes visible remotely).
- **Pipelines apply the rest after a failed command.** A batch is one pipeline
  (``transaction=False``) executed with ``raise_on_error=False``, and *each* reply is checked: a
  batch can half succeed, block by block.
- **Retries never outlast the deadline.** redis-py's own retries are off (its defaults stretched a
  0.2 s timeout to 6.4 s); this client retries a lost connection itself, once, and only if
  another attempt still fits before the caller's deadline (each is bounded by the socket timeout).
  A lost connection is re-established by the next attempt or the next call: the server coming
  back needs nothing from the caller.

- **Values of any size under kvflow's keys.** A read asks for the value's length and at most one
  entry's bytes (``STRLEN`` and a bounded ``GETRANGE`` in one pipeline): a value longer than an
  entry of this layout is refused without being read.
- **No copy of a value on its way in.** The replies to a read are parsed by a small reader of
  kvflow's own (``_Replies``: integers, errors and strings, the only replies those commands
  have) that receives a value's payload straight into its host slot's pages, proving (and
  decrypting) each part as it arrives; redis-py's parsers would hand every value over as a new
  ``bytes`` first. Connections (auth, TLS), the cluster's slot map and the packing of commands
  stay redis-py's.

Auth and TLS are redis-py's: put them in the URL (``rediss://user:password@host:6380/0``) or pass
redis-py keyword arguments (``password=``, ``ssl_ca_certs=``, ``ssl_certfile=`` ...) through
``connect``. ``redis_tier`` checks every setting, and that the server answers (``PING``) with
them, when the tier is built: a bad one is refused there, in one line.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import hiredis
import redis
from redis._parsers import Encoder
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import PythonRespSerializer
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvflow.core.config import Config
from kvflow.core.errors import ConfigError, KvflowError
from kvflow.core.names import BlockName
from kvflow.core.values import is_int
from kvflow.tiers.entry import (
    HEADER_BYTES,
    NONCE_BYTES,
    EntryCodec,
    Layout,
    Miss,
    Opening,
    check_shard,
    codec_for,
)
from kvflow.tiers.keys import TierKeys

if TYPE_CHECKING:
    from kvflow.tiers.remote_executor import RemoteTierExecutor

DEFAULT_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 3600.0
URL_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PREFIX = b"kvflow"
# connections (worker threads) per tier: a job's blocks move over all of them at once
DEFAULT_CONNECTIONS, MAX_CONNECTIONS = 1, 64
# the most bytes of values one store pipeline sends (and each connection keeps buffers for)
PIPELINE_BYTES = 32 << 20
# Tries per request: a dropped connection gets one fresh try; a server that is down answers no
# faster for being asked again (and the job's deadline bounds both)
ATTEMPTS = 2
# What a dropped connection, a killed server or a cluster in flux raise in redis-py.
_TRANSPORT_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError)


class RemoteUnavailable(KvflowError):
    """The remote store could not be reached before the deadline (the whole batch failed)."""


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


# Commands packed by redis-py's Python packer, which sends a large value as it is: with hiredis
# installed redis-py packs every command with hiredis, which copies each value into one new
# buffer first (most of the client's work for values of megabytes). Replies are still parsed by
# hiredis. (6000: redis-py's own cutoff between copying small pieces together and sending.)
_PACKER = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)  # type: ignore[no-untyped-call]  # redis-py: untyped


class _PackingPool(redis.ConnectionPool):
    """redis-py's connection pool whose connections pack commands with ``_PACKER`` (a cluster
    client takes a pool class, not connection arguments of its own)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"command_packer": _PACKER, **kwargs})


def connect(
    url: str,
    *,
    cluster: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **redis_kwargs: Any,
) -> redis.Redis | RedisCluster:
    """A redis-py client with kvflow's settings: socket timeouts of ``timeout_s``, no retries of
    its own. ``url`` names one server (``redis://``, ``rediss://``, ``unix://``); for a cluster,
    any one node (the client discovers the rest)."""
    if not _seconds(timeout_s) or not 0 < timeout_s < MAX_TIMEOUT_S:
        raise ConfigError(f"remote timeout must be a positive number of seconds, got {timeout_s!r}")
    kwargs: dict[str, Any] = dict(
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=_no_retry()
    )
    kwargs.update(redis_kwargs)
    if cluster:
        return RedisCluster.from_url(url, connection_pool_class=_PackingPool, **kwargs)
    return redis.Redis.from_url(url, command_packer=_PACKER, **kwargs)


def cluster_nodes(addresses: Sequence[tuple[str, int]]) -> list[ClusterNode]:
    return [ClusterNode(host, port) for host, port in addresses]  # type: ignore[no-untyped-call]  # redis-py: untyped


class RedisBlockStore:
    """Blocks of one layout in one Redis deployment; thread-confined (one per executor thread)."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        codec: EntryCodec,
        *,
        prefix: bytes = DEFAULT_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ttl_s: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``codec`` seals and opens the entries (their layout, keys and mode)."""
        check_ttl(ttl_s)
        self.client = client
        self.codec = codec
        self.layout = codec.layout
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._clock = clock
        self._layout_hex = codec.layout.digest.hex().encode()
        self._entry_bytes = codec.layout.entry_bytes
        # a store's values are sealed into buffers it keeps (``_value``), at most
        # ``PIPELINE_BYTES`` of them: a longer batch is sent in several pipelines
        self._per_pipeline = max(1, PIPELINE_BYTES // self._entry_bytes)
        self._values: list[bytearray] = []

    def key(self, name: BlockName) -> bytes:
        """``<prefix>:<layout digest>:<tenant id>:<full hash>`` (hex): one key per block, tenant
        and layout."""
        return b"%s:%s:%s:%s" % (self.prefix, self._layout_hex, name.tenant.hex().encode(), name.full.hex().encode())

    def put(
        self, blocks: Sequence[tuple[BlockName, Sequence[bytes | memoryview]]], deadline_s: float
    ) -> list[str | None]:
        """Write each ``(name, pages)``, sealed; per block ``None`` (stored) or the server's error.

        Raises ``RemoteUnavailable`` when no attempt reached the server before ``deadline_s``
        (a monotonic time): then no block is known to be stored."""
        per_pipeline = self._per_pipeline

        def run() -> list[Any]:
            replies: list[Any] = []
            for start in range(0, len(blocks), per_pipeline):
                part = blocks[start : start + per_pipeline]
                nonces = os.urandom(NONCE_BYTES * len(part))
                pipe = self.client.pipeline(transaction=False)
                for i, (name, pages) in enumerate(part):
                    value = self._value(i)
                    view = memoryview(value)
                    view[:HEADER_BYTES] = self.codec.seal(
                        name, pages, nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES], view[HEADER_BYTES:]
                    )
                    pipe.set(self.key(name), value, ex=self.ttl_s)
                replies += pipe.execute(raise_on_error=False)
            return replies

        return [None if reply is True else _error_text(reply) for reply in self._attempt(run, deadline_s)]

    def _value(self, i: int) -> bytearray:
        """The ``i``-th buffer a pipeline's values are sealed into, kept for the next one (a
        new buffer of megabytes costs more to allocate and fault in than to fill)."""
        while len(self._values) <= i:
            self._values.append(bytearray(self._entry_bytes))
        return self._values[i]

    def get(
        self, names: Sequence[BlockName], into: Sequence[Sequence[memoryview]], deadline_s: float
    ) -> list[Miss | None]:
        """Load each block into its pages (``into``, one list of pages per block): ``None``
        for a block proven and loaded, or a ``Miss`` saying why not (absent, evicted, foreign,
        forged: ``REASONS``, or the server's error for that key; the pages then hold nothing
        meaningful); a refused value's ``Miss`` carries its ``seen``. Reads at most one
        entry's bytes per key, whatever the server holds there, its payload straight into the
        pages (then proven, and decrypted, in place). Raises ``RemoteUnavailable`` as ``put``
        does."""
        reads = self._reads(names, into, deadline_s)
        return [self._entry(n, read, pages) for n, read, pages in zip(names, reads, into)]

    def seen(self, names: Sequence[BlockName], deadline_s: float) -> list[bytes | Miss | None]:
        """For each block, what its key holds, by the value's head and length alone: the value's
        identity (``seen_of``) if it can be this block's entry for this reader (a hint: the tag
        is checked when loaded); a ``Miss`` (with ``seen``) for a value that cannot (another
        tenant's, an unknown key's, an unkeyed one, a wrong length ...); ``None`` for an absent
        key or the server's error. Reads the heads only."""
        out: list[bytes | Miss | None] = []
        for name, (length, got, head, _) in zip(names, self._reads(names, [()] * len(names), deadline_s)):
            if not isinstance(length, int) or not isinstance(got, int) or length == 0 or got == 0:
                out.append(None)
                continue
            seen = seen_of(length, head[:got])
            miss = self.codec.check(head[:got], name)
            if miss is None and length != self._entry_bytes:
                miss = Miss("length")
            out.append(seen if miss is None else Miss(miss.reason, seen))
        return out

    def _reads(
        self, names: Sequence[BlockName], into: Sequence[Sequence[memoryview]], deadline_s: float
    ) -> list[tuple[Any, Any, bytearray, Opening | None]]:
        """Per key: the value's length (``STRLEN``: 0 when absent), how many of its first bytes
        were read (``GETRANGE`` of at most the head and ``into``'s pages; 0 when the key went
        between the two commands, evicted under maxmemory or expired: absent, not refused), or
        the server's error for either; a buffer holding the head; and the proof of a value read into its pages.
        The rest of a value goes into its pages only when its length and head can be the
        block's entry (a value refused by its head never reaches them), each part proven (and
        decrypted, in place) as it arrives; else it is read and dropped."""
        if not names:
            return []
        heads = [bytearray(HEADER_BYTES) for _ in names]
        keys = [self.key(name) for name in names]

        def run() -> list[tuple[Any, Any, bytearray, Opening | None]]:
            out: list[Any] = [None] * len(names)
            for client, which in self._by_server(keys):
                commands: list[tuple[Any, ...]] = []
                for i in which:
                    limit = HEADER_BYTES + sum(memoryview(page).nbytes for page in into[i])
                    commands += [("STRLEN", keys[i]), ("GETRANGE", keys[i], 0, limit - 1)]
                with _sent(client, commands) as replies:
                    for i in which:
                        length = replies.read()
                        opening: Opening | Miss | None = None

                        def payload() -> tuple[Sequence[memoryview], Callable[[memoryview], None]] | None:
                            nonlocal opening
                            if length != self._entry_bytes:
                                return None
                            opening = self.codec.opening(heads[i], names[i])  # noqa: B023  (called at once)
                            if isinstance(opening, Miss):
                                return None
                            return into[i], partial(_in_place, opening.update)  # noqa: B023

                        got = replies.read(heads[i], payload)
                        out[i] = (length, got, heads[i], opening if isinstance(opening, Opening) else None)
            return out

        return self._attempt(run, deadline_s)

    def _by_server(self, keys: Sequence[bytes]) -> list[tuple[redis.Redis, list[int]]]:
        """The keys' indices by the server that holds them (a cluster's: by its slot map)."""
        if not isinstance(self.client, RedisCluster):
            return [(self.client, list(range(len(keys))))]
        cluster: Any = self.client  # (redis-py: untyped)
        groups: dict[str, tuple[redis.Redis, list[int]]] = {}
        for i, key in enumerate(keys):
            node = cluster.get_node_from_key(key)
            groups.setdefault(node.name, (cluster.get_redis_connection(node), []))[1].append(i)
        return list(groups.values())

    def _entry(
        self, name: BlockName, read: tuple[Any, Any, bytearray, Opening | None], pages: Sequence[memoryview]
    ) -> Miss | None:
        length, got, head, opening = read
        for reply in (length, got):
            if isinstance(reply, Exception):
                return Miss(_error_text(reply))
        if length == 0 or got == 0:  # (an empty value is no entry either; 0 read: gone since STRLEN)
            return Miss("absent")
        seen = seen_of(length, head[: min(got, HEADER_BYTES)])
        if opening is None or got != length:  # (a longer one: refused, the rest never read)
            return Miss(getattr(self.codec.check(head[:got], name), "reason", "length"), seen)
        miss = opening.finish()  # (the pages hold the plaintext: served only if proven)
        return None if miss is None else Miss(miss.reason, seen)

    def _attempt(self, run: Callable[[], list[Any]], deadline_s: float) -> list[Any]:
        """``run``, and once more after a transport error (a dropped connection gets one fresh
        try) if a whole attempt (one socket timeout) still fits before the deadline. The first
        attempt always runs: ``redis_tier`` keeps the socket timeout within the job's deadline."""
        if self._clock() >= deadline_s:
            raise RemoteUnavailable("remote deadline passed before the request was sent")
        for attempt in range(ATTEMPTS):
            try:
                return run()
            except _TRANSPORT_ERRORS as e:
                if attempt + 1 == ATTEMPTS or self._clock() + self.timeout_s > deadline_s:
                    raise RemoteUnavailable(f"remote store unavailable: {_error_text(e)}") from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.client.close()


@contextlib.contextmanager
def _sent(client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> Iterator[_Replies]:
    """Send ``commands`` in one pipeline over one of ``client``'s connections; the block reads
    every reply, in order, from the ``_Replies`` given. A transport failure (or a reply left
    unread) raises redis-py's ``ConnectionError`` / ``TimeoutError`` and drops the connection."""
    pool: Any = client.connection_pool  # (redis-py: untyped)
    conn = pool.get_connection()
    try:
        # (small commands: hiredis packs them in C, several times faster than the Python packer)
        conn.send_packed_command([b"".join(map(hiredis.pack_command, commands))])
        replies = _Replies(conn._sock)  # (redis-py's parser holds nothing between requests)
        yield replies
        if replies.read_count != len(commands) or replies.pending:
            raise redis.ConnectionError("replies left unread")
    except BaseException as e:
        conn.disconnect()
        if isinstance(e, OSError) and not isinstance(e, redis.RedisError):
            error = redis.TimeoutError if isinstance(e, TimeoutError) else redis.ConnectionError
            raise error(f"reading from the server: {e}") from e
        raise
    finally:
        pool.release(conn)


class _Replies:
    """RESP replies (integers, errors, strings) read off a socket; a string's bytes go straight
    into the buffers meant for them (``recv_into``), never through a copy of their own. What
    redis-py's parsers cannot do: they return every string as a new ``bytes``."""

    _CHUNK = 16384  # what one read asks for between strings (a string's bytes are read into place)
    _PART = 256 << 10  # the most of a string one read puts in place

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()  # read, not yet consumed
        self._chunk = bytearray(self._CHUNK)
        self.read_count = 0

    @property
    def pending(self) -> int:
        return len(self._buf)

    def read(
        self,
        head: bytearray | None = None,
        rest: Callable[[], tuple[Sequence[memoryview], Callable[[memoryview], None]] | None] = lambda: None,
    ) -> int | redis.ResponseError:
        """The next reply: an integer, the server's error, or a string's length, its first
        bytes read into ``head`` and the others into the buffers ``rest()`` gives then, in turn,
        each part handed to its callback as soon as it is read (``None``: read and dropped). A
        string longer than those buffers breaks the exchange."""
        self.read_count += 1
        line = self._line()
        kind, rest_of_line = line[:1], line[1:]
        if kind == b":":
            return int(rest_of_line)
        if kind == b"-":
            return redis.ResponseError(rest_of_line.decode("utf-8", "replace"))
        if kind != b"$":
            raise redis.ConnectionError(f"unexpected reply {line[:32]!r}")
        size = int(rest_of_line)
        if size < 0:  # (no such value)
            return 0
        first = 0 if head is None else min(size, len(head))
        if head is not None and first:
            self._into(memoryview(head)[:first])
        left = size - first
        where = rest() if left else None
        if where is None:
            self._drop(left)
            left = 0
        else:
            buffers, each = where
            for buffer in buffers:
                view = memoryview(buffer).cast("B")
                self._into(view[: min(left, len(view))], each)
                left -= min(left, len(view))
        if left:
            raise redis.ConnectionError(f"a reply of {size} bytes, more than was asked for")
        if self._line():
            raise redis.ConnectionError("a string reply not ended by CRLF")
        return size

    def _drop(self, size: int) -> None:
        while size:
            view = memoryview(self._chunk)[: min(size, len(self._chunk))]
            self._into(view)
            size -= len(view)

    def _read(self) -> None:
        n = self._sock.recv_into(self._chunk)
        if not n:
            raise redis.ConnectionError("the server closed the connection")
        self._buf += memoryview(self._chunk)[:n]

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._read()
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def _into(self, view: memoryview, each: Callable[[memoryview], None] | None = None) -> None:
        """Fill ``view``, handing each part read to ``each`` (parts of at most ``_PART``: what
        ``each`` reads back is still in the CPU's cache)."""
        at = min(len(self._buf), len(view))
        view[:at] = self._buf[:at]
        del self._buf[:at]
        if each is not None and at:
            each(view[:at])
        while at < len(view):
            n = self._sock.recv_into(view[at : at + self._PART])
            if not n:
                raise redis.ConnectionError("the server closed the connection")
            if each is not None:
                each(view[at : at + n])
            at += n


def _in_place(update: Callable[[memoryview, memoryview], None], part: memoryview) -> None:
    update(part, part)


def seen_of(length: int, head: bytes | bytearray) -> bytes:
    """What identifies a value a reader refused: its length and its head, whose nonce (random,
    new for every write) changes whenever a writer rewrites the key: a refused value is not
    offered again until then."""
    return length.to_bytes(8, "little") + bytes(head[:HEADER_BYTES])


def check_ttl(ttl_s: object) -> None:
    if ttl_s is not None and (not is_int(ttl_s) or ttl_s <= 0):
        raise ConfigError(f"remote ttl_s must be a positive whole number of seconds (or None), got {ttl_s!r}")


def _seconds(value: object) -> bool:
    """A finite number (not a flag)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def shown_url(url: str) -> str:
    """``url`` with its password hidden, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    return parts._replace(netloc=f"{user}***@{parts.netloc.rsplit('@', 1)[1]}").geturl()


def check_url(url: object, cluster: bool) -> None:
    """A URL redis-py can connect with: ``redis://``/``rediss://`` with a host and a port in
    range (a cluster: any one node), or ``unix://`` with a socket path."""
    if not isinstance(url, str):
        raise ConfigError(f"remote url must be a string, got {type(url).__name__}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"remote url {shown_url(url)!r}: {e}") from None
    if parts.scheme not in URL_SCHEMES:
        raise ConfigError(
            f"remote url {shown_url(url)!r}: scheme must be one of {', '.join(URL_SCHEMES)}, got {parts.scheme!r}"
        )
    if parts.scheme == "unix":
        if cluster:
            raise ConfigError(f"remote url {shown_url(url)!r}: a cluster is reached over redis:// or rediss://")
        if not parts.path:
            raise ConfigError(f"remote url {shown_url(url)!r}: no socket path")
    elif not parts.hostname:
        raise ConfigError(f"remote url {shown_url(url)!r}: no host")
    elif port == 0:
        raise ConfigError(f"remote url {shown_url(url)!r}: port 0")


def _error_text(reply: object) -> str:
    text = str(reply).splitlines()[0] if str(reply) else type(reply).__name__
    return f"{type(reply).__name__}: {text}" if isinstance(reply, Exception) else text


def redis_tier(
    executor: object,
    config: Config,
    url: str,
    *,
    model: str,
    cluster: bool = False,
    timeout_s: float | None = None,
    prefix: bytes = DEFAULT_PREFIX,
    ttl_s: int | None = None,
    absent_ttl_s: float = 1.0,
    keys: TierKeys | None = None,
    encrypt: bool | None = None,
    insecure_no_key: bool = False,
    shard: tuple[int, int] = (0, 1),
    connections: int = DEFAULT_CONNECTIONS,
    ranks: Sequence[int] | None = None,
    **redis_kwargs: Any,
) -> RemoteTierExecutor:
    """``executor`` (with its host pool) behind a Redis remote tier: the executor to hand to
    ``SyncEngine`` with ``config`` (whose ``remote_blocks`` must be > 0). ``model`` names the
    KV's model: with the pool's page sizes and dtype, ``config.block_tokens`` and ``shard``
    (this pool's rank of ``ranks`` when each rank has a pool of its own) it is the layout
    identity entries are keyed and checked by. ``timeout_s`` (socket timeout, one attempt)
    defaults to a quarter of the job deadline, at most 1 s. A block a probe found absent is not
    asked about again for ``absent_ttl_s``. ``connections``: connections to the server (each
    in a thread of its own; a job's blocks are spread over them). ``ranks``: the ranks whose
    results a remote job's end reports (every rank of ``config.world_size`` when one pool
    serves them all; a worker's own rank when each rank has a pool and a tier of its own).

    Entries are sealed with ``keys`` (``kvflow.tiers.keys.TierKeys``): encrypted, or with
    ``encrypt=False`` authenticated in the clear. Without keys the tier refuses to start unless
    ``insecure_no_key=True`` (a private, single-tenant deployment: entries then carry a
    checksum anyone can recompute).

    Every argument is checked here, and the server must answer a ``PING`` with them (within
    ``timeout_s``): a bad setting, an unreachable server, a refused password or user, an
    untrusted certificate are a ``ConfigError`` of one line, before anything runs."""
    from kvflow.tiers.host_slots import OwnsPool, SlotPages
    from kvflow.tiers.remote_executor import RemoteTierExecutor

    if not config.remote:
        raise ConfigError("the remote tier needs config.remote_blocks > 0")
    if not isinstance(executor, OwnsPool) or not executor.pool.enabled:
        raise ConfigError("the remote tier needs an executor with a host pool (cpu_blocks > 0)")
    check_url(url, cluster)
    if not isinstance(model, str) or not model:
        raise ConfigError(f"remote model must be a non-empty string, got {model!r}")
    if not isinstance(prefix, bytes) or not prefix:
        raise ConfigError(f"remote prefix must be non-empty bytes (b\"kvflow\"), got {prefix!r}")
    check_ttl(ttl_s)
    if not _seconds(absent_ttl_s) or absent_ttl_s < 0:
        raise ConfigError(f"remote absent_ttl_s must be a finite number of seconds >= 0, got {absent_ttl_s!r}")
    if not is_int(connections) or not 1 <= connections <= MAX_CONNECTIONS:
        raise ConfigError(f"remote connections must be a whole number in [1, {MAX_CONNECTIONS}], got {connections!r}")
    pool = executor.pool
    deadline_s = config.job_deadline_ms / 1000.0
    if timeout_s is not None and not _seconds(timeout_s):
        raise ConfigError(f"remote timeout_s must be a finite number of seconds, got {timeout_s!r}")
    timeout = min(DEFAULT_TIMEOUT_S, deadline_s / 4) if timeout_s is None else float(timeout_s)
    if not 0 < timeout <= min(deadline_s, MAX_TIMEOUT_S - 1):
        raise ConfigError(f"remote timeout_s must be within (0, job deadline {deadline_s:g} s], got {timeout_s!r}")
    layout = Layout(
        model=model, page_bytes=tuple(pool.page_bytes), block_tokens=config.block_tokens,
        kv_dtype=executor.kv_dtype, shard=check_shard(shard, "remote tier"),
    )  # fmt: skip
    codec = codec_for(layout, keys=keys, encrypt=encrypt, insecure_no_key=insecure_no_key, tier="remote tier")
    _ping(url, cluster, timeout, redis_kwargs)

    def open_store() -> RedisBlockStore:
        client = connect(url, cluster=cluster, timeout_s=timeout, **redis_kwargs)
        return RedisBlockStore(client, codec, prefix=prefix, timeout_s=timeout, ttl_s=ttl_s)

    return RemoteTierExecutor(
        executor,
        open_store,
        SlotPages.of_pool(pool),
        job_deadline_ms=config.job_deadline_ms,
        ranks=range(config.world_size) if ranks is None else ranks,
        absent_ttl_s=absent_ttl_s,
        call_timeout_s=ATTEMPTS * timeout,
        connections=connections,
    )


def _ping(url: str, cluster: bool, timeout_s: float, redis_kwargs: dict[str, Any]) -> None:
    """Connect, authenticate and ``PING`` once, each step bounded by ``timeout_s``; any failure
    is a ``ConfigError`` naming the server (its password hidden) and the first line of why."""
    client: Any = None
    try:
        client = connect(url, cluster=cluster, timeout_s=timeout_s, **redis_kwargs)
        client.ping()
    except (redis.RedisError, RedisClusterException, OSError, ValueError, TypeError) as e:
        # (a cluster client wraps why no node answered, e.g. a refused password, in an
        # exception of its own: the cause is the one line worth showing)
        why = e.__cause__ if isinstance(e, RedisClusterException) and e.__cause__ is not None else e
        raise ConfigError(f"remote tier {shown_url(url)}: {_error_text(why)}") from None
    finally:
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
