"""``kvflow simulate`` (and ``kvflow kv-events`` on what it records) as a user runs them."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvflow.cli.main import main
from kvflow.simulate.run import SUMMARY_KEYS
from kvflow.simulate.workload import EXAMPLE_WORKLOAD

REPO = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).with_name("kvflow")
KVFLOW = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-c", "from kvflow.cli.main import main; main()"]

REQUIRED_KEYS = {
    "requests", "prompt_tokens", "hit_tokens", "cpu_hit_tokens", "device_hit_tokens",
    "stored_blocks", "loaded_blocks", "evicted_blocks", "failed_jobs",
}


def kvflow(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def line(n: int, **fields: object) -> str:
    record: dict[str, object] = {"timestamp": 10 * n, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]}
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not None})


def workload(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "w.jsonl"
    path.write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
    return path


def assert_one_line_error(result: Result, *needles: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert result.stdout == ""
    err = result.stderr
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("kvflow: error: ")
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# --- output -------------------------------------------------------------------------------


def test_json_summary_has_the_contract_keys() -> None:
    result = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 256, "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # no progress bar, no log lines
    summary = json.loads(result.stdout)  # the whole of stdout is one JSON object
    assert REQUIRED_KEYS <= set(summary) and set(SUMMARY_KEYS) <= set(summary)
    assert all(isinstance(summary[k], int) for k in REQUIRED_KEYS)
    assert summary["requests"] == 200 and summary["prompt_tokens"] == 1_198_285
    assert summary["hit_tokens"] == summary["cpu_hit_tokens"] + summary["device_hit_tokens"]
    assert summary["hit_tokens"] == 865_792  # EXAMPLE_WORKLOAD's docstring


def test_plain_output_is_a_table_of_the_same_numbers() -> None:
    result = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 256)
    assert result.exit_code == 0, result.output
    out = result.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
    rows = {}
    for text in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│|┃]", text) if c.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    assert rows.get("requests") == "200"
    assert rows.get("prompt tokens") == "1,198,285"
    assert rows.get("hit tokens", "").startswith("865,792")
    assert rows.get("evicted blocks") == "298"
    assert "failed jobs" in rows


def test_no_progress_bar_when_piped_and_json_is_one_line() -> None:
    proc = subprocess.run(
        [*KVFLOW, "simulate", str(EXAMPLE_WORKLOAD), "--cpu-blocks", "64", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.count("\n") == 1 and json.loads(proc.stdout)["requests"] == 200
    plain = subprocess.run(
        [*KVFLOW, "simulate", str(EXAMPLE_WORKLOAD), "--cpu-blocks", "64"], capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == 0 and plain.stderr == ""
    assert "\x1b" not in plain.stdout  # no cursor control, no colour in a pipe


def _on_a_terminal(*args: str) -> bytes:
    master, slave = pty.openpty()
    proc = subprocess.Popen([*KVFLOW, *args], stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, out[-500:]
    return out


HIDE_CURSOR = b"\x1b[?25l"  # what a live progress display starts with


def test_progress_bar_on_a_terminal_but_not_with_json() -> None:
    shown = _on_a_terminal("simulate", str(EXAMPLE_WORKLOAD), "--cpu-blocks", "64")
    assert HIDE_CURSOR in shown and b"simulate" in shown  # positive control: the bar is drawn
    as_json = _on_a_terminal("simulate", str(EXAMPLE_WORKLOAD), "--cpu-blocks", "64", "--json")
    assert HIDE_CURSOR not in as_json
    assert json.loads(as_json.decode())["requests"] == 200


def test_progress_is_never_drawn_into_captured_stderr() -> None:
    for args in ([], ["--progress"], ["--json", "--progress"]):
        result = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 64, *args)
        assert result.exit_code == 0, result.output
        assert result.stderr == "", args  # CliRunner's stderr is no terminal, even with --progress
        assert "\x1b" not in result.stdout  # and the bar did not land on stdout instead


def _split_terminal(*args: str, terminal: str) -> tuple[bytes, bytes]:
    """Run with one of stdout / stderr on a terminal and the other a pipe: (terminal, pipe)."""
    master, slave = pty.openpty()
    on_stdout = terminal == "stdout"
    proc = subprocess.Popen(
        [*KVFLOW, *args],
        stdin=subprocess.DEVNULL,
        stdout=slave if on_stdout else subprocess.PIPE,
        stderr=subprocess.PIPE if on_stdout else slave,
        close_fds=True,
    )
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    pipe = proc.stderr if on_stdout else proc.stdout
    assert pipe is not None
    piped = pipe.read()
    assert proc.wait(timeout=60) == 0, (shown[-500:], piped[-500:])
    return shown, piped


def test_progress_goes_to_stderr_only_when_it_is_a_terminal() -> None:
    # stderr redirected (2>log), stdout on the terminal: no bar anywhere
    shown, log = _split_terminal("simulate", str(EXAMPLE_WORKLOAD), "--cpu-blocks", "64", terminal="stdout")
    assert log == b"" and HIDE_CURSOR not in shown and b"requests" in shown
    # stdout redirected (>out), stderr on the terminal: the bar there, stdout clean
    shown, out = _split_terminal("simulate", str(EXAMPLE_WORKLOAD), "--cpu-blocks", "64", terminal="stderr")
    assert HIDE_CURSOR in shown and b"simulate" in shown
    assert b"\x1b" not in out and b"requests" in out


def test_timed_mode_shows_load_and_store_percentiles() -> None:
    data = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 64, "--mode", "timed", "--json").stdout)
    table = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 64, "--mode", "timed")
    assert table.exit_code == 0, table.output
    rows = {}
    for text in table.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│|┃]", text) if c.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    for direction in ("load", "store"):
        for q in (50, 90, 99):
            value = data[f"{direction}_p{q}_ms"]
            assert isinstance(value, float) and value > 0, (direction, q)
            assert rows.get(f"{direction} p{q} ms") == f"{value:.3f} ms"
    sequential = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 64).stdout
    assert "p50" not in sequential  # percentiles are a timed-mode result


# --- capacity in GB, of a model's KV geometry ---------------------------------------------------


def table_rows(out: str) -> dict[str, str]:
    """The two-cell rows of the tables ``kvflow simulate`` prints: name -> value."""
    rows = {}
    for text in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│|┃]", text) if c.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def without_cpu_gb(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary less what says how the capacity was asked for (the rest must not depend on it)."""
    return {**summary, "config": {k: v for k, v in summary["config"].items() if k != "cpu_gb"}}


