"""The trace writer's own thread (auto_flush): the same bytes as a writer whose owner writes for
it, everything on disk when flush() returns, and a failed write raised in the engine's thread."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from core_helpers import mixed_run

from kvflow.core.config import Config
from kvflow.engine.manager import OffloadManager
from kvflow.log.reader import TraceReader
from kvflow.log.writer import TraceWriter
from kvflow.replay.fold import replay

CONFIG = Config(cpu_blocks=24, block_tokens=16)


def run(manager: OffloadManager, requests: int, after: Callable[[], None] = lambda: None) -> None:
    mixed_run(manager, requests, seed=7, after=after)


@pytest.mark.parametrize("flush_records", [1, 7, 4096])
def test_the_worker_writes_what_the_caller_would(tmp_path: Path, flush_records: int) -> None:
    threaded, inline = tmp_path / "threaded.jsonl", tmp_path / "inline.jsonl"
    writer = TraceWriter(threaded, CONFIG, checkpoint_every=9, flush_records=flush_records)
    manager = OffloadManager(CONFIG, log=writer)
    run(manager, 60)
    manager.close()
    by_hand = TraceWriter(inline, CONFIG, checkpoint_every=9, auto_flush=False)
    manager = OffloadManager(CONFIG, log=by_hand)
    run(manager, 60, after=lambda: by_hand.write_bytes(by_hand.take_pending()))
    manager.close()
    assert threaded.read_bytes() == inline.read_bytes()
    result = replay(threaded)
    assert result.ok and result.checkpoints > 5 and not result.warnings, result.divergence


def test_everything_recorded_is_in_the_file_when_flush_returns(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, CONFIG, checkpoint_every=5)
    manager = OffloadManager(CONFIG, log=writer)
    run(manager, 30)
    writer.checkpoint(manager.state)
    writer.flush()
    # read while the writer is open: its last line is the checkpoint
    with TraceReader(path) as reader:
        records = [record for _, record in reader.records()]
    assert reader.mismatch is None and reader.unverified == 0
    assert type(records[-1]).__name__ == "Checkpoint" and records[-1].seq == manager.state.last_seq
    manager.close()


def test_a_failed_write_is_raised_in_the_engines_thread_and_close_returns(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, CONFIG, flush_records=3)

    def disk_full(blob: bytes) -> None:
        raise OSError(28, "No space left on device")

    writer.write_bytes = disk_full  # type: ignore[method-assign]
    manager = OffloadManager(CONFIG, log=writer)
    with pytest.raises(OSError, match="No space left"):
        run(manager, 30)
        writer.flush()
    with pytest.raises(OSError, match="No space left"):
        writer.close()
    assert writer.closed
