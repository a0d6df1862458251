"""The ``kvflow`` command: the click group that the verbs hang from.

Start-up is kept short: this module imports only click, the version and ``kvflow.cli.common``
at load time. Every verb lives in a module of its own job and is imported only when it is run
(or listed by ``--help``), through ``LAZY_COMMANDS``; the trace machinery and rich are imported
inside the verbs that use them. Torch is never imported.

Exit status: 0 ok; 1 a divergence or violation found (``replay``); 2 bad input. Every bad
input is one line on stderr, ``kvflow: error: <file>:<line>: <message>``, never a traceback
(``kvflow.cli.common`` holds that boundary). The analysis itself lives in ``kvflow.inspect``
and ``kvflow.replay.fold``; the verb modules only render.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from kvflow._version import __version__
from kvflow.cli.common import EXIT_FOUND, EXIT_OK, echo_error

# Every verb, imported only when run (or listed by --help): name -> "module:attribute".
LAZY_COMMANDS: dict[str, str] = {
    "diagram": "kvflow.cli.diagram:diagram",
    "explain": "kvflow.cli.explain:explain",
    "export": "kvflow.cli.export:export",
    "incidents": "kvflow.cli.inspect:incidents",
    "inspect": "kvflow.cli.inspect:inspect",
    "kv-events": "kvflow.cli.kv_events:kv_events_command",
    "replay": "kvflow.cli.replay:replay",
    "report": "kvflow.cli.report:report",
    "simulate": "kvflow.cli.simulate:simulate",
    "what-if": "kvflow.cli.what_if:what_if",
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
            echo_error(f"{exc.format_message()}{hint}")
            code = exc.exit_code
        except click.Abort:
            echo_error("aborted")
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


if __name__ == "__main__":
    main()
