"""Every verb that reads a trace reads it alike: the verbs are found in the ``kvflow`` group
(every command with a TRACE argument, so a new verb is covered without a word here), and each is
given every kind of bad trace (one line naming the file, exit 2, never a traceback, no output
file left behind), a trace whose record chain does not verify (one warning line; ``replay``
calls it a divergence), and the trace on standard input (what it prints is what it prints for
the file). Their seq, job and slot options follow one rule."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from kvflow.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "traces"
SOURCE = TRACES / "load_failures.jsonl"

# What a verb needs beyond TRACE to read the whole trace ({out}: a scratch folder). A verb not
# listed is given the trace alone.
EXTRA_ARGS: dict[str, list[str]] = {
    "inspect": ["--job", "19"],
    "report": ["--html", "{out}/page.html"],
    "export": ["--chrome-trace", "{out}/trace.json"],
    "explain": ["--all"],
}


def trace_verbs() -> list[str]:
    ctx = click.Context(main)
    verbs = []
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        if command is not None and any(p.name == "trace" for p in command.params):
            verbs.append(name)
    return verbs


VERBS = trace_verbs()


def test_the_trace_verbs_are_found() -> None:
    assert {"replay", "incidents", "inspect", "kv-events", "report", "export"} <= set(VERBS)
    assert "simulate" not in VERBS and "diagram" not in VERBS


def run(verb: str, trace: str, out: Path, stdin: bytes | None = None) -> Result:
    args = [verb, trace, *(a.format(out=out) for a in EXTRA_ARGS.get(verb, []))]
    # wide enough that no table wraps: where a line wraps depends on the names in it (the
    # trace's path against <stdin>, pytest's temporary paths), which the tests compare
    return CliRunner().invoke(main, args, input=stdin, catch_exceptions=False, env={"COLUMNS": "2000"})


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def truncated(path: Path) -> int:
    text = lines(SOURCE)
    path.write_text("".join(text[:40]) + text[40][: len(text[40]) // 2] + "\n" + "".join(text[41:]))
    return 41


def bad_json(path: Path) -> int:
    text = lines(SOURCE)
    path.write_text("".join(text[:40]) + '{"type": "job_failed", "seq": 3,,}\n' + "".join(text[41:]))
    return 41


def wrong_type(path: Path) -> int:
    text = lines(SOURCE)
    record = json.loads(text[40])
    record["seq"] = str(record["seq"])
    path.write_text("".join(text[:40]) + json.dumps(record) + "\n" + "".join(text[41:]))
    return 41


def wrong_version(path: Path) -> int:
    text = lines(SOURCE)
    header = json.loads(text[0])
    header["version"] = 99
    path.write_text(json.dumps(header) + "\n" + "".join(text[1:]))
    return 1


def not_a_trace(path: Path) -> int:
    path.write_text("hello\n")
    return 1


def missing(path: Path) -> None:
    return None


BAD: dict[str, Callable[[Path], int | None]] = {
    "missing file": missing,
    "truncated line": truncated,
    "bad JSON": bad_json,
    "wrong field type": wrong_type,
    "newer version": wrong_version,
    "not a trace": not_a_trace,
}


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("verb", VERBS)
def test_a_bad_trace_is_one_line_and_exit_2_for_every_verb(tmp_path: Path, verb: str, kind: str) -> None:
    path = tmp_path / "bad.jsonl"
    line = BAD[kind](path)
    out = tmp_path / "out"
    out.mkdir()
    result = run(verb, str(path), out)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    err = result.stderr.strip()
    assert "\n" not in err and "Traceback" not in result.output, err
    where = str(path) if line is None else f"{path}:{line}:"
    assert err.startswith(f"kvflow: error: {where}"), err
    assert list(out.iterdir()) == []  # a refused call leaves no output file


@pytest.mark.parametrize("verb", VERBS)
def test_a_trace_that_does_not_verify_is_one_warning_line_for_every_verb(tmp_path: Path, verb: str) -> None:
    """A request id changed by hand: the record chain names the first checkpoint after it;
    ``replay``, whose verdict that is, exits 1, every other verb warns and goes on."""
    text = lines(SOURCE)
    record = json.loads(text[1])
    record["request_id"] += "x"
    path = tmp_path / "altered.jsonl"
    path.write_text(text[0] + json.dumps(record, separators=(",", ":")) + "\n" + "".join(text[2:]))
    checkpoint = next(n for n, t in enumerate(text, 1) if '"checkpoint"' in t)
    out = tmp_path / "out"
    out.mkdir()
    result = run(verb, str(path), out)
    assert "Traceback" not in result.output
    if verb == "replay":
        assert result.exit_code == 1 and "DIVERGENCE (records) at seq" in result.stdout
        assert f"({path}:{checkpoint})" in result.stdout
        return
    assert result.exit_code == 0, result.output
    warnings = result.stderr.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"kvflow: warning: {path}:{checkpoint}: "), warnings
    assert "does not verify" in warnings[0]


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_reads_standard_input(tmp_path: Path, verb: str, compress: bool) -> None:
    data = SOURCE.read_bytes()
    by_file, by_stdin = tmp_path / "file", tmp_path / "pipe"  # (names of one length: one layout)
    by_file.mkdir()
    by_stdin.mkdir()
    from_file = run(verb, str(SOURCE), by_file)
    from_stdin = run(verb, "-", by_stdin, stdin=gzip.compress(data, mtime=0) if compress else data)
    assert from_file.exit_code == from_stdin.exit_code == 0, from_stdin.output
    shown = from_stdin.stdout.replace("<stdin>", str(SOURCE)).replace(str(by_stdin), str(by_file))
    assert shown == from_file.stdout
    assert from_file.stderr == from_stdin.stderr == ""
    def named(text: str) -> str:  # the trace, however it was named
        for name in (str(SOURCE), SOURCE.name, "&lt;stdin&gt;", "<stdin>"):
            text = text.replace(name, "TRACE")
        return text

    written = sorted(by_file.iterdir())
    assert [p.name for p in written] == [p.name for p in sorted(by_stdin.iterdir())]
    for path in written:
        assert named((by_stdin / path.name).read_text()) == named(path.read_text())


SEQ_OPTIONS = [("replay", "--until"), ("kv-events", "--until"), ("inspect", "--at"), ("inspect", "--job"), ("inspect", "--slot")]


@pytest.mark.parametrize(("verb", "option"), SEQ_OPTIONS)
@pytest.mark.parametrize("value", ["-1", "-5", "x", "1.5", ""])
def test_seq_job_and_slot_options_follow_one_rule(verb: str, option: str, value: str) -> None:
    result = CliRunner().invoke(main, [verb, str(SOURCE), option, value], catch_exceptions=False, prog_name="kvflow")
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err == (
        f"kvflow: error: Invalid value for '{option}': expected a whole number >= 0, got {value!r} "
        f"(see 'kvflow {verb} --help')"
    )


def test_every_seq_option_is_the_shared_one() -> None:
    """No verb defines a seq, job or slot option of its own: each is ``kvflow.cli.common``'s."""
    from kvflow.cli.common import WHOLE_NUMBER

    ctx = click.Context(main)
    seen = 0
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert command is not None
        for param in command.params:
            if param.name in ("until", "at", "at_seq", "job", "slot") or param.metavar == "SEQ":
                assert param.type is WHOLE_NUMBER, (name, param.name)
                seen += 1
    assert seen >= 5
