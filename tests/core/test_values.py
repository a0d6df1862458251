"""F19: the engine-facing boundary refuses what it cannot record, before anything changes.

Every refusal is checked to leave the state digest and the recorded log exactly as they were,
and every accepted call to leave a trace that reads back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvflow.core import values as bd
from kvflow.core.commands import JobResult
from kvflow.core.config import MAX_WORLD_SIZE, Config
from kvflow.core.errors import ConfigError, KvflowError, Rejected
from kvflow.core.events import JobCompleted, JobFailed
from kvflow.engine.manager import OffloadManager
from kvflow.engine.sync import SyncEngine
from kvflow.executors.simulated import SimulatedExecutor, VirtualClock
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay

np = pytest.importorskip("numpy")


def manager() -> OffloadManager:
    m = OffloadManager(Config(cpu_blocks=8, block_tokens=4))
    m.lookup("a", [1, 2], 9)
    return m


def refused(m: OffloadManager, call: Callable[[], Any], match: str) -> None:
    digest, records = m.state.digest(), len(m.log.records)
    with pytest.raises(Rejected, match=match):
        call()
    assert m.state.digest() == digest and len(m.log.records) == records


def test_F19_request_ids_are_str() -> None:
    m = manager()
    refused(m, lambda: m.lookup(7, [1], 9), "request ids are str")  # type: ignore[arg-type]
    refused(m, lambda: m.accept_hits(b"a", []), "request ids are str")  # type: ignore[arg-type]
    refused(m, lambda: m.blocks_computed(("a",), [5], [0]), "request ids are str")  # type: ignore[arg-type]
    refused(m, lambda: m.finish_request(None), "request ids are str")  # type: ignore[arg-type]
    assert m.blocks_computed(None, [5], [0]) is not None  # a store without a request is allowed


def test_F19_flags_are_bool() -> None:
    m = manager()
    refused(m, lambda: m.touch([1], reuse="no"), "reuse must be True or False")  # type: ignore[arg-type]
    refused(m, lambda: m.touch([1], reuse=0), "reuse must be True or False")  # type: ignore[arg-type]
    refused(m, lambda: m.finish_request("a", preempted=1), "preempted must be True or False")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "5", None, True])
def test_F19_times_are_finite_numbers(bad: Any) -> None:
    m = manager()
    m.blocks_computed("a", [5], [0])
    refused(m, lambda: m.plan_step(bad), "now_ms must be")
    jobs = m.plan_step(1.0)
    refused(m, lambda: m.tick(bad), "now_ms must be")
    assert m.state.jobs[jobs[0].job_id].deadline_ms == 1.0 + m.config.job_deadline_ms


def test_F19_a_nan_clock_cannot_make_a_job_that_never_times_out() -> None:
    clock = VirtualClock()
    engine = SyncEngine(Config(cpu_blocks=8, block_tokens=4), SimulatedExecutor(clock, hang_jobs=[1]), clock=lambda: math.nan)
    engine.blocks_computed("a", [5], [0])
    with pytest.raises(Rejected, match="now_ms must be finite"):
        engine.step()
    assert engine.manager.state.queued  # nothing was submitted with a NaN deadline


def test_F19_hashes_fit_in_256_bits_and_device_blocks_in_64() -> None:
    m = manager()
    refused(m, lambda: m.blocks_computed("a", [2**256], [0]), "256 bits")
    refused(m, lambda: m.blocks_computed("a", [-(2**255) - 1], [0]), "256 bits")
    refused(m, lambda: m.blocks_computed("a", [5], [2**64]), "does not fit in 64 bits")
    refused(m, lambda: m.lookup("b", [2**256], 9), "256 bits")
    refused(m, lambda: m.lookup("b", [2**64, 1.5], 9), "must be integers")
    refused(m, lambda: m.touch([1.5]), "must be integers")
    refused(m, lambda: m.blocks_computed("a", [5], ["x"]), "device blocks must be integers")
    assert m.blocks_computed("a", [2**64 - 1, -(2**63)], [2**64 - 1, 0]) is not None
    assert m.state.digest()  # every accepted value encodes


def test_F19_numpy_integers_are_accepted_where_ints_are() -> None:
    m = OffloadManager(Config(cpu_blocks=8, block_tokens=4))
    job = m.blocks_computed("a", np.array([5, 6], dtype=np.uint64), np.arange(2))
    for j in m.plan_step(np.float64(1.0)):
        m.job_result(np.int64(j.job_id), np.int32(0))
    m.finish_request("a")
    assert m.lookup("b", np.array([5, 6]), np.int64(9), device_hit_blocks=np.int64(0)) == 2
    assert m.evict(np.int64(0)) == 0
    assert job == 1 and all(type(h) is int for h in m.state.slot_of)
    refused(m, lambda: m.lookup("c", [5], True), "num_tokens must be")  # type: ignore[arg-type]
    refused(m, lambda: m.lookup("c", [5], -1), "num_tokens must be")
    refused(m, lambda: m.lookup("c", [5], 9.0), "num_tokens must be")  # type: ignore[arg-type]


def test_F19_world_size_within_what_the_acknowledgements_support() -> None:
    Config(cpu_blocks=4, world_size=MAX_WORLD_SIZE)
    with pytest.raises(ConfigError, match="world_size"):
        Config(cpu_blocks=4, world_size=MAX_WORLD_SIZE + 1)


@pytest.mark.parametrize(
    ("ok", "error"), [("false", None), ("true", None), (1, None), (None, None), (True, 404), (False, b"oops")]
)
def test_F19_a_malformed_executor_result_is_a_failure_never_a_success(ok: Any, error: Any) -> None:
    m = OffloadManager(Config(cpu_blocks=8, block_tokens=4))
    m.blocks_computed("a", [5, 6], [0, 1])
    (job,) = m.plan_step(0.0)
    m.job_results([JobResult(job_id=job.job_id, rank=0, ok=ok, error=error)])
    (terminal,) = [e for e in m.log.events() if isinstance(e, (JobCompleted, JobFailed))]
    assert type(terminal) is JobFailed and "malformed executor result" in terminal.error
    assert 5 not in m.state.slot_of  # the store's hashes never became visible


def test_F19_every_recorded_trace_reads_back_after_refusals(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    config = Config(cpu_blocks=8, block_tokens=4)
    m = OffloadManager(config, log=TraceWriter(path, config, checkpoint_every=2))
    for call in (
        lambda: m.lookup("a", [1, 2**256], 9),
        lambda: m.plan_step(math.nan),
        lambda: m.touch([1], reuse="yes"),
        lambda: m.blocks_computed(3, [1], [0]),
    ):
        with pytest.raises(Rejected):
            call()  # type: ignore[no-untyped-call]
    m.blocks_computed("a", np.array([1, 2]), np.arange(2))
    for j in m.plan_step(2.5):
        m.job_result(j.job_id, ok="no")  # type: ignore[arg-type]
    m.close()
    result = replay(path, redecide=True)
    assert result.ok, result.divergence
    assert result.events == m.state.last_seq


def test_F19_64_bit_hashes_pass_as_they_are_and_anything_else_is_still_checked() -> None:
    # the fast path reads the encoded tags: real 64-bit hashes (signed or unsigned, any count
    # of them, the msgpack array header's three sizes included) come back as the same tuple
    for count in (0, 1, 15, 16, 70_000):
        for start in (2**63, -(2**62)):
            values = tuple(range(start, start + count))
            assert bd.hashes(values) is values
            assert bd.hashes(list(values)) == values
    big = tuple(range(2**62, 2**62 + 20))
    with pytest.raises(Rejected, match="must be integers"):
        bd.hashes(big[:3] + (1.5,) + big[3:])  # a float is written in 9 bytes too
    with pytest.raises(Rejected, match="64 bits"):
        bd.hashes(big + (2**64,))
    mixed = bd.hashes(big[:2] + (True, 7))  # short forms take the checked path
    assert mixed == big[:2] + (1, 7) and all(type(h) is int for h in mixed)


# --- the value rules themselves ---------------------------------------------------------


BOUNDARY_INPUTS: list[tuple[Any, Any, Any]] = [
    # (input, ints result or error, hashes result or error)
    ([], (), ()),
    ((), (), ()),
    ([1, 2, 3], (1, 2, 3), (1, 2, 3)),
    ((5, 4), (5, 4), (5, 4)),
    (range(3, 6), (3, 4, 5), (3, 4, 5)),
    ([True, 2], (1, 2), (1, 2)),
    ([2**64 - 1, -(2**63)], (2**64 - 1, -(2**63)), (2**64 - 1, -(2**63))),
    ([2**64], (2**64,), "64 bits"),
    ([-(2**63) - 1], (-(2**63) - 1,), "64 bits"),
    ([1.5, 2], "must be integers", "must be integers"),
    (["a"], "must be integers", "must be integers"),
    ([None], "must be integers", "must be integers"),
    (iter([7, 8]), (7, 8), (7, 8)),
]


def _input_id(value: Any) -> str:
    # (an iterator's repr names its address: a test id must be the same in every process)
    return repr(value) if isinstance(value, (list, tuple, range, str, int)) else type(value).__name__


@pytest.mark.parametrize(("values", "as_ints", "as_hashes"), BOUNDARY_INPUTS, ids=_input_id)
def test_boundary_normalisation(values: Any, as_ints: Any, as_hashes: Any) -> None:
    items = list(values) if not isinstance(values, (list, tuple, range)) else values
    for fn, expected in ((bd.ints, as_ints), (bd.hashes, as_hashes)):
        if isinstance(expected, str):
            with pytest.raises(KvflowError, match=expected):
                fn(items)
        else:
            out = fn(items)
            assert out == expected and all(type(v) is int for v in out)


def test_numpy_integers_normalise_to_plain_ints() -> None:
    assert bd.ints(np.arange(3, dtype=np.int64)) == (0, 1, 2)
    assert bd.hashes([np.uint64(2**64 - 1)]) == (2**64 - 1,)


@pytest.mark.parametrize(
    ("value", "counts"),
    [(0, True), (-3, True), (2**70, True), (True, False), (False, False), (1.0, False), ("1", False), (None, False)],
)
def test_an_int_is_never_a_bool(value: Any, counts: bool) -> None:
    """The one rule every count, id and size is checked by (``is_int``): a bool is no number."""
    assert bd.is_int(value) is counts
    assert bd.is_int(np.int64(3)) is False  # (numpy integers are normalised first: ``ints``, ``count``)