@pytest.mark.parametrize(
    ("gb", "per_token"),
    [("0.5", 4096), ("1.25", 2000), ("0.6", 390_625)],  # the last: 3 blocks of 2e8 bytes exactly
)
def test_cpu_gb_is_whole_blocks_rounded_down(gb: str, per_token: int) -> None:
    from fractions import Fraction

    blocks = int(Fraction(gb) * 10**9 // (per_token * 512))  # exact arithmetic, rounded down
    by_gb = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-gb", gb, "--kv-bytes-per-token", per_token, "--json")
    assert by_gb.exit_code == 0, by_gb.output
    by_blocks = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", blocks, "--kv-bytes-per-token", per_token, "--json")
    summary = json.loads(by_gb.stdout)
    assert summary["config"]["cpu_blocks"] == blocks and summary["config"]["cpu_gb"] == float(gb)
    assert summary["config"]["cpu_bytes"] == blocks * per_token * 512
    assert without_cpu_gb(summary) == without_cpu_gb(json.loads(by_blocks.stdout))


def test_the_same_gb_is_far_fewer_blocks_of_a_real_model() -> None:
    """16 GB of the default 4 KiB tokens is 7,629 blocks; of Llama-3-8B's 128 KiB tokens, 238:
    the hit rate follows the blocks, and the output says which geometry it used."""
    default = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-gb", 16, "--json")
    llama = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-gb", 16, "--model", "llama3-8b", "--json")
    assert default.exit_code == 0 and llama.exit_code == 0, (default.output, llama.output)
    d, m = json.loads(default.stdout), json.loads(llama.stdout)
    assert d["config"]["kv"] == {"source": "default", "model": None, "kv_dtype": None, "bytes_per_token": 4096}
    assert m["config"]["kv"] == {
        "source": "model", "model": "llama3-8b", "kv_dtype": "bf16", "bytes_per_token": 131_072,
        "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2,
    }  # fmt: skip
    assert (d["config"]["bytes_per_block"], m["config"]["bytes_per_block"]) == (2 * 2**20, 64 * 2**20)
    assert (d["config"]["cpu_blocks"], m["config"]["cpu_blocks"]) == (16 * 10**9 // 2**21, 16 * 10**9 // 2**26)
    assert m["hit_rate"] < d["hit_rate"]
    # the figures are those of the same block count given as blocks, whatever the bytes per block
    by_blocks = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 238, "--json").stdout)
    assert {k: m[k] for k in SUMMARY_KEYS} == {k: by_blocks[k] for k in SUMMARY_KEYS}
    assert m["bytes_stored"] == by_blocks["bytes_stored"] * 32  # 128 KiB against 4 KiB per token


def test_the_geometry_and_bytes_per_block_are_on_screen() -> None:
    llama = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-gb", 16, "--model", "llama3-8b")
    assert llama.exit_code == 0 and llama.stderr == "", llama.output
    rows = table_rows(llama.stdout)
    assert "llama3-8b" in rows["KV geometry"] and "32 layers" in rows["KV geometry"] and "bf16" in rows["KV geometry"]
    assert rows["KV per token"] == "131,072 bytes (128 KiB)"
    assert rows["KV per block"] == "67,108,864 bytes (64 MiB), 512 tokens"
    assert rows["CPU tier"].startswith("238 blocks = 15.97 GB") and "--cpu-gb 16" in rows["CPU tier"]
    default = table_rows(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 256).stdout)
    assert default["KV geometry"].startswith("none given")
    assert default["KV per block"] == "2,097,152 bytes (2 MiB), 512 tokens"
    assert default["CPU tier"] == "256 blocks = 0.537 GB"


@pytest.mark.parametrize(
    ("model", "dtype", "per_token"),
    [
        ("llama3-8b", None, 2 * 32 * 8 * 128 * 2),
        ("llama3-70b", None, 2 * 80 * 8 * 128 * 2),
        ("qwen2.5-7b", None, 2 * 28 * 4 * 128 * 2),
        ("Llama3-8B", "fp8", 2 * 32 * 8 * 128 * 1),  # names and dtypes in any case
        ("qwen2.5-7b", "fp32", 2 * 28 * 4 * 128 * 4),
    ],
)
def test_models_and_dtypes(model: str, dtype: str | None, per_token: int) -> None:
    args = ["--model", model] + (["--kv-dtype", dtype] if dtype else [])
    summary = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 64, *args, "--json").stdout)
    assert summary["config"]["kv"]["bytes_per_token"] == per_token
    assert summary["config"]["bytes_per_block"] == per_token * 512
    assert summary["bytes_loaded"] == summary["loaded_blocks"] * per_token * 512
    given = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 64, "--kv-bytes-per-token", per_token,
                              "--json").stdout)
    assert given["config"]["kv"] == {"source": "kv_bytes_per_token", "model": None, "kv_dtype": None,
                                     "bytes_per_token": per_token}
    assert {**given, "config": None} == {**summary, "config": None}


