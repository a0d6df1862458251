"""The remote block store on Redis (standalone or Redis Cluster), through redis-py.

What a real server does, and what this client does about it:

- **Evicted, foreign or stale entries.** Every value is framed and checked on read
  (``kvflow.tiers.entry``): anything that is not this block under this layout, intact, is a
  ``Miss`` — never data.
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

Auth and TLS are redis-py's: put them in the URL (``rediss://user:password@host:6380/0``) or pass
redis-py keyword arguments (``password=``, ``ssl_ca_certs=``, ``ssl_certfile=`` ...) through
``connect``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvflow.core.config import Config
from kvflow.core.errors import ConfigError, KvflowError
from kvflow.core.values import is_int
from kvflow.tiers.entry import Layout, Miss, decode, encode, key_of

if TYPE_CHECKING:
    from kvflow.tiers.remote_executor import RemoteTierExecutor

DEFAULT_TIMEOUT_S = 1.0
DEFAULT_PREFIX = b"kvflow"
# Tries per request: a dropped connection gets one fresh try; a server that is down answers no
# faster for being asked again (and the job's deadline bounds both)
ATTEMPTS = 2
# What a dropped connection, a killed server or a cluster in flux raise in redis-py.
_TRANSPORT_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError)


class RemoteUnavailable(KvflowError):
    """The remote store could not be reached before the deadline (the whole batch failed)."""


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


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
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < 3600):
        raise ConfigError(f"remote timeout must be a positive number of seconds, got {timeout_s!r}")
    kwargs: dict[str, Any] = dict(
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=_no_retry()
    )
    kwargs.update(redis_kwargs)
    if cluster:
        return RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def cluster_nodes(addresses: Sequence[tuple[str, int]]) -> list[ClusterNode]:
    return [ClusterNode(host, port) for host, port in addresses]  # type: ignore[no-untyped-call]  # redis-py: untyped


class RedisBlockStore:
    """Blocks of one layout in one Redis deployment; thread-confined (one per executor thread)."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        layout: Layout,
        *,
        prefix: bytes = DEFAULT_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ttl_s: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s is not None and (not is_int(ttl_s) or ttl_s <= 0):
            raise ConfigError(f"remote ttl must be a positive number of seconds, got {ttl_s!r}")
        self.client = client
        self.layout = layout
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._clock = clock
        self._digest = layout.digest
        self._payload_bytes = layout.payload_bytes

    def key(self, block_hash: int) -> bytes:
        return key_of(self.prefix, self._digest, block_hash)

    def put(
        self, blocks: Sequence[tuple[int, Sequence[bytes | memoryview]]], deadline_s: float
    ) -> list[str | None]:
        """Write each ``(block_hash, pages)``; per block ``None`` (stored) or the server's error.

        Raises ``RemoteUnavailable`` when no attempt reached the server before ``deadline_s``
        (a monotonic time): then no block is known to be stored."""
        values = [(self.key(h), encode(self._digest, h, pages)) for h, pages in blocks]

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key, value in values:
                pipe.set(key, value, ex=self.ttl_s)
            return pipe.execute(raise_on_error=False)

        return [None if reply is True else _error_text(reply) for reply in self._attempt(run, deadline_s)]

    def get(self, block_hashes: Sequence[int], deadline_s: float) -> list[memoryview | Miss]:
        """Each block's payload, or a ``Miss`` saying why not (absent, evicted, foreign, corrupt,
        or the server's error for that key). Raises ``RemoteUnavailable`` as ``put`` does."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for h in block_hashes:
                pipe.get(self.key(h))
            return pipe.execute(raise_on_error=False)

        out: list[memoryview | Miss] = []
        for h, reply in zip(block_hashes, self._attempt(run, deadline_s)):
            if isinstance(reply, Exception):
                out.append(Miss(_error_text(reply)))
            else:
                out.append(decode(reply, self._digest, h, self._payload_bytes))
        return out

    def contains(self, block_hashes: Sequence[int], deadline_s: float) -> list[bool]:
        """Which blocks have a key (a hint: the entry is still validated when loaded)."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for h in block_hashes:
                pipe.exists(self.key(h))
            return pipe.execute(raise_on_error=False)

        return [reply == 1 for reply in self._attempt(run, deadline_s)]

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
    **redis_kwargs: Any,
) -> RemoteTierExecutor:
    """``executor`` (with its host pool) behind a Redis remote tier: the executor to hand to
    ``SyncEngine`` with ``config`` (whose ``remote_blocks`` must be > 0). ``model`` names the
    KV's model: with the pool's page sizes and ``config.block_tokens`` it is the layout identity
    entries are keyed and checked by. ``timeout_s`` (socket timeout, one attempt) defaults to a
    quarter of the job deadline, at most 1 s. A block a probe found absent is not asked about
    again for ``absent_ttl_s``."""
    from kvflow.tiers.host_slots import OwnsPool, SlotPages
    from kvflow.tiers.remote_executor import RemoteTierExecutor

    if not config.remote:
        raise ConfigError("the remote tier needs config.remote_blocks > 0")
    if not isinstance(executor, OwnsPool) or not executor.pool.enabled:
        raise ConfigError("the remote tier needs an executor with a host pool (cpu_blocks > 0)")
    pool = executor.pool
    deadline_s = config.job_deadline_ms / 1000.0
    timeout = min(1.0, deadline_s / 4) if timeout_s is None else float(timeout_s)
    if not 0 < timeout <= deadline_s:
        raise ConfigError(f"remote timeout_s must be within (0, job deadline {deadline_s} s], got {timeout_s!r}")
    layout = Layout(model=model, page_bytes=tuple(pool.page_bytes), block_tokens=config.block_tokens)

    def open_store() -> RedisBlockStore:
        client = connect(url, cluster=cluster, timeout_s=timeout, **redis_kwargs)
        return RedisBlockStore(client, layout, prefix=prefix, timeout_s=timeout, ttl_s=ttl_s)

    return RemoteTierExecutor(
        executor,
        open_store,
        SlotPages.of_pool(pool),
        job_deadline_ms=config.job_deadline_ms,
        world_size=config.world_size,
        absent_ttl_s=absent_ttl_s,
    )
