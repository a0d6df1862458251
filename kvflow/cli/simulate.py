"""The ``kvflow simulate`` verb: it parses, refuses what a run would ignore, and renders;
the runs are ``kvflow.simulate``'s. At load time it imports only click,
``kvflow.simulate.capacity`` (the option defaults) and ``kvflow.core.config`` (the disk's store
modes); the simulator, rich and matplotlib when used.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from kvflow.cli.common import fail, print_rich, warn
from kvflow.core.config import DISK_STORE_MODES
from kvflow.core.errors import KvflowError
from kvflow.simulate.capacity import (
    DEFAULT_BYTES_PER_TOKEN,
    DEFAULT_CPU_BLOCKS,
    DEFAULT_DISK_BANDWIDTH_GBPS,
    DEFAULT_DISK_LATENCY_US,
    DEFAULT_KV_DTYPE,
    GB,
    KV_DTYPES,
    MODELS,
)


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


def _binary(nbytes: int) -> str:
    """A size of KV cache in binary units (per token and per block, as models are sized)."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if nbytes >= unit:
            return f"{nbytes / unit:.4g} {name}"
    return f"{nbytes} bytes"


def _gb(nbytes: int) -> str:
    """A capacity in GB (10^9 bytes), as --cpu-gb takes it."""
    gb = nbytes / GB
    return f"{gb:,.2f} GB" if gb >= 1 else f"{gb:.3g} GB"


def _kv_text(kv: dict[str, Any]) -> str:
    """The KV geometry of a summary's ``config["kv"]``, for people."""
    if kv["source"] == "default":
        return "none given, so kvflow's default (set one with --model or --kv-bytes-per-token)"
    if kv["source"] == "kv_bytes_per_token":
        return f"--kv-bytes-per-token {kv['bytes_per_token']}"
    return (
        f"{kv['model']} ({MODELS[kv['model']].title}), {kv['kv_dtype']}: 2 (K, V) x {kv['layers']} layers "
        f"x {kv['kv_heads']} KV heads x {kv['head_dim']} head dim x {kv['dtype_bytes']} bytes"
    )


def _kv_short(cfg: dict[str, Any]) -> str:
    """The geometry in a few words (a plot's title)."""
    kv = cfg["kv"]
    per_token = f"{_binary(kv['bytes_per_token'])}/token"
    if kv["source"] == "model":
        return f"{kv['model']} {kv['kv_dtype']} ({per_token})"
    return per_token + (" (no model given)" if kv["source"] == "default" else "")


def _setup_rows(cfg: dict[str, Any], workload: str) -> list[tuple[str, str]]:
    """What ran, from a summary's ``config``: the workload, the geometry, the sizes in blocks
    and in bytes."""
    kv = cfg["kv"]
    tier = f"{cfg['cpu_blocks']:,} blocks = {_gb(cfg['cpu_bytes'])}"
    if cfg["cpu_gb"] is not None:
        tier += f" (--cpu-gb {cfg['cpu_gb']:g}, in whole blocks)"
    faults = "none" if not cfg["fault_rate"] else f"rate {cfg['fault_rate']:g}, seed {cfg['seed']}"
    disk = []
    if cfg.get("disk_blocks"):  # (the keys are there only with a disk tier)
        disk = [
            (
                "disk tier",
                f"{cfg['disk_blocks']:,} blocks = {_gb(cfg['disk_bytes'])} (--disk-gb {cfg['disk_gb']:g}, in "
                f"whole blocks), {cfg['disk_store_mode'].replace('_', '-')}",
            ),
            ("disk model", f"{cfg['disk_bandwidth_gbps']:g} GB/s per direction, {cfg['disk_latency_us']:g} µs per job"),
        ]
    return [
        ("workload", workload),
        ("KV geometry", _kv_text(kv)),
        ("KV per token", f"{kv['bytes_per_token']:,} bytes ({_binary(kv['bytes_per_token'])})"),
        (
            "KV per block",
            f"{cfg['bytes_per_block']:,} bytes ({_binary(cfg['bytes_per_block'])}), {cfg['block_tokens']} tokens",
        ),
        ("CPU tier", tier),
        *disk,
        ("policy, stores", f"{cfg['policy']}, {cfg['store']}"),
        ("device cache", f"{cfg['device_blocks']:,} blocks"),
        ("faults", faults),
    ]


