"""``kvflow explain`` and ``kvflow what-if`` on a trace an engine recorded: the reference engine of
tools/ref_engine.py with kvflow embedded (torch on the CPU device, small random weights), some of
its copies failing. What explain says each request got is what the engine itself counted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import ref_engine as ref  # noqa: E402

from kvflow.core.config import Config  # noqa: E402
from kvflow.engine.sync import SyncEngine  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402
from kvflow.inspect.explain import explain  # noqa: E402
from kvflow.simulate.whatif import what_if  # noqa: E402

B = 16
TINY = ref.Dims(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256, rope_base=10000.0)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[ref.TurnStats]]:
    model = ref.random_llama(TINY, device="cpu", dtype=torch.float32, seed=3)
    kv = ref.PagedKV(model.dims, num_blocks=12, block_tokens=B, device=model.device, dtype=model.dtype)
    ex = TorchExecutor(kv.tensors(), 64, block_dim=0, load_groups=model.dims.layers, fail_job_ids=[3, 12, 14])
    path = tmp_path_factory.mktemp("ref") / "engine.jsonl"
    engine = SyncEngine(Config(cpu_blocks=64, block_tokens=B), ex, trace_path=str(path))
    eng = ref.RefEngine(model, kv, engine)
    vocab = model.dims.vocab
    history = [[(31 * c + 7 * k) % (vocab - 10) + 5 for k in range(3 * B + 5)] for c in range(5)]
    stats = []
    for _ in range(3):
        for c, prompt in enumerate(history):
            out, st = eng.generate(prompt, 6)
            stats.append(st)
            history[c] = prompt + out + [7 + c] * 3
    engine.drain(timeout_ms=10_000)
    engine.close()
    return path, stats


def test_explain_counts_what_the_engine_counted(recorded: tuple[Path, list[ref.TurnStats]]) -> None:
    path, stats = recorded
    found = explain(path)
    by_id = {o.request_id: o for o in found.requests}
    assert len(by_id) == len(stats)
    for i, st in enumerate(stats, start=1):
        outcome = by_id[f"req{i}"]
        assert outcome.num_tokens == st.prompt_tokens
        assert outcome.device_hit_blocks == st.device_hit_blocks
        assert outcome.hit_tokens["device"] == st.device_hit_blocks * B
        assert outcome.hit_tokens["cpu"] == st.loaded_blocks * B, i
        assert ("load_failed" in outcome.missed) == st.load_failed, i
    assert any(st.load_failed for st in stats) and any(st.loaded_blocks for st in stats)


def test_what_if_reruns_an_engine_trace(recorded: tuple[Path, list[ref.TurnStats]]) -> None:
    path, stats = recorded
    rerun = what_if(path, {})
    assert rerun["device_hits"] == "as recorded" and rerun["requests"] == len(stats)
    assert rerun["device_hit_tokens"] == sum(st.device_hit_blocks for st in stats) * B
    assert rerun["failed_jobs"] == 0  # (the recorded failures were the executor's: the rerun's copies succeed)
    assert rerun["cpu_hit_tokens"] >= sum(st.loaded_blocks for st in stats) * B
    assert what_if(path, {"cpu_blocks": 64}) == rerun
