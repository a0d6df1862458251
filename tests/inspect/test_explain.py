"""``kvflow explain``: each cause of a miss planted in a trace recorded through the real manager
(and ``kvflow simulate``'s engine), and found by name, with the seq the trace records it at."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from core_helpers import BT, config, tokens

from kvflow.cli.main import main
from kvflow.core.commands import TierRefused
from kvflow.core.names import name_of
from kvflow.engine.manager import OffloadManager
from kvflow.inspect.explain import BlockOutcome, ExplainError, explain
from kvflow.log.reader import read_trace
from kvflow.log.writer import TraceWriter
from kvflow.simulate.run import SimOptions, simulate
from kvflow.simulate.workload import EXAMPLE_WORKLOAD


def recorded(tmp_path: Path, script: Callable[[OffloadManager], None], **kw: Any) -> Path:
    """A trace of ``script`` run against a manager writing a trace file."""
    path = tmp_path / "t.jsonl"
    cfg = config(**kw)
    m = OffloadManager(cfg, log=TraceWriter(path, cfg, checkpoint_every=7))
    script(m)
    m.close()
    return path


def request(m: OffloadManager, rid: str, hashes: list[int], *, ok: bool = True, error: str = "copy failed",
            device: int = 0, finish: bool = True) -> None:
    """An engine request: look up, load the hits, store the rest (its results ``ok``), finish."""
    hits = m.lookup(rid, hashes, tokens(len(hashes)))
    if hits:
        m.accept_hits(rid, range(device, device + hits))
    m.blocks_computed(rid, hashes[hits:], range(device + 100, device + 100 + len(hashes) - hits))
    for job in m.plan_step(0.0):
        m.job_result(job.job_id, ok=ok, error=None if ok else error)
    if finish:
        m.finish_request(rid)


def blocks(path: Path, rid: str, run: int = -1) -> list[BlockOutcome]:
    found = explain(path, rid)
    out = found.requests[run].blocks
    assert out is not None
    return out


def seq_of(path: Path, kind: str, nth: int = 0, **fields: Any) -> int:
    """The seq of the ``nth`` event of type ``kind`` whose fields match."""
    _, records = read_trace(path)
    seqs = [
        rec.seq for _, rec in records
        if type(rec).__struct_config__.tag == kind and all(getattr(rec, k) == v for k, v in fields.items())
    ]  # fmt: skip
    return seqs[nth]


def test_evicted_by_another_requests_store_under_the_policy(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        request(m, "a", [1, 2])
        request(m, "b", [3, 4])  # the tier holds 2: a's blocks go, to make room for b's
        request(m, "c", [1, 2])

    for policy in ("lru", "arc"):
        path = recorded(tmp_path, script, cpu_blocks=2, policy=policy)
        c = blocks(path, "c")
        evicted = seq_of(path, "blocks_evicted")
        assert [b.fact.cause if b.fact else b.tier for b in c] == ["evicted", "behind_miss"] or [
            b.fact.cause if b.fact else None for b in c
        ] == ["evicted", "evicted"]
        first = c[0]
        assert first.fact is not None and first.fact.seq == evicted and first.fact.request_id == "b"
        assert first.fact.command == "blocks_computed" and first.fact.reason == "capacity"
        assert first.policy == policy and first.fact.stored_before


def test_never_stored_and_a_hit(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        request(m, "a", [1, 2])
        request(m, "b", [1, 2, 9])

    path = recorded(tmp_path, script, cpu_blocks=8)
    b = blocks(path, "b")
    assert [x.tier for x in b[:2]] == ["cpu", "cpu"] and all(x.hit for x in b[:2])
    assert b[2].fact is not None and b[2].fact.cause == "never_stored" and not b[2].hit
    found = explain(path, "b").requests[0]
    assert found.hit_tokens == {"device": 0, "cpu": 2 * BT, "disk": 0, "remote": 0}
    assert found.missed == {"never_stored": 1}


def test_store_rejected_by_a_tier_full_of_pinned_entries(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        request(m, "a", [1])
        assert m.lookup("b", [1], tokens(1)) == 1  # b pins the only slot (not accepted yet)
        m.blocks_computed("c", [5], [50])  # no slot, nothing evictable: rejected
        m.finish_request("c")
        m.finish_request("b")
        request(m, "d", [5])

    path = recorded(tmp_path, script, cpu_blocks=1)
    (d,) = blocks(path, "d")
    assert d.fact is not None and d.fact.cause == "store_rejected"
    assert d.fact.seq == seq_of(path, "store_rejected") and d.fact.request_id == "c"
    assert d.fact.reason is not None and d.fact.reason.startswith("tier full")
    assert not d.fact.stored_before


@pytest.mark.parametrize("how", ["failed", "timed_out"])
def test_store_failed_or_timed_out(tmp_path: Path, how: str) -> None:
    def script(m: OffloadManager) -> None:
        job = m.blocks_computed("a", [1, 2], [0, 1])
        assert job is not None
        m.plan_step(0.0)
        if how == "failed":
            m.job_result(job, ok=False, error="CUDA error: launch failure")
        else:
            m.tick(10_000.0)
        m.finish_request("a")
        request(m, "b", [1, 2])

    path = recorded(tmp_path, script, cpu_blocks=4)
    first = blocks(path, "b", 0)[0]
    assert first.fact is not None and first.fact.cause == f"store_{how}"
    assert first.fact.seq == seq_of(path, f"job_{how}") and first.fact.job_id == 1
    if how == "failed":
        assert first.fact.reason == "CUDA error: launch failure"


def test_a_store_abandoned_by_a_reset_is_fenced(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        job = m.blocks_computed("a", [1], [0])
        m.plan_step(0.0)  # in flight
        m.reset()
        assert job is not None
        m.job_result(job)  # its copy reports over: nothing becomes visible
        m.finish_request("a")
        request(m, "b", [1])

    path = recorded(tmp_path, script, cpu_blocks=4)
    (b,) = blocks(path, "b", 0)
    assert b.fact is not None and b.fact.cause == "store_fenced" and b.fact.seq == seq_of(path, "reset")


def test_still_being_stored(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        m.blocks_computed("a", [1], [0])  # queued, not landed
        request(m, "b", [1])

    path = recorded(tmp_path, script, cpu_blocks=4)
    (b,) = blocks(path, "b")
    assert b.fact is not None and b.fact.cause == "store_in_flight" and b.fact.job_id == 1


def test_a_corrupt_host_copy_and_a_failed_load(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        request(m, "a", [1, 2])
        assert m.lookup("b", [1, 2], tokens(2)) == 2
        job = m.accept_hits("b", [0, 1])
        m.plan_step(0.0)
        assert job is not None
        m.job_result(job, ok=False, error="checksum mismatch", corrupt=[1])
        m.finish_request("b")
        request(m, "c", [1, 2])

    path = recorded(tmp_path, script, cpu_blocks=4)
    failed = seq_of(path, "job_failed")
    b = blocks(path, "b")
    assert [x.fact.cause for x in b if x.fact] == ["corrupt", "load_failed"]
    assert all(x.fact is not None and x.fact.seq == failed and x.fact.job_id == 2 for x in b)
    c = blocks(path, "c")
    assert c[0].fact is not None and c[0].fact.cause == "corrupt"
    assert c[0].fact.seq == seq_of(path, "blocks_evicted", reason="corrupt")
    assert c[1].fact is not None and c[1].fact.cause == "behind_miss" and c[1].first_miss == 0


def test_a_load_that_timed_out(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        request(m, "a", [1])
        m.lookup("b", [1], tokens(1))
        m.accept_hits("b", [0])
        m.plan_step(0.0)
        m.tick(10_000.0)
        m.finish_request("b")

    path = recorded(tmp_path, script, cpu_blocks=4)
    (b,) = blocks(path, "b")
    assert b.fact is not None and b.fact.cause == "load_timed_out" and b.fact.seq == seq_of(path, "job_timed_out")


def test_another_tenants_entry_refused_by_the_remote_tier(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        m.remote_found([7])
        m.tier_refused(TierRefused(tier="remote", block_hashes=(7,), reasons=("another tenant",), job_ids=(0,)))
        request(m, "a", [7])

    path = recorded(tmp_path, script, cpu_blocks=4, remote_blocks=16)
    (a,) = blocks(path, "a")
    assert a.fact is not None and a.fact.cause == "refused" and a.fact.tier == "remote"
    assert a.fact.reason == "another tenant" and a.fact.seq == seq_of(path, "entries_refused")
    assert a.lower_tiers == {"remote": "absent"}  # (the refusal dropped it from the index)


def lower_load(m: OffloadManager, rid: str, hashes: list[int]) -> None:
    """A lookup that queues a lower tier's load of those of ``hashes`` the CPU tier lacks, which
    lands; then the lookup that counts, whose hits load."""
    m.lookup(rid, hashes, tokens(len(hashes)))
    m.accept_hits(rid, [])
    for job in m.plan_step(0.0):
        m.job_result(job.job_id)
    hits = m.lookup(rid, hashes, tokens(len(hashes)))
    m.accept_hits(rid, range(hits))
    for job in m.plan_step(0.0):
        m.job_result(job.job_id)
    m.finish_request(rid)


def test_blocks_brought_from_the_disk_tier(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        m.disk_restored([(0, name_of(7)), (1, name_of(8))])
        request(m, "a", [7, 8])  # a does not wait for the disk: both on their way
        lower_load(m, "b", [7, 8, 9])  # b waits: a's load landed already, so they hit on the CPU tier
        m.disk_restored([(2, name_of(5))])
        lower_load(m, "c", [5])  # c waits for its own disk load

    path = recorded(tmp_path, script, cpu_blocks=8, disk_blocks=8)
    a = blocks(path, "a")
    assert all(x.fact is not None and x.fact.cause == "arriving" and x.fact.tier == "disk" for x in a)
    b = blocks(path, "b")
    assert [x.tier for x in b[:2]] == ["cpu", "cpu"]
    assert b[2].fact is not None and b[2].fact.cause == "never_stored" and b[2].lower_tiers == {"disk": "absent"}
    assert [x.tier for x in blocks(path, "c")] == ["disk"]


def test_blocks_brought_from_the_remote_tier(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        m.remote_found([7, 8])
        lower_load(m, "a", [7, 8])

    path = recorded(tmp_path, script, cpu_blocks=8, remote_blocks=16)
    assert [x.tier for x in blocks(path, "a")] == ["remote", "remote"]
    assert explain(path, "a").requests[0].hit_tokens["remote"] == 2 * BT


def test_not_accepted_and_beyond_the_cap(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        request(m, "a", [1, 2, 3])
        assert m.lookup("b", [1, 2, 3], 3 * BT) == 2  # a multiple of the block: the last is computed
        job = m.accept_hits("b", [0])  # the engine takes one of the two
        m.plan_step(0.0)
        assert job is not None
        m.job_result(job)
        m.finish_request("b")

    path = recorded(tmp_path, script, cpu_blocks=4)
    b = blocks(path, "b")
    assert [x.tier if x.hit else x.fact.cause for x in b if x.fact or x.hit] == ["cpu", "not_accepted", "beyond_cap"]


def test_device_hits_come_first(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        request(m, "a", [1, 2])
        hits = m.lookup("b", [1, 2], tokens(2), device_hit_blocks=1)
        m.accept_hits("b", range(hits))
        for job in m.plan_step(0.0):
            m.job_result(job.job_id)
        m.finish_request("b")

    path = recorded(tmp_path, script, cpu_blocks=4)
    assert [x.tier for x in blocks(path, "b")] == ["device", "cpu"]


def test_a_request_asked_twice_has_two_runs(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        request(m, "a", [1])
        request(m, "a", [1])

    path = recorded(tmp_path, script, cpu_blocks=4)
    first, second = explain(path, "a").requests
    assert (first.run, second.run) == (1, 2)
    assert first.missed == {"never_stored": 1} and second.hit_tokens["cpu"] == BT


def test_an_unknown_request_is_refused(tmp_path: Path) -> None:
    path = recorded(tmp_path, lambda m: request(m, "a", [1]), cpu_blocks=4)
    with pytest.raises(ExplainError, match="no lookup of request 'zz'"):
        explain(path, "zz")


# -- against kvflow simulate's own counting ------------------------------------------------------


SUMMARY_KEYS = ("requests", "prompt_tokens", "hit_tokens", "cpu_hit_tokens", "device_hit_tokens", "stored_blocks",
                "loaded_blocks", "evicted_blocks", "rejected_blocks", "failed_jobs", "timed_out_jobs", "bytes_stored",
                "bytes_loaded")


@pytest.mark.parametrize(
    "options",
    [
        dict(cpu_blocks=256),
        dict(cpu_blocks=64, policy="arc", fault_rate=0.1, seed=4),
        dict(cpu_blocks=128, device_blocks=64, store="lazy"),
        dict(cpu_blocks=48, disk_gb=0.5, fault_rate=0.05, seed=2),
        dict(cpu_blocks=200, mode="timed"),
    ],
    ids=["lru", "arc-faults", "lazy-device", "disk", "timed"],
)
def test_the_totals_of_a_simulated_trace_are_simulates(tmp_path: Path, options: dict[str, Any]) -> None:
    trace = tmp_path / "sim.jsonl"
    summary = simulate(str(EXAMPLE_WORKLOAD), SimOptions(**options, record=str(trace)))
    totals = explain(trace, keep=lambda o: False).totals.to_dict()
    assert {k: totals[k] for k in SUMMARY_KEYS} == {k: summary[k] for k in SUMMARY_KEYS}
    if "hit_tokens_disk" in summary:
        assert totals["hit_tokens_by_tier"]["disk"] == summary["hit_tokens_disk"]
        assert totals["hit_tokens_by_tier"]["cpu"] == summary["hit_tokens_cpu"]
        assert summary["hit_tokens_disk"] > 0
    assert sum(totals["missed_by_cause"].values()) == totals["missed_blocks"] > 0


# -- the verb ---------------------------------------------------------------------------------------


def run(*args: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_the_verb_prints_one_request_and_json(tmp_path: Path) -> None:
    def script(m: OffloadManager) -> None:
        request(m, "a", [1, 2])
        request(m, "b", [3, 4])
        request(m, "c", [1, 2, 5])

    path = recorded(tmp_path, script, cpu_blocks=2)
    out = run("explain", path, "--request", "c")
    assert out.exit_code == 0, out.output
    evicted = seq_of(path, "blocks_evicted")
    assert f"evicted at seq {evicted}" in out.output and "request b's store" in out.output
    data = json.loads(run("explain", path, "--request", "c", "--json").output)
    (req,) = data["requests"]
    assert req["request_id"] == "c" and req["missed_by_cause"]["evicted"] >= 1
    assert req["blocks"][0]["cause"] == "evicted" and req["blocks"][0]["seq"] == evicted
    assert set(req["blocks"][0]) == {"index", "block", "hit", "tier", "cause", "seq", "line", "job_id",
                                     "request_id", "command", "reason", "policy", "stored_before",
                                     "lower_tiers", "first_miss"}
    every = json.loads(run("explain", path, "--all", "--json").output)
    assert [r["request_id"] for r in every["requests"]] == ["a", "b", "c"]
    assert every["totals"]["requests"] == 3
    assert "missed blocks" in run("explain", path, "--all").output


@pytest.mark.parametrize(
    "args",
    [["--request", "nobody"], [], ["--request", "a", "--all"]],
    ids=["unknown request", "neither", "both"],
)
def test_the_verb_refuses_in_one_line(tmp_path: Path, args: list[str]) -> None:
    path = recorded(tmp_path, lambda m: request(m, "a", [1]), cpu_blocks=4)
    out = run("explain", path, *args)
    assert out.exit_code == 2 and out.output.count("\n") == 1 and "Traceback" not in out.output, out.output


def test_a_bad_trace_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not a trace\n")
    out = run("explain", bad, "--all")
    assert out.exit_code == 2 and out.output.count("\n") == 1 and f"{bad}:1" in out.output
    missing = run("explain", tmp_path / "missing.jsonl", "--all")
    assert missing.exit_code == 2 and missing.output.count("\n") == 1


# -- every trace the repository has ---------------------------------------------------------------

GOLDEN = sorted((Path(__file__).resolve().parents[2] / "traces").glob("*.jsonl"))


@pytest.mark.parametrize("path", GOLDEN, ids=[p.name for p in GOLDEN])
def test_every_full_block_is_a_hit_or_a_miss_with_a_cause(path: Path) -> None:
    found = explain(path)
    assert found.requests and found.warnings == []
    for outcome in found.requests:
        hit_blocks = sum(outcome.hit_tokens.values()) // found.config["block_tokens"]
        assert hit_blocks + sum(outcome.missed.values()) == outcome.full_blocks, outcome.request_id
    for rid in {o.request_id for o in found.requests[:5]}:
        for outcome in explain(path, rid).requests:
            assert outcome.blocks is not None and len(outcome.blocks) == outcome.full_blocks
            assert all(b.hit == (b.fact is None) for b in outcome.blocks)


def test_explain_streams_its_memory_follows_the_tier_not_the_trace(tmp_path: Path) -> None:
    """The same workload three times over: three times the trace, about the same peak memory."""
    import tracemalloc

    lines = EXAMPLE_WORKLOAD.read_text().splitlines()
    last = json.loads(lines[-1])["timestamp"]
    peaks = []
    for times in (1, 3):
        workload = tmp_path / f"w{times}.jsonl"
        with workload.open("w") as out:
            for k in range(times):
                for text in lines:
                    row = json.loads(text)
                    row["timestamp"] += k * (last + 1)
                    out.write(json.dumps(row) + "\n")
        trace = tmp_path / f"t{times}.jsonl"
        simulate(str(workload), SimOptions(cpu_blocks=128, record=str(trace)))
        tracemalloc.start()
        try:
            totals = explain(trace, keep=lambda o: False).totals
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert totals.requests == 200 * times
    assert peaks[1] < peaks[0] * 1.25 + (256 << 10), peaks