def _print_summary(summary: dict[str, Any], workload: str) -> None:
    from rich.table import Table

    setup = Table(title=f"kvflow simulate ({summary['mode']})", show_header=False, title_justify="left")
    setup.add_column("setting")
    setup.add_column("value", overflow="fold")
    for name, value in _setup_rows(summary["config"], workload):
        setup.add_row(name, value)
    print_rich(setup)
    table = Table(title="results", show_header=True, title_justify="left")
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
        ("bytes stored / loaded", f"{_gb(summary['bytes_stored'])} / {_gb(summary['bytes_loaded'])}"),
        ("simulated time", f"{summary['sim_time_ms'] / 1000:,.1f} s"),
    ]
    for key in (f"{d}_p{q}_ms" for d in ("load", "store") for q in (50, 90, 99)):
        if summary.get(key) is not None:  # timed mode, and only directions that had jobs
            rows.append((key.replace("_", " "), f"{summary[key]:.3f} ms"))
    for name, value in rows:
        table.add_row(name, value)
    print_rich(table)
    if "hit_tokens_disk" in summary:
        _print_tiers(summary)


def _print_tiers(summary: dict[str, Any]) -> None:
    """A run with a disk tier: what each tier served, what moved into and out of it, and how
    long its copies kept it busy. A tier's loads go up a level: the CPU tier's to the device,
    the disk's to the CPU tier (the disk's hits are loaded twice)."""
    from rich.table import Table

    s = summary
    prompt = s["prompt_tokens"] or 1
    table = Table(title="per tier", title_justify="left")
    for column in ("tier", "hit tokens", "blocks stored / loaded", "bytes stored / loaded", "busy storing / loading"):
        table.add_column(column, justify="left" if column == "tier" else "right")

    def hits(tokens: int) -> str:
        return f"{tokens:,} ({tokens / prompt:.1%})"

    table.add_row("device", hits(s["device_hit_tokens"]), "", "", "")
    for tier, hit, stored, loaded, moved_in, moved_out, busy_in, busy_out in (
        ("CPU tier", "hit_tokens_cpu", "stored_blocks", "loaded_blocks", "bytes_stored", "bytes_loaded",
         "cpu_store_ms", "cpu_load_ms"),
        ("disk tier", "hit_tokens_disk", "disk_stored_blocks", "disk_loaded_blocks", "disk_bytes_stored",
         "disk_bytes_loaded", "disk_store_ms", "disk_load_ms"),
    ):
        table.add_row(
            tier,
            hits(s[hit]),
            f"{s[stored]:,} / {s[loaded]:,}",
            f"{_gb(s[moved_in])} / {_gb(s[moved_out])}",
            f"{s[busy_in]:,.1f} ms / {s[busy_out]:,.1f} ms",
        )
    print_rich(table)


def _parse_caps(text: str, flag: str) -> list[Any]:
    """The capacities of --sweep (whole blocks), --sweep-gb or --sweep-disk-gb (GB), in the
    order given."""
    in_gb = flag != "--sweep"
    unit = "GB" if in_gb else "blocks"
    caps: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value: Any = float(part) if in_gb else int(part)
        except ValueError:
            raise KvflowError(f"{flag}: {part!r} is not a {'number' if in_gb else 'whole number'} of {unit}") from None
        if not math.isfinite(value) or value < 0:
            raise KvflowError(f"{flag}: capacity {part} is not a finite number >= 0")
        caps.append(value)
    if not caps:
        raise KvflowError(f"{flag} needs at least one capacity, e.g. {flag} {'4,8,16' if in_gb else '500,1000,2000'}")
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


