"""The ``kvflow simulate`` verb (DESIGN §6, §7). Heavy imports (rich, matplotlib) are lazy."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from kvflow.cli.common import fail, warn
from kvflow.core.errors import KvflowError

DEFAULT_CPU_BLOCKS = 2000


def _count_lines(path: str) -> int | None:
    if path.endswith(".gz"):
        return None
    try:
        with open(path, "rb") as fh:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
    except OSError:
        return None


def _run(path: str, options: Any, show_progress: bool) -> dict[str, Any]:
    from kvflow.simulate.run import simulate

    if not show_progress:
        return simulate(path, options)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    total = _count_lines(path)
    with Progress(
        TextColumn("[bold]simulate[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        transient=True,
        # on stderr, so stdout (the table, --json) stays clean when only stdout is redirected
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task("requests", total=total)
        return simulate(path, options, progress=lambda: progress.advance(task))


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = summary["config"]
    table = Table(
        title=f"kvflow simulate ({summary['mode']})",
        caption=(
            f"cpu {cfg['cpu_blocks']:,} blocks · device {cfg['device_blocks']:,} · {cfg['policy']} · "
            f"{cfg['store']} · {cfg['block_tokens']} tokens/block · faults {cfg['fault_rate']} seed {cfg['seed']}"
        ),
        show_header=True,
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    prompt = summary["prompt_tokens"] or 1
    rows: list[tuple[str, str]] = [
        ("requests", f"{summary['requests']:,}"),
        ("prompt tokens", f"{summary['prompt_tokens']:,}"),
        ("hit tokens", f"{summary['hit_tokens']:,} ({summary['hit_tokens'] / prompt:.1%})"),
        ("  device hit tokens", f"{summary['device_hit_tokens']:,}"),
        ("  cpu hit tokens", f"{summary['cpu_hit_tokens']:,}"),
        ("stored blocks", f"{summary['stored_blocks']:,}"),
        ("loaded blocks", f"{summary['loaded_blocks']:,}"),
        ("evicted blocks", f"{summary['evicted_blocks']:,}"),
        ("rejected blocks", f"{summary['rejected_blocks']:,}"),
        ("failed jobs", f"{summary['failed_jobs']:,} (timed out {summary['timed_out_jobs']:,})"),
        ("bytes stored / loaded", f"{summary['bytes_stored'] / 1e9:,.1f} GB / {summary['bytes_loaded'] / 1e9:,.1f} GB"),
        ("simulated time", f"{summary['sim_time_ms'] / 1000:,.1f} s"),
    ]
    for key in (f"{d}_p{q}_ms" for d in ("load", "store") for q in (50, 90, 99)):
        if summary.get(key) is not None:  # timed mode, and only directions that had jobs
            rows.append((key.replace("_", " "), f"{summary[key]:.3f} ms"))
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _parse_caps(text: str) -> list[int]:
    caps = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise KvflowError(f"--sweep: {part!r} is not a whole number of CPU blocks") from None
        if value < 0:
            raise KvflowError(f"--sweep: capacity {value} is negative")
        caps.append(value)
    if not caps:
        raise KvflowError("--sweep needs at least one capacity, e.g. --sweep 500,1000,2000")
    return caps


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib (an optional
    extra) is not installed: the sweep's numbers need no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _check_writable(path: str) -> None:
    """Fail now, not after a sweep of many simulations, if the plot cannot be written there.
    Opening for append changes no existing file; a file it had to create is removed again."""
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise KvflowError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    if not existed:
        os.remove(path)


def _plot(plt: Any, base: Any, caps: list[int], results: dict[str, list[dict[str, Any]]], path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, rows in results.items():
        ax.plot(caps, [r["hit_rate"] * 100 for r in rows], marker="o", label=policy.upper())
    # capacities usually span orders of magnitude (500 .. 16,000): a log axis spaces them
    # evenly. Capacity 0 (offload off) has no place on a log axis, so then the axis is linear
    # up to the smallest positive capacity (symlog).
    positive = [c for c in caps if c > 0]
    if len(positive) == len(caps):
        ax.set_xscale("log")
    else:
        ax.set_xscale("symlog", linthresh=min(positive, default=1))
    ax.minorticks_off()
    ax.set_xticks(caps, [f"{c:,}" for c in caps])  # the capacities run, not powers of ten
    ax.set_xlabel("CPU tier capacity (blocks, log scale)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title(f"kvflow simulate --sweep · device {base.device_blocks} blocks · {base.store}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise KvflowError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _sweep(path: str, base: Any, caps: list[int], plot: str, as_json: bool) -> None:
    import dataclasses

    from kvflow.simulate.run import simulate

    plt = _pyplot()
    if plt is None:
        warn(f"matplotlib is not installed: no plot written to {plot}, numbers only "
             "(pip install 'kvflow[plot]')")
    else:
        _check_writable(plot)
    results: dict[str, list[dict[str, Any]]] = {}
    for policy in ("lru", "arc"):
        for cap in caps:
            options = dataclasses.replace(base, cpu_blocks=cap, policy=policy, record=None)
            summary = simulate(path, options)
            results.setdefault(policy, []).append(summary)
            if not as_json:
                click.echo(
                    f"{policy:>4} cpu_blocks={cap:>8,}  hit rate {summary['hit_rate']:.2%}  "
                    f"(cpu {summary['cpu_hit_tokens'] / max(1, summary['prompt_tokens']):.2%})"
                )
    written = None
    if plt is not None:
        _plot(plt, base, caps, results, plot)
        written = plot
    if as_json:
        click.echo(json.dumps({"plot": written, "capacities": caps, "results": results}))
    elif written is not None:
        click.echo(f"plot written to {written}")


def _fleet(path: str, options: Any, instances: int, routing: str, remote_blocks: int | None, as_json: bool) -> None:
    from kvflow.simulate.fleet import print_fleet, simulate_fleet

    remote = 10 * options.cpu_blocks if remote_blocks is None else remote_blocks
    summary = simulate_fleet(path, options, instances, routing, remote)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        print_fleet(summary)


def _cpu_blocks(cpu_blocks: int | None, cpu_gb: float | None, bytes_per_block: int) -> int:
    """The CPU capacity in blocks from whichever of --cpu-blocks / --cpu-gb was given."""
    from kvflow.simulate.run import blocks_for_gb

    if cpu_gb is None:
        return DEFAULT_CPU_BLOCKS if cpu_blocks is None else cpu_blocks
    if cpu_blocks is not None:
        raise KvflowError("give the CPU capacity once: --cpu-blocks or --cpu-gb, not both")
    return blocks_for_gb(cpu_gb, bytes_per_block)


@click.command()
@click.argument("workload", type=click.Path(dir_okay=False))
@click.option("--cpu-blocks", type=int, default=None,
              help=f"CPU tier capacity in blocks (0 disables offload).  [default: {DEFAULT_CPU_BLOCKS}]")
@click.option("--cpu-gb", type=float, default=None, metavar="GB",
              help="CPU tier capacity in GB (10^9 bytes) instead of --cpu-blocks: rounded down to whole "
                   "blocks of --bytes-per-block (0 disables offload; less than one block is an error).")
@click.option("--device-blocks", type=int, default=0, show_default=True, help="Device prefix-cache capacity in blocks (0 allowed).")
@click.option("--policy", default="lru", show_default=True, help="Eviction policy: lru, arc, or module:Class of your own.")
@click.option("--store", "store", default="eager", show_default=True, help="Store mode: eager or lazy.")
@click.option("--block-tokens", type=int, default=512, show_default=True, help="Tokens per block (Mooncake: 512).")
@click.option("--fault-rate", type=float, default=0.0, show_default=True, help="Probability that a transfer job fails.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the fault draws.")
@click.option("--mode", type=click.Choice(["sequential", "timed"]), default="sequential", show_default=True,
              help="sequential: DESIGN §7 one request at a time; timed: arrivals at timestamp, concurrent.")
@click.option("--bytes-per-block", type=int, default=2 * 1024 * 1024, show_default=True, help="Bytes per KV block (all layers).")
@click.option("--bandwidth-gbps", type=float, default=55.5, show_default=True, help="Copy bandwidth per direction, GB/s.")
@click.option("--latency-us", type=float, default=20.0, show_default=True, help="Fixed cost per transfer job, µs.")
@click.option("--prefill-tokens-per-ms", type=float, default=10.0, show_default=True, help="Timed mode: prefill speed.")
@click.option("--record", type=click.Path(dir_okay=False), default=None, help="Write a kvflow trace of the run here.")
@click.option("--sweep", default=None, metavar="CAPS", help="Comma-separated CPU capacities: run both policies at each, plot hit rate.")
@click.option("--plot", default="sweep.png", show_default=True, help="PNG written by --sweep.")
@click.option("--instances", type=int, default=1, show_default=True,
              help="Route the requests across N instances (own device cache and CPU tier each) and compare a "
                   "shared remote tier with per-instance tiers only.")
@click.option("--routing", type=click.Choice(["round-robin", "session"]), default="round-robin", show_default=True,
              help="With --instances: round-robin, or session-affine (by the request's first block).")
@click.option("--remote-blocks", type=int, default=None, metavar="N",
              help="With --instances: the shared remote tier's capacity in blocks.  [default: 10 x --cpu-blocks]")
@click.option("--remote-store", type=click.Choice(["write-through", "ahead-of-eviction"]), default="write-through",
              show_default=True, help="With --instances: when blocks are copied to the shared tier.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr, drawn only when stderr is a terminal (default: not with --json).")
def simulate(
    workload: str,
    cpu_blocks: int | None,
    cpu_gb: float | None,
    device_blocks: int,
    policy: str,
    store: str,
    block_tokens: int,
    fault_rate: float,
    seed: int,
    mode: str,
    bytes_per_block: int,
    bandwidth_gbps: float,
    latency_us: float,
    prefill_tokens_per_ms: float,
    record: str | None,
    sweep: str | None,
    plot: str,
    instances: int,
    routing: str,
    remote_blocks: int | None,
    remote_store: str,
    as_json: bool,
    progress: bool | None,
) -> None:
    """Drive the real decision code over a Mooncake-format WORKLOAD on a virtual clock."""
    from kvflow.simulate.run import SimOptions

    try:
        options = SimOptions(
            cpu_blocks=_cpu_blocks(cpu_blocks, cpu_gb, bytes_per_block),
            device_blocks=device_blocks,
            policy=policy,
            store=store,
            block_tokens=block_tokens,
            fault_rate=fault_rate,
            seed=seed,
            mode=mode,
            bytes_per_block=bytes_per_block,
            bandwidth_gbps=bandwidth_gbps,
            latency_us=latency_us,
            prefill_tokens_per_ms=prefill_tokens_per_ms,
            record=record,
        )
        options.validate()
        options.config()  # F11: bad capacities / policy names fail before any work
        if sweep is not None:
            _sweep(workload, options, _parse_caps(sweep), plot, as_json)
            return
        if instances != 1 or remote_blocks is not None:
            options.remote_store_mode = remote_store.replace("-", "_")
            _fleet(workload, options, instances, routing, remote_blocks, as_json)
            return
        # a bar redraws itself with cursor controls: junk in a captured or redirected stderr
        wanted = progress if progress is not None else not as_json
        summary = _run(workload, options, wanted and sys.stderr.isatty())
    except KvflowError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{getattr(exc, 'filename', None) or workload}: {exc.strerror or exc}")
    if as_json:
        click.echo(json.dumps(summary))
    else:
        _print_summary(summary)
        if record:
            click.echo(f"trace written to {record}")
