"""Planning one direction of a submit: validate each job, merge the good ones, sort by slot.

Pure numpy (no torch, no device): what the copy kernels get is a ``Plan``, the pairs of device
block and host slot of all of a direction's jobs, sorted by slot, with the runs of consecutive
slots among them. Sorting first means a job whose slots are a permutation of a run is one run.
A job that cannot run (bad index, duplicate, clash with an earlier job of the same submit)
fails alone here, before anything is launched: on CUDA an out-of-range index would kill the
context.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvflow.core.errors import one_line
from kvflow.core.jobs import STORE, TransferJob


@dataclass
class Plan:
    """A direction's pairs, sorted by slot, and the runs of consecutive slots among them."""

    jobs: list[TransferJob]
    device_blocks: np.ndarray
    slots: np.ndarray
    owner: np.ndarray  # index into jobs for each pair
    # the list of runs is built only when a copy path walks it: the page kernel moves a
    # scattered batch in one launch from the arrays above, and never needs it
    _runs: list[tuple[int, int, int]] | None = field(default=None, repr=False)

    @property
    def num_runs(self) -> int:
        n = len(self.slots)
        return 0 if n == 0 else 1 + int(np.count_nonzero(np.diff(self.slots) != 1))

    @property
    def runs(self) -> list[tuple[int, int, int]]:
        """(first pair, length, first slot) of each run."""
        if self._runs is None:
            self._runs = slot_runs(self.slots)
        return self._runs


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slot numbers in a sorted array."""
    n = len(slots)
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [(int(a), int(b - a), int(slots[a])) for a, b in zip(starts, ends, strict=True)]


def run_bounds(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first pair, length) of each maximal run of consecutive slots in a sorted array."""
    n = len(slots)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(slots) != 1) + 1))
    return starts, np.diff(np.concatenate((starts, [n])))


def check_job(
    job: TransferJob, num_blocks: int, cpu_blocks: int
) -> tuple[np.ndarray, np.ndarray] | str:
    """The job's index arrays, or why it cannot run (it then fails alone, nothing launched)."""
    if len(job.device_blocks) != len(job.slots):
        return (
            f"job {job.job_id}: {len(job.device_blocks)} device blocks "
            f"but {len(job.slots)} slots"
        )
    count = len(job.slots)
    try:
        dev = np.fromiter(job.device_blocks, dtype=np.int64, count=count)
        slots = np.fromiter(job.slots, dtype=np.int64, count=count)
    except (TypeError, ValueError, OverflowError) as e:
        return f"job {job.job_id}: block ids must be integers ({one_line(e)})"
    if len(dev) == 0:
        return dev, slots
    nb, cb = num_blocks, cpu_blocks
    if dev.min() < 0 or dev.max() >= nb:
        bad = int(dev[(dev < 0) | (dev >= nb)][0])
        return f"job {job.job_id}: device block {bad} out of range [0, {nb})"
    if slots.min() < 0 or slots.max() >= cb:
        bad = int(slots[(slots < 0) | (slots >= cb)][0])
        return f"job {job.job_id}: slot {bad} out of range [0, {cb})"
    key = slots if job.direction == STORE else dev
    if count > 1 and not (key[1:] > key[:-1]).all():  # not strictly increasing: look closer
        ordered = np.sort(key)
        if (ordered[1:] == ordered[:-1]).any():
            what = (
                "a slot appears twice in one store"
                if job.direction == STORE
                else "a device block appears twice in one load"
            )
            return f"job {job.job_id}: {what}"
    return dev, slots


def plan_jobs(
    direction: str,
    jobs: list[TransferJob],
    num_blocks: int,
    cpu_blocks: int,
    fail_now: Callable[[TransferJob, str], None],
) -> Plan | None:
    """Validate and merge a direction's jobs; bad jobs fail now, alone (through ``fail_now``)."""
    whole = _plan_if_all_valid(direction, jobs, num_blocks, cpu_blocks)
    if whole is not None:
        return whole
    return _plan_job_by_job(direction, jobs, num_blocks, cpu_blocks, fail_now)


def _plan_if_all_valid(
    direction: str, jobs: list[TransferJob], num_blocks: int, cpu_blocks: int
) -> Plan | None:
    """The plan when every job is valid, checked for the whole submit at once (a few numpy
    calls instead of a dozen per job: a step of 40 small jobs took 1.5 ms job by job); None
    when any job is not, so that ``_plan_job_by_job`` names the culprits and fails them alone."""
    counts = [len(j.slots) for j in jobs]
    if not jobs or any(len(j.device_blocks) != c for j, c in zip(jobs, counts, strict=True)):
        return None
    total = sum(counts)
    try:
        dev = np.fromiter(itertools.chain.from_iterable(j.device_blocks for j in jobs), np.int64, total)
        slots = np.fromiter(itertools.chain.from_iterable(j.slots for j in jobs), np.int64, total)
    except (TypeError, ValueError, OverflowError):
        return None
    if total and (
        dev.min() < 0 or dev.max() >= num_blocks or slots.min() < 0 or slots.max() >= cpu_blocks
    ):
        return None
    key = np.sort(slots if direction == STORE else dev)
    if total > 1 and (key[1:] == key[:-1]).any():  # a repeat inside a job or across jobs
        return None
    return _by_slot(list(jobs), dev, slots, counts)


def _plan_job_by_job(
    direction: str,
    jobs: list[TransferJob],
    num_blocks: int,
    cpu_blocks: int,
    fail_now: Callable[[TransferJob, str], None],
) -> Plan | None:
    """Check each job in order: a bad one, or one clashing with an earlier kept job, fails."""
    kept: list[TransferJob] = []
    devs: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    taken: set[int] = set()  # slots (store) / device blocks (load) claimed by earlier jobs
    for job in jobs:
        checked = check_job(job, num_blocks, cpu_blocks)
        if isinstance(checked, str):
            fail_now(job, checked)
            continue
        dev, sl = checked
        if len(jobs) > 1:
            keys = (sl if direction == STORE else dev).tolist()
            clash = taken.intersection(keys)
            if clash:
                what = "slot" if direction == STORE else "device block"
                fail_now(
                    job,
                    f"job {job.job_id}: {what} {min(clash)} is also written by "
                    "an earlier job of the same submit",
                )
                continue
            taken.update(keys)
        kept.append(job)
        devs.append(dev)
        slots.append(sl)
    if not kept:
        return None
    return _by_slot(kept, np.concatenate(devs), np.concatenate(slots), [len(d) for d in devs])


def _by_slot(jobs: list[TransferJob], dev: np.ndarray, slots: np.ndarray, counts: list[int]) -> Plan:
    """The plan of these jobs' pairs (in job order, ``counts`` each), sorted by slot."""
    owner = np.repeat(np.arange(len(jobs)), counts)
    if len(slots) > 1 and not (slots[1:] > slots[:-1]).all():
        order = np.argsort(slots, kind="stable")
        dev, slots, owner = dev[order], slots[order], owner[order]
    return Plan(jobs, dev, slots, owner)


def overlaps(store: Plan, load: Plan) -> bool:
    """Do a store and a load of one submit touch the same device blocks or slots?"""
    return bool(
        np.intersect1d(store.device_blocks, load.device_blocks).size
        or np.intersect1d(store.slots, load.slots).size
    )
