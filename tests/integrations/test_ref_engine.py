"""The reference engine of tools/ref_engine.py with kvflow embedded, on the CPU device: the
same loop the GPU benchmark runs. A multi-turn workload whose prefixes the device cache cannot
keep gives identical greedy outputs with kvflow on and off, also with injected copy failures,
copies that outlive their deadline (fenced) and checksums on; the model is glassllm's real
pretrained one (when installed) for token-exact checks, else small random weights."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import ref_engine as ref  # noqa: E402
from late_loads import LateLoads  # noqa: E402

from kvflow.core.config import Config  # noqa: E402
from kvflow.engine.sync import SyncEngine  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402

B = 16
TINY = ref.Dims(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256, rope_base=10000.0)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def model(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> ref.Llama:
    """glassllm's pretrained model (float32) on the CPU device, and on CUDA where present."""
    device = request.param
    try:
        import glassllm  # noqa: F401
        import glassllm_model
        import safetensors  # noqa: F401
    except ImportError:
        return ref.random_llama(TINY, device=device, dtype=torch.float32, seed=3)
    path = glassllm_model.write_model(tmp_path_factory.mktemp("glass") / "m")
    return ref.load_llama(path, device=device)


def conversations(model: ref.Llama, n: int = 5) -> list[list[int]]:
    vocab = model.dims.vocab
    return [[(31 * c + 7 * k) % (vocab - 10) + 5 for k in range(3 * B + 5)] for c in range(n)]


def run(
    model: ref.Llama,
    *,
    kvflow: bool,
    turns: int = 2,
    clock: Any = None,
    overlap: bool = True,
    executor_cls: type[TorchExecutor] = TorchExecutor,
    **executor: Any,
) -> tuple[list[list[int]], list[ref.TurnStats], Any]:
    kv = ref.PagedKV(model.dims, num_blocks=12, block_tokens=B, device=model.device, dtype=model.dtype)
    engine = None
    if kvflow:
        ex = executor_cls(kv.tensors(), 64, block_dim=0, load_groups=model.dims.layers, **executor)
        extra = {} if clock is None else {"clock": clock}
        engine = SyncEngine(Config(cpu_blocks=64, block_tokens=B, job_deadline_ms=30_000.0), ex, **extra)
    eng = ref.RefEngine(model, kv, engine, overlap=overlap)
    outputs, stats = [], []
    history = conversations(model)
    for _ in range(turns):
        for c, prompt in enumerate(history):
            out, st = eng.generate(prompt, 6)
            outputs.append(out)
            stats.append(st)
            history[c] = prompt + out + [7 + c] * 3  # the next turn extends the conversation
    if engine is not None:
        engine.drain(timeout_ms=10_000)
    return outputs, stats, engine


@pytest.fixture(scope="module")
def baseline(model: ref.Llama) -> list[list[int]]:
    outputs, stats, _ = run(model, kvflow=False)
    assert sum(s.device_hit_blocks for s in stats) < 3, "the device cache must be too small to keep them"
    return outputs


@pytest.mark.parametrize("overlap", [True, False])
def test_prefixes_load_from_the_tier_and_outputs_are_identical(
    model: ref.Llama, baseline: list[list[int]], overlap: bool
) -> None:
    outputs, stats, engine = run(model, kvflow=True, overlap=overlap)
    assert outputs == baseline
    assert sum(s.loaded_blocks for s in stats[5:]) >= 5 * 3  # every second turn loaded its prefix
    assert engine.counters.jobs_failed == 0
    engine.close()


def test_injected_copy_failures_and_checksums_keep_outputs_identical(model: ref.Llama, baseline: list[list[int]]) -> None:
    outputs, stats, engine = run(model, kvflow=True, checksums=True, fail_job_ids=[3, 12, 14])
    assert outputs == baseline
    assert engine.counters.jobs_failed == 3
    assert any(s.load_failed for s in stats)
    engine.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_F15_copies_that_outlive_their_deadline_are_fenced_and_outputs_stay_identical(
    model: ref.Llama, baseline: list[list[int]], overlap: bool
) -> None:
    """The engine's clock jumps a minute at every step and each load reports one step late,
    so every load times out: it is recomputed into fresh blocks (F15), also after the
    overlapped pass already read its pages, and its blocks come back when the late copy
    reports."""
    from itertools import count

    ticks = count()
    outputs, stats, engine = run(
        model, kvflow=True, clock=lambda: next(ticks) * 60_000.0, overlap=overlap, executor_cls=LateLoads
    )
    assert outputs == baseline
    assert sum(s.load_failed for s in stats) >= 5  # every second turn's load was fenced
    assert engine.counters.jobs_timed_out > 0 and engine.counters.jobs_fenced == engine.counters.jobs_timed_out
    engine.close()
    assert engine.counters.fences_lifted == engine.counters.jobs_fenced
