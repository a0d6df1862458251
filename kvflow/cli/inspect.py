"""The ``kvflow incidents`` and ``kvflow inspect`` verbs: render what ``kvflow.inspect`` finds in a
trace (failed and timed-out jobs; the history of one block, job, request or slot; the state at a
seq) as tables, text or JSON.
"""

from __future__ import annotations

import json
from typing import Any

import click

from kvflow.cli.common import (
    fail,
    id_option,
    output_width,
    parse_int,
    print_json,
    print_rich,
    seq_option,
    trace_argument,
    user_errors,
    warn,
)

STATE_LIMIT = 20
"""How many items of each kind ``inspect --at`` lists unless told (a tier holds thousands)."""



@click.command()
@trace_argument
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per incident.")
def incidents(trace: str, as_json: bool) -> None:
    """Every failed, timed-out or cancelled job in TRACE and what recovery did, and every entry
    a shared tier refused."""
    from kvflow.inspect.incidents import find_incidents

    with user_errors():
        report = find_incidents(trace)
    for warning in report.warnings:
        warn(warning)
    if as_json:
        print_json(report.to_list())
        return
    _print_incidents(report)


# Below this many columns the table squeezes its text columns to a few characters a line
# (rich wraps every cell to fit): print one block of lines per incident instead.
TABLE_MIN_WIDTH = 130


def _print_incidents(report: Any) -> None:
    found = report.found()
    if not found:
        click.echo(
            f"{report.path}: no failed or timed-out jobs ({report.jobs} jobs, last seq {report.last_seq})"
        )
        return
    counts: dict[str, int] = {}
    for incident in report.incidents:
        counts[incident.outcome] = counts.get(incident.outcome, 0) + 1
    tally = ", ".join(f"{n} {outcome.replace('_', ' ')}" for outcome, n in sorted(counts.items()))
    if report.refused:
        n = len(report.refused)
        tally = ", ".join(part for part in (tally, f"{n} refused entr{'y' if n == 1 else 'ies'}") if part)
    title = f"{report.path}: {len(found)} incidents of {report.jobs} jobs ({tally})"
    from kvflow.inspect.incidents import RefusedEntry

    rows = [refused_cells(i) if isinstance(i, RefusedEntry) else incident_cells(i) for i in found]
    width = output_width()
    if width < TABLE_MIN_WIDTH:
        _print_incident_blocks(title, rows, width)
    else:
        _print_incident_table(title, rows)


def refused_cells(entry: Any) -> dict[str, str]:
    """One refused entry's texts, in the columns of a job incident."""
    from kvflow.inspect.render import exact_ms

    if entry.job_id is None:
        recovery = "refused by a probe: never loaded, never offered"
    else:
        failed = "" if entry.job_seq is None else f" (seq {entry.job_seq})"
        recovery = f"never served: its load job {entry.job_id} failed{failed}"
    recovery += f"; dropped from the {entry.tier} index" if entry.dropped else ""
    return {
        "heading": f"{entry.tier} entry refused: block {entry.block}",
        "seq": str(entry.seq),
        "step": str(entry.step),
        "ms": "-" if entry.time_ms is None else exact_ms(entry.time_ms),
        "job": "-" if entry.job_id is None else str(entry.job_id),
        "what": f"{entry.tier} entry refused",
        "request": "-",
        "blocks": f"1: {entry.block}",
        "error": entry.reason,
        "recovery": recovery,
        "late results": "-",
    }


def incident_cells(incident: Any) -> dict[str, str]:
    """One incident's texts, shared by the table and the narrow layout."""
    from kvflow.inspect.render import exact_ms, few, recovery_summary

    what = f"{incident.direction} {incident.outcome.replace('_', ' ')}"
    if incident.rank is not None and incident.outcome == "failed":
        what += f" (rank {incident.rank})"
    late = ", ".join(
        f"seq {r.seq}: rank {r.rank} {'ok' if r.ok else 'error'}" for r in incident.late_results
    )
    ms = "-" if incident.time_ms is None else exact_ms(incident.time_ms)
    request = ", ".join(incident.requests) or "-"
    return {
        "heading": f"job {incident.job_id}: {what}, {'no request' if request == '-' else f'request {request}'}",
        "seq": str(incident.seq),
        "step": str(incident.step),
        "ms": ms,
        "job": str(incident.job_id),
        "what": what,
        "request": request,
        "blocks": f"{len(incident.hashes)}: {few(incident.hashes, 2)[1:-1]}".replace(", +", " +"),
        "error": incident.error,
        "recovery": recovery_summary(incident),
        "late results": late or "-",
    }


