"""kvflow behind transformers' continuous batching, on the CPU device: a small
Llama-architecture model with random weights from a fixed seed (nothing downloaded) runs chats
(each turn's prompt is the conversation so far) through transformers' scheduler, paged cache and
preemption, with kvflow's CPU tier on and off. Greedy outputs are identical; the tier serves
prefixes across turns and restores preempted requests; a failed load and a copy that outlives
its deadline (fenced) are recomputed with identical outputs; nothing is left behind (no job,
fence, pin or held device block; transformers' cache all free); the trace replays and
``kvflow incidents`` names the failed loads.

Skips without transformers (or psutil, its CPU sizing: both in ``kvflow[transformers]``); under ``KVFLOW_REQUIRE_TRANSFORMERS=1`` (CI) a missing one fails.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVFLOW_REQUIRE_TRANSFORMERS"):  # CI: a missing transformers is a failure, not a skip
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("psutil")  # (transformers sizes its cache on the CPU device with it)

from click.testing import CliRunner  # noqa: E402
from late_loads import LateLoads  # noqa: E402

from kvflow.cli.main import main as kvflow_cli  # noqa: E402
from kvflow.core.commands import JobResult  # noqa: E402
from kvflow.core.config import Config  # noqa: E402
from kvflow.core.errors import ConfigError  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402
from kvflow.integrations.transformers import batching  # noqa: E402
from kvflow.integrations.transformers.tier import KvflowTier, TierStats  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_transformers as bench  # noqa: E402

B = 16


@pytest.fixture(scope="module")
def model() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a tiny model's matrices: threads only contend)
    try:
        yield bench.build_model(True, seed=0, device="cpu", dtype=torch.float32)
    finally:
        torch.set_num_threads(threads)


def chats() -> list[list[bench.Turn]]:
    """Five chats of three turns: a 37-token opening, then 6 new tokens a turn."""
    return [
        [bench.Turn([(31 * c + 7 * k + 11 * t) % 480 + 20 for k in range(37 if t == 0 else 6)], 7) for t in range(3)]
        for c in range(5)
    ]


def run(model: Any, tier: KvflowTier | None) -> tuple[dict[str, list[int]], TierStats]:
    """The chats through continuous batching; a device cache of 12 blocks (the chats need
    35) that admits requests to its last block: prefixes fall out of it and requests are
    preempted."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    cb = ContinuousBatchingConfig(
        block_size=B, num_blocks=12, max_batch_tokens=48, max_blocks_per_request=0, safety_margin=0.0
    )
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = batching.init_continuous_batching(model, tier=tier, generation_config=generation, continuous_batching_config=cb)
    manager.start()
    try:
        results = bench.run_conversations(manager, chats(), history=True, timeout_s=120.0)
    finally:
        manager.stop(block=True)
        manager.destroy()
    return {rid: list(r.generated_tokens) for rid, r in results.items()}, manager.stats


def tier(tmp_path: Path, **kwargs: Any) -> KvflowTier:
    return KvflowTier(Config(cpu_blocks=96, block_tokens=B, job_deadline_ms=30_000.0), trace_path=str(tmp_path / "t.jsonl"), **kwargs)


@pytest.fixture(scope="module")
def baseline(model: Any) -> dict[str, list[int]]:
    outputs, stats = run(model, None)
    assert stats.preemptions > 0, "the device cache must be small enough to preempt"
    assert stats.leaks == []
    return outputs


def test_the_tier_serves_turns_and_preempted_requests_with_identical_outputs(
    model: Any, baseline: dict[str, list[int]], tmp_path: Path
) -> None:
    outputs, stats = run(model, tier(tmp_path))
    assert outputs == baseline
    # later turns' conversations so far and preempted requests came back from the tier
    assert stats.tier_hit_tokens >= 10 * B
    assert stats.preemptions > 0 and stats.loads_failed == 0
    assert stats.leaks == []
    replayed = CliRunner().invoke(kvflow_cli, ["replay", str(tmp_path / "t.jsonl"), "--redecide"])
    assert replayed.exit_code == 0, replayed.output


