"""Failure conformance of a vLLM KV connector: the real engine (vLLM-CPU), glassllm's pretrained
model, greedy, through seeded faults (docs/conformance.md).

Three vLLM runs, each a process of its own (``conformance_drive.py``): the reference (no
connector), the ``local`` program (a failed store, a failed load, a reset, preemption under
memory pressure) and the ``remote`` program (a real redis-server behind ``StallProxy``: a late
copy, then a stalled tier). The connector is observed through vLLM's connector API
(``conformance_observe``) and each test checks one promise against what it told vLLM:

* greedy outputs token for token those of vLLM without a connector;
* every block of a failed load named to vLLM (``get_block_ids_with_load_errors``), no other;
* no request held back by the connector, or waiting for its load, past the connector's deadline;
* nothing left at shutdown: vLLM's blocks all free, no request left, the connector's own audit
  (its profile's) empty.

The connector: ``KVFLOW_CONFORMANCE_CONNECTOR=module:Class`` (default: the profile's), its fault
profile ``KVFLOW_CONFORMANCE_PROFILE=module:attribute`` (default: kvflow's,
``conformance_profiles.KVFLOW``); the seed that picks which conversations' copies fail:
``KVFLOW_CONFORMANCE_SEED`` (default 1; in every test id). A fault the profile cannot produce is
a skip naming it, never a pass.

Skips without vLLM and glassllm; under ``KVFLOW_REQUIRE_VLLM=1`` (CI) a missing one fails.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVFLOW_REQUIRE_VLLM"):
    import glassllm  # noqa: F401
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
    pytest.importorskip("glassllm")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import glassllm_model  # noqa: E402

SEED = int(os.environ.get("KVFLOW_CONFORMANCE_SEED", "1"))
PROFILE = os.environ.get("KVFLOW_CONFORMANCE_PROFILE", "conformance_profiles:KVFLOW")
# how long past the deadline a request may still be seen waiting: vLLM asks the connector once
# per engine step, and a step on a busy two-core machine takes up to a second
STEP_SLACK_S = 1.5
PREFIX = 64


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


_profile = _load(PROFILE)
CONNECTOR = os.environ.get("KVFLOW_CONFORMANCE_CONNECTOR") or _profile.connector
CASE = f"{CONNECTOR.rpartition(':')[2]}-seed{SEED}"


@pytest.fixture(scope="module", params=[SEED], ids=[CASE])
def seed(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def profile() -> Any:
    return _profile


def needs(profile: Any, fault: str) -> None:
    if fault not in profile.faults:
        pytest.skip(f"not exercised: the fault profile {PROFILE} cannot make {CONNECTOR} fail with {fault}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return glassllm_model.write_model(tmp_path_factory.mktemp("glass") / "glass-llama")


def drive(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps({**spec, "workdir": str(workdir)}))
    env = {k: v for k, v in os.environ.items() if k != "KVFLOW_CONFORMANCE_CONNECTOR"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(HERE), env.get("PYTHONPATH", "")])
    out = workdir / "result.json"
    done = subprocess.run(
        [sys.executable, str(HERE / "conformance_drive.py"), str(workdir / "spec.json"), str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=workdir,
    )  # fmt: skip
    assert done.returncode == 0 and out.exists(), done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module")
def reference(model_dir: Path, seed: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = drive({"program": "local", "seed": seed, "model": str(model_dir)}, tmp_path_factory.mktemp("reference"))
    first = phase(run, "first_turns")
    assert [r["cached"] for r in first] == [0] * 6, "vLLM's own cache must be too small to keep the prefixes"
    return run


@pytest.fixture(scope="module")
def local_run(model_dir: Path, seed: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    spec = {"program": "local", "seed": seed, "model": str(model_dir), "connector": CONNECTOR, "profile": PROFILE}
    return drive(spec, tmp_path_factory.mktemp("local"))


@pytest.fixture(scope="module")
def remote_run(model_dir: Path, seed: int, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from redis_servers import RedisServer, require_redis

    require_redis()
    server = RedisServer()
    try:
        spec = {"program": "remote", "seed": seed, "model": str(model_dir), "connector": CONNECTOR,
                "profile": PROFILE, "redis_host": server.host, "redis_port": server.port}  # fmt: skip
        yield drive(spec, tmp_path_factory.mktemp("remote"))
    finally:
        server.close()


# -- what the runs tell --------------------------------------------------------------------


def phase(run: dict[str, Any], name: str) -> list[dict[str, Any]]:
    (found,) = [p for p in run["phases"] if p["name"] == name]
    return list(found["requests"])


def calls_of(run: dict[str, Any], request_id: str) -> list[tuple[float, str, dict[str, Any]]]:
    """The observed calls naming one request (vLLM's engine adds a suffix to the request id the
    caller sees)."""
    return [(t, call, d) for t, call, rid, d in run["calls"] if rid is not None and rid.split("-")[0] == request_id]


def recving(run: dict[str, Any]) -> list[tuple[float, str]]:
    return [(t, rid.split("-")[0]) for t, call, _, d in run["calls"] if call == "get_finished" for rid in d["recving"]]


def waits(run: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(request, what, seconds) of every wait the connector imposed: held back (lookups
    answered "ask later") and loading (allocated with external tokens until reported over)."""
    out = []
    done = recving(run)
    ids = sorted({rid.split("-")[0] for _, _, rid, _ in run["calls"] if rid is not None}, key=int)
    end = max(t for t, *_ in run["calls"])
    for rid in ids:
        held_since = None
        for t, call, d in calls_of(run, rid):
            if call == "lookup" and d["tokens"] is None and held_since is None:
                held_since = t
            elif call == "lookup" and d["tokens"] is not None and held_since is not None:
                out.append((rid, "held back", t - held_since))
                held_since = None
            elif call == "alloc" and d["external"] > 0:
                over = [u for u, r in done if r == rid and u >= t]
                out.append((rid, "loading", (over[0] if over else end) - t))
        if held_since is not None:
            out.append((rid, "held back", end - held_since))
    return out