def _print_incident_table(title: str, rows: list[dict[str, str]]) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=True)
    names: list[str] = []
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
        if name == "late results" and all(row[name] == "-" for row in rows):
            continue
        table.add_column(name, **kwargs)
        names.append(name)
    for row in rows:
        table.add_row(*(row[name] for name in names))
    print_rich(table)


def _print_incident_blocks(title: str, rows: list[dict[str, str]], width: int) -> None:
    """One incident per block of lines: a heading naming the job, then one labelled field a
    line, long values wrapped under their label. Numbers and ids are never split."""
    import textwrap

    labels = ("blocks", "error", "recovery", "late results")
    indent = 2 + max(len(label) for label in labels) + 2
    fill = max(20, width - indent)  # a tiny COLUMNS still gets readable lines

    def wrap(text: str, size: int) -> list[str]:
        return textwrap.wrap(text, size, break_on_hyphens=False) or [""]

    for text in wrap(title, width):
        click.echo(text)
    for row in rows:
        click.echo("")
        for text in wrap(row["heading"], width):
            click.echo(text)
        when = f"seq {row['seq']}, step {row['step']}, {row['ms']} ms"
        for label, value in (("when", when), *((label, row[label]) for label in labels)):
            if label == "late results" and value == "-":
                continue
            for n, text in enumerate(wrap(value, fill)):
                click.echo(f"  {label if n == 0 else '':<{indent - 4}}  {text}")


@click.command()
@trace_argument
@click.option("--block", "block_text", metavar="HASH", help="Follow one block (its hash).")
@id_option("--job", "ID", "Follow one transfer job.")
@click.option("--request", metavar="ID", help="Follow one request.")
@id_option("--slot", "N", "Follow one host-pool slot.")
@seq_option("--at", "The state after this seq.", "at_seq")
@id_option(
    "--limit", "N", f"With --at: list the first N entries, jobs and pins of each kind [default: {STATE_LIMIT}]."
)
@click.option("--all", "show_all", is_flag=True, help="With --at: list every entry, job and pin.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(
    trace: str,
    block_text: str | None,
    job: int | None,
    request: str | None,
    slot: int | None,
    at_seq: int | None,
    limit: int | None,
    show_all: bool,
    as_json: bool,
) -> None:
    """The full history of one block, job, request or slot in TRACE, and/or the state at SEQ.

    The state is summarised (entries per state, pins, live jobs, fences, lower tiers), then
    listed up to --limit items of each kind (--all: every one; --json: always every one).
    """
    from kvflow.inspect.history import Selector, inspect_trace

    block = None if block_text is None else parse_int(block_text, "--block")
    selector = Selector(block=block, job=job, request=request, slot=slot)
    given = selector.given()
    if not given and at_seq is None:
        fail(
            "say what to inspect: --block HASH, --job ID, --request ID, --slot N, and/or --at SEQ"
        )
    if len(given) > 1:
        fail(f"follow one thing at a time: got --{' and --'.join(given)}")
    if (limit is not None or show_all) and (at_seq is None or given):
        fail("--limit and --all list the state at a seq: give them with --at SEQ alone")
    if limit is not None and show_all:
        fail("give --limit N or --all, not both")
    with user_errors():
        result = inspect_trace(trace, selector, at=at_seq)
    for warning in result.warnings:
        warn(warning)
    if given and not result.history:
        _refuse_unknown(result)
    if as_json:
        print_json(result.to_dict())
        return
    if given:
        _print_history(result)
    if result.focus is not None:
        _print_focus(result)
    if result.state is not None:
        _print_state(result.path, result.state, None if show_all else STATE_LIMIT if limit is None else limit)


def _refuse_unknown(result: Any) -> None:
    """No record names the followed thing. A job id, request id or block hash that never
    appears is a typo or the wrong trace: exit 2 rather than print an empty history. A slot
    is different: one inside the tier that no job ever used is a fair question (it stayed
    free); only one beyond the tier's capacity is refused."""
    selector = result.selector
    if selector.slot is None:
        fail(f"{selector} never appears in {result.path} (last seq {result.last_seq})")
    slots = result.cpu_blocks
    if selector.slot >= slots:
        fail(f"{selector} is not in {result.path}: its CPU tier has {slots} slots (0..{slots - 1})")


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