@pytest.mark.parametrize("args", [["--cpu-gb", "16"], ["--sweep-gb", "8,16"]])
def test_gb_without_a_geometry_warns_once(args: list[str], tmp_path: Path) -> None:
    plot = ["--plot", str(tmp_path / "s.png")] if args[0] == "--sweep-gb" else []
    result = kvflow("simulate", EXAMPLE_WORKLOAD, *args, *plot, "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("kvflow: warning: "), result.stderr
    assert args[0] in result.stderr and "4,096 bytes per token" in result.stderr
    assert "--model" in result.stderr and "--kv-bytes-per-token" in result.stderr
    json.loads(result.stdout)  # stdout stays one JSON object
    for quiet in (["--model", "llama3-8b"], ["--kv-bytes-per-token", "4096"]):
        assert kvflow("simulate", EXAMPLE_WORKLOAD, *args, *plot, *quiet, "--json").stderr == ""
    assert kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 100, "--json").stderr == ""


def test_cpu_gb_zero_disables_offload_like_zero_blocks() -> None:
    summary = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-gb", "0", "--model", "llama3-8b", "--json").stdout)
    assert summary["config"]["cpu_blocks"] == 0 and summary["cpu_hit_tokens"] == 0


def test_default_capacity_without_either_option() -> None:
    summary = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--json").stdout)
    assert summary["config"]["cpu_blocks"] == 2000  # the documented default


def test_cpu_gb_and_cpu_blocks_together() -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-gb", "1", "--cpu-blocks", 100), "--cpu-gb", "--cpu-blocks")


@pytest.mark.parametrize("gb", ["-1", "nan", "inf", "0.001", "-0.5"])
def test_bad_cpu_gb(gb: str) -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-gb", gb, "--model", "llama3-8b"), "--cpu-gb")


def test_cpu_gb_below_one_block_says_so() -> None:
    err = assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-gb", "0.002", "--kv-bytes-per-token", 6000))
    assert "less than one block" in err and "3,072,000 bytes" in err


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--model", "llama3-8b", "--kv-bytes-per-token", "4096"], ["--model", "--kv-bytes-per-token", "not both"]),
        (["--kv-dtype", "fp8"], ["--kv-dtype", "--model"]),
        (["--kv-dtype", "fp8", "--kv-bytes-per-token", "4096"], ["--kv-dtype", "--model"]),
        (["--model", "gpt-17"], ["--model", "gpt-17", "llama3-8b", "qwen2.5-7b"]),
        (["--model", "llama3-8b", "--kv-dtype", "int3"], ["--kv-dtype", "int3", "bf16"]),
        (["--kv-bytes-per-token", "0"], ["--kv-bytes-per-token", "0"]),
        (["--kv-bytes-per-token", "-4096"], ["--kv-bytes-per-token", "-4096"]),
        (["--kv-bytes-per-token", "1.5"], ["--kv-bytes-per-token", "1.5"]),
    ],
)
def test_a_bad_geometry(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, *args), *needles)


def test_help_names_the_models_and_the_example() -> None:
    out = kvflow("simulate", "--help").stdout
    for word in ("--example", "--model", "llama3-8b", "llama3-70b", "qwen2.5-7b", "--kv-dtype", "fp8",
                 "--kv-bytes-per-token", "--sweep-gb"):
        assert word in out, word


def test_instances_sized_in_gb_of_a_model() -> None:
    result = kvflow("simulate", EXAMPLE_WORKLOAD, "--instances", 2, "--cpu-gb", 1, "--model", "llama3-8b", "--json")
    assert result.exit_code == 0 and result.stderr == "", result.output
    data = json.loads(result.stdout)
    block = 512 * 128 * 1024
    assert data["config"]["cpu_blocks"] == 10**9 // block and data["config"]["bytes_per_block"] == block
    assert data["remote_blocks"] == 10 * data["config"]["cpu_blocks"]  # the default: 10 x the CPU tier
    assert data["shared"]["cpu_bytes_held"] % block == 0 and data["shared"]["cpu_bytes_held"] > 0
    table = table_rows(kvflow("simulate", EXAMPLE_WORKLOAD, "--instances", 2, "--cpu-gb", 1, "--model", "llama3-8b").stdout)
    assert table["CPU tier (each)"].startswith(f"{data['config']['cpu_blocks']} blocks = ")
    assert table["KV per block"].startswith("67,108,864 bytes")


# --- the example that ships with kvflow -----------------------------------------------------------


def test_the_example_runs_without_a_file_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # found from the package, not from the working directory
    by_flag = kvflow("simulate", "--example", "--cpu-blocks", 256, "--json")
    assert by_flag.exit_code == 0, by_flag.output
    summary = json.loads(by_flag.stdout)
    assert summary["workload"] == str(EXAMPLE_WORKLOAD)
    by_path = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 256, "--json").stdout)
    assert summary == by_path
    assert (summary["requests"], summary["hit_tokens"]) == (200, 865_792)  # EXAMPLE_WORKLOAD's docstring


def test_the_example_says_what_it_ran_and_what_came_out() -> None:
    result = kvflow("simulate", "--example", "--model", "llama3-8b", "--cpu-gb", 16)
    assert result.exit_code == 0 and result.stderr == "", result.output
    rows = table_rows(result.stdout)
    data = json.loads(kvflow("simulate", "--example", "--model", "llama3-8b", "--cpu-gb", 16, "--json").stdout)
    assert "example" in rows["workload"] and "ships with kvflow" in rows["workload"]
    assert rows["KV geometry"].startswith("llama3-8b")
    assert rows["CPU tier"].startswith(f"{data['config']['cpu_blocks']:,} blocks = 15.97 GB")
    assert rows["requests"] == "200"
    assert rows["hit tokens"] == f"{data['hit_tokens']:,} ({data['hit_rate']:.1%})"
    assert rows["evicted blocks"] == f"{data['evicted_blocks']:,}"


@pytest.mark.parametrize("args", [["--example", "w.jsonl"], []])
def test_workload_or_example_exactly_one(args: list[str]) -> None:
    err = assert_one_line_error(kvflow("simulate", *args, "--cpu-blocks", 10), "WORKLOAD", "--example")
    assert ("not both" in err) == bool(args)