def external_blocks(run: dict[str, Any], request_id: str) -> list[list[int]]:
    """The device blocks of each load the connector started for a request: those after vLLM's
    own prefix hit (the lookup's computed tokens) for the external tokens."""
    out, computed = [], 0
    for _, call, d in calls_of(run, request_id):
        if call == "lookup":
            computed = d["computed"]
        elif call == "alloc" and d["external"] > 0:
            first = computed // 32
            out.append(sorted(d["block_ids"][first : first + d["external"] // 32]))
    return out


def check_outputs(run: dict[str, Any], reference: dict[str, Any], names: list[str], conv: int | None = None) -> None:
    """The outputs of the phases ``names`` (of conversation ``conv`` alone, or all) are the
    reference's, token for token."""
    for name in names:
        expected = phase(reference, name if name in ("pressure", "after_reset", "second_turns") else "first_turns")
        by_conv = {r["conv"]: r["tokens"] for r in expected}
        for r in phase(run, name):
            if conv is None or r["conv"] == conv:
                assert r["tokens"] == by_conv[r["conv"]], f"seed {SEED}: {name}, conversation {r['conv']}: outputs differ"


# -- the promises --------------------------------------------------------------------------


def test_failed_store_changes_no_output_and_is_never_served(
    local_run: dict[str, Any], reference: dict[str, Any], profile: Any
) -> None:
    needs(profile, "failed_store")
    conv = local_run["plan"]["fail_store"]
    check_outputs(local_run, reference, ["first_turns", "second_turns"], conv)
    (second,) = [r for r in phase(local_run, "second_turns") if r["conv"] == conv]
    served = [d["tokens"] for _, call, d in calls_of(local_run, second["id"]) if call == "lookup" and d["tokens"]]
    assert served == [], f"seed {SEED}: conversation {conv}'s store failed, yet its prefix was offered: {served}"
    assert second["cached"] == 0


def test_every_block_of_a_failed_load_is_named_to_vllm(
    local_run: dict[str, Any], reference: dict[str, Any], profile: Any
) -> None:
    needs(profile, "failed_load")
    conv = local_run["plan"]["fail_load"]
    (second,) = [r for r in phase(local_run, "second_turns") if r["conv"] == conv]
    loads = external_blocks(local_run, second["id"])
    assert loads, f"seed {SEED}: conversation {conv}'s second turn started no load: the fault was not exercised"
    named = [d["block_ids"] for _, call, _, d in local_run["calls"] if call == "load_errors"]
    assert named == loads[:1], f"seed {SEED}: the load of conversation {conv} failed on blocks {loads[0]}; named: {named}"
    check_outputs(local_run, reference, ["second_turns"], conv)


def test_outputs_are_token_exact_with_no_connector(
    local_run: dict[str, Any], remote_run: dict[str, Any], reference: dict[str, Any]
) -> None:
    check_outputs(local_run, reference, ["first_turns", "second_turns", "after_reset", "pressure"])
    check_outputs(remote_run, reference, ["first_turns", "late", "stalled"])


def test_every_load_is_reported_over(local_run: dict[str, Any], remote_run: dict[str, Any]) -> None:
    for run in (local_run, remote_run):
        done = recving(run)
        for rid in {rid.split("-")[0] for _, call, rid, d in run["calls"] if call == "alloc" and d["external"]}:
            started = [t for t, call, d in calls_of(run, rid) if call == "alloc" and d["external"]]
            over = [t for t, r in done if r == rid]
            assert len(over) >= len(started), f"seed {SEED}: request {rid}'s load was never reported over"


@pytest.mark.parametrize("program", ["local", "remote"])
def test_no_request_waits_past_the_deadline(program: str, seed: int, request: pytest.FixtureRequest) -> None:
    run = request.getfixturevalue(f"{program}_run")
    limit = run["deadline_s"] + STEP_SLACK_S
    late = [(rid, what, round(s, 2)) for rid, what, s in waits(run) if s > limit]
    assert late == [], f"seed {SEED}: waits past the {run['deadline_s']} s deadline: {late}"


def test_a_late_copy_is_not_waited_for_and_changes_no_output(
    remote_run: dict[str, Any], reference: dict[str, Any], profile: Any
) -> None:
    needs(profile, "late_copy")
    assert remote_run["held_late"] > 0, f"seed {SEED}: no reply of the remote tier was held: no copy was late"
    # (the connector's own records, where its profile reads them, say what became of the copy)
    print("evidence:", remote_run["evidence"])
    check_outputs(remote_run, reference, ["first_turns", "late"])
    (late,) = phase(remote_run, "late")
    held = [s for rid, _, s in waits(remote_run) if rid == late["id"]]
    assert held and max(held) <= remote_run["deadline_s"] + STEP_SLACK_S


def test_a_stalled_remote_tier_neither_hangs_vllm_nor_serves_wrong_kv(
    remote_run: dict[str, Any], reference: dict[str, Any], profile: Any
) -> None:
    needs(profile, "stalled_remote")
    check_outputs(remote_run, reference, ["stalled"])
    deadline = remote_run["deadline_s"]
    for r in phase(remote_run, "stalled"):
        held = [s for rid, _, s in waits(remote_run) if rid == r["id"]]
        assert max(held, default=0.0) <= deadline + STEP_SLACK_S, f"seed {SEED}: conversation {r['conv']} waited {held}"
    # shutdown with the tier still stalled
    assert remote_run["shutdown_s"] <= 2 * deadline + 5.0


def test_preemption_under_memory_pressure_changes_no_output(
    local_run: dict[str, Any], reference: dict[str, Any]
) -> None:
    preempted = [d["requests"] for _, call, _, d in local_run["calls"] if call == "preempted"]
    assert preempted, "the workload must make vLLM preempt"
    check_outputs(local_run, reference, ["pressure"])
    loaded = [r for r in phase(local_run, "pressure") if r["cached"] >= PREFIX]
    assert loaded, "no prefix came from the connector under memory pressure: its copies were not exercised"


def test_reset_forgets_everything_before_it(local_run: dict[str, Any], reference: dict[str, Any]) -> None:
    (answer,) = [d["answer"] for _, call, _, d in local_run["calls"] if call == "reset"]
    assert answer is not False, "the connector refused vLLM's reset"
    check_outputs(local_run, reference, ["after_reset"])
    for r in phase(local_run, "after_reset"):
        served = [d["tokens"] for _, call, d in calls_of(local_run, r["id"]) if call == "lookup" and d["tokens"]]
        assert served == [], f"conversation {r['conv']} was offered {served} tokens stored before the reset"


@pytest.mark.parametrize("program", ["local", "remote"])
def test_nothing_is_left_at_shutdown(program: str, seed: int, request: pytest.FixtureRequest) -> None:
    run = request.getfixturevalue(f"{program}_run")
    assert run["vllm_blocks_in_use"] == 0 and run["vllm_requests_left"] == []
    assert run["leaks"] == [], f"seed {SEED}: {run['leaks']}"
    assert [call for _, call, _, _ in run["calls"]].count("shutdown") >= 1