def _print_state(path: str, state: dict[str, Any], limit: int | None) -> None:
    """The state at a seq: a summary, then each listing cut to ``limit`` items (None: all),
    saying how many it left out and how to see them."""
    from rich.table import Table

    from kvflow.inspect.render import exact_ms, few

    def shown(rows: list[Any], what: str) -> list[Any]:
        if limit is None or len(rows) <= limit:
            return rows
        click.echo(f"({what}: the first {limit} of {len(rows):,}; --limit N or --all for more)")
        return rows[:limit]

    entries, jobs, pins = state["entries"], state["jobs"], state["pins"]
    by_state: dict[str, int] = {}
    for entry in entries:
        by_state[entry["state"]] = by_state.get(entry["state"], 0) + 1
    states = ", ".join(f"{n:,} {name}" for name, n in sorted(by_state.items())) or "empty"
    pinned = sum(1 for e in entries if e["pins"])
    total_pins = sum(n for per in pins.values() for n in per.values())
    by_direction: dict[str, int] = {}
    for j in jobs:
        by_direction[j["direction"]] = by_direction.get(j["direction"], 0) + 1
    directions = ", ".join(f"{n} {d}" for d, n in sorted(by_direction.items()))
    fenced_jobs = sum(1 for j in jobs if j["fenced"] or j["abandoned"])
    click.echo(f"state of {path} at seq {state['seq']} (digest {state['digest']})")
    click.echo(
        f"  tier:     {state['capacity']:,} slots ({state['policy']}): {states}; "
        f"{state['free_slots']:,} free, {len(state['fenced_slots'])} fenced"
    )
    click.echo(
        f"  pins:     {total_pins:,} on {pinned:,} blocks, held by {len(pins):,} "
        f"request{'' if len(pins) == 1 else 's'}"
    )
    click.echo(
        f"  jobs:     {len(jobs):,} live{f' ({directions})' if jobs else ''}, {fenced_jobs} fenced or abandoned; "
        f"{len(state['held_device_blocks']):,} device blocks held"
    )
    if "remote_index" in state:
        click.echo(f"  remote tier: {len(state['remote_index'])} blocks known there {few(state['remote_index'], 8)}")
    if "disk_index" in state:
        on_disk = [e["hash"] for e in state["disk_index"]]
        click.echo(f"  disk tier: {len(on_disk)} blocks, {state['disk_free_slots']} slots free {few(on_disk, 8)}")
    if entries:
        rows = shown(entries, "entries")
        table = Table(title="entries (by slot)", title_justify="left")
        for column in ("slot", "hash", "state", "pins", "job"):
            table.add_column(column, justify="right" if column != "state" else "left")
        for e in rows:
            job = e.get("job")
            table.add_row(
                str(e["slot"]),
                str(e["hash"]),
                e["state"],
                str(e["pins"] or ""),
                "" if job is None else str(job),
            )
        print_rich(table)
    if pins:
        click.echo("pins per request:")
        for request_id, per in shown(list(pins.items()), "requests holding pins"):
            listed = ", ".join(f"{h}" + (f" x{n}" if n > 1 else "") for h, n in per.items())
            click.echo(f"  {request_id}: {sum(per.values())} pins on {listed}")
    else:
        click.echo("pins per request: none")
    if jobs:
        rows = shown(jobs, "live jobs")
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
        for j in rows:
            flags = " (fenced)" if j["abandoned"] else ""
            table.add_row(
                str(j["job"]),
                j["direction"],
                j["state"] + flags,
                str(j["blocks"]),
                j["request"] or "-",
                "-" if j["deadline_ms"] is None else exact_ms(j["deadline_ms"]),
                few(j["slots"], 6),
                few(j["device_blocks"], 6),
            )
        print_rich(table)
    else:
        click.echo("live jobs: none")
    fenced = state["fenced_slots"]
    cut = fenced if limit is None else fenced[:limit]
    more = f", +{len(fenced) - len(cut)} more" if len(cut) < len(fenced) else ""
    listed = ", ".join(f"slot {q['slot']} (job {q['job']})" for q in cut)
    click.echo(f"fenced slots: {listed + more if fenced else 'none'}")
    held = state["held_device_blocks"]
    cut = held if limit is None else held[:limit]
    more = f", +{len(held) - len(cut)} more" if len(cut) < len(held) else ""
    click.echo(
        "held device blocks: "
        + (", ".join(f"{h['device_block']} (job {h['job']})" for h in cut) + more if held else "none")
    )