def _plot(plt: Any, sweep: dict[str, Any], name: str, path: str) -> None:
    caps, in_gb, of_disk = sweep["capacities"], sweep["unit"] != "blocks", sweep["unit"] == "disk GB"
    first = next(iter(sweep["results"].values()))[0]
    cfg = first["config"]
    # a disk sweep's runs share their CPU tier (and the disk's store mode, but not its size: the
    # first run may have none)
    tiers = f"\nCPU tier {cfg['cpu_blocks']:,} blocks = {_gb(cfg['cpu_bytes'])} above the disk" if of_disk else ""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, rows in sweep["results"].items():
        ax.plot(caps, [r["hit_rate"] * 100 for r in rows], marker="o", label=policy)
    # capacities usually span orders of magnitude (500 .. 16,000): a log axis spaces them
    # evenly. Capacity 0 (offload off) has no place on a log axis, so then the axis is linear
    # up to the smallest positive capacity (symlog).
    positive = [c for c in caps if c > 0]
    if len(positive) == len(caps):
        ax.set_xscale("log")
    else:
        ax.set_xscale("symlog", linthresh=min(positive, default=1))
    ax.minorticks_off()
    ax.set_xticks(caps, [f"{c:g}" if in_gb else f"{c:,}" for c in caps])  # the capacities run
    ax.set_xlabel(f"{'disk' if of_disk else 'CPU'} tier capacity ({'GB of KV cache' if in_gb else 'blocks'}, log scale)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title(
        f"{name}: {first['requests']:,} requests, {sweep['mode']}\n{_kv_short(cfg)}, "
        f"{cfg['block_tokens']}-token blocks · device {cfg['device_blocks']:,} blocks · {cfg['store']} stores{tiers}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(title="policy")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise KvflowError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _sweep(
    path: str, name: str, base: Any, kind: str, caps: list[Any], policies: list[str], plot: str, as_json: bool
) -> None:
    """``kind``: the capacity swept, a keyword of ``kvflow.simulate.run.sweep``."""
    from kvflow.simulate.run import sweep

    plt = _pyplot()
    if plt is None:
        warn(f"matplotlib is not installed: no plot written to {plot}, numbers only "
             "(pip install 'kvflow[plot]')")
    else:
        _check_writable(plot)

    def line(policy: str, cap: Any, summary: dict[str, Any]) -> None:
        if not printed:  # (after the sweep's checks: a refused sweep prints nothing on stdout)
            cfg = summary["config"]
            cpu = f", CPU tier {cfg['cpu_blocks']:,} blocks = {_gb(cfg['cpu_bytes'])}" if kind == "disk_gb" else ""
            click.echo(
                f"sweep of {name}: {_kv_short(cfg)}, {cfg['block_tokens']}-token blocks{cpu}, "
                f"{base.mode} mode, policies {', '.join(policies)}"
            )
            printed.append(True)
        cfg = summary["config"]
        size = (
            f"cpu_blocks={cap:,}" if kind == "cpu_blocks"
            else f"{kind}={cap:g} ({cfg[kind.replace('gb', 'blocks')]:,} blocks)" if cap
            else f"{kind}=0"  # (no disk tier: its config has no disk_blocks)
        )
        prompt = max(1, summary["prompt_tokens"])
        disk = f", of which disk {summary['hit_tokens_disk'] / prompt:.2%}" if "hit_tokens_disk" in summary else ""
        click.echo(
            f"{policy:>4} {size:<30} hit rate {summary['hit_rate']:.2%}  "
            f"(cpu {summary['cpu_hit_tokens'] / prompt:.2%}{disk})"
        )

    printed: list[bool] = []
    result = sweep(path, base, policies=policies, on_run=None if as_json else line, **{kind: caps})
    result["plot"] = None
    if plt is not None:
        _plot(plt, result, os.path.basename(name), plot)
        result["plot"] = plot
    if as_json:
        click.echo(json.dumps(result))
    elif result["plot"] is not None:
        click.echo(f"plot written to {plot}")


def _fleet(path: str, name: str, options: Any, instances: int, routing: str, remote_blocks: int | None,
           as_json: bool) -> None:
    from kvflow.simulate.fleet import simulate_fleet

    remote = 10 * options.capacity_blocks() if remote_blocks is None else remote_blocks
    summary = simulate_fleet(path, options, instances, routing, remote)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        _print_fleet(summary, name)


