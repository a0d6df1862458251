"""The two halves of the vLLM connector without vLLM: configuration, hashes, and the scheduler
side's decisions for the call sequences vLLM makes (tests/integrations/test_vllm_connector.py runs them
inside the real engine)."""

from __future__ import annotations

import pytest

from kvflow.core.commands import JobResult
from kvflow.core.errors import ConfigError
from kvflow.integrations.vllm.sides import ConnectorConfig, SchedulerSide, kvflow_hash

B = 32


def test_capacity_in_blocks_bytes_or_gb() -> None:
    assert ConnectorConfig.from_extra({"cpu_blocks": 10}).blocks(4096) == 10
    assert ConnectorConfig.from_extra({"cpu_bytes": 10 * 4096 + 5}).blocks(4096) == 10
    assert ConnectorConfig.from_extra({"cpu_gb": 1}).blocks(1 << 20) == 1024


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "exactly one of"),
        ({"cpu_blocks": 4, "cpu_gb": 1}, "exactly one of"),
        ({"cpu_blocks": 0}, "cpu_blocks must be a whole number > 0"),
        ({"cpu_gb": float("nan")}, "cpu_gb must be a number > 0"),
        ({"cpu_blocks": 4, "polcy": "lru"}, "unknown key 'polcy'"),
        ({"cpu_blocks": 4, "store_mode": "lazy"}, "stores eagerly"),
    ],
)
def test_bad_extra_config_is_one_clear_error(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_extra(extra)


def test_a_capacity_below_one_block_is_refused() -> None:
    with pytest.raises(ConfigError, match="hold no block"):
        ConnectorConfig.from_extra({"cpu_bytes": 100}).blocks(4096)


def test_vllm_hashes_become_64_bit_ints() -> None:
    digest = bytes(range(32)) + b"\0\0\0\0"
    assert kvflow_hash(digest) == int.from_bytes(bytes(range(8)), "big")
    assert kvflow_hash(2**70 + 5) == 5


def hashes(*ids: int) -> list[bytes]:
    return [i.to_bytes(8, "big") + bytes(24) for i in ids]


def test_a_load_goes_into_the_blocks_after_vllms_own_prefix_hits() -> None:
    """vLLM's prefix cache has block 0; kvflow's tier blocks 1 and 2: the load must target
    the request's 2nd and 3rd blocks, whatever ``request.num_computed_tokens`` says when the
    blocks are allocated (vLLM updates it afterwards)."""
    side = SchedulerSide(ConnectorConfig(cpu_blocks=8), B, 4096)
    side.matched_tokens("w", hashes(1, 2, 3), 3 * B + 1, 0)
    side.allocated("w", [10, 11, 12], 0)
    plan = side.step([("w", 3 * B + 1, None, False)], [])
    assert [(j.direction, j.device_blocks) for j in plan.jobs] == [("store", (10, 11, 12))]
    side.results([JobResult(job_id=plan.jobs[0].job_id)])
    assert side.finished("w") is False
    assert side.matched_tokens("r", hashes(1, 2, 3, 4), 4 * B + 1, B) == 2 * B  # after 1 device hit
    side.allocated("r", [20, 21, 22, 23], 2 * B)
    plan = side.step([("r", 4 * B + 1, None, False)], [])
    loads = [j for j in plan.jobs if j.direction == "load"]
    assert [j.device_blocks for j in loads] == [(21, 22)]
    stores = [j for j in plan.jobs if j.direction == "store"]
    assert [j.device_blocks for j in stores] == [(23,)]  # the block vLLM computes itself


def test_a_finished_request_keeps_its_blocks_while_its_store_runs() -> None:
    side = SchedulerSide(ConnectorConfig(cpu_blocks=8), B, 4096)
    side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0)
    side.allocated("r", [5, 6, 7], 0)
    plan = side.step([("r", 2 * B + 1, None, False)], [])
    assert side.finished("r") is True  # vLLM must not free blocks 5 and 6 yet
    nxt = side.step([], [])
    assert nxt.delayed_free == ["r"] and nxt.jobs == []
    side.results([JobResult(job_id=plan.jobs[0].job_id)])
    assert side.manager.state.jobs == {}


def test_a_request_whose_load_failed_is_offered_nothing_again() -> None:
    """vLLM recomputes the failed blocks and asks again: kvflow answers 0 for that request, so
    a load that keeps failing cannot loop; other requests still hit."""
    side = SchedulerSide(ConnectorConfig(cpu_blocks=8), B, 4096)
    side.matched_tokens("w", hashes(1, 2), 2 * B + 1, 0)
    side.allocated("w", [1, 2, 3], 0)
    plan = side.step([("w", 2 * B + 1, None, False)], [])
    side.results([JobResult(job_id=plan.jobs[0].job_id)])
    side.finished("w")
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) == 2 * B
    side.allocated("r", [5, 6, 7], 2 * B)
    load = side.step([], []).jobs[0]
    side.results([JobResult(job_id=load.job_id, ok=False, error="copy failed")])
    assert side.loads_failed == 1
    assert side.matched_tokens("r", hashes(1, 2), 2 * B + 1, 0) == 0  # recompute
    assert side.matched_tokens("s", hashes(1, 2), 2 * B + 1, 0) == 2 * B  # the entries are fine