def test_the_example_is_in_the_package_directory() -> None:
    import kvflow.simulate

    assert EXAMPLE_WORKLOAD.parent == Path(kvflow.simulate.__file__).parent and EXAMPLE_WORKLOAD.is_file()


# --- bad input: exit 2, one line, file:line and field, no traceback ----------------------


def test_a_line_that_is_not_json(tmp_path: Path) -> None:
    path = workload(tmp_path, line(0), line(1), "{this is not json")
    assert_one_line_error(kvflow("simulate", path), f"{path}:3:", "JSON")


def test_a_missing_field(tmp_path: Path) -> None:
    path = workload(tmp_path, line(0), line(1, input_length=None))
    assert_one_line_error(kvflow("simulate", path, "--json"), f"{path}:2:", "input_length")


def test_a_negative_length(tmp_path: Path) -> None:
    path = workload(tmp_path, line(0, input_length=-5))
    assert_one_line_error(kvflow("simulate", path), f"{path}:1:", "input_length", "-5")


def test_hash_ids_not_matching_the_input_length(tmp_path: Path) -> None:
    path = workload(tmp_path, line(0), line(1), line(2, input_length=2000))  # needs 4 ids, has 3
    assert_one_line_error(kvflow("simulate", path), f"{path}:3:", "hash_ids")


def test_a_nonexistent_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    assert_one_line_error(kvflow("simulate", missing), str(missing))


def test_negative_cpu_blocks() -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", -1), "--cpu-blocks must be a whole number >= 0", "-1")


def test_an_unknown_policy_lists_the_known_ones() -> None:
    err = assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, "--policy", "fifo"), "fifo")
    assert "lru" in err and "arc" in err


@pytest.mark.parametrize("rate", ["2", "-0.5", "nan"])
def test_a_fault_rate_outside_zero_to_one(rate: str) -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, "--fault-rate", rate), "fault-rate")


