"""The ``kvflow replay`` verb: fold a trace, check it, and render the verdict or the divergence.

The checking itself is ``kvflow.replay.fold``'s; this module only turns its result into text, JSON and
an exit status (0 consistent, 1 divergence or violation, 2 unreadable).
"""

from __future__ import annotations

import json
from typing import Any

import click

from kvflow.cli.common import (
    EXIT_FOUND,
    EXIT_OK,
    exit_with,
    print_json,
    seq_option,
    trace_argument,
    user_errors,
    warn,
)


@click.command()
@trace_argument
@seq_option("--until", "Stop after this seq.")
@click.option("--redecide", is_flag=True, help="Re-run the commands through today's decisions.")
@click.option("--strict", is_flag=True, help="Check every invariant after every event (slow).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def replay(trace: str, until: int | None, redecide: bool, strict: bool, as_json: bool) -> None:
    """Fold TRACE's events, checking invariants and every checkpoint digest.

    Exit 0 consistent, 1 at the first divergence or violation, 2 unreadable.
    """
    from kvflow.replay.fold import replay as run_replay
    from kvflow.replay.fold import repro_command

    with user_errors():
        result = run_replay(trace, until=until, redecide=redecide, strict=strict)
    for warning in result.warnings:
        warn(warning)
    divergence = result.divergence
    repro = None
    if divergence is not None:
        repro = repro_command(trace, divergence, redecide, strict)
    if as_json:
        data = result.to_dict()
        data["repro"] = repro
        print_json(data)
    elif divergence is None:
        _print_replay_summary(result.path, result, until)
    else:
        _print_divergence(result.path, result, repro or "")
    exit_with(EXIT_OK if divergence is None else EXIT_FOUND)


def _print_replay_summary(trace: str, result: Any, until: int | None) -> None:
    state = result.state
    how = (
        "every event re-decided identically by today's code"
        if result.redecided
        else "events fold, invariants and checkpoints hold"
    )
    upto = "" if result.stopped_at is None else f" up to seq {result.stopped_at}"
    click.echo(f"{trace}: consistent{upto} ({how})")
    if result.stopped_at is not None:
        why = f"--until {until}" if until is not None else "the trace is cut short"
        click.echo(f"  stopped at     seq {result.stopped_at} ({why})")
    click.echo(f"  events         {result.events}")
    click.echo(f"  commands       {result.commands}")
    click.echo(f"  checkpoints    {result.checkpoints} verified")
    click.echo(f"  final state    seq {state.last_seq}, digest {state.digest()}")
    click.echo(
        f"  tier           {state.num_resident()} resident blocks, {len(state.free_slots)} free "
        f"slots of {state.capacity}, {len(state.jobs)} live job{'' if len(state.jobs) == 1 else 's'}"
    )


def _print_divergence(trace: str, result: Any, repro: str) -> None:
    from kvflow.inspect.render import describe, to_builtins

    d = result.divergence
    where = f" ({trace}:{d.line})" if d.line is not None else ""
    click.echo(f"{trace}: DIVERGENCE ({d.kind}) at seq {d.seq}{where}")
    click.echo(f"  {d.message}")
    if d.command is not None:
        click.echo(f"  command    {describe(d.command)}")
        click.echo(f"             {json.dumps(to_builtins(d.command))}")
    sides = [("recorded", d.recorded)] if d.kind in ("redecide", "illegal") else []
    if d.kind == "redecide":
        sides.append(("produced", d.produced))  # a plain fold decides nothing to compare
    for label, event in sides:
        if event is None:
            click.echo(f"  {label:<10} (none)")
        else:
            click.echo(f"  {label:<10} {describe(event)}")
            click.echo(f"             {json.dumps(to_builtins(event))}")
    digest_before = d.digest_before
    if digest_before is None and d.kind == "illegal":
        digest_before = result.state.digest()  # an illegal event changes nothing
    if digest_before is not None:
        click.echo(f"  digest     before seq {d.seq}: {digest_before}")
    if d.kind == "checkpoint" and d.digest_recorded is not None:
        click.echo(f"  digest     recorded in the trace: {d.digest_recorded}")
        click.echo(f"  digest     replay computed:       {d.digest_produced}")
    elif d.digest_recorded is not None or d.digest_produced is not None:
        click.echo(f"  digest     after the recorded event: {d.digest_recorded or '-'}")
        click.echo(f"  digest     after today's event:      {d.digest_produced or '-'}")
    checkpoints = f"{result.checkpoints} checkpoint{'' if result.checkpoints == 1 else 's'}"
    click.echo(f"  events     {result.events} applied before it, {checkpoints} verified")
    click.echo(f"  reproduce  {repro}")
