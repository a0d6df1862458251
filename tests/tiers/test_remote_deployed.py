"""Redis as it is deployed: ACL users and passwords, and TLS with a CA, a server and a client
certificate (made by the test with ``openssl``), standalone and as a 3-node Redis Cluster. Real
servers; the right credentials store and load real bytes; wrong ones are refused when the tier is
built, in one line, at once."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("xxhash")
from redis_servers import (  # noqa: E402
    ACL_PASSWORD,
    ACL_USER,
    DEFAULT_PASSWORD,
    acl_cluster,  # noqa: F401  (fixtures)
    acl_server,  # noqa: F401
    tls_cluster,  # noqa: F401
    tls_server,  # noqa: F401
)
from remote_rig import HASHES, blocks_of, instance, load_prefix, store_prefix  # noqa: E402

from kvflow.core.errors import ConfigError  # noqa: E402
from kvflow.core.state.invariants import check_invariants  # noqa: E402


def with_user(url: str, user: str, password: str) -> str:
    scheme, rest = url.split("://")
    return f"{scheme}://{user}:{password}@{rest}"


def shares(url: str, cluster: bool = False, **tier) -> None:
    """One instance stores, another loads the same bytes, through ``url``."""
    writer, writer_kv = instance(url, cluster, seed=1, **tier)
    reader, reader_kv = instance(url, cluster, seed=2, **tier)
    try:
        store_prefix(writer, "w", (0, 1, 2, 3))
        assert writer.executor.stats["remote_stored_blocks"] == len(HASHES)
        assert load_prefix(reader, "r", (8, 9, 10, 11)) == len(HASHES)
        assert reader.executor.stats["remote_loaded_blocks"] == len(HASHES)
        for a, b in zip(blocks_of(reader_kv, (8, 9, 10, 11)), blocks_of(writer_kv, (0, 1, 2, 3))):
            assert a.equal(b)
        assert check_invariants(reader.manager.state) == []
    finally:
        writer.close()
        reader.close()


def refused(url: str, cluster: bool = False, **tier) -> str:
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        instance(url, cluster, seed=1, **tier)
    assert time.monotonic() - started < 3.0  # at build, at once: never a hang
    message = str(err.value)
    assert message and "\n" not in message, message
    return message


def test_an_acl_user_with_only_kvflow_keys_stores_and_loads(acl_server) -> None:  # noqa: F811
    shares(with_user(acl_server.url, ACL_USER, ACL_PASSWORD))
    assert int(acl_server.cli("DBSIZE")) == len(HASHES)  # the ACL user wrote them
    acl_server.cli("FLUSHALL")


def test_the_default_user_with_requirepass_stores_and_loads(acl_server) -> None:  # noqa: F811
    shares(with_user(acl_server.url, "", DEFAULT_PASSWORD))
    acl_server.cli("FLUSHALL")


@pytest.mark.parametrize(
    "user, password, words",
    [
        (ACL_USER, "wrong", "AuthenticationError"),
        ("nobody", ACL_PASSWORD, "AuthenticationError"),
        ("", "wrong", "AuthenticationError"),
        (None, None, "AuthenticationError"),
    ],
)
def test_wrong_credentials_are_refused_at_build_in_one_line(acl_server, user, password, words) -> None:  # noqa: F811
    url = acl_server.url if user is None else with_user(acl_server.url, user, password)
    message = refused(url)
    assert words in message, message
    if password:
        assert password not in message.split("@")[0].split("//")[-1].replace("***", ""), message


def test_a_tls_server_with_client_certificates_stores_and_loads(tls_server) -> None:  # noqa: F811
    server, certs = tls_server
    shares(
        server.url,
        ssl_ca_certs=certs["ca.crt"], ssl_certfile=certs["client.crt"], ssl_keyfile=certs["client.key"],
    )  # fmt: skip
    assert int(server.cli("DBSIZE")) == len(HASHES)
    server.cli("FLUSHALL")


@pytest.mark.parametrize(
    "files, words",
    [
        ({"ssl_ca_certs": "other-ca.crt", "ssl_certfile": "client.crt", "ssl_keyfile": "client.key"},
         "certificate verify failed"),
        ({"ssl_ca_certs": "ca.crt"}, "ConnectionError"),  # no client certificate: the server hangs up
        ({}, "certificate verify failed"),  # the system's CAs do not know the test's CA
    ],
)  # fmt: skip
def test_an_untrusted_certificate_is_refused_at_build_in_one_line(tls_server, files, words) -> None:  # noqa: F811
    server, certs = tls_server
    message = refused(server.url, **{k: certs[v] for k, v in files.items()})
    assert words in message, message


def test_plain_redis_to_a_tls_port_is_refused_at_build(tls_server) -> None:  # noqa: F811
    server, _ = tls_server
    assert "ConnectionError" in refused(server.url.replace("rediss://", "redis://"), timeout_s=0.3)


def cluster_keys(cluster) -> int:
    return sum(int(node.cli("DBSIZE")) for node in cluster.nodes)


def test_an_acl_user_stores_and_loads_on_a_cluster(acl_cluster) -> None:  # noqa: F811
    shares(with_user(acl_cluster.url, ACL_USER, ACL_PASSWORD), cluster=True)
    assert cluster_keys(acl_cluster) == len(HASHES)  # spread over the nodes, each logged in to
    for node in acl_cluster.nodes:
        node.cli("FLUSHALL")


@pytest.mark.parametrize("user, password", [(ACL_USER, "wrong"), ("", "wrong"), (None, None)])
def test_wrong_credentials_on_a_cluster_are_refused_at_build_in_one_line(acl_cluster, user, password) -> None:  # noqa: F811
    url = acl_cluster.url if user is None else with_user(acl_cluster.url, user, password)
    message = refused(url, cluster=True)
    assert "AuthenticationError" in message or "NOAUTH" in message, message
    if password:
        assert "wrong" not in message, message


def test_a_tls_cluster_with_client_certificates_stores_and_loads(tls_cluster) -> None:  # noqa: F811
    cluster, certs = tls_cluster
    shares(
        cluster.url, cluster=True,
        ssl_ca_certs=certs["ca.crt"], ssl_certfile=certs["client.crt"], ssl_keyfile=certs["client.key"],
    )  # fmt: skip
    assert cluster_keys(cluster) == len(HASHES)
    for node in cluster.nodes:
        node.cli("FLUSHALL")


@pytest.mark.parametrize(
    "files, words",
    [
        ({"ssl_ca_certs": "other-ca.crt", "ssl_certfile": "client.crt", "ssl_keyfile": "client.key"},
         "certificate verify failed"),
        ({"ssl_ca_certs": "ca.crt"}, "ConnectionError"),  # no client certificate
        ({}, "certificate verify failed"),
    ],
)  # fmt: skip
def test_an_untrusted_certificate_on_a_cluster_is_refused_at_build_in_one_line(tls_cluster, files, words) -> None:  # noqa: F811
    cluster, certs = tls_cluster
    message = refused(cluster.url, cluster=True, **{k: certs[v] for k, v in files.items()})
    assert words in message, message


def test_plain_redis_to_a_tls_cluster_is_refused_at_build(tls_cluster) -> None:  # noqa: F811
    cluster, _ = tls_cluster
    assert "ConnectionError" in refused(cluster.url.replace("rediss://", "redis://"), cluster=True, timeout_s=0.3)
