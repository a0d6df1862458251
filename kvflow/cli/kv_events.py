"""The ``kvflow kv-events`` verb: a trace's events as the vLLM-compatible KV events they imply
(``kvflow.integrations.vllm.kv_events`` does the mapping), one JSON line each.
"""

from __future__ import annotations

import sys

import click

from kvflow.cli.common import seq_option, trace_argument, user_errors, warn


@click.command("kv-events")
@trace_argument
@seq_option("--until", "Stop after this seq.")
def kv_events_command(trace: str, until: int | None) -> None:
    """The vLLM-compatible KV events (BlockStored / BlockRemoved / AllBlocksCleared, medium
    CPU) that TRACE's events imply, as JSON lines."""
    from typing import cast

    import msgspec

    from kvflow.core.events import EVENT_TYPES, Event
    from kvflow.integrations.vllm.kv_events import KVEventPublisher
    from kvflow.log.reader import TraceReader

    encoder = msgspec.json.Encoder()
    out = sys.stdout
    with user_errors():
        reader = TraceReader(trace)
        with reader:
            publisher = KVEventPublisher(reader.config.block_tokens)  # (one for the whole trace)
            for _, rec in reader.records():
                if not isinstance(rec, EVENT_TYPES):
                    continue
                rec = cast("Event", rec)
                if until is not None and rec.seq > until:
                    break
                publisher(rec)
                for kv in publisher.take():
                    out.write(encoder.encode(kv).decode() + "\n")
        for warning in reader.findings():
            warn(warning)