def _print_fleet(summary: dict[str, Any], workload: str) -> None:
    from rich.table import Table

    setup = Table(
        title=f"kvflow simulate: {summary['instances']} instances, {summary['routing']} routing",
        show_header=False,
        title_justify="left",
    )
    setup.add_column("setting")
    setup.add_column("value", overflow="fold")
    for name, value in _setup_rows(summary["config"], workload):
        setup.add_row(f"{name} (each)" if name == "CPU tier" else name, value)
    cfg = summary["config"]
    setup.add_row(
        "shared remote tier",
        f"{summary['remote_blocks']:,} blocks = {_gb(summary['remote_blocks'] * cfg['bytes_per_block'])}, "
        f"{summary['remote_store_mode'].replace('_', '-')}",
    )
    print_rich(setup)
    table = Table(title="results", title_justify="left")
    table.add_column("metric")
    table.add_column("shared remote tier", justify="right")
    table.add_column("per-instance tiers only", justify="right")
    shared, local = summary["shared"], summary["local"]
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("hit rate", lambda s: f"{s['hit_rate']:.1%}"),
        ("hit tokens", lambda s: f"{s['hit_tokens']:,}"),
        ("  cpu hit tokens", lambda s: f"{s['cpu_hit_tokens']:,}"),
        ("    from the remote tier", lambda s: f"{s['remote_hit_tokens']:,}"),
        ("  device hit tokens", lambda s: f"{s['device_hit_tokens']:,}"),
        ("cpu tier stored / loaded", lambda s: f"{_gb(s['cpu_bytes_stored'])} / {_gb(s['cpu_bytes_loaded'])}"),
        ("remote tier stored / loaded", lambda s: f"{_gb(s['remote_bytes_stored'])} / {_gb(s['remote_bytes_loaded'])}"),
        ("held at the end: cpu / remote", lambda s: f"{_gb(s['cpu_bytes_held'])} / {_gb(s['remote_bytes_held'])}"),
        ("failed jobs", lambda s: f"{s['failed_jobs']:,} (timed out {s['timed_out_jobs']:,})"),
    ]
    for name, cell in rows:
        table.add_row(name, cell(shared), cell(local))
    print_rich(table)


# What each kind of run reads: an option given for a run that would not read it is refused
# (one line, exit 2), never silently dropped.
_SWEEPS = {"sweep": "cpu_blocks", "sweep_gb": "cpu_gb", "sweep_disk_gb": "disk_gb"}
"""Each sweep option, and the capacity it sweeps (a keyword of ``kvflow.simulate.run.sweep``)."""
_SWEEP_SETS = {"cpu_blocks": ("cpu_blocks", "cpu_gb"), "cpu_gb": ("cpu_blocks", "cpu_gb"), "disk_gb": ("disk_gb",)}
"""The sizes a sweep of each kind gives itself: the options that would set them are ignored."""
_SWEEP_IGNORES = {
    "record": "a sweep runs many simulations and records no trace",
    "instances": "a sweep runs one instance",
    "routing": "a sweep runs one instance",
    "remote_blocks": "a sweep runs one instance",
    "remote_store": "a sweep runs one instance",
}
_FLEET_ONLY = ("routing", "remote_store")  # --remote-blocks alone asks for a fleet (of one)
_DISK_MODEL = ("disk_bandwidth_gbps", "disk_latency_us", "disk_store")  # read only with a disk tier


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _refuse_ignored(given: set[str], sweeping: str | None, fleet: bool, progress: bool | None) -> None:
    """``sweeping``: the sweep option given (a key of ``_SWEEPS``), or None."""
    disk = {"disk_gb", "sweep_disk_gb"} & given
    for name in _DISK_MODEL:
        if name in given and not disk:
            raise KvflowError(f"{_flag(name)} applies to --disk-gb or --sweep-disk-gb only")
    if sweeping is not None:
        sweep_flag = _flag(sweeping)
        ignored = {name: "the sweep gives the capacities" for name in _SWEEP_SETS[_SWEEPS[sweeping]]}
        for name, why in {**ignored, **_SWEEP_IGNORES}.items():
            if name in given:
                raise KvflowError(f"{_flag(name)} does not apply to {sweep_flag} ({why})")
        if progress:
            raise KvflowError(f"--progress does not apply to {sweep_flag} (it prints a line per run)")
        return
    if "plot" in given:
        raise KvflowError("--plot applies to --sweep, --sweep-gb or --sweep-disk-gb only")
    if fleet:
        for name in ("disk_gb", *_DISK_MODEL):
            if name in given:
                raise KvflowError(
                    f"{_flag(name)} does not apply to --instances (the instances share a remote tier, not disks)"
                )
        if progress:
            raise KvflowError("--progress does not apply to --instances (it draws no progress bar)")
        return
    for name in _FLEET_ONLY:
        if name in given:
            raise KvflowError(f"{_flag(name)} applies to --instances only")


