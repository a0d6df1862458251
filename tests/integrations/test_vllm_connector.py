"""kvflow inside the real vLLM engine (its CPU build) with a real pretrained model.

The model is glassllm's (a 4-layer Llama-style model shipped inside the package, converted by
``tools/glassllm_model.py``; nothing is downloaded). vLLM runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), its KV cache made too small to keep the conversations'
prefixes, so the second turn of each conversation finds its prefix only in kvflow's tier.
Every comparison is against the same vLLM run without kvflow (prefix caching on in both).

Skips without vLLM and glassllm: ``.ci/run`` installs both in a venv of their own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if os.environ.get("KVFLOW_REQUIRE_VLLM"):  # CI: a missing vLLM is a failure, not a skip
    import glassllm  # noqa: F401
    import vllm
else:
    vllm = pytest.importorskip("vllm")
    pytest.importorskip("glassllm")

from click.testing import CliRunner  # noqa: E402

from kvflow.cli.main import main as kvflow_cli  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import glassllm_model  # noqa: E402

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
CONVERSATIONS = 6
PREFIX = 2 * BLOCK  # each conversation's own system prompt: two full blocks
FORGED = 3  # entries an attacker rewrites in a shared Redis (of the 12 the first process stored)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return glassllm_model.write_model(tmp_path_factory.mktemp("glass") / "glass-llama")


def conversations(user_tokens: int = 20) -> list[list[int]]:
    """Six conversations, each with its own 64-token system prompt and a user turn."""
    return [[(37 * i + k) % 1000 + 10 for k in range(PREFIX)] + [200 + i] * user_tokens for i in range(CONVERSATIONS)]


def run(
    model_dir: Path,
    extra: dict[str, Any] | None,
    *,
    gpu_blocks: int = 8,
    max_seqs: int = 2,
    rounds: int = 2,
    batch: bool = False,
    user_tokens: int = 20,
    max_tokens: int = 8,
    salts: list[str | None] | None = None,
) -> tuple[list[list[int]], list[int], Any]:
    """Greedy outputs and vLLM's cached-token counts, turn by turn, and the connector.
    ``salts``: each round's ``cache_salt`` (vLLM's tenant), None for none."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        block_size=BLOCK,
        enable_prefix_caching=True,
        num_gpu_blocks_override=gpu_blocks,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=128,
        seed=0,
        enforce_eager=True,
    )
    if extra is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVFlowConnector",
            "kv_connector_module_path": "kvflow.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs, cached = [], []
    for turn in range(rounds):
        salt = salts[turn] if salts else None
        prompts = [
            TokensPrompt(prompt_token_ids=c, **({"cache_salt": salt} if salt else {}))  # type: ignore[typeddict-item]
            for c in conversations(user_tokens)
        ]
        if batch:
            results = llm.generate(prompts, params, use_tqdm=False)
        else:
            results = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        for r in results:
            outputs.append(list(r.outputs[0].token_ids))
            cached.append(int(r.num_cached_tokens or 0))
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if connector is not None:
        connector.shutdown()  # the trace gets its last checkpoint
    del llm
    return outputs, cached, connector


@pytest.fixture(scope="module")
def without_kvflow(model_dir: Path) -> tuple[list[list[int]], list[int]]:
    outputs, cached, _ = run(model_dir, None)
    assert cached == [0] * (2 * CONVERSATIONS), "vLLM's own cache must be too small to keep them"
    return outputs, cached


def test_the_model_is_glassllm_exactly(model_dir: Path) -> None:
    assert glassllm_model.max_logit_difference(model_dir) < 1e-3


def test_prefixes_come_back_from_kvflows_tier_with_identical_outputs(
    model_dir: Path, without_kvflow: tuple[list[list[int]], list[int]], tmp_path: Path
) -> None:
    trace = tmp_path / "vllm.jsonl"
    outputs, cached, connector = run(model_dir, {"cpu_blocks": 64, "trace_path": str(trace)})
    assert outputs == without_kvflow[0]  # greedy, token for token
    # (b) vLLM counts the second turns' prefixes as cached, and kvflow loaded exactly those
    assert cached == [0] * CONVERSATIONS + [PREFIX] * CONVERSATIONS
    side = connector._scheduler
    assert side.loads_landed == CONVERSATIONS and side.loads_failed == 0
    # (e) the trace of the run replays and re-decides clean
    result = CliRunner().invoke(kvflow_cli, ["replay", str(trace), "--redecide"])
    assert result.exit_code == 0, result.output
    assert "consistent" in result.output