class FailingLoads(TorchExecutor):
    """The first ``failures`` loads fail (their copies never start); the rest copy as usual."""

    def __init__(self, *args: Any, failures: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures = failures
        self.failed: list[JobResult] = []

    def submit(self, jobs: Any, compute_done: Any = None) -> None:
        kept = []
        for job in jobs:
            if job.direction == "load" and self.failures > 0:
                self.failures -= 1
                self.failed.append(JobResult(job_id=job.job_id, rank=0, ok=False, error="injected copy failure"))
            else:
                kept.append(job)
        if kept:
            super().submit(kept, compute_done)

    def poll(self) -> list[JobResult]:
        out, self.failed = self.failed + super().poll(), []
        return out


def test_failed_loads_are_recomputed_and_named_by_incidents(
    model: Any, baseline: dict[str, list[int]], tmp_path: Path
) -> None:
    executor = lambda tensors, slots: FailingLoads(tensors, slots, block_dim=0, failures=2)  # noqa: E731
    outputs, stats = run(model, tier(tmp_path, executor=executor))
    assert outputs == baseline
    assert stats.loads_failed == 2 and stats.loads_fenced == 0 and stats.recomputed_tokens > 0
    assert stats.tier_hit_tokens > 0  # the other loads landed
    assert stats.leaks == []
    found = CliRunner().invoke(kvflow_cli, ["incidents", str(tmp_path / "t.jsonl"), "--json"])
    assert found.exit_code == 0, found.output
    incidents = json.loads(found.stdout)
    assert [i["direction"] for i in incidents] == ["load", "load"]


def test_late_copies_are_fenced_and_recomputed_into_fresh_blocks(
    model: Any, baseline: dict[str, list[int]], tmp_path: Path
) -> None:
    ticks = iter(range(0, 10**12, 60_000))
    executor = lambda tensors, slots: LateLoads(tensors, slots, block_dim=0)  # noqa: E731
    outputs, stats = run(model, tier(tmp_path, executor=executor, clock=lambda: float(next(ticks))))
    assert outputs == baseline
    assert stats.loads_fenced > 0 and stats.loads_fenced == stats.loads_failed
    assert stats.tier_hit_tokens == 0
    assert stats.leaks == []  # every fence lifted when its copy reported; the blocks came back
    found = CliRunner().invoke(kvflow_cli, ["incidents", str(tmp_path / "t.jsonl"), "--json"])
    assert found.exit_code == 0, found.output
    assert len(json.loads(found.stdout)) == stats.loads_fenced


def test_loads_overlap_the_other_requests_work(model: Any, baseline: dict[str, list[int]], tmp_path: Path) -> None:
    """Each load reports four polls after its copy: while it is outstanding, the loop goes on
    scheduling and computing the other requests (forward passes run), and the loading request
    joins a batch once its load landed, its blocks computed; outputs identical."""
    executors: list[LateLoads] = []

    def executor(tensors: list[Any], slots: int) -> LateLoads:
        executors.append(LateLoads(tensors, slots, block_dim=0, polls=4))
        return executors[-1]

    passes: list[int] = []  # loads outstanding at each forward pass
    hook = model.register_forward_hook(lambda *_: passes.append(executors[0].outstanding if executors else 0))
    try:
        outputs, stats = run(model, tier(tmp_path, executor=executor))
    finally:
        hook.remove()
    assert outputs == baseline
    assert stats.tier_hit_tokens >= 10 * B and stats.loads_failed == 0
    overlapped = sum(1 for loading in passes if loading)
    assert overlapped > 0, f"no forward pass ran while a load was outstanding ({len(passes)} passes)"
    assert stats.leaks == []


def test_a_request_cancelled_while_its_load_is_out_leaves_nothing_behind(
    model: Any, baseline: dict[str, list[int]], tmp_path: Path
) -> None:
    """The chats' second turns, whose prefixes load from the tier; the request of the first
    load is cancelled while it is outstanding (ten polls): its copy ends on its own, its
    blocks come back, the other turns' outputs are unchanged."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    cancelled: list[str] = []

    class CancelFirstLoad(LateLoads):
        def submit(self, jobs: Any, compute_done: Any = None) -> None:
            for job in jobs:
                if job.direction == "load" and not cancelled:
                    cancelled.append(job.request_id)
                    manager.cancel_request(job.request_id)
            super().submit(jobs, compute_done)

    executor = lambda tensors, slots: CancelFirstLoad(tensors, slots, block_dim=0, polls=10)  # noqa: E731
    cb = ContinuousBatchingConfig(
        block_size=B, num_blocks=12, max_batch_tokens=48, max_blocks_per_request=0, safety_margin=0.0
    )
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = batching.init_continuous_batching(
        model, tier=tier(tmp_path, executor=executor), generation_config=generation, continuous_batching_config=cb
    )
    manager.start()
    outputs: dict[str, list[int]] = {}
    # the chats' first turns; other prompts that push their blocks out of the device cache;
    # the chats' second turns, whose prefixes the tier has
    waves = [
        {f"c{c}t0": chat[0].prompt for c, chat in enumerate(chats())},
        {f"x{i}": [(5 * k + i) % 400 + 30 for k in range(40)] for i in range(4)},
        {f"c{c}t1": chat[0].prompt + baseline[f"c{c}t0"] + chat[1].prompt for c, chat in enumerate(chats())},
    ]
    try:
        for wave in waves:
            for rid, prompt in wave.items():
                manager.add_request(prompt, request_id=rid, max_new_tokens=7)
            while not set(wave) - set(cancelled) <= set(outputs):
                result = manager.get_result(timeout=30)
                assert result is not None and result.error is None
                if result.is_finished():
                    outputs[result.request_id] = list(result.generated_tokens)
    finally:
        manager.stop(block=True)
        manager.destroy()
    assert len(cancelled) == 1 and cancelled[0] not in outputs, cancelled
    assert {rid: out for rid, out in outputs.items() if rid in baseline} == {
        rid: out for rid, out in baseline.items() if rid in outputs
    }
    assert len(outputs) == 13
    assert manager.stats.leaks == []


def test_generate_batch_turns_the_tier_on_with_one_argument(model: Any, tmp_path: Path) -> None:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    prompts = [[(5 * k + c) % 400 + 30 for k in range(40)] for c in range(3)] * 2
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    runs = []
    for on in (None, tier(tmp_path)):
        cb = ContinuousBatchingConfig(block_size=B, num_blocks=10, max_batch_tokens=64, max_blocks_per_request=0)
        outputs, stats = batching.generate_batch(
            model, prompts, tier=on, generation_config=generation, continuous_batching_config=cb, max_new_tokens=5
        )
        assert list(outputs) == [f"req_{i}" for i in range(len(prompts))] and stats.leaks == []
        runs.append(([o.generated_tokens for o in outputs.values()], stats))
    assert runs[0][0] == runs[1][0]
    assert runs[1][1].offered_blocks > 0


def test_refusals_are_one_line(model: Any) -> None:
    from transformers import ContinuousBatchingConfig

    cases = [
        (Config(cpu_blocks=8, block_tokens=32), {}, "block_tokens=32"),
        (Config(cpu_blocks=8, block_tokens=B, store_mode="lazy"), {}, "store_mode"),
        (Config(cpu_blocks=8, block_tokens=B), {"cpu_offload_space": 1.0}, "cpu_offload_space"),
        (Config(cpu_blocks=8, block_tokens=B), {"use_async_batching": True}, "use_async_batching"),
    ]
    for config, extra, word in cases:
        cb = ContinuousBatchingConfig(block_size=B, num_blocks=8, **extra)
        with pytest.raises(ConfigError, match=word) as refused:
            batching.init_continuous_batching(model, tier=KvflowTier(config), continuous_batching_config=cb)
        assert "\n" not in str(refused.value)


def test_another_transformers_release_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # (the module object transformers registered last: its lazy loader may swap it)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.99.0")
    with pytest.raises(ImportError, match=r"needs transformers==5\.17\.0, not 5\.99\.0"):
        importlib.reload(batching)
    monkeypatch.undo()
    importlib.reload(batching)
