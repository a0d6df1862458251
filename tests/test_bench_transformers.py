"""tools/bench_transformers.py on the CPU (``--tiny``): a Mooncake-format trace becomes chats of
fixed token ids, the arms run over them (transformers' swap pool needs CUDA: it is skipped), the
table names every arm and the outputs are token-exact; a bad trace is refused in one line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

if not os.environ.get("KVFLOW_REQUIRE_TRANSFORMERS"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("psutil")  # (transformers sizes its cache on the CPU device with it)
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_transformers as bench  # noqa: E402


def write_trace(path: Path) -> Path:
    """Four conversations of three turns; each turn extends the previous one's hash ids."""
    lines = []
    for c in range(4):
        ids = [1000 * c + i for i in range(3)]
        for t in range(3):
            ids = ids + [1000 * c + 100 + 10 * t + i for i in range(2)]
            lines.append({"timestamp": 10 * len(lines), "input_length": 512 * len(ids) - 100, "output_length": 200, "hash_ids": ids})
    lines.append({"timestamp": 999, "input_length": 5, "output_length": 1, "hash_ids": [77777]})  # alone: no chat
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_turns_share_the_tokens_of_their_shared_hash_ids(tmp_path: Path) -> None:
    chats = bench.read_conversations(str(write_trace(tmp_path / "w.jsonl")), 10, 2, 16, 8, 512)
    assert len(chats) == 4 and [len(c) for c in chats] == [2, 2, 2, 2]
    first, second = chats[0]
    # the trace's lengths scaled by 16 / 512, rounded up: (5 * 512 - 100) tokens -> 77
    assert len(first.prompt) == 77 and len(second.prompt) == 109 and first.max_new == 7
    assert second.prompt[:77] == first.prompt  # the shared hash ids, the same tokens
    assert bench.tokens_of(3, 16, 512) == bench.tokens_of(3, 16, 512) != bench.tokens_of(4, 16, 512)


def test_the_tiny_run_prints_every_arm_token_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "figures.json"
    try:
        code = bench.main([str(write_trace(tmp_path / "w.jsonl")), "--tiny", "--tokens-per-id", "16", "--exact",
                           "--trace-out", str(tmp_path / "t.jsonl"), "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "transformers: skipped" in printed and "token-exact across arms" in printed
    figures = {f["arm"]: f for f in json.loads(out.read_text())}
    assert set(figures) == {"none", "kvflow"}
    assert figures["kvflow"]["tier_hit_tokens"] > 0 and figures["none"]["tier_hit_tokens"] == 0
    assert figures["kvflow"]["leaks"] == [] and figures["kvflow"]["outputs"] == figures["none"]["outputs"]
    assert (tmp_path / "t.jsonl").stat().st_size > 0


def test_a_bad_trace_is_refused_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1, 2]}\n')
    with pytest.raises(SystemExit) as refused:
        bench.main([str(bad), "--tiny"])
    assert str(refused.value).startswith(f"{bad}:1: field 'hash_ids'") and "\n" not in str(refused.value)
