"""Every failure the Hypothesis machines found (from the git history), replayed step by step
through the machine that found it: its own rules with their draws scripted, and every one of
its invariants after each step. They run on every test run, whatever the profile draws.

* Two in-flight loads of one resident block share its slot; a reset fenced the slot
  once, so the first abandoned report freed it and the second raised ``KeyError`` out of
  evolve (found by test_stateful's machine; fixed in c77df30; also the plain test
  test_scenarios.py::test_F15_a_slot_two_abandoned_loads_read_is_freed_when_both_report).
* A load naming one block twice (so one slot twice) at a reset: its report raised
  ``KeyError`` when its fenced slot was released (test_stateful's machine; fixed in 04941c7;
  test_scenarios.py::test_F15_a_load_reading_one_slot_twice_frees_it_once_after_a_reset).
* A rank repeating its success for a job another rank still copies: decide yielded
  ``LateResultIgnored``, which evolve refused for a live job, so ``IllegalTransition``
  escaped (test_stateful's two-rank machine; fixed in c77df30;
  test_failure_rules.py::test_F2_repeated_rank_result_for_a_live_job_is_recorded_and_ignored).
* A store "deduplicated" onto a device block still copied by a store a reset abandoned, so
  the new job took over blocks the old copy still wrote (the machines, then run as twins of a
  live and a paranoid manager; fixed in d4d2fd6;
  test_scenarios.py::test_F15_a_store_cannot_reuse_a_device_block_an_abandoned_copy_still_reads).

The machines reach these cases again on their own (a repeated hash anywhere in a prefix,
lookups that mostly hit and loads that mostly run, a reset whenever loads share a slot, a rule
for repeated successes, stores naming a fenced job's block): in 1,000 derandomized examples the
two-rank machine reset 52 times while two loads shared a slot and 7 times while one load read
a slot twice, repeated 38 successes and named a fenced job's block twice. These replays make
sure each case runs every time, whatever the profile draws.
"""

from __future__ import annotations

from typing import Any

from test_stateful import OffloadMachine, OffloadMachineTwoRanks

from kvflow.core.events import BlocksEvicted, LateResultIgnored


class Draws:
    """Stands in for Hypothesis's ``st.data()``: each draw takes the next value scripted
    under its label (a draw the script does not expect fails the replay)."""

    def __init__(self, **values: list[Any]) -> None:
        self.values = {label.replace("_", " "): list(v) for label, v in values.items()}

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        assert label in self.values and self.values[label], f"unscripted draw {label!r}"
        return self.values[label].pop(0)

    def used_up(self) -> bool:
        return not any(self.values.values())


def replay(machine: Any, steps: list[tuple[str, dict[str, Any]]]) -> None:
    """Run ``steps`` (rule name, arguments) on ``machine`` as Hypothesis would: every
    invariant after each step, the teardown at the end; every scripted draw must be used."""
    try:
        for rule, arguments in steps:
            getattr(machine, rule)(**arguments)
            for invariant in machine.invariants:
                invariant.function(machine)
            data = arguments.get("data")
            assert data is None or data.used_up(), f"{rule}: draws left over {data.values}"
    finally:
        machine.teardown()


def lookup_and_accept(hashes: list[int], extra_tokens: int, accepted: int, **draws: list[Any]) -> tuple[str, dict[str, Any]]:
    data = Draws(aim_at_resident_blocks=[False], device_hit_blocks=[0], accept_at_once=[True], accepted=[accepted], **draws)
    return ("lookup", {"data": data, "hashes": hashes, "extra_tokens": extra_tokens})


def report(job: int, rank: int = 0, ok: int = 1) -> tuple[str, dict[str, Any]]:
    return ("job_result", {"data": Draws(job=[job], rank=[rank]), "ok": ok})


def test_F15_two_loads_of_one_block_abandoned_by_a_reset_free_its_slot_only_when_both_reported() -> None:
    machine = OffloadMachine()
    replay(
        machine,
        [
            ("warm_tier", {"hashes": [1]}),  # job 1
            lookup_and_accept([1, 2], 1, 1, repeat_a_hash=[1]),  # job 2 reads block 1's slot
            lookup_and_accept([1, 2], 1, 1, existing_request=[False], repeat_a_hash=[1]),  # job 3 too
            ("plan_step", {}),
            ("reset", {"go": 0}),
        ],
    )
    state = machine.m.state
    assert state.jobs[2].slots == state.jobs[3].slots and state.jobs[2].abandoned and state.jobs[3].abandoned
    (slot,) = state.jobs[2].slots
    replay(machine, [report(2)])
    assert slot not in state.free_slots  # job 3 still reads it
    replay(machine, [report(3)])
    assert slot in state.free_slots and not state.jobs


def test_F15_a_load_reading_one_slot_twice_abandoned_by_a_reset_frees_it_once() -> None:
    machine = OffloadMachine()
    replay(
        machine,
        [
            ("warm_tier", {"hashes": [1]}),
            # [1, 2] with block 1 repeated: the prefix [1, 1, 2], both 1s within the hit cap
            lookup_and_accept([1, 2], 4, 2, repeat_a_hash=[0], repeated_position=[0]),
            ("plan_step", {}),
            ("reset", {"go": 0}),
        ],
    )
    state = machine.m.state
    (slot, again) = state.jobs[2].slots
    assert slot == again and state.jobs[2].abandoned
    replay(machine, [report(2)])
    assert slot in state.free_slots and list(state.free_slots).count(slot) == 1


def test_F2_a_rank_repeating_its_success_while_another_copies_changes_nothing() -> None:
    machine = OffloadMachineTwoRanks()
    replay(
        machine,
        [
            ("warm_tier", {"hashes": [1]}),
            lookup_and_accept([1, 2], 1, 1, repeat_a_hash=[1]),  # load job 2
            ("plan_step", {}),
            report(2, rank=0),
            ("repeated_success", {"data": Draws(job=[2], rank=[0])}),
        ],
    )
    assert isinstance(machine.m.log.events()[-1], LateResultIgnored)
    replay(machine, [report(2, rank=1)])
    assert not machine.m.state.jobs


def test_F15_a_store_never_takes_a_device_block_a_reset_abandoned_copy_still_reads() -> None:
    machine = OffloadMachine()
    store = Draws(no_request=[1], existing_request=[False], fenced_block=[0], held_block=[1000])
    replay(
        machine,
        [
            ("blocks_computed", {"data": Draws(no_request=[1]), "hashes": [3]}),  # job 1, device block 1000
            ("plan_step", {}),
            ("reset", {"go": 0}),
            # the same hash from the same device block: refused (BlockHeld), not a duplicate
            ("blocks_computed", {"data": store, "hashes": [3]}),
        ],
    )
    state = machine.m.state
    assert state.held == {1000: 1} and state.jobs[1].abandoned and state.last_job_id == 1
    replay(machine, [report(1)])
    assert not state.held and not any(isinstance(e, BlocksEvicted) for e in machine.m.log.events())
