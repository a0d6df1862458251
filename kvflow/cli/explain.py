"""The ``kvflow explain`` verb: renders what ``kvflow.inspect.explain`` finds about why a
request's blocks missed (one request, block by block; or every request, summed)."""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import click

from kvflow.cli.common import fail, print_json, print_rich, trace_argument, user_errors, warn

TOP_REQUESTS = 10  # --all: the requests that missed the most tokens, listed by name


@click.command()
@trace_argument
@click.option("--request", "request_id", default=None, metavar="ID", help="The request to explain, block by block.")
@click.option("--all", "every", is_flag=True, help="Every request: hits per tier and misses per cause, summed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (schema: docs/debugging.md).")
def explain(trace: str, request_id: str | None, every: bool, as_json: bool) -> None:
    """Why did a request of TRACE miss? For every full block of the request's last lookup: a
    hit and the tier it came from, or the cause of the miss, named from the trace (never
    stored and why, evicted when and by whom, corrupt, a failed load, refused by a shared
    tier ...)."""
    from kvflow.inspect.explain import RequestOutcome, explain

    if (request_id is None) == (not every):
        fail("give --request ID (one request, block by block) or --all (every request), not both" if every
             else "give --request ID (one request, block by block) or --all (every request)")
    with user_errors():
        if every and not as_json:
            # the table names a few requests: the rest are summed, not kept
            top: list[tuple[int, int, RequestOutcome]] = []
            seen = itertools.count(1)

            def keep(outcome: RequestOutcome) -> bool:
                # (missed tokens, then the earlier request: the heap drops the least of them)
                entry = (outcome.num_tokens - outcome.total_hit_tokens, -next(seen), outcome)
                (heapq.heappush if len(top) < TOP_REQUESTS else heapq.heappushpop)(top, entry)
                return False

            found = explain(trace, keep=keep)
            found.requests = [o for _, _, o in sorted(top, key=lambda e: (-e[0], -e[1]))]
        else:
            found = explain(trace, request_id)
    for warning in found.warnings:
        warn(warning)
    if as_json:
        print_json(found.to_dict())
    elif every:
        _print_all(found)
    else:
        _print_request(found)


def _tokens(n: int, of: int) -> str:
    return f"{n:,} ({n / of:.1%})" if of else f"{n:,}"


def _print_request(found: Any) -> None:
    from rich.table import Table

    from kvflow.inspect.explain import block_runs, why

    policy = found.config.get("policy")
    for outcome in found.requests:
        hits = ", ".join(f"{tier} {n:,}" for tier, n in outcome.hit_tokens.items() if n) or "none"
        run = f" (run {outcome.run})" if outcome.run > 1 else ""
        click.echo(
            f"request {outcome.request_id}{run} in {found.path}: {outcome.num_tokens:,} tokens, "
            f"{outcome.full_blocks} full blocks ({found.config['block_tokens']} tokens each), "
            f"last lookup at line {outcome.line} ({outcome.lookups} lookup{'s' * (outcome.lookups != 1)}), "
            f"policy {policy}"
        )
        click.echo(
            f"  hit tokens {_tokens(outcome.total_hit_tokens, outcome.num_tokens)}: {hits}; "
            f"missed {sum(outcome.missed.values())} blocks"
            + (": " + ", ".join(f"{c.replace('_', ' ')} {n}" for c, n in outcome.missed.items()) if outcome.missed else "")
        )
        table = Table(show_header=True, box=None, pad_edge=False)
        table.add_column("blocks", justify="right")
        table.add_column("hashes")
        table.add_column("outcome", overflow="fold")
        for first, last, head in block_runs(outcome.blocks or []):
            span = str(first) if first == last else f"{first}-{last}"
            hashes = str(head.block) if first == last else f"{head.block} ..."
            table.add_row(span, hashes, why(head))
        print_rich(table)


def _print_all(found: Any) -> None:
    from rich.table import Table

    t = found.totals
    prompt = t.prompt_tokens
    click.echo(
        f"{found.path}: {t.requests:,} requests, {prompt:,} prompt tokens, policy {found.config['policy']}, "
        f"{found.config['cpu_blocks']:,} CPU blocks of {found.config['block_tokens']} tokens"
    )
    hits = Table(title="hit tokens", title_justify="left", show_header=True)
    hits.add_column("tier")
    hits.add_column("tokens", justify="right")
    for tier, n in t.hit_tokens_by_tier.items():
        hits.add_row(tier, _tokens(n, prompt))
    hits.add_row("all", _tokens(t.hit_tokens, prompt))
    print_rich(hits)
    causes = Table(title=f"missed blocks ({t.missed_blocks:,})", title_justify="left", show_header=True)
    causes.add_column("cause")
    causes.add_column("blocks", justify="right")
    for cause, n in t.to_dict()["missed_by_cause"].items():
        causes.add_row(cause, f"{n:,}")
    print_rich(causes)
    if found.requests:
        top = Table(title="the requests that missed the most tokens", title_justify="left", show_header=True)
        for column in ("request", "tokens", "hit tokens", "missed blocks by cause"):
            top.add_column(column, justify="left" if column in ("request", "missed blocks by cause") else "right")
        for o in found.requests:
            top.add_row(
                o.request_id,
                f"{o.num_tokens:,}",
                f"{o.total_hit_tokens:,}",
                ", ".join(f"{c.replace('_', ' ')} {n}" for c, n in o.missed.items()),
            )
        print_rich(top)
    click.echo("kvflow explain TRACE --request ID shows one request block by block")
