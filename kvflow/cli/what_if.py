"""The ``kvflow what-if`` verb: the workload of a trace rerun under another configuration
(``kvflow.simulate.whatif``), both traces explained the same way (``kvflow.inspect.explain``) and
shown side by side."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import click

from kvflow.cli.common import print_json, print_rich, trace_argument, user_errors, warn
from kvflow.cli.simulate import run_options

TOP_CHANGES = 10  # the table lists the requests whose hits changed the most


@click.command("what-if")
@trace_argument
@run_options(as_recorded=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (schema: docs/debugging.md).")
def what_if(trace: str, record: str | None, as_json: bool, **changes: Any) -> None:
    """Rerun the workload TRACE saw (its requests, their blocks, tokens and order, rebuilt from
    the recorded commands) through kvflow's real decision code under another configuration, and
    show its figures beside the recording's, with the requests whose hits changed. Every option
    not given keeps the value the trace recorded."""
    from kvflow.core.errors import TraceError
    from kvflow.inspect.explain import compare
    from kvflow.log.source import STDIN, STDIN_NAME, spool
    from kvflow.simulate.whatif import what_if as rerun

    if changes.get("disk_store") is not None:
        changes["disk_store_mode"] = changes.pop("disk_store").replace("-", "_")
    else:
        changes.pop("disk_store", None)
    shown = trace
    with user_errors(), tempfile.TemporaryDirectory(prefix="kvflow-what-if-") as scratch:
        if trace == STDIN:
            # the trace is read more than once (its options, its workload, the comparison)
            trace = spool(sys.stdin.buffer, scratch)
            shown = STDIN_NAME
        path = record if record is not None else os.path.join(scratch, "what-if.jsonl")
        try:
            summary = rerun(trace, changes, record=path)
            found = compare(trace, path)
        except TraceError as exc:
            if shown != trace:  # (name standard input as every verb does, not the copy of it)
                exc.args = (str(exc).replace(trace, STDIN_NAME),)
            raise
    for warning in found.warnings:
        warn(warning.replace(trace, shown))
    changed = sorted(found.changed, key=lambda c: (-abs(c.delta), c.request_id, c.run))
    out = {
        "trace": shown,
        "recorded": found.recorded.to_dict(),
        "what_if": found.what_if.to_dict(),
        "what_if_config": summary["config"],
        "what_if_mode": summary["mode"],
        "device_hits": summary["device_hits"],
        "requests_changed": len(changed),
        "requests_gained": sum(1 for c in changed if c.delta > 0),
        "requests_lost": sum(1 for c in changed if c.delta < 0),
        "only_recorded": found.only_recorded,
        "only_what_if": found.only_what_if,
        "changed": [c.to_dict() for c in changed],
        "record": record,
    }
    if as_json:
        print_json(out)
        return
    _print(out, changed)
    if record:
        click.echo(f"what-if trace written to {record} (kvflow explain {record} --request ID)")


def _print(out: dict[str, Any], changed: list[Any]) -> None:
    from rich.table import Table

    before, after, cfg = out["recorded"], out["what_if"], out["what_if_config"]
    click.echo(
        f"what-if of {out['trace']}: {after['requests']:,} requests rerun, {cfg['cpu_blocks']:,} CPU blocks, "
        f"policy {cfg['policy']}, {cfg['store']} stores"
        + (f", disk {cfg['disk_blocks']:,} blocks" if cfg.get("disk_blocks") else "")
        + f", device hits {out['device_hits']}, {out['what_if_mode']} mode"
    )
    table = Table(show_header=True, title_justify="left")
    for column in ("metric", "recorded", "what-if", "change"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    prompt_before, prompt_after = before["prompt_tokens"] or 1, after["prompt_tokens"] or 1

    def count(n: int | None) -> str:
        return "-" if n is None else f"{n:,}"

    def change(a: int | None, b: int | None) -> str:
        return "" if a is None or b is None or a == b else f"{b - a:+,}"

    rows: list[tuple[str, Any, Any, str]] = [
        ("requests", before["requests"], after["requests"], ""),
        ("prompt tokens", before["prompt_tokens"], after["prompt_tokens"], ""),
        ("hit tokens", before["hit_tokens"], after["hit_tokens"], "rate"),
        *((f"  {tier}", before["hit_tokens_by_tier"][tier], after["hit_tokens_by_tier"][tier], "rate")
          for tier in before["hit_tokens_by_tier"]),
        ("stored blocks", before["stored_blocks"], after["stored_blocks"], ""),
        ("loaded blocks", before["loaded_blocks"], after["loaded_blocks"], ""),
        ("evicted blocks", before["evicted_blocks"], after["evicted_blocks"], ""),
        ("rejected blocks", before["rejected_blocks"], after["rejected_blocks"], ""),
        ("failed jobs", before["failed_jobs"], after["failed_jobs"], ""),
        ("bytes stored", before["bytes_stored"], after["bytes_stored"], ""),
        ("bytes loaded", before["bytes_loaded"], after["bytes_loaded"], ""),
    ]
    for name, a, b, kind in rows:
        if kind == "rate":
            table.add_row(name, f"{a:,} ({a / prompt_before:.1%})", f"{b:,} ({b / prompt_after:.1%})", change(a, b))
        else:
            table.add_row(name, count(a), count(b), change(a, b))
    print_rich(table)
    click.echo(
        f"{out['requests_changed']:,} requests changed: {out['requests_gained']:,} hit more, "
        f"{out['requests_lost']:,} hit less"
    )
    if changed:
        top = Table(show_header=True, title=f"the {min(TOP_CHANGES, len(changed))} that changed most",
                    title_justify="left")
        for column in ("request", "tokens", "recorded hit tokens", "what-if hit tokens", "change"):
            top.add_column(column, justify="left" if column == "request" else "right")
        for c in changed[:TOP_CHANGES]:
            top.add_row(c.request_id + (f" (run {c.run})" if c.run > 1 else ""), f"{c.num_tokens:,}",
                        f"{sum(c.before.values()):,}", f"{sum(c.after.values()):,}", f"{c.delta:+,}")
        print_rich(top)
