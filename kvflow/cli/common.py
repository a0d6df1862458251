"""What every ``kvflow`` verb shares: exit codes, one-line errors and warnings, JSON and rich
output.

Kept apart from ``kvflow.cli.main`` (the click group) so the verb modules can import it without
importing the group back: ``python -m kvflow.cli.main`` runs the group as ``__main__``, and a verb
importing ``kvflow.cli.main`` would load a second copy of it. Imports only click and the standard
library at load time (rich is imported when something is printed through it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any, NoReturn, TypeVar

import click

EXIT_OK = 0
EXIT_FOUND = 1  # replay: a divergence or an invariant violation
EXIT_BAD_INPUT = 2


def echo_error(message: str) -> None:
    click.echo(f"kvflow: error: {' '.join(message.split())}", err=True)


def warn(message: str) -> None:
    click.echo(f"kvflow: warning: {' '.join(message.split())}", err=True)


def exit_with(code: int) -> NoReturn:
    raise click.exceptions.Exit(code)


def fail(message: str) -> NoReturn:
    echo_error(message)
    exit_with(EXIT_BAD_INPUT)


@contextmanager
def user_errors() -> Iterator[None]:
    """The CLI boundary: kvflow's own errors and file errors become one line + exit 2."""
    from kvflow.core.errors import KvflowError

    try:
        yield
    except KvflowError as exc:
        fail(str(exc))
    except BrokenPipeError:
        # the reader went away (`kvflow kv-events t | head`): not an error of ours
        sys.stderr.close()
        exit_with(0)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        fail(f"{where}{exc.strerror or exc}")


@contextmanager
def output_file(path: str) -> Iterator[IO[str]]:
    """A text file that appears at ``path`` only when the block ends without an error (a
    refused call leaves nothing behind, nor half a file): written beside it, then renamed.
    ``-`` is standard output (written as it comes)."""
    import tempfile

    if path == "-":
        yield sys.stdout
        return

    folder, name = os.path.split(os.path.abspath(path))
    try:
        out = tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=folder, prefix=f".{name}.", suffix=".partial", delete=False
        )
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from None  # (named as the user named it)
    with out:
        try:
            yield out
        except BaseException:
            out.close()
            os.unlink(out.name)
            raise
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(out.name, 0o666 & ~mask)  # (as open() would have made it; a temporary file is private)
    os.replace(out.name, path)


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


PIPE_WIDTH = 140  # a pipe or file has no width of its own: wide enough for every table


def output_width() -> int:
    """The columns stdout's output should fit: the terminal's width on a terminal (``COLUMNS``
    overrides it, as rich reads it), else ``COLUMNS`` when it is set, else ``PIPE_WIDTH``.

    ``COLUMNS`` counts in a pipe too, so ``COLUMNS=80 kvflow incidents T | less`` and the
    tests can ask for the narrow layout.
    """
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if sys.stdout.isatty():
        return shutil.get_terminal_size((PIPE_WIDTH, 24)).columns
    return PIPE_WIDTH


def _console() -> Any:
    """A rich console as wide as :func:`output_width`; no colour in a pipe or file."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console(width=output_width(), highlight=False)
    return Console(width=output_width(), highlight=False, no_color=True)


def print_rich(renderable: Any) -> None:
    """Print through rich, without the trailing blanks it pads lines with."""
    console = _console()
    with console.capture() as captured:
        console.print(renderable)
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


if TYPE_CHECKING:
    _IntParam = click.ParamType[int]
else:  # (click's ParamType is generic from 8.2; kvflow takes 8.1)
    _IntParam = click.ParamType


class WholeNumber(_IntParam):
    """A seq, a job id, a slot: a whole number >= 0, written in decimal. The one rule of every
    verb's ``--until``, ``--at``, ``--job`` and ``--slot`` (a negative number counts from
    nowhere: seqs start at 1 and a trace streams, so there is no end to count back from)."""

    name = "N"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        text = str(value).strip()
        if not text.isdigit():
            self.fail(f"expected a whole number >= 0, got {value!r}", param, ctx)
        return int(text)


WHOLE_NUMBER = WholeNumber()


F = TypeVar("F", bound=Callable[..., Any])


def trace_argument(function: F) -> F:
    """The TRACE argument of every verb that reads a trace: a file (``.gz``: gzip), or ``-``
    for standard input (gzip or not, told by its first bytes)."""
    return click.argument("trace", metavar="TRACE")(function)


def seq_option(name: str, help: str, dest: str | None = None) -> Callable[[F], F]:
    """A ``--until`` / ``--at``-style option naming a seq (see ``WholeNumber``)."""
    return id_option(name, "SEQ", help, dest)


def id_option(name: str, metavar: str, help: str, dest: str | None = None) -> Callable[[F], F]:
    """A ``--job`` / ``--slot``-style option naming a job id or a slot (see ``WholeNumber``)."""
    decls = [name] if dest is None else [name, dest]
    return click.option(*decls, type=WHOLE_NUMBER, metavar=metavar, help=help)


def parse_int(text: str, what: str) -> int:
    try:
        return int(text) if text.strip().lstrip("+-").isdigit() else int(text, 0)
    except ValueError:
        fail(f"{what} must be a whole number (decimal, or 0x... hex), got {text!r}")