def _given() -> set[str]:
    """The parameters given on the command line (or by environment), not left at their default."""
    ctx = click.get_current_context()
    defaults = (click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP, None)
    return {p.name for p in ctx.command.params if p.name and ctx.get_parameter_source(p.name) not in defaults}


_MODEL_NAMES = ", ".join(MODELS)


# The options of one simulated run, shared by ``kvflow simulate`` and ``kvflow what-if`` (which
# reruns a trace's workload: an option it is not given keeps the value the trace recorded).
# name -> (click.option keywords, simulate's default).
_RUN_OPTIONS: dict[str, tuple[dict[str, Any], Any]] = {
    "--cpu-blocks": (dict(type=int, help="CPU tier capacity in blocks (0 disables offload)."), None),
    "--cpu-gb": (dict(type=float, metavar="GB",
                      help="CPU tier capacity in GB (10^9 bytes) of KV cache instead of --cpu-blocks, rounded "
                           "down to whole blocks of the KV geometry (give --model or --kv-bytes-per-token; 0 "
                           "disables offload)."), None),
    "--model": (dict(type=click.Choice(list(MODELS), case_sensitive=False),
                     help="The model whose KV cache is simulated: its layers x KV heads x head dim x dtype bytes "
                          "size each block (and so --cpu-gb and the bytes moved)."), None),
    "--kv-dtype": (dict(type=click.Choice(list(KV_DTYPES), case_sensitive=False),
                        help=f"With --model: the KV cache's dtype ({DEFAULT_KV_DTYPE} unless given)."), None),
    "--kv-bytes-per-token": (dict(type=int, metavar="N",
                                  help="KV bytes per token (K and V, all layers) of a model not in --model's "
                                       f"list ({DEFAULT_BYTES_PER_TOKEN} when no geometry is given)."), None),
    "--device-blocks": (dict(type=int, help="Device prefix-cache capacity in blocks (0 allowed)."), 0),
    "--policy": (dict(help="Eviction policy: lru, arc, or module:Class of your own."), "lru"),
    "--store": (dict(type=click.Choice(["eager", "lazy"]),
                     help="Store mode: eager (every computed block) or lazy (blocks the device cache evicts)."),
                "eager"),
    "--fault-rate": (dict(type=float, help="Probability that a transfer job fails."), 0.0),
    "--seed": (dict(type=int, help="Seed of the fault draws."), 0),
    "--mode": (dict(type=click.Choice(["sequential", "timed"]),
                    help="sequential: one request at a time; timed: arrivals at their timestamp, concurrent."),
               "sequential"),
    "--bandwidth-gbps": (dict(type=float, help="Copy bandwidth per direction, GB/s."), 55.5),
    "--latency-us": (dict(type=float, help="Fixed cost per transfer job, µs."), 20.0),
    "--prefill-tokens-per-ms": (dict(type=float, help="Timed mode: prefill speed."), 10.0),
    "--disk-gb": (dict(type=float, metavar="GB",
                       help="A disk tier below the CPU tier, of GB (10^9 bytes) of KV cache in whole blocks "
                            "(0: none; sequential mode only)."), None),
    "--disk-bandwidth-gbps": (dict(type=float, help="With a disk tier: its bandwidth per direction, GB/s."),
                              DEFAULT_DISK_BANDWIDTH_GBPS),
    "--disk-latency-us": (dict(type=float, help="With a disk tier: the fixed cost of each disk job, µs."),
                          DEFAULT_DISK_LATENCY_US),
    "--disk-store": (dict(type=click.Choice([m.replace("_", "-") for m in DISK_STORE_MODES]),
                          help="With a disk tier: copy the CPU tier's coldest blocks ahead of their eviction, "
                               "or every block as its CPU-tier store completes."),
                     DISK_STORE_MODES[0].replace("_", "-")),
    "--record": (dict(type=click.Path(dir_okay=False), help="Write a kvflow trace of the run here."), None),
}
_SIMULATE_HELP = {
    "--cpu-blocks": f"  [default: {DEFAULT_CPU_BLOCKS}]",  # (not click's: --cpu-gb may size it instead)
    "--policy": " With a sweep: only this one (default: both lru and arc).",
}
"""What ``kvflow simulate``'s help adds to an option's."""


