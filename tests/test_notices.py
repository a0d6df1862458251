"""Notices' truthiness is a flag kept up to date as events are observed (the engine asks at
every step): it must say exactly whether any notice is held."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvflow.events import FenceLifted, JobCompleted, JobFailed, JobTimedOut, Reset, StoreRejected
from kvflow.notices import Notices

DIRECTIONS = ("store", "load", "remote_store", "remote_load")
blocks = st.lists(st.integers(0, 9), max_size=2).map(tuple)


def terminal(kind: type, draw: st.DrawFn) -> object:
    fields = dict(
        seq=1,
        job_id=draw(st.integers(1, 5)),
        direction=draw(st.sampled_from(DIRECTIONS)),
        request_id=draw(st.sampled_from([None, "r1"])),
        hashes=draw(blocks),
        device_blocks=draw(blocks),
        slots=(),
        abandoned=draw(st.booleans()),
        rank=0,
    )
    if kind is JobFailed:
        fields.update(error="x", fenced=draw(st.booleans()))
    elif kind is JobTimedOut:
        del fields["rank"]
        fields.update(now_ms=2.0, deadline_ms=1.0, fenced=draw(st.booleans()))
    return kind(**fields)


def held(notices: Notices) -> bool:
    return any(
        [
            notices.loads_finished,
            notices.loads_failed,
            notices.stores_finished,
            notices.stores_failed,
            notices.released_device_blocks,
            notices.rejected_store_blocks,
            notices.all_blocks_cleared,
        ]
    )


@st.composite
def notice_events(draw: st.DrawFn) -> object:
    kind = draw(st.sampled_from([JobCompleted, JobFailed, JobTimedOut, FenceLifted, StoreRejected, Reset]))
    if kind is FenceLifted:
        return FenceLifted(seq=1, job_id=1, device_blocks=draw(blocks), slots=(), reason="copy over")
    if kind is StoreRejected:
        return StoreRejected(seq=1, request_id=None, hashes=draw(blocks), device_blocks=(), reason="full")
    if kind is Reset:
        return Reset(seq=1, abandoned_job_ids=())
    return terminal(kind, draw)


@given(st.lists(notice_events(), max_size=4))
def test_notices_are_true_exactly_when_one_is_held(events: list) -> None:
    notices = Notices()
    for event in events:
        notices.observe(event)
        assert bool(notices) == held(notices), event


def test_every_single_terminal_event_leaves_the_flag_exact() -> None:
    """Every combination of the fields that decide what a job's end tells the engine."""
    for kind, direction, request_id, device_blocks, abandoned, fenced in itertools.product(
        (JobCompleted, JobFailed, JobTimedOut), DIRECTIONS, (None, "r1"), ((), (3,)), (False, True), (False, True)
    ):
        fields = dict(seq=1, job_id=1, direction=direction, request_id=request_id, hashes=(7,),
                      device_blocks=device_blocks, slots=(), abandoned=abandoned)
        if kind is JobCompleted:
            event = JobCompleted(rank=0, **fields)
        elif kind is JobFailed:
            event = JobFailed(rank=0, error="x", fenced=fenced, **fields)
        else:
            event = JobTimedOut(now_ms=2.0, deadline_ms=1.0, fenced=fenced, **fields)
        notices = Notices()
        notices.observe(event)
        assert bool(notices) == held(notices), event
    for event in (
        FenceLifted(seq=1, job_id=1, device_blocks=(), slots=(), reason="copy over"),
        FenceLifted(seq=1, job_id=1, device_blocks=(4,), slots=(), reason="copy over"),
        StoreRejected(seq=1, request_id=None, hashes=(), device_blocks=(), reason="full"),
        StoreRejected(seq=1, request_id=None, hashes=(5,), device_blocks=(), reason="full"),
        Reset(seq=1, abandoned_job_ids=()),
    ):
        notices = Notices()
        notices.observe(event)
        assert bool(notices) == held(notices), event
