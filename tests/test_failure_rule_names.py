"""The failure rules and their tests stay in step with docs/failure-rules.md.

Every rule has tests named ``test_F<n>_...`` (so ``pytest -k F15`` runs F15's), spelled one way;
the page has a section per rule naming its tests as ``path::name``; every test it names exists
under that name in that file and belongs to that rule, and every ``test_F<n>_`` test of the suite
is named under its rule. The engine names the page uses (``StepReport.x``, ``Counters.x``, ...)
exist.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "failure-rules.md"
RULES = tuple(range(1, 23))
RULE_TEST = re.compile(r"test_F(\d+)_\w+")
NAMED = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


@functools.cache
def collected_tests() -> dict[str, frozenset[str]]:
    """The tests pytest collects, by file (relative to the repository): module-level functions
    named ``test*`` and the ``test*`` methods of ``Test*`` classes, in ``test_*.py`` files."""
    found: dict[str, frozenset[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                names.update(
                    n.name
                    for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
                )
        found[path.relative_to(REPO).as_posix()] = frozenset(names)
    return found


def rule_tests(tests: dict[str, frozenset[str]]) -> dict[int, set[str]]:
    """``path::name`` of every ``test_F<n>_`` test, by rule."""
    by_rule: dict[int, set[str]] = {}
    for path, names in tests.items():
        for name in names:
            match = RULE_TEST.fullmatch(name)
            if match:
                by_rule.setdefault(int(match.group(1)), set()).add(f"{path}::{name}")
    return by_rule


def doc_sections(text: str) -> dict[int, str]:
    """The text of each ``## F<n> ...`` section of the page, by rule."""
    parts = re.split(r"^## F(\d+)\b.*$", text, flags=re.M)
    return {int(number): body for number, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_every_rule_has_tests_named_for_it_spelled_one_way() -> None:
    tests = collected_tests()
    by_rule = rule_tests(tests)
    assert [n for n in RULES if not by_rule.get(n)] == []
    assert set(by_rule) <= set(RULES), f"tests of rules that do not exist: {sorted(set(by_rule) - set(RULES))}"
    # one spelling: test_F15_..., never test_f15_ or test_F15x
    stray = sorted(
        f"{path}::{name}"
        for path, names in tests.items()
        for name in names
        if re.match(r"test_[Ff]\d", name) and not RULE_TEST.fullmatch(name)
    )
    assert stray == []


def test_the_page_names_each_rules_tests_and_only_real_ones() -> None:
    tests = collected_tests()
    by_rule = rule_tests(tests)
    sections = doc_sections(DOC.read_text(encoding="utf-8"))
    assert sorted(sections) == list(RULES), "one section per rule, each once"
    for rule, body in sections.items():
        named = {f"{path}::{name}" for path, name in NAMED.findall(body)}
        assert named, f"F{rule} names no test"
        missing = sorted(n for n in named if n.split("::")[1] not in tests.get(n.split("::")[0], ()))
        assert missing == [], f"F{rule} names tests that do not exist: {missing}"
        other = sorted(n for n in named if not n.split("::")[1].startswith(f"test_F{rule}_"))
        assert other == [], f"F{rule} names tests of another rule: {other}"
        unlisted = sorted(by_rule.get(rule, set()) - named)
        assert unlisted == [], f"F{rule}'s tests missing from {DOC.name}: {unlisted}"


# (ids that no selector matches: this test is not one of a rule's)
@pytest.mark.parametrize("selector", [*(f"F{n}_" for n in RULES), "F15"], ids=lambda s: s.lower().replace("f", "rule "))
def test_k_selects_one_rules_tests_only(selector: str) -> None:
    """``pytest -k`` matches a substring of the test id, ignoring case: ``F1_`` must not reach
    the tests of F10 to F19, and no test outside a rule may carry a rule's name."""
    rule = int(selector.strip("F_"))
    everything = [f"{p}::{n}" for p, names in collected_tests().items() for n in names]
    picked = sorted(t for t in everything if selector.lower() in t.split("::")[1].lower())
    assert picked and all(t.split("::")[1].startswith(f"test_F{rule}_") for t in picked)


def _attributes(cls: type) -> set[str]:
    names = set(dir(cls))
    names.update(getattr(cls, "__struct_fields__", ()))
    if dataclasses.is_dataclass(cls):
        names.update(f.name for f in dataclasses.fields(cls))
    return names


def test_the_engine_names_the_page_uses_exist() -> None:
    from kvflow.core.commands import JobResult
    from kvflow.core.config import Config
    from kvflow.engine.manager import OffloadManager
    from kvflow.engine.notices import Fence, LoadFailure, StepReport
    from kvflow.engine.watch import Counters

    classes = {
        cls.__name__: cls for cls in (StepReport, Counters, LoadFailure, Fence, Config, JobResult, OffloadManager)
    }
    text = DOC.read_text(encoding="utf-8")
    used = set(re.findall(r"`(" + "|".join(classes) + r")\.(\w+)", text))
    assert used, "the page names no engine field"
    missing = sorted(f"{cls}.{attr}" for cls, attr in used if attr not in _attributes(classes[cls]))
    assert missing == []