def test_F21_a_request_with_another_cache_salt_never_hits_a_salted_prefix(
    model_dir: Path, without_kvflow: tuple[list[list[int]], list[int]]
) -> None:
    """Three rounds of the same conversations: tenant a, then tenant b, then tenant a again.
    Tenant b's requests find nothing of tenant a's in kvflow's tier; tenant a's come back."""
    outputs, cached, _ = run(model_dir, {"cpu_blocks": 64}, rounds=3, salts=["tenant-a", "tenant-b", "tenant-a"])
    first_turns = without_kvflow[0][:CONVERSATIONS]
    assert outputs == first_turns * 3
    assert cached == [0] * CONVERSATIONS + [0] * CONVERSATIONS + [PREFIX] * CONVERSATIONS


def test_injected_store_and_load_failures_change_no_output(
    model_dir: Path, without_kvflow: tuple[list[list[int]], list[int]], tmp_path: Path
) -> None:
    """Conversation 1's store fails (its second turn misses); a load fails (vLLM recomputes
    exactly its blocks): outputs stay identical and ``kvflow incidents`` lists both."""
    trace = tmp_path / "faults.jsonl"
    # jobs 1..6: the first turns' stores; 7: turn 2 of conversation 0 loads; 8: conversation 1
    # stores again (its first store failed); 9: conversation 2's load
    outputs, cached, connector = run(model_dir, {"cpu_blocks": 64, "trace_path": str(trace), "fail_job_ids": [2, 9]})
    assert outputs == without_kvflow[0]
    side = connector._scheduler
    assert cached[CONVERSATIONS + 1] == 0  # its prefix never reached the tier
    # the failed load's blocks were named to vLLM, which rescheduled the request; kvflow offers
    # that request nothing again, so it recomputes: 4 of 6 second turns loaded
    assert side.loads_failed == 1 and side.loads_landed == CONVERSATIONS - 2
    result = CliRunner().invoke(kvflow_cli, ["incidents", str(trace), "--json"])
    assert result.exit_code == 0, result.output
    import json

    incidents = json.loads(result.stdout)
    assert sorted((i["job_id"], i["direction"]) for i in incidents) == [(2, "store"), (9, "load")]
    replayed = CliRunner().invoke(kvflow_cli, ["replay", str(trace), "--redecide"])
    assert replayed.exit_code == 0, replayed.output


def test_preemption_under_memory_pressure_keeps_outputs_identical(model_dir: Path, tmp_path: Path) -> None:
    """Conversations of 90 prompt tokens decoding 16 more, all at once, in 7 blocks: two run,
    and when both grow into a fourth block one is preempted with its copies in flight. kvflow
    waits for a preempted request's copies and takes it back under its id (F18)."""
    shape = dict(gpu_blocks=7, max_seqs=4, batch=True, user_tokens=26, max_tokens=16)
    base, _, _ = run(model_dir, None, **shape)  # type: ignore[arg-type]
    trace = tmp_path / "preempted.jsonl"
    outputs, _, connector = run(model_dir, {"cpu_blocks": 64, "trace_path": str(trace)}, **shape)  # type: ignore[arg-type]
    assert outputs == base
    text = trace.read_text()
    assert '"preempted":true' in text, "the workload must make vLLM preempt"
    state = connector._scheduler.manager.state
    assert not state.jobs and not state.fenced_slots  # every copy ended, nothing fenced
    replayed = CliRunner().invoke(kvflow_cli, ["replay", str(trace), "--redecide"])
    assert replayed.exit_code == 0, replayed.output


