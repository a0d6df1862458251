"""The distribution users install: one pure wheel, licensed, typed, with the files it needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # the build backend the dev extra installs (setuptools >= 77): no network needed
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("kvflow-*.whl")
    return path


def test_the_wheel_is_pure_python(wheel: Path) -> None:
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    compiled = [n for n in names if n.endswith((".so", ".pyd", ".c", ".h", ".pyi"))]
    assert compiled == []
    assert "kvflow/py.typed" in names
    assert any(n.startswith("kvflow/core/state/") for n in names) and any(n.startswith("kvflow/inspect/") for n in names)


def test_the_wheel_carries_its_license(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
        license_text = z.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert "Classifier: Typing :: Typed" in meta
    assert "Project-URL: Source," in meta


def test_the_wheel_carries_the_example_workload_and_an_install_runs_it(wheel: Path, tmp_path: Path) -> None:
    example = ROOT / "kvflow" / "simulate" / "example.jsonl"
    with zipfile.ZipFile(wheel) as z:
        assert z.read("kvflow/simulate/example.jsonl") == example.read_bytes()
    # installed (without its dependencies, which this environment has), away from the checkout
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    ran = subprocess.run(
        [sys.executable, "-m", "kvflow", "simulate", "--example", "--cpu-blocks", "256", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert ran.returncode == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["workload"] == str(target / "kvflow" / "simulate" / "example.jsonl")
    assert (summary["requests"], summary["hit_tokens"]) == (200, 865_792)
