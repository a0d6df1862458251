"""The debugging verbs cost what the trace holds, not what its header says the tier could hold:
a golden trace whose header claims a tier of ten million blocks (every event still folds: a
bigger tier hands out the same slots while it has room) is read, folded and searched with about
the memory of the trace as recorded. Bounded by counting bytes (tracemalloc), not by timing."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvflow.inspect.history import Selector, inspect_trace
from kvflow.inspect.incidents import find_incidents
from kvflow.replay.fold import replay

TRACES = Path(__file__).resolve().parents[2] / "traces"
HUGE = 10_000_000


def with_tier(tmp_path: Path, name: str, cpu_blocks: int) -> Path:
    lines = (TRACES / name).read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["config"]["cpu_blocks"] = cpu_blocks
    path = tmp_path / f"{cpu_blocks}-{name}"
    path.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(lines[1:]))
    return path


def peak_bytes(run: Callable[[], Any]) -> tuple[int, Any]:
    tracemalloc.start()
    try:
        out = run()
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


VERBS: dict[str, Callable[[Path], Any]] = {
    "incidents": lambda p: [i.to_dict() for i in find_incidents(p).incidents],
    "inspect --slot": lambda p: [h.text for h in inspect_trace(p, Selector(slot=3)).history],
    "inspect --block --at": lambda p: inspect_trace(p, Selector(block=1), at=200).focus,
    "inspect --at": lambda p: inspect_trace(p, at=300).state,
    "replay": lambda p: (replay(p).events, replay(p).state.num_resident()),
}


@pytest.mark.parametrize("name", ["store_failures.jsonl", "timeouts.jsonl", "reset_inflight.jsonl"])
@pytest.mark.parametrize("verb", list(VERBS))
def test_a_verb_on_a_trace_claiming_a_huge_tier_costs_what_the_trace_holds(
    tmp_path: Path, name: str, verb: str
) -> None:
    as_recorded = with_tier(tmp_path, name, json.loads((TRACES / name).read_bytes().splitlines()[0])["config"]["cpu_blocks"])
    huge = with_tier(tmp_path, name, HUGE)
    small_peak, small_out = peak_bytes(lambda: VERBS[verb](as_recorded))
    huge_peak, huge_out = peak_bytes(lambda: VERBS[verb](huge))
    # (a list of the free slots alone would be 80 MB; one set of them, built per incident, more)
    assert huge_peak < small_peak + (2 << 20), (verb, small_peak, huge_peak)
    if verb != "inspect --at":  # (the state's own view names its capacity)
        assert huge_out == small_out or verb == "replay"


def test_the_slot_owner_is_found_among_the_blocks_admitted_to_it(tmp_path: Path) -> None:
    """``inspect --slot`` names the block that owns the slot, asked of the state, not found by a
    scan of every entry: the same answers at the recorded size and at ten million blocks."""
    path = TRACES / "store_failures.jsonl"
    recorded = inspect_trace(path, Selector(slot=5), at=400)
    huge = inspect_trace(with_tier(tmp_path, "store_failures.jsonl", HUGE), Selector(slot=5), at=400)
    assert recorded.focus is not None and recorded.focus["owner"] == "block"
    assert huge.focus == recorded.focus
    assert [h.change for h in huge.history] == [h.change for h in recorded.history]
    assert any(h.change and "->" in h.change for h in recorded.history)


@pytest.mark.parametrize("verb", list(VERBS))
def test_no_verb_walks_the_tiers_slots(tmp_path: Path, verb: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The free slots are walked one by one only for the whole-state digest of traces before
    version 4: no verb on a current trace does, so none costs the tier's capacity."""
    from kvflow.core.state.slots import FreeSlots

    def walked(self: FreeSlots) -> Any:
        raise AssertionError(f"walked {len(self):,} free slots")

    monkeypatch.setattr(FreeSlots, "__iter__", walked)
    VERBS[verb](with_tier(tmp_path, "reset_inflight.jsonl", HUGE))
