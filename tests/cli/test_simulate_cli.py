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

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "traces" / "workloads" / "example.jsonl"
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
    result = kvflow("simulate", EXAMPLE, "--cpu-blocks", 256, "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # no progress bar, no log lines
    summary = json.loads(result.stdout)  # the whole of stdout is one JSON object
    assert REQUIRED_KEYS <= set(summary) and set(SUMMARY_KEYS) <= set(summary)
    assert all(isinstance(summary[k], int) for k in REQUIRED_KEYS)
    assert summary["requests"] == 200 and summary["prompt_tokens"] == 1_198_285
    assert summary["hit_tokens"] == summary["cpu_hit_tokens"] + summary["device_hit_tokens"]
    assert summary["hit_tokens"] == 865_792  # traces/workloads/README.md


def test_plain_output_is_a_table_of_the_same_numbers() -> None:
    result = kvflow("simulate", EXAMPLE, "--cpu-blocks", 256)
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
        [*KVFLOW, "simulate", str(EXAMPLE), "--cpu-blocks", "64", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.count("\n") == 1 and json.loads(proc.stdout)["requests"] == 200
    plain = subprocess.run(
        [*KVFLOW, "simulate", str(EXAMPLE), "--cpu-blocks", "64"], capture_output=True, text=True, timeout=60
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
    shown = _on_a_terminal("simulate", str(EXAMPLE), "--cpu-blocks", "64")
    assert HIDE_CURSOR in shown and b"simulate" in shown  # positive control: the bar is drawn
    as_json = _on_a_terminal("simulate", str(EXAMPLE), "--cpu-blocks", "64", "--json")
    assert HIDE_CURSOR not in as_json
    assert json.loads(as_json.decode())["requests"] == 200


def test_progress_is_never_drawn_into_captured_stderr() -> None:
    for args in ([], ["--progress"], ["--json", "--progress"]):
        result = kvflow("simulate", EXAMPLE, "--cpu-blocks", 64, *args)
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
    shown, log = _split_terminal("simulate", str(EXAMPLE), "--cpu-blocks", "64", terminal="stdout")
    assert log == b"" and HIDE_CURSOR not in shown and b"requests" in shown
    # stdout redirected (>out), stderr on the terminal: the bar there, stdout clean
    shown, out = _split_terminal("simulate", str(EXAMPLE), "--cpu-blocks", "64", terminal="stderr")
    assert HIDE_CURSOR in shown and b"simulate" in shown
    assert b"\x1b" not in out and b"requests" in out


def test_timed_mode_shows_load_and_store_percentiles() -> None:
    data = json.loads(kvflow("simulate", EXAMPLE, "--cpu-blocks", 64, "--mode", "timed", "--json").stdout)
    table = kvflow("simulate", EXAMPLE, "--cpu-blocks", 64, "--mode", "timed")
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
    sequential = kvflow("simulate", EXAMPLE, "--cpu-blocks", 64).stdout
    assert "p50" not in sequential  # percentiles are a timed-mode result


# --- capacity in GB ---------------------------------------------------------------------------


@pytest.mark.parametrize(("gb", "bytes_per_block"), [("0.5", 2 * 1024 * 1024), ("1.25", 10**6), ("0.3", 10**8)])
def test_cpu_gb_is_whole_blocks_rounded_down(gb: str, bytes_per_block: int) -> None:
    from fractions import Fraction

    blocks = int(Fraction(gb) * 10**9 // bytes_per_block)  # exact arithmetic, rounded down
    by_gb = kvflow("simulate", EXAMPLE, "--cpu-gb", gb, "--bytes-per-block", bytes_per_block, "--json")
    assert by_gb.exit_code == 0, by_gb.output
    by_blocks = kvflow("simulate", EXAMPLE, "--cpu-blocks", blocks, "--bytes-per-block", bytes_per_block, "--json")
    summary = json.loads(by_gb.stdout)
    assert summary["config"]["cpu_blocks"] == blocks
    assert summary == json.loads(by_blocks.stdout)


def test_cpu_gb_zero_disables_offload_like_zero_blocks() -> None:
    summary = json.loads(kvflow("simulate", EXAMPLE, "--cpu-gb", "0", "--json").stdout)
    assert summary["config"]["cpu_blocks"] == 0 and summary["cpu_hit_tokens"] == 0


def test_default_capacity_without_either_option() -> None:
    summary = json.loads(kvflow("simulate", EXAMPLE, "--json").stdout)
    assert summary["config"]["cpu_blocks"] == 2000  # the documented default


def test_cpu_gb_and_cpu_blocks_together() -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE, "--cpu-gb", "1", "--cpu-blocks", 100), "--cpu-gb", "--cpu-blocks")


@pytest.mark.parametrize("gb", ["-1", "nan", "inf", "0.001", "-0.5"])
def test_bad_cpu_gb(gb: str) -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE, "--cpu-gb", gb), "--cpu-gb")


