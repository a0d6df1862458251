"""The Hypothesis settings profiles (tests/conftest.py): every property test and state machine
runs as many examples as the active profile says (none sets its own), CI loads the ``ci``
profile (2,000 examples each, derandomized), and neither profile has a deadline."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import unittest
from collections.abc import Iterator
from pathlib import Path

from conftest import CI_EXAMPLES
from hypothesis import settings

TESTS = Path(__file__).resolve().parent


def hypothesis_tests() -> Iterator[tuple[str, settings]]:
    """(name, settings) of every @given test and every machine's TestCase under tests/."""
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.stem == Path(__file__).stem or "hypothesis" not in path.read_text():
            continue
        if str(path.parent) not in sys.path:  # (as pytest imports a test module: by its folder)
            sys.path.insert(0, str(path.parent))
        module = importlib.import_module(path.stem)
        for name, obj in vars(module).items():
            if callable(obj) and hasattr(obj, "hypothesis"):
                yield f"{path.stem}::{name}", obj._hypothesis_internal_use_settings
            elif isinstance(obj, type) and issubclass(obj, unittest.TestCase) and hasattr(obj, "settings"):
                if getattr(obj, "__module__", None) == "hypothesis.stateful" and name.startswith("Test"):
                    yield f"{path.stem}::{name}", obj.settings


def test_every_hypothesis_test_runs_the_profile_s_number_of_examples() -> None:
    found = dict(hypothesis_tests())
    # the machines of test_stateful and test_policies, and the @given tests
    assert len(found) >= 12, sorted(found)
    profile = settings.default
    assert profile is not None
    wrong = {name: s.max_examples for name, s in found.items() if s.max_examples != profile.max_examples}
    assert wrong == {}, f"set their own max_examples (the profile says {profile.max_examples})"
    assert all(s.deadline is None for s in found.values())


def test_ci_loads_the_ci_profile_with_2000_examples_derandomized() -> None:
    probe = (
        "import conftest; from hypothesis import settings; s = settings.default; "
        "print(settings.get_current_profile_name(), s.max_examples, s.derandomize, s.deadline)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KVFLOW_HYPOTHESIS_PROFILE")}
    runs = {}
    for extra in ({}, {"CI": "true"}):
        out = subprocess.run(
            [sys.executable, "-c", probe], cwd=TESTS, env={**env, **extra}, capture_output=True, text=True, check=True
        )
        runs[bool(extra)] = out.stdout.split()
    assert runs[True] == ["ci", str(CI_EXAMPLES), "True", "None"]
    assert CI_EXAMPLES >= 2000
    assert runs[False][0] == "dev" and int(runs[False][1]) < CI_EXAMPLES and runs[False][2:] == ["False", "None"]
