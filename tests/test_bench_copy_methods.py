"""tools/bench_copy_methods.py on the CPU device: every method runs its steps, the pages land
where they should, and the CUDA-only method says it cannot run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_copy_methods  # noqa: E402


def test_quick_run_on_the_cpu_device_checks_every_method(tmp_path: Path) -> None:
    out = tmp_path / "methods.md"
    assert bench_copy_methods.main(["--quick", "--reps", "1", "--out", str(out)]) == 0
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ")]
    table = {(r[0].strip(), r[1].strip(), r[2].strip()): [c.strip() for c in r[3:]] for r in rows[1:]}
    geometries = {g for g, _, _ in table}
    assert len(geometries) == 2
    for geometry in geometries:
        for what in ("store", "load", "both"):
            contiguous = table[(geometry, what, "contiguous")]
            assert float(contiguous[0]) > 0 and contiguous[1] == "1.00"
            for method in ("kvflow", "copy_ loop"):
                gbps, fraction, slowdown, checked = table[(geometry, what, method)]
                assert float(gbps) > 0 and float(fraction) > 0
                assert slowdown == "n/a" and checked == "yes"  # (no decode on the CPU device)
            batch = table[(geometry, what, "cuMemcpyBatchAsync n/a (CUDA only)")]
            assert batch == ["n/a", "n/a", "n/a", "-"]
