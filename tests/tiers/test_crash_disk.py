"""tools/crash_disk.py: a writer killed a few times; every restart is warm and no recovered
entry is served with bytes other than its own (CI runs a few kills; the tool's own note asks for
a hundred)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xxhash")
pytest.importorskip("numpy")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import crash_disk  # noqa: E402

from kvflow.core.names import name_of  # noqa: E402
from kvflow.tiers.disk_file import DiskEntryFile  # noqa: E402


def test_F22_a_killed_writer_never_leaves_a_wrong_entry(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "crash_disk.py"), "--kills", "4", "--dir", str(tmp_path / "tier"),
         "--seed", "7", "--max-delay-ms", "150"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.splitlines()[-1]
    found = re.fullmatch(r"crash_disk: kills 4, restarts 4, entries recovered (\d+), served wrongly 0", last)
    assert found, last
    assert re.search(r"warm \(the journal replayed\)\s+4$", done.stdout, re.M), done.stdout


def test_the_check_finds_an_entry_that_breaks_the_rule(tmp_path: Path) -> None:
    layout = crash_disk.layout_of(4)
    host = crash_disk.HostPages(layout)
    with DiskEntryFile(tmp_path / "tier", codec=crash_disk.codec_of(layout), slots=4) as tier:
        good = crash_disk.payload_of(11, layout.payload_bytes)
        assert tier.store([(0, name_of(11), host.put(good))]) == [None]
        assert tier.store([(1, name_of(12), host.put(good))]) == [None]  # block 12 holding block 11's bytes
    note, recovered, wrong, misses = crash_disk.check(tmp_path / "tier", 4, 4)
    assert (note, recovered, wrong, misses) == ("warm: 2 entries recovered from the journal", 2, 1, {})
