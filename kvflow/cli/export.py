"""The ``kvflow export`` verb: a trace's transfer jobs as Chrome trace-event JSON, the format
Perfetto (ui.perfetto.dev) and chrome://tracing open.

One process, one track ("thread") per direction and rank; a complete event (``"ph": "X"``) for
each job on each of its ranks, from its submission to its end on that rank; an instant event
(``"ph": "i"``) for each failure, timeout, cancellation, fence and fence lift; metadata events
(``"ph": "M"``) naming the process and the tracks. Times are the engine's, in microseconds as
the format counts them. Written as the trace is read: what is held does not grow with it.
"""

from __future__ import annotations

import json
from typing import IO, Any

import click

from kvflow.cli.common import output_file, trace_argument, user_errors, warn

PID = 1


@click.command()
@trace_argument
@click.option(
    "--chrome-trace", "chrome_path", metavar="FILE", required=True,
    help="Write the jobs to FILE (- for standard output) as Chrome trace-event JSON (Perfetto, "
    "chrome://tracing).",
)  # fmt: skip
def export(trace: str, chrome_path: str) -> None:
    """TRACE's transfer jobs as Chrome trace-event JSON: a track per direction and rank, a
    slice per job, instants for failures, timeouts and fences."""
    from kvflow.inspect.timeline import follow

    with user_errors():
        with output_file(chrome_path) as out:
            writer = ChromeTraceWriter(out)
            timeline, _ = follow(trace, on_span=writer.span, on_mark=writer.mark)
            writer.close(timeline)
    for warning in timeline.walk.warnings:
        warn(warning)
    if chrome_path == "-":
        return  # (the events went to standard output)
    click.echo(
        f"{timeline.walk.path}: wrote {chrome_path}: {timeline.jobs_ended:,} jobs on "
        f"{len(timeline.tracks)} track{'' if len(timeline.tracks) == 1 else 's'}, "
        f"{sum(timeline.mark_counts.values()):,} marks"
    )


def _us(ms: float | None) -> float:
    return 0.0 if ms is None else round(ms * 1000.0, 3)


class ChromeTraceWriter:
    """Writes trace events as they come, then the metadata and the closing brackets."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.count = 0
        self.world = 1
        out.write('{"displayTimeUnit":"ms","traceEvents":[\n')

    def _event(self, event: dict[str, Any]) -> None:
        self.out.write((",\n" if self.count else "") + json.dumps(event, separators=(",", ":")))
        self.count += 1

    def _tid(self, direction: str, rank: int) -> int:
        from kvflow.inspect.timeline import DIRECTIONS

        d = DIRECTIONS.index(direction) if direction in DIRECTIONS else len(DIRECTIONS)
        return 1 + d * 1024 + rank  # (ranks of one direction side by side, directions in order)

    def span(self, span: Any) -> None:
        start = _us(span.start_ms)
        self._event(
            {
                "name": f"{span.direction} job {span.job_id}",
                "cat": span.direction,
                "ph": "X",
                "ts": start,
                "dur": max(_us(span.end_ms) - start, 0.0),
                "pid": PID,
                "tid": self._tid(span.direction, span.rank),
                "args": {
                    "job": span.job_id,
                    "request": span.request_id,
                    "blocks": span.blocks,
                    "outcome": span.outcome,
                    "start_seq": span.start_seq,
                    "end_seq": span.end_seq,
                },
            }
        )

    def mark(self, mark: Any) -> None:
        self._event(
            {
                "name": f"{mark.kind.replace('_', ' ')}: job {mark.job_id}",
                "cat": mark.kind,
                "ph": "i",
                "s": "t",
                "ts": _us(mark.ms),
                "pid": PID,
                "tid": self._tid(mark.direction, mark.rank),
                "args": {"job": mark.job_id, "seq": mark.seq, "text": mark.text},
            }
        )

    def close(self, timeline: Any) -> None:
        process = f"kvflow {timeline.walk.path}"
        self._event({"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": process}})
        for name in timeline.ordered_tracks():
            direction, _, rank = name.rpartition(" rank ")
            tid = self._tid(direction, int(rank))
            self._event({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}})
            self._event({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid, "args": {"sort_index": tid}})
        self.out.write("\n]}\n")