def test_bad_input_in_a_real_process(tmp_path: Path) -> None:
    path = workload(tmp_path, line(0), line(1, hash_ids=[1, 2, "x"]))
    proc = subprocess.run([*KVFLOW, "simulate", str(path), "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"{path}:2:" in proc.stderr and "hash_ids" in proc.stderr


def test_nan_rates_are_refused_not_run_forever() -> None:
    options = {
        "bandwidth": ["--bandwidth-gbps", "nan"],
        "latency": ["--latency-us", "nan"],
        "prefill": ["--mode", "timed", "--prefill-tokens-per-ms", "nan"],
    }
    procs = {
        name: subprocess.Popen([*KVFLOW, "simulate", str(EXAMPLE_WORKLOAD), *args, "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, args in options.items()
    }
    deadline = time.monotonic() + 6
    outcome: dict[str, object] = {}
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            outcome[name] = (proc.returncode, err.strip())
        except subprocess.TimeoutExpired:
            proc.kill()  # one we started, by its handle
            proc.communicate()
            outcome[name] = "still running after 6 s"
    for name, got in outcome.items():
        assert isinstance(got, tuple) and got[0] == 2 and "\n" not in got[1], (name, outcome)


# --- sweep ------------------------------------------------------------------------------------


def test_sweep_writes_a_png_and_prints_both_policies(tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    result = kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "32,256", "--plot", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 1000
    lines = result.stdout.splitlines()
    for policy in ("lru", "arc"):
        for cap in ("32", "256"):
            assert any(policy in x and re.search(rf"\b{cap}\b", x) for x in lines), (policy, cap, lines)
    # the numbers printed are the simulator's own
    lru256 = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 256, "--json").stdout)
    assert any("lru" in x and f"{lru256['hit_rate']:.2%}" in x for x in lines)


def test_sweep_with_a_bad_capacity() -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "32,x"), "sweep")


def test_sweep_without_matplotlib_still_prints_its_numbers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` raises ImportError
    png = tmp_path / "sweep.png"
    result = kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "32,256", "--plot", png)
    assert result.exit_code == 0, result.output
    lru256 = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 256, "--json").stdout)
    lines = result.stdout.splitlines()
    assert len([x for x in lines if "cpu_blocks=" in x]) == 4
    assert any("lru" in x and f"{lru256['hit_rate']:.2%}" in x for x in lines)
    assert "plot written" not in result.stdout and not png.exists()
    assert result.stderr.startswith("kvflow: warning: ") and result.stderr.count("\n") == 1
    assert "matplotlib" in result.stderr and str(png) in result.stderr
    as_json = kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "32,256", "--plot", png, "--json")
    data = json.loads(as_json.stdout)
    assert data["plot"] is None and data["capacities"] == [32, 256]
    assert data["results"]["lru"][1]["hit_rate"] == lru256["hit_rate"]


@pytest.mark.parametrize("where", ["missing directory", "a directory"])
def test_sweep_checks_the_plot_path_before_running(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str) -> None:
    pytest.importorskip("matplotlib")
    import kvflow.simulate.run as sim

    runs: list[object] = []
    real = sim.simulate

    def spy(*args: Any, **kwargs: Any) -> Any:
        runs.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(sim, "simulate", spy)
    png = tmp_path / "no" / "such" / "dir" / "sweep.png" if where == "missing directory" else tmp_path
    err = assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "32,256", "--plot", png), str(png), "plot")
    assert runs == []  # refused before the first simulation
    assert ("No such file or directory" if where == "missing directory" else "Is a directory") in err
    ok = kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "32,256", "--plot", tmp_path / "ok.png")
    assert ok.exit_code == 0 and len(runs) == 4  # positive control: the spy sees a sweep's runs


def test_the_plot_check_leaves_nothing_behind(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    result = kvflow("simulate", tmp_path / "missing.jsonl", "--sweep", "32", "--plot", png)
    assert result.exit_code == 2 and not png.exists()  # the check passed, the run failed
    png.write_bytes(b"keep me")
    result = kvflow("simulate", tmp_path / "missing.jsonl", "--sweep", "32", "--plot", png)
    assert result.exit_code == 2 and png.read_bytes() == b"keep me"


def test_sweep_plots_capacity_on_a_log_axis(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved: list[tuple[str, list[str]]] = []
    real_savefig = Figure.savefig

    def savefig(fig: Figure, *args: Any, **kwargs: Any) -> None:
        ax = fig.axes[0]
        saved.append((ax.get_xscale(), [t.get_text() for t in ax.get_xticklabels()]))
        real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    assert kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "32,256,1000", "--plot", tmp_path / "a.png").exit_code == 0
    assert kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "0,32,256", "--plot", tmp_path / "b.png").exit_code == 0
    # capacity 0 (offload off) cannot sit on a log axis: linear up to the first capacity
    assert saved == [("log", ["32", "256", "1,000"]), ("symlog", ["0", "32", "256"])]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--record", "run.jsonl"),
        ("--instances", "2"),
        ("--instances", "1"),  # given at all: a sweep would not read it
        ("--cpu-gb", "16"),
        ("--cpu-blocks", "100"),
        ("--routing", "session"),
        ("--remote-blocks", "100"),
        ("--remote-store", "ahead-of-eviction"),
        ("--progress", None),
    ],
)
@pytest.mark.parametrize("sweep", [["--sweep", "32,256"], ["--sweep-gb", "1,2", "--model", "llama3-8b"]])
def test_a_sweep_refuses_what_it_would_ignore(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sweep: list[str], option: str, value: str | None
) -> None:
    import kvflow.simulate.run as sim

    runs: list[object] = []
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: runs.append(a))
    png = tmp_path / "s.png"
    args = [option] if value is None else [option, value]
    err = assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, *sweep, *args, "--plot", png), option, sweep[0])
    assert "apply" in err
    assert runs == [] and not png.exists() and not (tmp_path / "run.jsonl").exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--plot", "x.png"], ["--plot", "--sweep"]),
        (["--routing", "session"], ["--routing", "--instances"]),
        (["--remote-store", "ahead-of-eviction"], ["--remote-store", "--instances"]),
        (["--instances", "2", "--progress"], ["--progress", "--instances"]),
        (["--sweep", "32", "--sweep-gb", "1"], ["--sweep", "--sweep-gb"]),
        (["--sweep-gb", "1,x", "--model", "llama3-8b"], ["--sweep-gb", "'x'"]),
        (["--sweep-gb", "1,-2", "--model", "llama3-8b"], ["--sweep-gb", "-2"]),
        (["--sweep-gb", "nan", "--model", "llama3-8b"], ["--sweep-gb", "nan"]),
        (["--sweep-gb", "0.01", "--model", "llama3-70b"], ["0.01", "less than one block"]),
        (["--sweep", " , "], ["--sweep", "at least one"]),
    ],
)
def test_options_for_another_kind_of_run_are_refused(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE_WORKLOAD, *args), *needles)


def test_a_sweep_runs_only_the_policy_given(tmp_path: Path) -> None:
    result = kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "32,256", "--policy", "arc", "--plot", tmp_path / "a.png",
                    "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert list(data["results"]) == ["arc"]
    arc = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 256, "--policy", "arc", "--json").stdout)
    assert data["results"]["arc"][1] == arc
    both = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--sweep", "32", "--plot", tmp_path / "b.png", "--json").stdout)
    assert list(both["results"]) == ["lru", "arc"]  # without --policy: both


def test_a_sweep_in_gb_plots_gb_and_names_the_workload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    seen: list[dict[str, Any]] = []
    real_savefig = Figure.savefig

    def savefig(fig: Figure, *args: Any, **kwargs: Any) -> None:
        ax = fig.axes[0]
        seen.append({
            "ticks": [t.get_text() for t in ax.get_xticklabels()],
            "x": [list(line.get_xdata()) for line in ax.get_lines()],
            "xlabel": ax.get_xlabel(),
            "title": ax.get_title(),
            "legend": [t.get_text() for t in ax.get_legend().get_texts()],
        })  # fmt: skip
        real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    args = ["--sweep-gb", "2,4.5,16", "--model", "qwen2.5-7b", "--plot", tmp_path / "gb.png"]
    result = kvflow("simulate", EXAMPLE_WORKLOAD, *args, "--json")
    assert result.exit_code == 0 and result.stderr == "", result.output
    data = json.loads(result.stdout)
    assert data["unit"] == "GB" and data["capacities"] == [2, 4.5, 16] and data["plot"] == str(tmp_path / "gb.png")
    block = 2 * 28 * 4 * 128 * 2 * 512
    for policy in ("lru", "arc"):
        assert [r["config"]["cpu_blocks"] for r in data["results"][policy]] == [int(g * 10**9) // block for g in (2, 4.5, 16)]
        assert [r["config"]["cpu_gb"] for r in data["results"][policy]] == [2, 4.5, 16]
    (plot,) = seen
    assert plot["ticks"] == ["2", "4.5", "16"] and plot["x"] == [[2, 4.5, 16]] * 2
    assert "GB" in plot["xlabel"] and "blocks" not in plot["xlabel"]
    assert EXAMPLE_WORKLOAD.name in plot["title"] and "200 requests" in plot["title"]
    assert "qwen2.5-7b" in plot["title"] and "56 KiB/token" in plot["title"]
    assert plot["legend"] == ["lru", "arc"]
    # the same figures as each capacity run on its own
    alone = json.loads(kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-gb", 4.5, "--model", "qwen2.5-7b", "--json").stdout)
    assert data["results"]["lru"][1] == alone
    text = kvflow("simulate", EXAMPLE_WORKLOAD, *args).stdout.splitlines()
    assert text[0].startswith(f"sweep of {EXAMPLE_WORKLOAD}") and "qwen2.5-7b" in text[0]
    assert any(x.strip().startswith(f"lru cpu_gb=4.5 ({alone['config']['cpu_blocks']:,} blocks)") for x in text)


# --- record, then kv-events ------------------------------------------------------------------


def test_kv_events_of_a_recorded_run_match_its_stores_and_evictions(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    result = kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 32, "--fault-rate", 0.2, "--seed", 3,
                    "--record", trace, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["failed_jobs"] > 0 and summary["evicted_blocks"] > 0

    # expected, straight from the trace's JSON lines
    want: list[tuple[str, list[int], int]] = []
    failed_store_hashes: set[int] = set()
    for raw in trace.read_text().splitlines()[1:]:
        rec = json.loads(raw)
        if rec.get("type") == "job_completed" and rec["direction"] == "store" and not rec.get("abandoned"):
            want.append(("BlockStored", rec["hashes"], rec["seq"]))
        elif rec.get("type") == "blocks_evicted":
            want.append(("BlockRemoved", rec["hashes"], rec["seq"]))
        elif rec.get("type") in ("job_failed", "job_timed_out") and rec["direction"] == "store":
            failed_store_hashes.update(rec["hashes"])
    assert failed_store_hashes  # failed stores exist, and must not show up below

    out = kvflow("kv-events", trace)
    assert out.exit_code == 0, out.output
    got = []
    for text in out.stdout.splitlines():
        ev = json.loads(text)
        assert ev["medium"] == "CPU"
        if ev["type"] == "BlockStored":
            assert ev["block_size"] == 512
        got.append((ev["type"], ev["block_hashes"], ev["seq"]))
    assert got == want
    stored = sum(len(h) for kind, h, _ in got if kind == "BlockStored")
    removed = sum(len(h) for kind, h, _ in got if kind == "BlockRemoved")
    assert (stored, removed) == (summary["stored_blocks"], summary["evicted_blocks"])


def test_kv_events_through_python_dash_m(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    assert kvflow("simulate", EXAMPLE_WORKLOAD, "--cpu-blocks", 32, "--record", trace, "--json").exit_code == 0
    proc = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "kv-events", str(trace)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == kvflow("kv-events", trace).stdout


# --- a disk tier below the CPU tier ----------------------------------------------------------------

DISK_KEYS = {
    "hit_tokens_cpu", "hit_tokens_disk", "disk_stored_blocks", "disk_loaded_blocks", "disk_bytes_stored",
    "disk_bytes_loaded", "disk_store_ms", "disk_load_ms", "cpu_store_ms", "cpu_load_ms",
}  # fmt: skip
DISK_CONFIG_KEYS = {"disk_blocks", "disk_gb", "disk_bytes", "disk_bandwidth_gbps", "disk_latency_us", "disk_store_mode"}
LLAMA_1GB = ["--example", "--model", "llama3-8b", "--cpu-gb", "1"]  # a CPU tier of 14 blocks of 64 MiB


def run_json(*args: object) -> dict[str, Any]:
    result = kvflow("simulate", *args, "--json")
    assert result.exit_code == 0 and result.stderr == "", result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def tier_rows(out: str) -> dict[str, list[str]]:
    """The rows of the "per tier" table: tier -> its other cells (empty ones kept)."""
    rows = {}
    for text in out.splitlines():
        if text.count("│") == 6:  # five cells between the borders
            cells = [c.strip() for c in text.split("│")[1:-1]]
            rows[cells[0]] = cells[1:]
    return rows


def test_the_disk_keys_are_there_with_a_disk_and_only_then() -> None:
    with_disk = run_json(*LLAMA_1GB, "--disk-gb", 10)
    assert DISK_KEYS <= set(with_disk) and DISK_CONFIG_KEYS <= set(with_disk["config"])
    assert all(isinstance(with_disk[k], int) for k in DISK_KEYS if not k.endswith("_ms"))
    assert all(isinstance(with_disk[k], float) and with_disk[k] > 0 for k in DISK_KEYS if k.endswith("_ms"))
    block = with_disk["config"]["bytes_per_block"]
    assert with_disk["config"]["disk_blocks"] == 10 * 10**9 // block and with_disk["config"]["disk_gb"] == 10
    assert with_disk["config"]["disk_bytes"] == with_disk["config"]["disk_blocks"] * block
    assert (with_disk["config"]["disk_bandwidth_gbps"], with_disk["config"]["disk_latency_us"]) == (3.0, 100.0)
    assert with_disk["config"]["disk_store_mode"] == "ahead_of_eviction"
    assert with_disk["disk_bytes_stored"] == with_disk["disk_stored_blocks"] * block > 0
    assert with_disk["disk_bytes_loaded"] == with_disk["disk_loaded_blocks"] * block > 0
    without = run_json(*LLAMA_1GB)
    assert not DISK_KEYS & set(without) and not DISK_CONFIG_KEYS & set(without["config"])
    plain = kvflow("simulate", *LLAMA_1GB).stdout
    assert tier_rows(plain) == {} and "disk tier" not in table_rows(plain)


@pytest.mark.parametrize(
    "extra",
    [[], ["--disk-store", "write-through"], ["--device-blocks", "40"], ["--store", "lazy", "--device-blocks", "40"],
     ["--fault-rate", "0.1", "--seed", "3"], ["--policy", "arc"]],
)  # fmt: skip
def test_the_cpu_tier_hits_split_into_its_own_and_the_disks(extra: list[str]) -> None:
    s = run_json(*LLAMA_1GB, "--disk-gb", 10, *extra)
    assert s["hit_tokens_cpu"] + s["hit_tokens_disk"] == s["cpu_hit_tokens"]
    assert s["hit_tokens"] == s["cpu_hit_tokens"] + s["device_hit_tokens"]
    assert s["hit_tokens_disk"] > 0 and s["hit_tokens_cpu"] >= 0
    # a disk hit went disk -> CPU tier -> device: what the disk loaded, the CPU tier loaded on
    assert s["hit_tokens_disk"] <= s["disk_loaded_blocks"] * 512 <= s["loaded_blocks"] * 512


def test_a_bigger_disk_never_lowers_the_disk_hits() -> None:
    none, small, large = (run_json(*LLAMA_1GB, *args) for args in ([], ["--disk-gb", 2], ["--disk-gb", 10]))
    assert 0 < small["hit_tokens_disk"] < large["hit_tokens_disk"]
    assert none["hit_tokens"] < small["hit_tokens"] < large["hit_tokens"]


def test_a_disk_of_zero_gb_is_no_disk() -> None:
    assert run_json(*LLAMA_1GB, "--disk-gb", 0) == run_json(*LLAMA_1GB)
    # the disk's model options are read (a disk of 0 is a disk option given), and change nothing
    assert run_json(*LLAMA_1GB, "--disk-gb", 0, "--disk-latency-us", 5) == run_json(*LLAMA_1GB)
    assert kvflow("simulate", *LLAMA_1GB, "--disk-gb", 0).stdout == kvflow("simulate", *LLAMA_1GB).stdout
    assert run_json(*LLAMA_1GB, "--disk-gb", 0, "--mode", "timed") == run_json(*LLAMA_1GB, "--mode", "timed")


def test_the_disk_model_sets_the_disks_busy_time() -> None:
    """Each disk job takes its latency plus its bytes over the bandwidth, on the disk's own
    streams: halving the bandwidth doubles the bytes' share and leaves the decisions alone."""
    fast = run_json(*LLAMA_1GB, "--disk-gb", 10, "--disk-latency-us", 0)
    slow = run_json(*LLAMA_1GB, "--disk-gb", 10, "--disk-latency-us", 0, "--disk-bandwidth-gbps", 1.5)
    assert fast["disk_load_ms"] == pytest.approx(fast["disk_bytes_loaded"] / 3e9 * 1000)
    assert fast["disk_store_ms"] == pytest.approx(fast["disk_bytes_stored"] / 3e9 * 1000)
    assert slow["disk_load_ms"] == pytest.approx(2 * fast["disk_load_ms"])
    assert {k: slow[k] for k in SUMMARY_KEYS} == {k: fast[k] for k in SUMMARY_KEYS}
    assert slow["cpu_load_ms"] == fast["cpu_load_ms"]  # the link's copies are not the disk's
    assert slow["sim_time_ms"] > fast["sim_time_ms"]  # a request waits for its disk run
    late = run_json(*LLAMA_1GB, "--disk-gb", 10, "--disk-latency-us", 1000)
    jobs_lower_bound = 1000 / 1000  # (at least one job, 1 ms each)
    assert late["disk_load_ms"] >= fast["disk_load_ms"] + jobs_lower_bound


def test_write_through_copies_every_stored_block() -> None:
    ahead = run_json(*LLAMA_1GB, "--disk-gb", 40)
    through = run_json(*LLAMA_1GB, "--disk-gb", 40, "--disk-store", "write-through")
    assert through["config"]["disk_store_mode"] == "write_through"
    assert through["disk_stored_blocks"] > ahead["disk_stored_blocks"]


def test_the_tables_show_the_disk_and_each_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # no cell folded onto a second line, whatever runs the tests
    args = [*LLAMA_1GB, "--disk-gb", 10, "--disk-bandwidth-gbps", 2.5, "--disk-latency-us", 50]
    data = run_json(*args)
    out = kvflow("simulate", *args)
    assert out.exit_code == 0 and out.stderr == "", out.output
    setup = table_rows(out.stdout)
    assert setup["disk tier"] == f"{data['config']['disk_blocks']} blocks = 10.00 GB (--disk-gb 10, in whole blocks), ahead-of-eviction"
    assert setup["disk model"] == "2.5 GB/s per direction, 50 µs per job"
    tiers = tier_rows(out.stdout)
    assert list(tiers) == ["device", "CPU tier", "disk tier"]
    prompt = data["prompt_tokens"]
    for tier, prefix in (("CPU tier", "cpu"), ("disk tier", "disk")):
        hit, blocks, moved, busy = tiers[tier]
        d = "disk_" if prefix == "disk" else ""
        assert hit == f"{data[f'hit_tokens_{prefix}']:,} ({data[f'hit_tokens_{prefix}'] / prompt:.1%})"
        assert blocks == f"{data[f'{d}stored_blocks']:,} / {data[f'{d}loaded_blocks']:,}"
        assert moved == f"{data[f'{d}bytes_stored'] / 1e9:,.2f} GB / {data[f'{d}bytes_loaded'] / 1e9:,.2f} GB"
        assert busy == f"{data[f'{prefix}_store_ms']:,.1f} ms / {data[f'{prefix}_load_ms']:,.1f} ms"
    assert tiers["device"][0] == "0 (0.0%)"


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--disk-gb", "-1"], ["--disk-gb", "-1"]),
        (["--disk-gb", "nan"], ["--disk-gb", "nan"]),
        (["--disk-gb", "inf"], ["--disk-gb", "inf"]),
        (["--disk-gb", "x"], ["--disk-gb", "'x'"]),
        (["--disk-gb", "0.01"], ["--disk-gb", "less than one block"]),
        (["--disk-gb", "1e12"], ["--disk-gb", "more than a disk tier's"]),
        (["--disk-gb", "2", "--disk-bandwidth-gbps", "0"], ["--disk-bandwidth-gbps", "> 0"]),
        (["--disk-gb", "2", "--disk-bandwidth-gbps", "-3"], ["--disk-bandwidth-gbps", "-3"]),
        (["--disk-gb", "2", "--disk-bandwidth-gbps", "nan"], ["--disk-bandwidth-gbps", "nan"]),
        (["--disk-gb", "2", "--disk-latency-us", "-1"], ["--disk-latency-us", ">= 0"]),
        (["--disk-gb", "2", "--disk-latency-us", "inf"], ["--disk-latency-us", "inf"]),
        (["--disk-gb", "2", "--disk-store", "sometimes"], ["--disk-store", "sometimes", "write-through"]),
        (["--disk-bandwidth-gbps", "5"], ["--disk-bandwidth-gbps", "--disk-gb"]),
        (["--disk-latency-us", "5"], ["--disk-latency-us", "--disk-gb"]),
        (["--disk-store", "write-through"], ["--disk-store", "--disk-gb"]),
        (["--disk-gb", "2", "--instances", "2"], ["--disk-gb", "--instances", "remote tier"]),
        (["--disk-gb", "2", "--remote-blocks", "100"], ["--disk-gb", "--instances"]),
        (["--disk-gb", "2", "--cpu-blocks", "0"], ["--disk-gb", "CPU tier"]),
        (["--sweep-disk-gb", "1", "--disk-gb", "2"], ["--disk-gb", "--sweep-disk-gb", "apply"]),
        (["--sweep-disk-gb", "1", "--sweep", "32"], ["--sweep", "--sweep-disk-gb", "one sweep"]),
        (["--sweep-disk-gb", "1", "--sweep-gb", "1"], ["--sweep-gb", "--sweep-disk-gb", "one sweep"]),
        (["--sweep-disk-gb", "1,x"], ["--sweep-disk-gb", "'x'"]),
        (["--sweep-disk-gb", "1,-2"], ["--sweep-disk-gb", "-2"]),
        (["--sweep-disk-gb", " , "], ["--sweep-disk-gb", "at least one"]),
        (["--sweep-disk-gb", "8,0.01"], ["0.01", "less than one block"]),
    ],
)
def test_a_bad_disk_option_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str], needles: list[str]
) -> None:
    import kvflow.simulate.run as sim

    runs: list[object] = []
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: runs.append(a))
    monkeypatch.chdir(tmp_path)
    plot = ["--plot", "s.png"] if any(a.startswith("--sweep") for a in args) else []
    assert_one_line_error(kvflow("simulate", "--example", "--model", "llama3-8b", *args, *plot), *needles)
    assert runs == [] and list(tmp_path.iterdir()) == []  # refused before any run, nothing written


def test_the_disk_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    seen: list[dict[str, Any]] = []
    real_savefig = Figure.savefig

    def savefig(fig: Figure, *args: Any, **kwargs: Any) -> None:
        ax = fig.axes[0]
        seen.append({"x": [list(line.get_xdata()) for line in ax.get_lines()], "xlabel": ax.get_xlabel(),
                     "title": ax.get_title()})  # fmt: skip
        real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    args = [*LLAMA_1GB, "--sweep-disk-gb", "0,2,10", "--plot", tmp_path / "disk.png"]
    data = run_json(*args)
    assert data["unit"] == "disk GB" and data["capacities"] == [0, 2, 10] and list(data["results"]) == ["lru", "arc"]
    block = 512 * 128 * 1024
    for policy in ("lru", "arc"):
        runs = data["results"][policy]
        assert [r["config"]["cpu_blocks"] for r in runs] == [10**9 // block] * 3  # the CPU tier given, each time
        assert [r["config"].get("disk_blocks", 0) for r in runs] == [0, 2 * 10**9 // block, 10 * 10**9 // block]
        assert "hit_tokens_disk" not in runs[0] and runs[1]["hit_tokens_disk"] < runs[2]["hit_tokens_disk"]
    # each run is the run of that disk alone
    assert data["results"]["arc"][2] == run_json(*LLAMA_1GB, "--disk-gb", 10, "--policy", "arc")
    assert data["results"]["lru"][0] == run_json(*LLAMA_1GB)
    (plot,) = seen
    assert plot["x"] == [[0, 2, 10]] * 2 and plot["xlabel"].startswith("disk tier capacity (GB")
    assert "CPU tier 14 blocks" in plot["title"]
    text = kvflow("simulate", *args).stdout.splitlines()
    assert "CPU tier 14 blocks = 0.94 GB" in text[0]
    lru10 = data["results"]["lru"][2]
    want = f"hit rate {lru10['hit_rate']:.2%}  (cpu {lru10['cpu_hit_tokens'] / lru10['prompt_tokens']:.2%}, "
    want += f"of which disk {lru10['hit_tokens_disk'] / lru10['prompt_tokens']:.2%})"
    assert any(x.strip().startswith("lru disk_gb=10 (149 blocks)") and x.endswith(want) for x in text), text


def test_a_disk_under_each_cpu_size_of_a_sweep(tmp_path: Path) -> None:
    data = run_json("--example", "--model", "llama3-8b", "--disk-gb", 10, "--sweep-gb", "1,4", "--policy", "lru",
                    "--plot", tmp_path / "s.png")  # fmt: skip
    assert data["unit"] == "GB" and [r["config"]["disk_gb"] for r in data["results"]["lru"]] == [10, 10]
    assert data["results"]["lru"][0] == run_json(*LLAMA_1GB, "--disk-gb", 10)


def test_the_documented_per_tier_table_is_what_the_command_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/simulate.md shows a command and, below it, the table it prints: run it again."""
    text = (REPO / "docs" / "simulate.md").read_text(encoding="utf-8")
    found = re.search(r"```bash\n(kvflow simulate [^\n]*--disk-gb [^\n]*)\n```\n.*?```text\n(per tier\n.*?)```", text, re.S)
    assert found is not None, "docs/simulate.md: the disk tier's command and its output"
    command, shown = found.groups()
    monkeypatch.setenv("COLUMNS", "140")  # (what tests/test_docs.py runs the documents' commands with)
    result = kvflow(*command.split()[1:])
    assert result.exit_code == 0, result.output
    printed = result.stdout[result.stdout.index("per tier\n"):]
    assert printed == shown, f"docs/simulate.md: paste the output of `COLUMNS=140 {command}` from 'per tier' on"