def test_kv_events_reach_vllm_as_its_own_with_vllms_block_hashes(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``take_events`` (vLLM calls it every step) hands vLLM's publisher its own KV event
    structs, medium CPU, naming each block as vLLM's own events do (not kvflow's form), with
    the stored blocks' token ids and the run's parent block hash."""
    from vllm.distributed import kv_events as vk
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    from kvflow.integrations.vllm.connector import KVFlowConnector

    taken: list[Any] = []
    original = KVFlowConnector.take_events

    def recording(self: Any) -> list[Any]:
        events = original(self)
        taken.extend(events)
        return events

    monkeypatch.setattr(KVFlowConnector, "take_events", recording)
    run(model_dir, {"cpu_blocks": 64}, rounds=1)
    stored = [e for e in taken if isinstance(e, vk.BlockStored)]
    assert all(e.medium == "CPU" for e in stored)
    published = [h for e in stored for h in e.block_hashes]
    assert len(published) == 2 * CONVERSATIONS
    # the first block of each conversation, hashed the way vLLM hashes it
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import NONE_HASH, init_none_hash

    init_none_hash(get_hash_fn_by_name("sha256"))
    firsts = {
        maybe_convert_block_hash(hash_block_tokens(get_hash_fn_by_name("sha256"), NONE_HASH, c[:BLOCK]))
        for c in conversations()
    }
    assert firsts <= set(published)
    # and as vLLM's own events do, each run of stored blocks carries its tokens and its parent
    by_first = {e.block_hashes[0]: e for e in stored}
    for c in conversations():
        first = maybe_convert_block_hash(hash_block_tokens(get_hash_fn_by_name("sha256"), NONE_HASH, c[:BLOCK]))
        event = by_first[first]  # (each conversation's first store starts at its first block)
        assert event.parent_block_hash is None and event.token_ids == c[: len(event.block_hashes) * BLOCK]
    for e in stored:
        if e.block_hashes[0] not in firsts:  # a run stored after the first block: its parent is the block before
            assert e.parent_block_hash in published and len(e.token_ids) == len(e.block_hashes) * BLOCK


def test_transfer_stats_reach_vllms_logging_and_prometheus(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The workers' transfers go to vLLM as connector stats each step (it aggregates them for
    its log line and its Prometheus metrics, ``kvflow_*_total`` in vLLM's registry), the disk
    tier's beside the CPU tier's."""
    from prometheus_client import REGISTRY

    from kvflow.integrations.vllm.connector import KVFlowConnector

    seen: list[dict[str, Any]] = []
    original = KVFlowConnector.get_kv_connector_stats

    def recording(self: Any) -> Any:
        stats = original(self)
        if stats is not None:
            seen.append(dict(stats.data))
        return stats

    monkeypatch.setattr(KVFlowConnector, "get_kv_connector_stats", recording)
    disk = {"disk_path": str(tmp_path / "disk"), "disk_gb": 0.01, "disk_store_mode": "write_through",
            "disk_insecure_no_key": True}  # fmt: skip
    run(model_dir, {"cpu_blocks": 64, **disk})
    total = KVFlowConnector.build_kv_connector_stats({})
    for data in seen:
        total = total.aggregate(KVFlowConnector.build_kv_connector_stats(data))
    reduced = total.reduce()
    assert reduced["store_ok_blocks"] == 2 * CONVERSATIONS and reduced["load_ok_blocks"] == 2 * CONVERSATIONS
    assert reduced["store_bytes"] == reduced["load_bytes"] > 0
    # vLLM's metrics pipeline builds kvflow's counters from the connector class
    import prometheus_client as prom

    kinds = {prom.Gauge: prom.Gauge, prom.Counter: prom.Counter, prom.Histogram: prom.Histogram}
    no_transfer = type("VllmConfig", (), {"kv_transfer_config": None})()
    metrics = KVFlowConnector.build_prom_metrics(no_transfer, kinds, ["engine"], {0: ["0"]})
    metrics.observe(reduced, 0)
    assert REGISTRY.get_sample_value("kvflow_loaded_blocks_total", {"engine": "0"}) == 2 * CONVERSATIONS
    # every stored block was written through to the disk tier (the CPU tier served the loads)
    assert reduced["disk_store_ok_blocks"] == 2 * CONVERSATIONS and reduced["disk_store_bytes"] > 0
    assert REGISTRY.get_sample_value("kvflow_disk_stored_blocks_total", {"engine": "0"}) == 2 * CONVERSATIONS


