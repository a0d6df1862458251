"""Real Redis servers for the tests: standalone and a 3-node Redis Cluster, on loopback.

Each server is the distribution's ``redis-server`` started here, in a temporary directory, on a
free port, with persistence off (``--save '' --appendonly no``), and stopped when the test or the
session ends. No mocks and no in-process fake: the remote tier's failure handling is only worth
something against the real server's behaviour (silent eviction under ``maxmemory``, OOM errors
under ``noeviction``, a pipeline that applies the rest after a failed command).

Without ``redis-server`` (or redis-py) the tests skip, unless ``KVFLOW_REQUIRE_REDIS=1`` (CI),
where a missing server is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0


def require_redis() -> None:
    """Skip (or, under KVFLOW_REQUIRE_REDIS=1, fail) when a real server cannot be started."""
    missing = [name for name in ("redis-server", "redis-cli") if shutil.which(name) is None]
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py (pip install redis)")
    if not missing:
        return
    message = f"needs {', '.join(missing)}"
    if os.environ.get("KVFLOW_REQUIRE_REDIS"):
        pytest.fail(f"KVFLOW_REQUIRE_REDIS is set but this machine lacks {', '.join(missing)}")
    pytest.skip(message)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also ``port + 10000`` (its cluster bus)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster:
            return port
        if port + 10000 < 65536 and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One ``redis-server`` process on loopback; ``stop()`` kills it (also mid-test)."""

    def __init__(self, *extra: str, cluster: bool = False, port: int | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvflow-redis-"))
        self.port = free_port(cluster) if port is None else port
        self.host = "127.0.0.1"
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.start(cluster)

    def start(self, cluster: bool = False) -> None:
        """Start (or restart, on the same port) the server."""
        args = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.dir), "--save", "", "--appendonly", "no",
            "--logfile", str(self.dir / "redis.log"), "--daemonize", "no",
        ]  # fmt: skip
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000"]  # fmt: skip
        self.process = subprocess.Popen(
            [*args, *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-h", self.host, "-p", str(self.port), *args],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return out.stdout

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited at start: {log}")
            try:
                if self.cli("PING").strip() == "PONG":
                    return
            except subprocess.CalledProcessError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} not ready in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        """Kill the server at once (SIGKILL: what a crashed or lost server looks like)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server still holds its connections but answers nothing (a hung host)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.process is not None:
            self.resume()
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster:
    """Three primaries, no replicas, every slot covered; ``nodes[i]`` can be killed."""

    def __init__(self, size: int = 3) -> None:
        self.nodes = [RedisServer(cluster=True) for _ in range(size)]
        try:
            addrs = [f"{n.host}:{n.port}" for n in self.nodes]
            subprocess.run(
                ["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0",
                 "--cluster-yes"],
                capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            self._wait_ok()
        except BaseException:
            self.close()
            raise

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(n.host, n.port) for n in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S * 3
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in self.nodes):
                return
            time.sleep(0.05)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@pytest.fixture(scope="session")
def redis_standalone() -> Iterator[RedisServer]:
    """One standalone server shared by the session's tests (flush between uses)."""
    require_redis()
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def redis_fresh() -> Iterator[RedisServer]:
    """A server of the test's own, for tests that reconfigure or kill it."""
    require_redis()
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A 3-node Redis Cluster shared by the session's tests."""
    require_redis()
    cluster = RedisCluster()
    yield cluster
    cluster.close()


@pytest.fixture
def redis_cluster_fresh() -> Iterator[RedisCluster]:
    """A 3-node cluster of the test's own, for tests that kill a node."""
    require_redis()
    cluster = RedisCluster()
    yield cluster
    cluster.close()