def run_options(as_recorded: bool = False) -> Callable[[Any], Any]:
    """The options of one simulated run as click decorators: with ``kvflow simulate``'s
    defaults, or (``as_recorded``) defaulting to what the trace being rerun recorded (None)."""

    def decorate(command: Any) -> Any:
        for name, (keywords, default) in reversed(_RUN_OPTIONS.items()):
            keywords = dict(keywords)
            if as_recorded:
                keywords["help"] += "  [default: as recorded]"
                keywords["default"] = None
            else:
                keywords["default"] = default
                keywords["show_default"] = default is not None
                keywords["help"] += _SIMULATE_HELP.get(name, "")
            command = click.option(name, **keywords)(command)
        return command

    return decorate


@click.command()
@click.argument("workload", required=False, type=click.Path(dir_okay=False))
@click.option("--example", is_flag=True,
              help="Run the example workload that ships with kvflow (200 chat requests) instead of a WORKLOAD file.")
@run_options()
@click.option("--block-tokens", type=int, default=512, show_default=True, help="Tokens per block (Mooncake: 512).")
@click.option("--sweep", default=None, metavar="BLOCKS",
              help="Comma-separated CPU capacities in blocks: run lru and arc at each, plot the hit rates.")
@click.option("--sweep-gb", default=None, metavar="GBS",
              help="The same sweep with capacities in GB of KV cache (give --model or --kv-bytes-per-token).")
@click.option("--sweep-disk-gb", default=None, metavar="GBS",
              help="Comma-separated disk tier sizes in GB of KV cache: run the CPU tier given (--cpu-blocks or "
                   "--cpu-gb) above a disk of each size, under lru and arc, and plot the hit rates.")
@click.option("--plot", default="sweep.png", show_default=True, metavar="FILE", help="PNG written by a sweep.")
@click.option("--instances", type=int, default=1, show_default=True,
              help="Route the requests across N instances (own device cache and CPU tier each) and compare a "
                   "shared remote tier with per-instance tiers only.")
@click.option("--routing", type=click.Choice(["round-robin", "session"]), default="round-robin", show_default=True,
              help="With --instances: round-robin, or session-affine (by the request's first block).")
@click.option("--remote-blocks", type=int, default=None, metavar="N",
              help="With --instances: the shared remote tier's capacity in blocks.  [default: 10 x the CPU tier]")
@click.option("--remote-store", type=click.Choice(["write-through", "ahead-of-eviction"]), default="write-through",
              show_default=True, help="With --instances: when blocks are copied to the shared tier.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr, drawn only when stderr is a terminal (default: not with --json).")
