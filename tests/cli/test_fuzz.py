"""``tools/fuzz.py``: a few hundred seeded inputs give no traceback and no hang, and the fuzzer
itself tells a traceback and a hang apart from a one-line error and says how to reproduce it."""

from __future__ import annotations

import importlib.util
import io
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_fuzz() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvflow_fuzz_tool", REPO / "tools" / "fuzz.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzz()


def test_a_few_hundred_seeded_inputs_give_no_traceback_and_no_hang() -> None:
    # (a hang is each input's own timeout; no wall-time bound on the whole run: a slower CI
    # machine must not fail a test that checks behaviour)
    summary = fuzz.fuzz(400, seed=20261123, jobs=2, timeout=10.0)
    out = io.StringIO()
    fuzz.report(summary, out)
    assert summary.inputs == 400 and not summary.broken, out.getvalue()
    assert summary.tracebacks == [] and summary.hangs == [], out.getvalue()
    runs = {verb: counts["runs"] for verb, counts in summary.runs.items()}
    assert set(runs) == set(fuzz.VERBS) and min(runs.values()) > 20, runs
    # the inputs reach every outcome: read fine, diverge, refused with one line
    total = sum((c for c in summary.runs.values()), start=fuzz.Counter())
    assert total["exit 0"] > 100 and total["exit 1"] > 20 and total["exit 2"] > 100, total


def test_inputs_are_deterministic() -> None:
    for index in (0, 1, 17, 999):
        a, b = fuzz.make_input(5, index), fuzz.make_input(5, index)
        assert (a.data, a.suffix, a.mutations, a.verbs) == (b.data, b.suffix, b.mutations, b.verbs)
    assert fuzz.make_input(5, 3).data != fuzz.make_input(6, 3).data or fuzz.make_input(5, 3).mutations != fuzz.make_input(6, 3).mutations


def test_every_mutation_kind_is_drawn() -> None:
    kinds = {m.split(":")[0] for i in range(600) for m in fuzz.make_input(1, i).mutations}
    names = {f.__name__[2:] for f, _ in fuzz.MUTATIONS}
    assert names <= kinds and "special /dev/zero" in kinds
    assert any(k.startswith("gzip") for k in kinds)


def test_a_traceback_and_a_hang_are_found_and_reproducible(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug in one verb and a planted hang in another (the workers are forked, so they
    inherit the patches)."""
    import kvflow.inspect.incidents
    import kvflow.integrations.vllm.kv_events

    def broken(*_args: object, **_kwargs: object) -> None:
        raise ZeroDivisionError("planted")

    def stuck(*_args: object, **_kwargs: object) -> None:
        time.sleep(30)

    monkeypatch.setattr(kvflow.inspect.incidents, "find_incidents", broken)
    monkeypatch.setattr(kvflow.integrations.vllm.kv_events.KVEventPublisher, "__call__", stuck)
    index = next(i for i in range(100) if fuzz.make_input(3, i).kind == "trace"
                 and fuzz.make_input(3, i).special is None)
    summary = fuzz.fuzz(1, seed=3, start=index, jobs=1, timeout=1.0)
    out = io.StringIO()
    fuzz.report(summary, out)
    text = out.getvalue()
    tracebacks, hangs = summary.tracebacks, summary.hangs
    # incidents always reaches find_incidents; kv-events reaches its publisher when an event reads
    assert [o.verb for o in tracebacks] == ["incidents"], text
    assert "ZeroDivisionError" in tracebacks[0].where and "planted" in tracebacks[0].detail
    assert f"python tools/fuzz.py --seed 3 --only {index} --verb \"incidents\"" in text
    assert all(o.verb == "kv-events" for o in hangs)
    assert "tracebacks: 1," in text


def test_reproduce_runs_one_input_and_can_write_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    written = tmp_path / "input.jsonl"
    index = next(i for i in range(100) if fuzz.make_input(1, i).special is None)
    assert fuzz.main(["--seed", "1", "--only", str(index), "--write", str(written)]) == 0
    assert written.read_bytes() == fuzz.make_input(1, index).data
    out = capsys.readouterr().out
    assert f"input {index} of seed 1" in out and "kvflow " in out
