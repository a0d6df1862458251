"""``redis_tier`` checks every setting, and reaches the server, when the tier is built: a bad
one is refused there in one line, before any job runs; ``close()`` ends the tier's thread in a
bounded time whatever the job deadline."""

from __future__ import annotations

import math
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("xxhash")
from redis_servers import free_port, redis_standalone  # noqa: E402, F401  (fixtures)
from remote_rig import CPU_BLOCKS, B, random_kv  # noqa: E402
from tier_keys import tier_keys  # noqa: E402

from kvflow.core.config import Config  # noqa: E402
from kvflow.core.errors import ConfigError  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402

KEYS = tier_keys()


def build(url: str, *, deadline_ms: float = 2000.0, **tier):
    from kvflow.tiers.redis_store import redis_tier

    config = Config(cpu_blocks=CPU_BLOCKS, block_tokens=B, remote_blocks=64, job_deadline_ms=deadline_ms)
    inner = TorchExecutor(random_kv(1), CPU_BLOCKS, device="cpu")
    try:
        return redis_tier(inner, config, url, **{"model": "m", "keys": KEYS, **tier})
    except BaseException:
        inner.close()
        raise


def refused(url: str, **tier) -> str:
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        build(url, **tier)
    assert time.monotonic() - started < 5.0  # refused at once, never a hang
    message = str(err.value)
    assert "\n" not in message and message, message
    return message


BAD = [
    ({"url": "http://127.0.0.1:6379"}, "scheme must be one of redis, rediss, unix, got 'http'"),
    ({"url": "redis://:6379"}, "no host"),
    ({"url": "redis://127.0.0.1:99999"}, "out of range"),
    ({"url": "redis://127.0.0.1:port"}, "remote url"),
    ({"url": "unix://"}, "no socket path"),
    ({"url": 6379}, "remote url must be a string"),
    ({"prefix": "kvflow"}, "remote prefix must be non-empty bytes"),
    ({"prefix": b""}, "remote prefix must be non-empty bytes"),
    ({"ttl_s": 0}, "ttl_s must be a positive whole number"),
    ({"ttl_s": 1.5}, "ttl_s must be a positive whole number"),
    ({"ttl_s": True}, "ttl_s must be a positive whole number"),
    ({"absent_ttl_s": math.nan}, "absent_ttl_s must be a finite number"),
    ({"absent_ttl_s": -1.0}, "absent_ttl_s must be a finite number"),
    ({"absent_ttl_s": math.inf}, "absent_ttl_s must be a finite number"),
    ({"timeout_s": "1"}, "timeout_s must be a finite number"),
    ({"timeout_s": math.nan}, "timeout_s must be a finite number"),
    ({"timeout_s": 0}, "timeout_s must be within"),
    ({"timeout_s": 5.0}, "timeout_s must be within (0, job deadline 2 s]"),
    ({"model": ""}, "remote model must be a non-empty string"),
    # secure by default: a key, or the opt-out by name
    ({"keys": None}, "the remote tier needs a key: keys=TierKeys.from_file(PATH) or TierKeys.from_env(NAME); "
                     "insecure_no_key=True for a private single-tenant deployment"),
    ({"keys": "0" * 64}, "remote tier: keys must be TierKeys"),
    ({"encrypt": "yes"}, "remote tier: encrypt must be True, False or None"),
    ({"insecure_no_key": 1}, "remote tier: insecure_no_key must be True or False"),
    ({"insecure_no_key": True}, "remote tier: keys and insecure_no_key=True together"),
    ({"keys": None, "insecure_no_key": True, "encrypt": True}, "remote tier: encrypt=True needs keys"),
    ({"shard": (2, 2)}, "remote tier: shard must be (rank, ranks) with 0 <= rank < ranks"),
    ({"shard": 0}, "remote tier: shard must be (rank, ranks)"),
    ({"connections": 0}, "remote connections must be a whole number in [1, 64]"),
    ({"connections": 65}, "remote connections must be a whole number in [1, 64]"),
    ({"connections": 2.0}, "remote connections must be a whole number"),
    ({"connections": True}, "remote connections must be a whole number"),
]


@pytest.mark.parametrize("bad, words", BAD)
def test_each_bad_setting_is_refused_at_build_in_one_line(redis_standalone, bad, words) -> None:  # noqa: F811
    tier = {"url": redis_standalone.url, **bad}
    assert words in refused(tier.pop("url"), **tier)


@pytest.mark.parametrize("tier", [{"keys": KEYS, "encrypt": False}, {"keys": None, "insecure_no_key": True}])
def test_a_tier_with_a_key_or_without_one_by_name_builds(redis_standalone, tier) -> None:  # noqa: F811
    executor = build(redis_standalone.url, **tier)
    assert executor.remote_rejected() == dict.fromkeys(executor.remote_rejected(), 0)
    executor.close()


def test_a_server_nobody_listens_on_is_refused_at_build(redis_standalone) -> None:  # noqa: F811
    port = free_port()
    message = refused(f"redis://127.0.0.1:{port}")
    assert message.startswith(f"remote tier redis://127.0.0.1:{port}: ConnectionError"), message


def test_a_hung_server_is_refused_within_the_timeout(redis_standalone) -> None:  # noqa: F811
    redis_standalone.pause()
    try:
        started = time.monotonic()
        message = refused(redis_standalone.url, timeout_s=0.3)
        assert time.monotonic() - started < 2.0
        assert "Timeout" in message, message
    finally:
        redis_standalone.resume()


def test_bad_redis_kwargs_are_refused_in_one_line(redis_standalone) -> None:  # noqa: F811
    assert "TypeError" in refused(redis_standalone.url, no_such_option=1)


def test_a_password_never_shows_in_a_message() -> None:
    port = free_port()
    message = refused(f"redis://alice:s3cret@127.0.0.1:{port}")
    assert "s3cret" not in message and f"alice:***@127.0.0.1:{port}" in message, message


@pytest.mark.parametrize("deadline_ms, connections", [(1e300, 1), (2000.0, 1), (1e300, 4)])
def test_close_ends_the_thread_whatever_the_deadline(redis_standalone, deadline_ms, connections) -> None:  # noqa: F811
    before = set(threading.enumerate())
    tier = build(redis_standalone.url, deadline_ms=deadline_ms, connections=connections)
    assert len(tier._threads) == connections
    assert all(t.is_alive() for t in tier._threads)
    started = time.monotonic()
    tier.close()
    assert time.monotonic() - started < 5.0
    assert not any(t.is_alive() for t in tier._threads)
    deadline = time.monotonic() + 5.0
    while set(threading.enumerate()) - before:  # the wrapped executor's threads end too
        assert time.monotonic() < deadline, set(threading.enumerate()) - before
        time.sleep(0.01)
