"""kvflow inside vLLM at tensor parallelism 2 (vLLM-CPU, two worker processes, one core each).

The model is glassllm's, its MLP padded with zero units so that it splits over two ranks (the
same function: ``tools/glassllm_model.py --split 2``). Each vLLM run is a process of its own
(vLLM's multiprocessing executor starts the two workers); the runs are: without kvflow, with
kvflow's CPU tier (written through to a real redis-server), a second process that finds the
first's prefixes in that Redis, and with a load that fails on rank 1 only. Outputs must be the
same token for token; the second turn of each conversation must come from kvflow's tier; the
rank-1 failure must be reported once, fenced until both ranks are over, and recomputed.

Skips without vLLM and glassllm (``.ci/run`` installs both); under ``KVFLOW_REQUIRE_VLLM=1``
(CI) a missing one, or a machine with fewer than two cores, is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REQUIRED = bool(os.environ.get("KVFLOW_REQUIRE_VLLM"))
if REQUIRED:
    import glassllm  # noqa: F401
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
    pytest.importorskip("glassllm")

from click.testing import CliRunner  # noqa: E402

from kvflow.cli.main import main as kvflow_cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import glassllm_model  # noqa: E402

CONVERSATIONS, PREFIX = 6, 64
FAILING_LOAD = 8  # the second load job of the second round (jobs 1-6 store the first turns)

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    model, extra, convs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    kwargs = dict(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=128, block_size=32,
                  enable_prefix_caching=True, num_gpu_blocks_override=8, max_num_seqs=2,
                  max_num_batched_tokens=128, seed=0, enforce_eager=True, tensor_parallel_size=2,
                  distributed_executor_backend="mp")
    if extra is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVFlowConnector", "kv_connector_module_path": "kvflow.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = []
    for _ in range(2):
        for c in convs:
            r = llm.generate([TokensPrompt(prompt_token_ids=c)], params, use_tqdm=False)[0]
            out.append([list(r.outputs[0].token_ids), int(r.num_cached_tokens or 0)])
    print("RESULT " + json.dumps(out), flush=True)
    del llm  # (the engine shuts down: the connector ends its trace)

if __name__ == "__main__":  # (vLLM starts its workers by spawning: they import this file)
    main()
"""


def conversations() -> list[list[int]]:
    return [[(37 * i + k) % 1000 + 10 for k in range(PREFIX)] + [200 + i] * 20 for i in range(CONVERSATIONS)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (os.cpu_count() or 1) < 2:
        message = "tensor parallelism 2 on vLLM-CPU needs two cores (one per rank)"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    return glassllm_model.write_model(tmp_path_factory.mktemp("glass") / "glass-llama-tp2", split=2)


def records(trace: Path) -> list[dict[str, Any]]:
    """The trace's records (one JSON object per line), header first; the results of one
    step's ``job_results`` as records of their own."""
    out: list[dict[str, Any]] = []
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        out.extend(record["results"] if record.get("type") == "job_results" else [record])
    return out


def serve(model_dir: Path, extra: dict[str, Any] | None, tmp_path: Path) -> list[tuple[list[int], int]]:
    script = tmp_path / "serve_tp.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), str(model_dir), json.dumps(extra), json.dumps(conversations())],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT " in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
    return [(o, c) for o, c in json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])]


@pytest.fixture(scope="module")
def without_kvflow(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[list[int], int]]:
    runs = serve(model_dir, None, tmp_path_factory.mktemp("off"))
    assert [c for _, c in runs] == [0] * (2 * CONVERSATIONS), "vLLM's own cache must be too small to keep them"
    return runs


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real redis-server for the module's kvflow runs, and the connector keys that reach it
    (entries sealed with a keys file)."""
    from redis_servers import RedisServer, require_redis
    from tier_keys import keys_file

    require_redis()
    server = RedisServer()
    yield {"server": server, "extra": {"remote_url": server.url,
                                       "remote_key_file": str(keys_file(tmp_path_factory.mktemp("keys")))}}  # fmt: skip
    server.close()


@pytest.fixture(scope="module")
def with_kvflow(
    model_dir: Path, shared_redis: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[tuple[list[int], int]], Path]:
    """kvflow's CPU tier (written through to the shared Redis): the runs and the trace."""
    where = tmp_path_factory.mktemp("tp2")
    trace = where / "tp2.jsonl"
    return serve(model_dir, {"cpu_blocks": 64, "trace_path": str(trace), **shared_redis["extra"]}, where), trace