def test_cpu_gb_below_one_block_says_so() -> None:
    err = assert_one_line_error(kvflow("simulate", EXAMPLE, "--cpu-gb", "0.002", "--bytes-per-block", 3 * 10**6))
    assert "less than one block" in err and "3,000,000 bytes" in err


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
    assert_one_line_error(kvflow("simulate", EXAMPLE, "--cpu-blocks", -1), "cpu_blocks", "-1")


def test_an_unknown_policy_lists_the_known_ones() -> None:
    err = assert_one_line_error(kvflow("simulate", EXAMPLE, "--policy", "fifo"), "fifo")
    assert "lru" in err and "arc" in err


@pytest.mark.parametrize("rate", ["2", "-0.5", "nan"])
def test_a_fault_rate_outside_zero_to_one(rate: str) -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE, "--fault-rate", rate), "fault-rate")


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
        name: subprocess.Popen([*KVFLOW, "simulate", str(EXAMPLE), *args, "--json"],
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
    result = kvflow("simulate", EXAMPLE, "--sweep", "32,256", "--plot", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 1000
    lines = result.stdout.splitlines()
    for policy in ("lru", "arc"):
        for cap in ("32", "256"):
            assert any(policy in x and re.search(rf"\b{cap}\b", x) for x in lines), (policy, cap, lines)
    # the numbers printed are the simulator's own
    lru256 = json.loads(kvflow("simulate", EXAMPLE, "--cpu-blocks", 256, "--json").stdout)
    assert any("lru" in x and f"{lru256['hit_rate']:.2%}" in x for x in lines)


def test_sweep_with_a_bad_capacity() -> None:
    assert_one_line_error(kvflow("simulate", EXAMPLE, "--sweep", "32,x"), "sweep")


def test_sweep_without_matplotlib_still_prints_its_numbers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` raises ImportError
    png = tmp_path / "sweep.png"
    result = kvflow("simulate", EXAMPLE, "--sweep", "32,256", "--plot", png)
    assert result.exit_code == 0, result.output
    lru256 = json.loads(kvflow("simulate", EXAMPLE, "--cpu-blocks", 256, "--json").stdout)
    lines = result.stdout.splitlines()
    assert len([x for x in lines if "cpu_blocks=" in x]) == 4
    assert any("lru" in x and f"{lru256['hit_rate']:.2%}" in x for x in lines)
    assert "plot written" not in result.stdout and not png.exists()
    assert result.stderr.startswith("kvflow: warning: ") and result.stderr.count("\n") == 1
    assert "matplotlib" in result.stderr and str(png) in result.stderr
    as_json = kvflow("simulate", EXAMPLE, "--sweep", "32,256", "--plot", png, "--json")
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
    err = assert_one_line_error(kvflow("simulate", EXAMPLE, "--sweep", "32,256", "--plot", png), str(png), "plot")
    assert runs == []  # refused before the first simulation
    assert ("No such file or directory" if where == "missing directory" else "Is a directory") in err
    ok = kvflow("simulate", EXAMPLE, "--sweep", "32,256", "--plot", tmp_path / "ok.png")
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
    assert kvflow("simulate", EXAMPLE, "--sweep", "32,256,1000", "--plot", tmp_path / "a.png").exit_code == 0
    assert kvflow("simulate", EXAMPLE, "--sweep", "0,32,256", "--plot", tmp_path / "b.png").exit_code == 0
    # capacity 0 (offload off) cannot sit on a log axis: linear up to the first capacity
    assert saved == [("log", ["32", "256", "1,000"]), ("symlog", ["0", "32", "256"])]


# --- record, then kv-events ------------------------------------------------------------------


def test_kv_events_of_a_recorded_run_match_its_stores_and_evictions(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    result = kvflow("simulate", EXAMPLE, "--cpu-blocks", 32, "--fault-rate", 0.2, "--seed", 3,
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
    assert kvflow("simulate", EXAMPLE, "--cpu-blocks", 32, "--record", trace, "--json").exit_code == 0
    proc = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "kv-events", str(trace)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == kvflow("kv-events", trace).stdout
