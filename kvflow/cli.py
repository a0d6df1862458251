"""The ``kvflow`` command (DESIGN §6): replay, incidents, inspect, diagram (+ simulate).

Start-up is kept short: this module imports only click and the version at load time; the
trace machinery and rich are imported inside the commands that use them, and commands that
live elsewhere are imported only when invoked (``LAZY_COMMANDS``). Torch is never imported.

Exit status: 0 ok; 1 a divergence or violation found (``replay``); 2 bad input. Every bad
input is one line on stderr, ``kvflow: error: <file>:<line>: <message>``, never a traceback.
The analysis itself lives in ``kvflow.inspect`` and ``kvflow.replay``; this file only renders.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

from kvflow._version import __version__

EXIT_OK = 0
EXIT_FOUND = 1  # replay: a divergence or an invariant violation
EXIT_BAD_INPUT = 2

# Commands defined in other modules, imported only when run (or listed by --help):
# name -> "module:attribute".
LAZY_COMMANDS: dict[str, str] = {
    "simulate": "kvflow.simulate_cli:simulate",
}


class KvflowGroup(click.Group):
    """A click group with lazily imported commands and one-line usage errors."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = LAZY_COMMANDS.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module_name, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command

    def main(
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else EXIT_OK
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            _echo_error(f"{exc.format_message()}{hint}")
            code = exc.exit_code
        except click.Abort:
            _echo_error("aborted")
            code = EXIT_FOUND
        except BrokenPipeError:
            # the reader went away (``| head``): stop quietly, and keep Python from
            # complaining again when it flushes stdout at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            code = 1  # as click does
        if standalone_mode:
            sys.exit(code)
        return code


def _echo_error(message: str) -> None:
    click.echo(f"kvflow: error: {' '.join(message.split())}", err=True)


def _warn(message: str) -> None:
    click.echo(f"kvflow: warning: {' '.join(message.split())}", err=True)


def _exit(code: int) -> NoReturn:
    raise click.exceptions.Exit(code)


def _fail(message: str) -> NoReturn:
    _echo_error(message)
    _exit(EXIT_BAD_INPUT)


@contextmanager
def _user_errors() -> Iterator[None]:
    """The CLI boundary: kvflow's own errors and file errors become one line + exit 2."""
    from kvflow.errors import KvflowError

    try:
        yield
    except KvflowError as exc:
        _fail(str(exc))
    except BrokenPipeError:
        # the reader went away (`kvflow kv-events t | head`): not an error of ours
        sys.stderr.close()
        _exit(0)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        _fail(f"{where}{exc.strerror or exc}")


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


def _console() -> Any:
    """A rich console: the terminal's width, or a fixed 140 columns in a pipe or file."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console(highlight=False)
    return Console(width=140, highlight=False, no_color=True)


def _print_rich(renderable: Any) -> None:
    """Print through rich, without the trailing blanks it pads lines with."""
    console = _console()
    with console.capture() as captured:
        console.print(renderable)
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text) if text.strip().lstrip("+-").isdigit() else int(text, 0)
    except ValueError:
        _fail(f"{what} must be a whole number (decimal, or 0x... hex), got {text!r}")


def _version_line() -> str:
    return f"kvflow {__version__}"


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(_version_line())
        ctx.exit()


@click.group(cls=KvflowGroup, invoke_without_command=True)
@click.option(
    "--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
    help="Show the version and exit.",
)
@click.pass_context
def main(ctx: click.Context) -> None:
    """kvflow: event-sourced KV-cache offload. Replay, inspect and debug kvflow traces."""
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


# --- replay --------------------------------------------------------------------------------


@main.command()
@click.argument("trace")
@click.option("--until", type=click.IntRange(min=0), metavar="SEQ", help="Stop after this seq.")
@click.option("--redecide", is_flag=True, help="Re-run the commands through today's decisions.")
@click.option("--strict", is_flag=True, help="Check every invariant after every event (slow).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def replay(trace: str, until: int | None, redecide: bool, strict: bool, as_json: bool) -> None:
    """Fold TRACE's events, checking invariants and every checkpoint digest.

    Exit 0 consistent, 1 at the first divergence or violation, 2 unreadable.
    """
    from kvflow.replay import replay as run_replay
    from kvflow.replay import repro_command

    with _user_errors():
        result = run_replay(trace, until=until, redecide=redecide, strict=strict)
    for warning in result.warnings:
        _warn(warning)
    divergence = result.divergence
    repro = None
    if divergence is not None:
        repro = repro_command(trace, divergence, redecide, strict)
    if as_json:
        data = result.to_dict()
        data["repro"] = repro
        _print_json(data)
    elif divergence is None:
        _print_replay_summary(trace, result, until)
    else:
        _print_divergence(trace, result, repro or "")
    _exit(EXIT_OK if divergence is None else EXIT_FOUND)


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
        click.echo(f"  stopped at     seq {result.stopped_at} (--until {until})")
    click.echo(f"  events         {result.events}")
    click.echo(f"  commands       {result.commands}")
    click.echo(f"  checkpoints    {result.checkpoints} verified")
    click.echo(f"  final state    seq {state.last_seq}, digest {state.digest()}")
    click.echo(
        f"  tier           {state.num_resident()} resident blocks, {len(state.free_slots)} free "
        f"slots of {state.capacity}, {len(state.jobs)} live job{'' if len(state.jobs) == 1 else 's'}"
    )


def _print_divergence(trace: str, result: Any, repro: str) -> None:
    from kvflow.inspect import describe, to_builtins

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


# --- incidents -----------------------------------------------------------------------------


@main.command()
@click.argument("trace")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per incident.")
def incidents(trace: str, as_json: bool) -> None:
    """Every failed, timed-out or cancelled job in TRACE and what recovery did."""
    from kvflow.inspect import find_incidents

    with _user_errors():
        report = find_incidents(trace)
    for warning in report.warnings:
        _warn(warning)
    if as_json:
        _print_json(report.to_list())
        return
    _print_incidents(report)


def _print_incidents(report: Any) -> None:
    from rich.table import Table

    from kvflow.inspect import few, recovery_summary

    found = report.incidents
    if not found:
        click.echo(
            f"{report.path}: no failed or timed-out jobs ({report.jobs} jobs, last seq {report.last_seq})"
        )
        return
    counts: dict[str, int] = {}
    for incident in found:
        counts[incident.outcome] = counts.get(incident.outcome, 0) + 1
    tally = ", ".join(f"{n} {outcome.replace('_', ' ')}" for outcome, n in sorted(counts.items()))
    table = Table(
        title=f"{report.path}: {len(found)} incidents of {report.jobs} jobs ({tally})",
        title_justify="left",
        show_lines=True,
    )
    for name, kwargs in (
        ("seq", {"justify": "right"}),
        ("step", {"justify": "right"}),
        ("ms", {"justify": "right"}),
        ("job", {"justify": "right"}),
        ("what", {"no_wrap": True}),
        ("request", {"no_wrap": True}),
        ("blocks", {"overflow": "fold"}),
        ("error", {"ratio": 3, "overflow": "fold"}),
        ("recovery", {"ratio": 3, "overflow": "fold"}),
        ("late results", {"ratio": 1, "overflow": "fold"}),
    ):
        if name == "late results" and not any(i.late_results for i in found):
            continue
        table.add_column(name, **kwargs)
    for incident in found:
        what = f"{incident.direction} {incident.outcome.replace('_', ' ')}"
        if incident.rank is not None and incident.outcome == "failed":
            what += f" (rank {incident.rank})"
        late = ", ".join(
            f"seq {r.seq}: rank {r.rank} {'ok' if r.ok else 'error'}" for r in incident.late_results
        )
        cells = [
            str(incident.seq),
            str(incident.step),
            "-" if incident.time_ms is None else f"{incident.time_ms:,.1f}" if incident.time_ms >= 1000 else f"{incident.time_ms:.3f}".rstrip("0").rstrip("."),
            str(incident.job_id),
            what,
            ", ".join(incident.requests) or "-",
            f"{len(incident.hashes)}: {few(incident.hashes, 2)[1:-1]}".replace(", +", " +"),
            incident.error,
            recovery_summary(incident),
            late or "-",
        ]
        table.add_row(*cells[: len(table.columns)])
    _print_rich(table)


# --- inspect -------------------------------------------------------------------------------


@main.command()
@click.argument("trace")
@click.option("--block", "block_text", metavar="HASH", help="Follow one block (its hash).")
@click.option("--job", type=int, metavar="ID", help="Follow one transfer job.")
@click.option("--request", metavar="ID", help="Follow one request.")
@click.option("--slot", type=click.IntRange(min=0), metavar="N", help="Follow one host-pool slot.")
@click.option(
    "--at", "at_seq", type=click.IntRange(min=0), metavar="SEQ", help="The state after this seq."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(
    trace: str,
    block_text: str | None,
    job: int | None,
    request: str | None,
    slot: int | None,
    at_seq: int | None,
    as_json: bool,
) -> None:
    """The full history of one block, job, request or slot in TRACE, and/or the state at SEQ."""
    from kvflow.inspect import Selector, inspect_trace

    block = None if block_text is None else _parse_int(block_text, "--block")
    selector = Selector(block=block, job=job, request=request, slot=slot)
    given = selector.given()
    if not given and at_seq is None:
        _fail(
            "say what to inspect: --block HASH, --job ID, --request ID, --slot N, and/or --at SEQ"
        )
    if len(given) > 1:
        _fail(f"follow one thing at a time: got --{' and --'.join(given)}")
    with _user_errors():
        result = inspect_trace(trace, selector, at=at_seq)
    for warning in result.warnings:
        _warn(warning)
    if as_json:
        _print_json(result.to_dict())
        return
    if given:
        _print_history(result)
    if result.focus is not None:
        _print_focus(result)
    if result.state is not None:
        _print_state(result.path, result.state)


def _print_history(result: Any) -> None:
    history = result.history
    what = str(result.selector)
    if not history:
        click.echo(f"{result.path}: no record names {what} (last seq {result.last_seq})")
        return
    click.echo(f"{what} in {result.path}: {len(history)} records")
    click.echo(f"{'seq':>7}  {'line':>5}  what")
    marked = result.at is None
    for entry in history:
        if not marked and entry.before_seq >= result.at:
            click.echo(f"{'':>7}  {'':>5}  ---- state at seq {result.at} (below) ----")
            marked = True
        seq = "cmd" if entry.seq is None else str(entry.seq)
        change = f"   [{entry.change}]" if entry.change else ""
        click.echo(f"{seq:>7}  {entry.line:>5}  {entry.text}{change}")


def _print_focus(result: Any) -> None:
    focus = dict(result.focus)
    click.echo(f"\n{result.selector} at seq {focus.pop('seq')}:")
    for key, value in focus.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            click.echo(f"  {key}:")
            for item in value:
                click.echo(f"    {json.dumps(item)}")
        else:
            shown = json.dumps(value) if isinstance(value, (dict, list)) else value
            click.echo(f"  {key}: {'-' if value is None else shown}")


def _print_state(path: str, state: dict[str, Any]) -> None:
    from rich.table import Table

    from kvflow.inspect import few

    by_state: dict[str, int] = {}
    for entry in state["entries"]:
        by_state[entry["state"]] = by_state.get(entry["state"], 0) + 1
    states = ", ".join(f"{n} {name}" for name, n in sorted(by_state.items())) or "empty"
    click.echo(f"state of {path} at seq {state['seq']} (digest {state['digest']})")
    click.echo(
        f"  tier: {state['capacity']} slots ({state['policy']}): {states}; "
        f"{state['free_slots']} free, {len(state['quarantine'])} quarantined"
    )
    if state["entries"]:
        table = Table(title="entries (by slot)", title_justify="left")
        for column in ("slot", "hash", "state", "pins", "job"):
            table.add_column(column, justify="right" if column != "state" else "left")
        for e in state["entries"]:
            job = e.get("job")
            table.add_row(
                str(e["slot"]),
                str(e["hash"]),
                e["state"],
                str(e["pins"] or ""),
                "" if job is None else str(job),
            )
        _print_rich(table)
    if state["pins"]:
        click.echo("pins per request:")
        for request_id, pins in state["pins"].items():
            listed = ", ".join(f"{h}" + (f" x{n}" if n > 1 else "") for h, n in pins.items())
            click.echo(f"  {request_id}: {sum(pins.values())} pins on {listed}")
    else:
        click.echo("pins per request: none")
    if state["jobs"]:
        table = Table(title="live jobs", title_justify="left")
        for column in (
            "job",
            "direction",
            "state",
            "blocks",
            "request",
            "deadline ms",
            "slots",
            "device blocks",
        ):
            table.add_column(column)
        for j in state["jobs"]:
            flags = " (abandoned)" if j["abandoned"] else ""
            table.add_row(
                str(j["job"]),
                j["direction"],
                j["state"] + flags,
                str(j["blocks"]),
                j["request"] or "-",
                "-" if j["deadline_ms"] is None else f"{j['deadline_ms']:g}",
                few(j["slots"], 6),
                few(j["device_blocks"], 6),
            )
        _print_rich(table)
    else:
        click.echo("live jobs: none")
    quarantine = ", ".join(f"slot {q['slot']} (job {q['job']})" for q in state["quarantine"])
    click.echo(f"quarantine: {quarantine or 'none'}")
    held = state["held_device_blocks"]
    click.echo(
        "held device blocks: "
        + (", ".join(f"{h['device_block']} (job {h['job']})" for h in held) if held else "none")
    )


# --- diagram -------------------------------------------------------------------------------


@main.command()
@click.argument("which", type=click.Choice(["both", "block", "job"]), default="both")
@click.option("--mermaid", is_flag=True, help="Mermaid stateDiagram-v2 instead of text.")
def diagram(which: str, mermaid: bool) -> None:
    """The block and job lifecycles, printed from kvflow.state's transition tables."""
    from kvflow.state import (
        BLOCK_TRANSITIONS,
        JOB_TRANSITIONS,
        TERMINAL_JOB_STATES,
        BlockState,
        JobState,
    )

    tables: list[tuple[str, dict[Any, dict[str, Any]], Any, tuple[Any, ...]]] = []
    if which in ("both", "block"):
        tables.append(
            (
                "block lifecycle (kvflow.state.BLOCK_TRANSITIONS)",
                BLOCK_TRANSITIONS,
                BlockState.ABSENT,
                (),
            )
        )
    if which in ("both", "job"):
        tables.append(
            (
                "job lifecycle (kvflow.state.JOB_TRANSITIONS)",
                JOB_TRANSITIONS,
                JobState.NEW,
                TERMINAL_JOB_STATES,
            )
        )
    chunks = []
    for title, table, start, terminal in tables:
        lines = []
        if mermaid:
            lines += ["stateDiagram-v2", f"  %% {title}", f"  [*] --> {start.name}"]
            for source, edges in table.items():
                targets: dict[str, list[str]] = {}
                for tag, target in edges.items():
                    targets.setdefault(target.name, []).append(tag)
                for target_name, tags in targets.items():
                    lines.append(f"  {source.name} --> {target_name}: {', '.join(tags)}")
            lines += [f"  {end.name} --> [*]" for end in terminal]
        else:
            lines.append(title)
            for source, edges in table.items():
                for tag, target in edges.items():
                    lines.append(f"  {source.name} --{tag}--> {target.name}")
        chunks.append("\n".join(lines))
    click.echo("\n\n".join(chunks))


@main.command("kv-events")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--until", type=int, default=None, help="Stop after this seq.")
def kv_events_command(trace: str, until: int | None) -> None:
    """The vLLM-compatible KV events (BlockStored / BlockRemoved / AllBlocksCleared, medium
    CPU) that TRACE's events imply, as JSON lines."""
    from typing import cast

    import msgspec

    from kvflow.events import EVENT_TYPES, Event
    from kvflow.kvevents import kv_event
    from kvflow.log import TraceReader

    encoder = msgspec.json.Encoder()
    out = sys.stdout
    with _user_errors():
        reader = TraceReader(trace)
        with reader:
            block_tokens = reader.config.block_tokens
            for _, rec in reader.records():
                if not isinstance(rec, EVENT_TYPES):
                    continue
                rec = cast("Event", rec)
                if until is not None and rec.seq > until:
                    break
                kv = kv_event(rec, block_tokens)
                if kv is not None:
                    out.write(encoder.encode(kv).decode() + "\n")
        for warning in reader.warnings:
            _warn(warning)


if __name__ == "__main__":
    main()