def test_two_ranks_load_every_prefix_from_the_cpu_tier_with_identical_outputs(
    with_kvflow: tuple[list[tuple[list[int], int]], Path], without_kvflow: list[tuple[list[int], int]]
) -> None:
    runs, trace = with_kvflow
    assert [o for o, _ in runs] == [o for o, _ in without_kvflow]
    assert [c for _, c in runs] == [0] * CONVERSATIONS + [PREFIX] * CONVERSATIONS
    header, *rest = records(trace)
    assert header["config"]["world_size"] == 2
    assert "late_result_ignored" not in [r.get("type") for r in rest]  # no rank's result comes late
    # every job is over once both ranks reported it (the CPU tier's: the first turns' stores
    # and the second turns' loads)
    local = {r["job_id"] for r in rest if r.get("type") == "job_completed" and r["direction"] in ("store", "load")}
    assert len(local) == 2 * CONVERSATIONS
    kinds = [r.get("type") for r in rest if r.get("job_id") in local]
    assert kinds.count("rank_succeeded") == 2 * CONVERSATIONS and kinds.count("job_result") == 4 * CONVERSATIONS
    replayed = CliRunner().invoke(kvflow_cli, ["replay", str(trace), "--redecide"])
    assert replayed.exit_code == 0, replayed.output


def test_a_load_failing_on_rank_1_only_is_fenced_reported_once_and_recomputed(
    model_dir: Path, without_kvflow: list[tuple[list[int], int]], tmp_path: Path
) -> None:
    trace = tmp_path / "fail.jsonl"
    extra = {"cpu_blocks": 64, "trace_path": str(trace), "fail_job_ids": [FAILING_LOAD], "fail_ranks": [1]}
    runs = serve(model_dir, extra, tmp_path)
    assert [o for o, _ in runs] == [o for o, _ in without_kvflow]  # recomputed, token for token
    rest = records(trace)[1:]
    failed = [r for r in rest if r.get("type") == "job_failed"]
    assert [(r["job_id"], r["rank"]) for r in failed] == [(FAILING_LOAD, 1)]
    results = [r for r in rest if r.get("type") == "job_result" and r.get("job_id") == FAILING_LOAD]
    assert sorted(r.get("rank", 0) for r in results) == [0, 1]  # rank 0's copy reported too
    incidents = CliRunner().invoke(kvflow_cli, ["incidents", str(trace), "--json"])
    assert incidents.exit_code == 0, incidents.output
    (incident,) = json.loads(incidents.stdout)
    assert incident["job_id"] == FAILING_LOAD


def test_two_tp2_processes_share_a_redis_each_rank_reading_its_own_shard(
    model_dir: Path,
    without_kvflow: list[tuple[list[int], int]],
    with_kvflow: tuple[list[tuple[list[int], int]], Path],
    shared_redis: dict[str, Any],
    tmp_path: Path,
) -> None:
    """A second vLLM process at tensor parallelism 2 shares the Redis the first
    (``with_kvflow``) wrote through to: each of its ranks finds its own shard of every prefix
    there, under a layout of its own (its rank of two), and loads it at its first turn. Outputs
    are the same token for token (a rank that read the other's shard would compute something
    else); Redis holds each block twice, once per rank's layout; no rank refused an entry
    (another layout's is refused, never served) and both ranks reported every remote load."""
    trace = tmp_path / "second.jsonl"
    second = serve(model_dir, {"cpu_blocks": 64, "trace_path": str(trace), **shared_redis["extra"]}, tmp_path)
    keys = shared_redis["server"].cli("--scan", "--pattern", "kvflow:*").split()
    assert [o for o, _ in second] == [o for o, _ in with_kvflow[0]] == [o for o, _ in without_kvflow]
    assert [c for _, c in second] == [PREFIX] * (2 * CONVERSATIONS)  # the first turns from Redis
    # kvflow:<layout>:<tenant>:<block>: one layout per rank, each holding every block once
    blocks = CONVERSATIONS * PREFIX // 32
    by_layout: dict[str, set[str]] = {}
    for key in keys:
        _, layout, _, block = key.split(":")
        by_layout.setdefault(layout, set()).add(block)
    assert len(by_layout) == 2 and [len(b) for b in by_layout.values()] == [blocks, blocks], by_layout.keys()
    rest = records(trace)[1:]
    assert not [r for r in rest if r.get("type") == "entries_refused"]
    remote_loads = {r["job_id"]: len(r["hashes"]) for r in rest
                    if r.get("type") == "job_completed" and r["direction"] == "remote_load"}  # fmt: skip
    assert sum(remote_loads.values()) == blocks
    ranks = sorted(r.get("rank", 0) for r in rest if r.get("type") == "job_result" and r["job_id"] in remote_loads)
    assert ranks == sorted([0, 1] * len(remote_loads))