def simulate(
    workload: str | None,
    example: bool,
    cpu_blocks: int | None,
    cpu_gb: float | None,
    model: str | None,
    kv_dtype: str | None,
    kv_bytes_per_token: int | None,
    device_blocks: int,
    policy: str,
    store: str,
    block_tokens: int,
    fault_rate: float,
    seed: int,
    mode: str,
    bandwidth_gbps: float,
    latency_us: float,
    prefill_tokens_per_ms: float,
    disk_gb: float | None,
    disk_bandwidth_gbps: float,
    disk_latency_us: float,
    disk_store: str,
    record: str | None,
    sweep: str | None,
    sweep_gb: str | None,
    sweep_disk_gb: str | None,
    plot: str,
    instances: int,
    routing: str,
    remote_blocks: int | None,
    remote_store: str,
    as_json: bool,
    progress: bool | None,
) -> None:
    """Run a Mooncake-format WORKLOAD (JSON Lines), or with --example the workload that ships
    with kvflow, through kvflow's real decision code on a virtual clock, and report the prefix
    hit rate and what moved.

    Size the CPU tier in blocks (--cpu-blocks) or in GB of KV cache (--cpu-gb) of a model
    (--model) or of a number of KV bytes per token (--kv-bytes-per-token); the output says
    the geometry and the bytes per block it used. --disk-gb adds a disk tier below it."""
    from kvflow.simulate.run import SimOptions
    from kvflow.simulate.workload import EXAMPLE_WORKLOAD

    path = str(EXAMPLE_WORKLOAD) if workload is None else workload
    name = "example.jsonl, the example that ships with kvflow" if workload is None else workload
    try:
        if example == (workload is not None):
            raise KvflowError(
                "give a WORKLOAD file or --example, not both" if example else
                "give a WORKLOAD file (Mooncake JSON Lines), or --example to run the example that ships with kvflow"
            )
        sweeps = {"sweep": sweep, "sweep_gb": sweep_gb, "sweep_disk_gb": sweep_disk_gb}
        sweeping = [name for name, text in sweeps.items() if text is not None]
        if len(sweeping) > 1:
            raise KvflowError(
                f"give one sweep, not {' and '.join(map(_flag, sweeping))}: --sweep (CPU blocks), "
                "--sweep-gb (CPU GB) or --sweep-disk-gb (disk GB)"
            )
        given = _given()
        fleet = instances != 1 or remote_blocks is not None
        _refuse_ignored(given, sweeping[0] if sweeping else None, fleet, progress)
        options = SimOptions(
            cpu_blocks=cpu_blocks,
            cpu_gb=cpu_gb,
            model=model,
            kv_dtype=kv_dtype,
            kv_bytes_per_token=kv_bytes_per_token,
            device_blocks=device_blocks,
            policy=policy,
            store=store,
            block_tokens=block_tokens,
            fault_rate=fault_rate,
            seed=seed,
            mode=mode,
            bandwidth_gbps=bandwidth_gbps,
            latency_us=latency_us,
            prefill_tokens_per_ms=prefill_tokens_per_ms,
            record=record,
            disk_gb=disk_gb,
            disk_bandwidth_gbps=disk_bandwidth_gbps,
            disk_latency_us=disk_latency_us,
            disk_store_mode=disk_store.replace("-", "_"),
        )
        options.validate()
        options.config()  # F11: bad capacities / policy names fail before any work
        sized = {"cpu_gb": cpu_gb is not None, "sweep_gb": sweep_gb is not None, "disk_gb": bool(disk_gb),
                 "sweep_disk_gb": sweep_disk_gb is not None}
        in_gb = [name for name, yes in sized.items() if yes]
        if in_gb and options.geometry().default:
            warn(
                f"{_flag(in_gb[0])} without a KV geometry: assuming "
                f"{DEFAULT_BYTES_PER_TOKEN:,} bytes per token ({options.bytes_per_block:,} per block); "
                f"give --model ({_MODEL_NAMES}) or --kv-bytes-per-token"
            )
        if sweeping:
            caps = _parse_caps(sweeps[sweeping[0]] or "", _flag(sweeping[0]))
            policies = [policy] if "policy" in given else ["lru", "arc"]
            _sweep(path, name, options, _SWEEPS[sweeping[0]], caps, policies, plot, as_json)
            return
        if fleet:
            options.remote_store_mode = remote_store.replace("-", "_")
            _fleet(path, name, options, instances, routing, remote_blocks, as_json)
            return
        # a bar redraws itself with cursor controls: junk in a captured or redirected stderr
        wanted = progress if progress is not None else not as_json
        summary = _run(path, options, wanted and sys.stderr.isatty())
    except KvflowError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{getattr(exc, 'filename', None) or path}: {exc.strerror or exc}")
    if as_json:
        click.echo(json.dumps(summary))
    else:
        _print_summary(summary, name)
        if record:
            click.echo(f"trace written to {record}")
