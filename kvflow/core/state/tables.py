"""The lifecycle tables: every legal transition of a CPU-tier entry and of a transfer job.

These two tables *are* the machine (h11's way): ``evolve`` reads every next state from them,
``kvflow diagram`` prints them, and the transition tests walk them, so the three cannot
disagree. An (state, event tag) pair missing from a table is illegal.

Pure data: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from enum import IntEnum


class BlockState(IntEnum):
    ABSENT = 0
    STORE_QUEUED = 1
    STORING = 2
    RESIDENT = 3


class JobState(IntEnum):
    NEW = 0
    QUEUED = 1
    IN_FLIGHT = 2
    COMPLETED = 3
    FAILED = 4
    TIMED_OUT = 5
    # In flight when a reset came (the reset abandoned it): the copy may still be running,
    # so its slots and device blocks stay fenced until every rank reports (F15).
    ABANDONED = 6
    # Outcome decided (timed out, or failed on one rank) while a copy may still run: the
    # engine was told, but its slots and device blocks stay fenced until the copy is over.
    FENCED = 7
    # The fence ended: the job leaves the state.
    LIFTED = 8


ABSENT, STORE_QUEUED, STORING, RESIDENT = (
    BlockState.ABSENT,
    BlockState.STORE_QUEUED,
    BlockState.STORING,
    BlockState.RESIDENT,
)
NEW, QUEUED, IN_FLIGHT, COMPLETED, FAILED, TIMED_OUT, ABANDONED, FENCED, LIFTED = (
    JobState.NEW,
    JobState.QUEUED,
    JobState.IN_FLIGHT,
    JobState.COMPLETED,
    JobState.FAILED,
    JobState.TIMED_OUT,
    JobState.ABANDONED,
    JobState.FENCED,
    JobState.LIFTED,
)

# (state, event tag) -> next state, for one CPU-tier entry named by the event.
# Pins are a counter on a RESIDENT entry (see the pin rules in evolve), not a separate state.
BLOCK_TRANSITIONS: dict[BlockState, dict[str, BlockState]] = {
    ABSENT: {
        "store_queued": STORE_QUEUED,
        "remote_load_queued": STORE_QUEUED,
        "disk_load_queued": STORE_QUEUED,
        "reset": ABSENT,
    },
    STORE_QUEUED: {
        "jobs_submitted": STORING,
        "job_failed": ABSENT,  # cancelled before submission (reset)
        "blocks_touched": STORE_QUEUED,  # remembered until it lands (F14)
    },
    STORING: {
        "blocks_touched": STORING,  # remembered until it lands (F14)
        "job_completed": RESIDENT,
        "job_failed": ABSENT,
        "job_timed_out": ABSENT,
        "reset": ABSENT,  # dropped; its slot stays fenced until the job reports
    },
    RESIDENT: {
        "load_queued": RESIDENT,
        "remote_store_queued": RESIDENT,  # copied to the remote tier, pinned meanwhile
        "disk_store_queued": RESIDENT,  # copied to the disk tier, pinned meanwhile
        "jobs_submitted": RESIDENT,  # its load job was handed to the executor
        "job_completed": RESIDENT,  # a load finished: its pin is released
        "job_failed": RESIDENT,  # a load failed: entry stays, pin released (F1)
        "job_timed_out": RESIDENT,
        "pins_acquired": RESIDENT,
        "pins_released": RESIDENT,
        "blocks_touched": RESIDENT,
        "blocks_corrupt": RESIDENT,  # remembered: evicted when its last pin goes (F17)
        "blocks_evicted": ABSENT,  # only when unpinned
        "reset": ABSENT,
    },
}

# Job tags: an outcome event with ``fenced`` set reads as "<tag>:fenced" (the copy may still
# run, so the job is FENCED rather than gone).
JOB_TRANSITIONS: dict[JobState, dict[str, JobState]] = {
    JobState.NEW: {
        "store_queued": JobState.QUEUED,
        "load_queued": JobState.QUEUED,
        "remote_load_queued": JobState.QUEUED,
        "remote_store_queued": JobState.QUEUED,
        "disk_load_queued": JobState.QUEUED,
        "disk_store_queued": JobState.QUEUED,
    },
    JobState.QUEUED: {
        "jobs_submitted": JobState.IN_FLIGHT,
        "job_failed": JobState.FAILED,  # cancelled by reset before submission
    },
    JobState.IN_FLIGHT: {
        "rank_succeeded": JobState.IN_FLIGHT,
        "job_completed": JobState.COMPLETED,
        "job_failed": JobState.FAILED,
        "job_timed_out": JobState.TIMED_OUT,  # (traces from before fences)
        "job_failed:fenced": JobState.FENCED,  # another rank may still be copying
        "job_timed_out:fenced": JobState.FENCED,
        "reset": JobState.ABANDONED,
        "late_result_ignored": JobState.IN_FLIGHT,  # a rank repeated its success
    },
    # Its end frees the fenced slots and device blocks; nothing becomes visible.
    JobState.ABANDONED: {
        "rank_succeeded": JobState.ABANDONED,
        "job_completed": JobState.COMPLETED,
        "job_failed": JobState.FAILED,
        "job_failed:fenced": JobState.FENCED,
        "job_timed_out": JobState.TIMED_OUT,  # (traces from before fences)
        "late_result_ignored": JobState.ABANDONED,
        "fence_lifted": JobState.LIFTED,  # the executor was closed
        "reset": JobState.ABANDONED,
    },
    JobState.FENCED: {
        "late_result_ignored": JobState.FENCED,  # a rank's copy is over
        "fence_lifted": JobState.LIFTED,
        "reset": JobState.FENCED,  # already out of the tier's bookkeeping; stays fenced
    },
    JobState.COMPLETED: {"late_result_ignored": JobState.COMPLETED},
    JobState.FAILED: {"late_result_ignored": JobState.FAILED},
    JobState.TIMED_OUT: {"late_result_ignored": JobState.TIMED_OUT},
    JobState.LIFTED: {"late_result_ignored": JobState.LIFTED},
}
TERMINAL_JOB_STATES = (JobState.COMPLETED, JobState.FAILED, JobState.TIMED_OUT, JobState.LIFTED)
# States an outcome event may leave a job in: gone, or fenced while its copy may still run.
OUTCOME_JOB_STATES = (JobState.COMPLETED, JobState.FAILED, JobState.TIMED_OUT, JobState.FENCED)
# Jobs whose memory is fenced: their outcome is known, their copy may still run (F15).
FENCE_JOB_STATES = (JobState.ABANDONED, JobState.FENCED)
# Jobs the state keeps (terminal jobs leave it; their events stay in the log).
LIVE_JOB_STATES = (JobState.QUEUED, JobState.IN_FLIGHT, JobState.ABANDONED, JobState.FENCED)
