"""Real Redis servers for the tests: standalone and a 3-node Redis Cluster, on loopback.

Each server is the distribution's ``redis-server`` started here, in a temporary directory, on a
free port, with persistence off (``--save '' --appendonly no``), and stopped when the test or the
session ends. No mocks and no in-process fake: the remote tier's failure handling is only worth
something against the real server's behaviour (silent eviction under ``maxmemory``, OOM errors
under ``noeviction``, a pipeline that applies the rest after a failed command).

Servers as they are deployed too: with ACL users and passwords (``acl_server``, and a 3-node
cluster of them, ``acl_cluster``), and with TLS only (``tls_server``, ``tls_cluster``:
certificates made here by the ``openssl`` command, a CA of the test's own signing the server's and
a client's).

Without ``redis-server`` (or redis-py, or ``openssl`` for TLS) the tests skip, unless
``KVFLOW_REQUIRE_REDIS=1`` (CI), where a missing one is a failure.
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


def require_redis(*tools: str) -> None:
    """Skip (or, under KVFLOW_REQUIRE_REDIS=1, fail) when a real server cannot be started
    (or one of ``tools`` is missing)."""
    missing = [name for name in ("redis-server", "redis-cli", *tools) if shutil.which(name) is None]
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

    def __init__(
        self,
        *extra: str,
        cluster: bool = False,
        port: int | None = None,
        cli_args: tuple[str, ...] = (),
        tls: bool = False,
    ) -> None:
        """``cli_args``: what ``redis-cli`` needs to reach it (credentials, TLS files); ``tls``:
        it listens for TLS only, on ``port``."""
        self.dir = Path(tempfile.mkdtemp(prefix="kvflow-redis-"))
        self.port = free_port(cluster) if port is None else port
        self.host = "127.0.0.1"
        self.extra = extra
        self.cli_args = cli_args
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None
        self.start(cluster)

    def start(self, cluster: bool = False) -> None:
        """Start (or restart, on the same port) the server."""
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        args = [
            "redis-server", *ports, "--bind", "127.0.0.1",
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
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}"

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-h", self.host, "-p", str(self.port), *self.cli_args, *args],
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
    """Three primaries, no replicas, every slot covered; ``nodes[i]`` can be killed.
    ``extra``, ``cli_args`` and ``tls`` go to every node (as for ``RedisServer``): a cluster of
    ACL users, or one that speaks TLS only (its cluster bus too)."""

    def __init__(
        self, size: int = 3, *extra: str, cli_args: tuple[str, ...] = (), tls: bool = False
    ) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(size):
                self.nodes.append(RedisServer(*extra, cluster=True, cli_args=cli_args, tls=tls))
            addrs = [f"{n.host}:{n.port}" for n in self.nodes]
            subprocess.run(
                ["redis-cli", *cli_args, "--cluster", "create", *addrs, "--cluster-replicas", "0",
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


ACL_USER, ACL_PASSWORD, DEFAULT_PASSWORD = "kvflow-user", "kvflow-pw", "default-pw"
# what redis-cli (the tests' own checks, and ``--cluster create``) logs in with
_ACL_CLI = ("--user", "default", "--pass", DEFAULT_PASSWORD, "--no-auth-warning")


def _acl_file(where: Path) -> str:
    """An ACL file whose default user needs a password, and with a user allowed only kvflow's
    keys and no dangerous command (a cluster's client also needs CLUSTER SLOTS/NODES, which
    are not dangerous)."""
    acl = where / "users.acl"
    acl.write_text(
        f"user default on >{DEFAULT_PASSWORD} ~* &* +@all\n"
        f"user {ACL_USER} on >{ACL_PASSWORD} ~kvflow:* +@all -@dangerous\n"
    )
    return str(acl)


@pytest.fixture(scope="session")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server (its ACL file) whose default user needs a password, and with a user allowed
    only kvflow's keys and no dangerous command."""
    require_redis()
    server = RedisServer("--aclfile", _acl_file(tmp_path_factory.mktemp("acl")), cli_args=_ACL_CLI)
    yield server
    server.close()


@pytest.fixture(scope="session")
def acl_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A 3-node cluster whose nodes share ``acl_server``'s users (every node checks them: a
    cluster client logs in to each node it reaches)."""
    require_redis()
    cluster = RedisCluster(3, "--aclfile", _acl_file(tmp_path_factory.mktemp("acl-cluster")), cli_args=_ACL_CLI)
    yield cluster
    cluster.close()


def make_certs(where: Path) -> dict[str, str]:
    """With ``openssl``: a CA, a server certificate for 127.0.0.1 and a client certificate it
    signs, and a second CA that signs nothing of these (an untrusted one). Paths by name."""
    where.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, capture_output=True, check=True, timeout=60)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        run("req", "-x509", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
            "-subj", f"/CN=kvflow test {ca}")  # fmt: skip
    (where / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvflow test {name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    names = ("ca.crt", "other-ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    return {name: str(where / name) for name in names}


def _tls_args(certs: dict[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A TLS-only server's options (clients must show a certificate the CA signed), and
    redis-cli's."""
    server = ("--tls-cert-file", certs["server.crt"], "--tls-key-file", certs["server.key"],
              "--tls-ca-cert-file", certs["ca.crt"], "--tls-auth-clients", "yes")  # fmt: skip
    cli = ("--tls", "--cacert", certs["ca.crt"], "--cert", certs["client.crt"], "--key", certs["client.key"])
    return server, cli


@pytest.fixture(scope="session")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, dict[str, str]]]:
    """A server that speaks TLS only and wants a client certificate its CA signed; the files."""
    require_redis("openssl")
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    options, cli = _tls_args(certs)
    server = RedisServer(*options, tls=True, cli_args=cli)
    yield server, certs
    server.close()


@pytest.fixture(scope="session")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisCluster, dict[str, str]]]:
    """A 3-node cluster that speaks TLS only, to its clients and on its cluster bus (the nodes
    show each other the server certificate); the files."""
    require_redis("openssl")
    certs = make_certs(tmp_path_factory.mktemp("cluster-certs"))
    options, cli = _tls_args(certs)
    cluster = RedisCluster(3, *options, "--tls-cluster", "yes", tls=True, cli_args=cli)
    yield cluster, certs
    cluster.close()


def tls_acl_server(where: Path) -> tuple[RedisServer, dict[str, str]]:
    """A server as a shared deployment runs one: TLS only (clients show a certificate its CA
    signed) and ``acl_server``'s users (``ACL_USER`` may touch kvflow's keys alone). The
    certificate files by name (``make_certs``); stop it with ``close()``."""
    require_redis("openssl")
    certs = make_certs(where / "certs")
    options, cli = _tls_args(certs)
    server = RedisServer("--aclfile", _acl_file(where), *options, tls=True, cli_args=(*cli, *_ACL_CLI))
    return server, certs


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
