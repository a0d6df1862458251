"""The vLLM connector's remote tier without vLLM, against a real redis-server: two deployments
(each a scheduler side and two tensor-parallel workers, as two vLLM processes would have) share
the server; the second finds the first's blocks by the probes its workers answer, loads them
and gets every rank's own shard back (tests/integrations/test_vllm_connector.py runs the same
inside the real engine)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from redis_servers import RedisServer, redis_standalone, tls_server  # noqa: F401
from tier_keys import keys_file

from kvflow.core.commands import JobResult
from kvflow.core.errors import ConfigError
from kvflow.integrations.vllm.sides import ConnectorConfig, SchedulerSide, StepPlan, WorkerSide

B = 32


def hashes(*ids: int) -> list[bytes]:
    return [i.to_bytes(8, "big") + bytes(24) for i in ids]


def shard(seed: int) -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn((16, 2, 4, 8), generator=gen) for i in range(2)}


def deployment(config: ConnectorConfig, caches: list[dict[str, Any]]) -> tuple[SchedulerSide, list[WorkerSide]]:
    workers = [WorkerSide(config, rank=r, world_size=len(caches), model="glass:float32", block_tokens=B) for r in range(len(caches))]
    block_bytes = {worker.register(cache) for worker, cache in zip(workers, caches)}
    return SchedulerSide(config, B, block_bytes.pop(), world_size=len(caches)), workers


def run(side: SchedulerSide, workers: list[WorkerSide], plan: StepPlan, timeout_s: float = 30.0) -> None:
    """Every worker runs the plan (its jobs, its probes) until each job and probe reported; the
    scheduler side gets the results and the answers, as vLLM's metadata carries them."""
    asked = {n.key for n in plan.probes}
    for worker in workers:
        worker.bind(plan)
        worker.start_loads()
        worker.start_stores()
    results: list[JobResult] = []
    answers: dict[int, tuple[list[int], list[int]]] = {w.rank: ([], []) for w in workers}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(plan.jobs) * len(workers) or any(set(a) != asked for a, _ in answers.values()):
        assert time.monotonic() < deadline, "jobs or probes never reported"
        for worker in workers:
            worker.poll()
            results += worker.take_results()
            probed = worker.take_probed()
            if probed is not None:
                answers[worker.rank][0].extend(probed[0])
                answers[worker.rank][1].extend(probed[1])
        time.sleep(0.002)
    side.results(results, probes=answers)


def test_a_second_deployment_loads_the_firsts_blocks_each_rank_its_own_shard(
    redis_standalone: RedisServer, tmp_path: Path  # noqa: F811
) -> None:
    config = ConnectorConfig.from_extra(
        {"cpu_blocks": 8, "remote_url": f"redis://{redis_standalone.host}:{redis_standalone.port}",
         "remote_key_file": str(keys_file(tmp_path))}
    )  # fmt: skip
    writer_caches = [shard(1), shard(2)]
    writer, writer_workers = deployment(config, writer_caches)
    assert writer.matched_tokens("w", hashes(7, 8), 2 * B + 1, 0) is None  # the remote tier is asked first
    run(writer, writer_workers, writer.step([], []))
    assert writer.matched_tokens("w", hashes(7, 8), 2 * B + 1, 0) == 0  # nobody has them
    writer.allocated("w", [1, 2, 3], 0)
    run(writer, writer_workers, writer.step([("w", 2 * B + 1, None, False)], []))  # the CPU tier's store
    plan = writer.step([], [])
    assert [j.direction for j in plan.jobs] == ["remote_store"]  # write-through
    run(writer, writer_workers, plan)
    writer.finished("w")
    for worker in writer_workers:
        worker.close()
    writer.close()

    torch = pytest.importorskip("torch")
    reader_caches = [{k: torch.zeros_like(v) for k, v in shard(0).items()} for _ in range(2)]
    reader, reader_workers = deployment(config, reader_caches)
    assert reader.matched_tokens("r", hashes(7, 8), 2 * B + 1, 0) is None  # being asked
    plan = reader.step([], [])
    assert len(plan.probes) == 2
    run(reader, reader_workers, plan)
    assert reader.remote_found == 2
    assert reader.matched_tokens("r", hashes(7, 8), 2 * B + 1, 0) is None  # its remote load runs
    plan = reader.step([], [])
    assert [j.direction for j in plan.jobs] == ["remote_load"]
    run(reader, reader_workers, plan)
    assert reader.matched_tokens("r", hashes(7, 8), 2 * B + 1, 0) == 2 * B
    reader.allocated("r", [5, 6, 7], 2 * B)
    plan = reader.step([("r", 2 * B + 1, None, False)], [])
    assert [j.direction for j in plan.jobs] == ["load"]
    run(reader, reader_workers, plan)
    assert reader.loads_landed == 1 and reader.loads_failed == 0
    for rank in range(2):  # each rank got its own shard back, not the other's
        for name, tensor in reader_caches[rank].items():
            assert torch.equal(tensor[5:7], writer_caches[rank][name][1:3])
    stats = reader_workers[1].take_stats()
    assert stats["remote_load_ok_blocks"] == 2 and stats["load_ok_blocks"] == 2
    for worker in reader_workers:
        worker.close()
    reader.close()


def test_a_worker_reaches_a_tls_server_with_the_configs_certificate_files(
    tls_server: tuple[RedisServer, dict[str, str]], tmp_path: Path  # noqa: F811
) -> None:
    """``remote_tls_*`` reach redis-py: with the CA and the client's certificate the worker's
    tier starts (the server answered a PING over TLS); without the client's certificate, the
    server refuses it, in one line, before vLLM runs anything."""
    server, certs = tls_server
    extra = {"cpu_blocks": 8, "remote_url": server.url, "remote_key_file": str(keys_file(tmp_path)),
             "remote_tls_ca_file": certs["ca.crt"]}  # fmt: skip
    both = {**extra, "remote_tls_cert_file": certs["client.crt"], "remote_tls_key_file": certs["client.key"]}
    worker = WorkerSide(ConnectorConfig.from_extra(both), model="glass:float32", block_tokens=B)
    worker.register(shard(1))
    worker.close()
    with pytest.raises(ConfigError) as refused:
        WorkerSide(ConnectorConfig.from_extra(extra), model="glass:float32", block_tokens=B).register(shard(1))
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith("kv_connector_extra_config: remote tier rediss://")