MULTIPROCESS_SCRIPT = """
import json, os, sys
os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: engine core in a subprocess
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    model, trace, convs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=128, block_size=32,
              enable_prefix_caching=True, num_gpu_blocks_override=8, max_num_seqs=2, max_num_batched_tokens=128,
              seed=0, enforce_eager=True, kv_transfer_config={
                  "kv_connector": "KVFlowConnector", "kv_connector_module_path": "kvflow.integrations.vllm.connector",
                  "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_blocks": 64, "trace_path": trace}})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = []
    for _ in range(2):
        for c in convs:
            r = llm.generate([TokensPrompt(prompt_token_ids=c)], params, use_tqdm=False)[0]
            out.append([list(r.outputs[0].token_ids), int(r.num_cached_tokens or 0)])
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(out))

if __name__ == "__main__":
    main()
"""


def test_scheduler_and_worker_in_vllms_engine_process(
    model_dir: Path, without_kvflow: tuple[list[list[int]], list[int]], tmp_path: Path
) -> None:
    """vLLM's default: the engine core (scheduler and worker) runs in a process of its own;
    the step metadata and the workers' results cross as vLLM pickles them, the trace is
    written there and replays clean."""
    import json
    import subprocess

    script, trace = tmp_path / "serve.py", tmp_path / "mp.jsonl"
    script.write_text(MULTIPROCESS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(trace), json.dumps(conversations())],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert [o for o, _ in result] == without_kvflow[0]
    assert [c for _, c in result] == [0] * CONVERSATIONS + [PREFIX] * CONVERSATIONS
    replayed = CliRunner().invoke(kvflow_cli, ["replay", str(trace), "--redecide"])
    assert replayed.exit_code == 0, replayed.output


SECOND_PROCESS_SCRIPT = """
import json, os, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    model, extra, convs, salt = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=128, block_size=32,
              enable_prefix_caching=True, num_gpu_blocks_override=8, max_num_seqs=2, max_num_batched_tokens=128,
              seed=0, enforce_eager=True, disable_log_stats=False, kv_transfer_config={
                  "kv_connector": "KVFlowConnector", "kv_connector_module_path": "kvflow.integrations.vllm.connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = []
    for c in convs:
        prompt = TokensPrompt(prompt_token_ids=c, **({"cache_salt": salt} if salt else {}))
        r = llm.generate([prompt], params, use_tqdm=False)[0]
        out.append([list(r.outputs[0].token_ids), int(r.num_cached_tokens or 0)])
    # a serving process steps on: the last turns' copies to the lower tier are planned and run
    # (a request shorter than a block stores nothing)
    for _ in range(4):
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=2), use_tqdm=False)
    time.sleep(1.0)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=2), use_tqdm=False)
    # kvflow's counters in vLLM's own Prometheus registry (vLLM's stat loggers feed them)
    import prometheus_client
    metrics = [[s.name, s.labels.get("reason"), s.value] for family in prometheus_client.REGISTRY.collect()
               if family.name.startswith("kvflow_") for s in family.samples if s.name.endswith("_total") and s.value]
    print("METRICS " + json.dumps(metrics), flush=True)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # no shutdown: a tier that outlives the process must not need one

if __name__ == "__main__":
    main()
"""


