"""The state machine of the CPU tier: its tables, its data, ``evolve``, invariants, digest.

Everything here is pure: no I/O, no clock, no randomness, no logging (a test enforces it).

- ``tables``: the block and job lifecycle tables, the machine itself;
- ``model``: ``State`` (entries column-wise, live jobs, requests, the policy) and its queries;
- ``legality`` / ``apply``: ``evolve`` applies one event, reading every next state from the tables;
- ``invariants``: the structural rules checked at checkpoints and by the tests;
- ``digest``: the deterministic state digest that traces carry.
"""

from kvflow.errors import IllegalTransition
from kvflow.state.apply import evolve, fold
from kvflow.state.invariants import check_invariants
from kvflow.state.model import EntriesView, Entry, Job, Request, State
from kvflow.state.tables import (
    ABSENT,
    BLOCK_TRANSITIONS,
    JOB_TRANSITIONS,
    LIVE_JOB_STATES,
    RESIDENT,
    STORE_QUEUED,
    STORING,
    TERMINAL_JOB_STATES,
    BlockState,
    JobState,
)

__all__ = [
    "ABSENT",
    "BLOCK_TRANSITIONS",
    "JOB_TRANSITIONS",
    "LIVE_JOB_STATES",
    "RESIDENT",
    "STORE_QUEUED",
    "STORING",
    "TERMINAL_JOB_STATES",
    "BlockState",
    "EntriesView",
    "Entry",
    "IllegalTransition",
    "Job",
    "JobState",
    "Request",
    "State",
    "check_invariants",
    "evolve",
    "fold",
]