def two_processes(
    model_dir: Path,
    tmp_path: Path,
    extra: dict[str, Any],
    salts: tuple[str | None, str | None] = (None, None),
    between: Callable[[], None] | None = None,
    metrics: list[Any] | None = None,
) -> list[tuple[list[Any], Path]]:
    """Two vLLM processes, one after the other, with the connector config ``extra`` (and a
    trace each): every conversation's first turn, greedy, with vLLM's cached-token counts.
    ``salts``: each process's requests' ``cache_salt`` (their tenant), None for none;
    ``between``: run after the first process ended; ``metrics``: gets the second's kvflow
    counters from vLLM's Prometheus registry, ``[name, reason label, value]``."""
    import json
    import subprocess

    script = tmp_path / "serve.py"
    script.write_text(SECOND_PROCESS_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    runs = []
    for name, salt in zip(("first", "second"), salts):
        if name == "second" and between is not None:
            between()
        trace = tmp_path / f"{name}.jsonl"
        done = subprocess.run(
            [sys.executable, str(script), str(model_dir), json.dumps({**extra, "trace_path": str(trace)}),
             json.dumps(conversations()), json.dumps(salt)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "RESULT " in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
        runs.append((json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0]), trace))
        if metrics is not None:
            metrics[:] = json.loads(done.stdout.split("METRICS ", 1)[1].splitlines()[0])
    return runs


def test_F22_a_second_vllm_process_loads_the_first_ones_prefixes_from_the_disk_tier(
    model_dir: Path, without_kvflow: tuple[list[list[int]], list[int]], tmp_path: Path
) -> None:
    """Two vLLM processes, one after the other, sharing a disk tier's directory: the first
    computes the conversations' first turns (written through to disk) and ends without a
    shutdown; the second, with an empty CPU tier, finds every conversation's prefix on disk at
    its first turn. Outputs are vLLM's own without kvflow, token for token."""
    import json

    from tier_keys import keys_file

    extra = {"cpu_blocks": 64, "disk_path": str(tmp_path / "disk"), "disk_gb": 0.01,
             "disk_key_file": str(keys_file(tmp_path)), "disk_store_mode": "write_through"}  # fmt: skip
    runs = two_processes(model_dir, tmp_path, extra)
    (first, _), (second, second_trace) = runs
    assert [o for o, _ in first] == [o for o, _ in second] == without_kvflow[0][:CONVERSATIONS]
    assert [c for _, c in first] == [0] * CONVERSATIONS  # nothing on disk yet
    assert [c for _, c in second] == [PREFIX] * CONVERSATIONS  # every prefix from the disk tier
    replayed = CliRunner().invoke(kvflow_cli, ["replay", str(second_trace), "--redecide"])
    assert replayed.exit_code == 0, replayed.output
    incidents = CliRunner().invoke(kvflow_cli, ["incidents", str(second_trace), "--json"])
    assert incidents.exit_code == 0, incidents.output
    assert json.loads(incidents.stdout) == []  # (stderr says the killed writer left no last checkpoint)
    assert "no checkpoint after them" in incidents.stderr


@pytest.mark.parametrize("deployment", ["tls-acl", "cluster"])
def test_a_second_vllm_process_loads_the_first_ones_prefixes_from_a_shared_redis(
    model_dir: Path, without_kvflow: tuple[list[list[int]], list[int]], tmp_path: Path, deployment: str
) -> None:
    """Two vLLM processes sharing a real Redis, entries sealed with a keys file: a 3-node Redis
    Cluster, or a server as a shared deployment runs one (TLS only, a client certificate, an ACL
    user allowed kvflow's keys alone). The first computes the conversations' first turns
    (written through to Redis); the second, with empty CPU and device caches, finds their
    prefixes there by its workers' probes at its first turn and loads them. Outputs are vLLM's
    own without kvflow, token for token; the second's trace replays and re-decides clean.

    Over TLS, an attacker (``tests/attacker.py``: a process of its own with plain redis-py and
    the ACL user's password, none of the keys) rewrites some of the first's entries between
    the two processes: the second refuses each one it reads (``forged``, counted in vLLM's own
    Prometheus registry as ``kvflow_remote_rejected_total{reason="forged"}``), recomputes
    those prefixes and loads the others."""
    import json
    import subprocess
    from urllib.parse import urlencode

    from redis_servers import ACL_PASSWORD, ACL_USER, RedisCluster, require_redis, tls_acl_server
    from tier_keys import keys_file

    require_redis()
    extra: dict[str, Any] = {"cpu_blocks": 64, "remote_key_file": str(keys_file(tmp_path))}
    forged: list[dict[str, Any]] = []
    metrics: list[Any] = []
    between = None
    if deployment == "cluster":
        servers: Any = RedisCluster()
        node = servers.nodes[0]
        extra.update(remote_url=f"redis://{node.host}:{node.port}", remote_cluster=True)
    else:
        servers, certs = tls_acl_server(tmp_path / "tls")
        url = f"rediss://{ACL_USER}:{ACL_PASSWORD}@{servers.host}:{servers.port}"
        extra.update(remote_url=url, remote_tls_ca_file=certs["ca.crt"], remote_tls_cert_file=certs["client.crt"],
                     remote_tls_key_file=certs["client.key"])  # fmt: skip
        tls = {"ssl_ca_certs": certs["ca.crt"], "ssl_certfile": certs["client.crt"], "ssl_keyfile": certs["client.key"]}

        def between() -> None:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            done = subprocess.run(
                [sys.executable, str(ROOT / "tests" / "attacker.py"), f"{url}?{urlencode(tls)}", "rewrite", str(FORGED)],
                capture_output=True, text=True, timeout=60, env=env, check=True,
            )  # fmt: skip
            forged.append(json.loads(done.stdout))

    try:
        (first, _), (second, second_trace) = two_processes(model_dir, tmp_path, extra, between=between, metrics=metrics)
    finally:
        servers.close()
    assert [o for o, _ in first] == [o for o, _ in second] == without_kvflow[0][:CONVERSATIONS]
    assert [c for _, c in first] == [0] * CONVERSATIONS  # nothing in Redis yet
    replayed = CliRunner().invoke(kvflow_cli, ["replay", str(second_trace), "--redecide"])
    assert replayed.exit_code == 0, replayed.output
    from kvflow.core.events import EVENT_TYPES, JobCompleted
    from kvflow.log.reader import read_trace

    _, records = read_trace(second_trace)
    completed = [r for _, r in records if isinstance(r, EVENT_TYPES) and isinstance(r, JobCompleted)]
    loaded = sum(len(e.hashes) for e in completed if e.direction == "remote_load")
    cached = [c for _, c in second]
    assert loaded * BLOCK == sum(cached)  # what vLLM counts as cached came over from Redis
    if deployment == "cluster":
        assert cached == [PREFIX] * CONVERSATIONS  # every prefix from the remote tier
        return
    assert forged == [{"action": "rewrite", "wrote": FORGED}]
    rejected = {reason: value for name, reason, value in metrics if name == "kvflow_remote_rejected_total"}
    assert set(rejected) == {"forged"} and 1 <= rejected["forged"] <= FORGED, metrics
    # the conversations whose entries were not forged came from the remote tier
    assert cached.count(PREFIX) >= CONVERSATIONS - FORGED and sum(cached) < PREFIX * CONVERSATIONS, cached


def test_F21_a_second_vllm_process_of_another_tenant_finds_nothing_in_a_shared_redis(
    model_dir: Path, without_kvflow: tuple[list[list[int]], list[int]], tmp_path: Path
) -> None:
    """As above, but the first process's requests carry ``cache_salt`` "alice" and the second's
    "mallory": the second finds none of alice's blocks in the shared Redis (no hit, no remote
    load), and computes, token for token as vLLM alone."""
    from redis_servers import RedisServer, require_redis
    from tier_keys import keys_file

    require_redis()
    server = RedisServer()
    try:
        extra = {"cpu_blocks": 64, "remote_url": server.url, "remote_key_file": str(keys_file(tmp_path))}
        (first, _), (second, second_trace) = two_processes(model_dir, tmp_path, extra, salts=("alice", "mallory"))
    finally:
        server.close()
    assert [o for o, _ in first] == [o for o, _ in second] == without_kvflow[0][:CONVERSATIONS]
    assert [c for _, c in second] == [0] * CONVERSATIONS
    from kvflow.core.events import EVENT_TYPES, JobCompleted
    from kvflow.log.reader import read_trace

    _, records = read_trace(second_trace)
    assert not [r for _, r in records if isinstance(r, EVENT_TYPES) and isinstance(r, JobCompleted)
                and r.direction == "remote_load"]  # fmt: skip
