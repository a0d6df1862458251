"""``kvflow report --html`` rendered in a real headless Chromium (Debian's
``chromium-headless-shell``), its page checked against what ``kvflow inspect`` and ``kvflow
incidents`` say and against the trace's own lines; ``kvflow export --chrome-trace`` checked
against the trace-event format's required fields and the trace's jobs.

Without Chromium the page tests skip, unless ``KVFLOW_REQUIRE_CHROMIUM`` is set (CI), where a
missing browser is a failure.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvflow.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "traces"
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser")


def kvflow(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("KVFLOW_REQUIRE_CHROMIUM"):
        pytest.fail(f"KVFLOW_REQUIRE_CHROMIUM is set but none of {', '.join(BROWSERS)} is installed")
    pytest.skip("no headless Chromium (Debian: apt-get install chromium-headless-shell)")


def rendered(page: Path) -> str:
    """The page's DOM after its scripts ran, as Chromium serialises it."""
    done = subprocess.run(
        [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return done.stdout


def trace_lines(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return json.loads(lines[0]), [json.loads(text) for text in lines[1:]]


def attrs(tag: str) -> dict[str, str]:
    return {k: html.unescape(v) for k, v in re.findall(r'([\w-]+)="([^"]*)"', tag)}


def elements(dom: str, name: str, cls: str) -> list[dict[str, str]]:
    """The attributes of every ``<name class="cls ...">`` in the DOM."""
    return [attrs(m) for m in re.findall(rf"<{name} [^>]*>", dom) if re.search(rf'class="{cls}[ "]', m)]


@pytest.fixture(scope="module")
def big_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trace with more jobs than the page draws one by one (tools/make_big_trace.py)."""
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_big_trace.py"), str(path), "--mb", "12", "--fault-rate", "0.02"],
        check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    return path


def report(trace: Path, tmp_path: Path) -> tuple[str, str]:
    page = tmp_path / "page.html"
    result = kvflow("report", trace, "--html", page)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    return page.read_text(encoding="utf-8"), rendered(page)


@pytest.mark.parametrize("name", ["two_ranks.jsonl", "timeouts.jsonl", "load_failures.jsonl", "reset_inflight.jsonl"])
def test_the_page_shows_what_inspect_and_incidents_say(tmp_path: Path, name: str) -> None:
    trace = TRACES / name
    source, dom = report(trace, tmp_path)
    assert 'data-drawn="yes"' in dom  # the page's script ran to its end

    # it loads nothing: no stylesheet, script or image from anywhere
    assert not re.search(r"<link|<img|<iframe|\ssrc=|@import|url\(", source, re.I)
    assert set(re.findall(r"https?://[^\s\"'<>]+", source)) <= {"http://www.w3.org/2000/svg"}

    # the tier at a run's last seq is what inspect --at says there
    runs = elements(dom, "g", "occupancy")
    assert len(runs) >= 10
    for run in [runs[0], runs[len(runs) // 3], runs[len(runs) // 2], runs[-1]]:
        state = json.loads(kvflow("inspect", trace, "--at", run["data-seq"], "--json").stdout)["state"]
        assert int(run["data-resident"]) == state["resident_blocks"]
        assert int(run["data-free"]) == state["free_slots"]
        assert int(run["data-fenced"]) == len(state["fenced_slots"])
        assert int(run["data-in-flight"]) == len(state["entries"]) - state["resident_blocks"]

    # the hit rate, counted here from the trace's lines: a lookup's hits are the pins it took
    header, records = trace_lines(trace)
    tokens_per_block = header["config"]["block_tokens"]
    hits = tokens = 0
    lookup: dict[str, Any] = {}
    for rec in records:
        if rec["type"] == "lookup":
            lookup = rec
        elif rec["type"] == "pins_acquired":
            tokens += rec["num_tokens"]
            hits += (len(rec["hashes"]) + lookup.get("device_hit_blocks", 0)) * tokens_per_block
    rate = next(a for a in (attrs(m) for m in re.findall(r"<span [^>]*>", dom)) if a.get("id") == "hit-rate")
    assert (int(rate["data-hit-tokens"]), int(rate["data-tokens"])) == (hits, tokens) and tokens > 0
    bars = elements(dom, "rect", "hit")
    assert sum(int(float(b["data-hit-tokens"])) for b in bars) == hits
    assert sum(int(float(b["data-tokens"])) for b in bars) == tokens

    # the incidents are kvflow incidents', each linking to its job's records on the page
    found = json.loads(kvflow("incidents", trace, "--json").stdout)
    rows = elements(dom, "tr", "incident")
    assert [(int(r["data-seq"]), r["data-job"]) for r in rows] == [
        (i["seq"], str(i["job_id"]) if i["job_id"] is not None else "-") for i in found
    ]
    jobs = sorted({i["job_id"] for i in found if i["kind"] == "job"})
    assert jobs
    for job in jobs:
        assert f'href="#job-{job}"' in dom and f'id="job-{job}"' in dom
        section = re.search(rf'<section class="history" id="job-{job}">.*?<pre>(.*?)</pre>', dom, re.S)
        assert section is not None
        shown_lines = html.unescape(section.group(1)).splitlines()[1:]
        history = json.loads(kvflow("inspect", trace, "--job", job, "--json").stdout)["history"]
        expected = {(str(h["seq"] if h["seq"] is not None else "cmd"), str(h["line"]), h["text"]) for h in history}
        for text in shown_lines:
            seq, line, what = text.split(None, 2)
            assert (seq, line, what) in expected, text
        assert any(w in t.lower() for t in shown_lines for w in ("failed", "timed out", "cancelled")), shown_lines

    # every job is drawn on each of its ranks' tracks; every failure, timeout and fence is marked
    world = header["config"]["world_size"]
    queued = [r for r in records if r["type"].endswith("_queued")]
    ended = [r for r in records if r["type"] in ("job_completed", "job_failed", "job_timed_out")]
    drawn = elements(dom, "rect", "job")
    assert len(drawn) == len(ended) * world and len({d["data-job"] for d in drawn}) == len(ended) <= len(queued)
    for kind, rtype in (("failed", "job_failed"), ("timed_out", "job_timed_out")):
        marked = {m["data-job"] for m in elements(dom, "path", f"mark {kind}")}
        expected_jobs = {str(r["job_id"]) for r in records if r["type"] == rtype and (rtype != "job_failed" or r["rank"] >= 0)}
        assert marked == expected_jobs
    fenced = {str(r["job_id"]) for r in records if r["type"] in ("job_failed", "job_timed_out") and r.get("fenced")}
    assert {m["data-job"] for m in elements(dom, "path", "mark fenced")} == fenced
    lifted = {str(r["job_id"]) for r in records if r["type"] == "fence_lifted"}
    assert {m["data-job"] for m in elements(dom, "path", "mark fence_lifted")} <= lifted


def test_a_long_trace_is_summarised_in_runs(tmp_path: Path, big_trace: Path) -> None:
    """Past the jobs the page draws one by one, each track shows how busy it was per run
    (the busy seqs add up to the jobs' spans); failures are still marked one by one."""
    source, dom = report(big_trace, tmp_path)
    assert len(source) < 2_000_000
    assert not elements(dom, "rect", "job")
    busy = elements(dom, "rect", "busy")
    assert busy and {b["data-track"] for b in busy} == {"store rank 0", "load rank 0"}
    header, records = trace_lines(big_trace)
    found = json.loads(kvflow("incidents", big_trace, "--json").stdout)
    assert len(elements(dom, "path", "mark failed")) == len([i for i in found if i["outcome"] == "failed"]) > 0
    # the busy seqs of a track are the seqs its jobs spanned: submitted .. ended, both counted
    submitted: dict[int, int] = {}
    queued: dict[int, tuple[str, int]] = {}
    spans = {"store rank 0": 0, "load rank 0": 0}
    for rec in records:
        if rec["type"] in ("store_queued", "load_queued"):
            queued[rec["job_id"]] = (rec["type"].removesuffix("_queued"), rec["seq"])
        elif rec["type"] == "jobs_submitted":
            for job in rec["job_ids"]:
                submitted[job] = rec["seq"]
        elif rec["type"] in ("job_completed", "job_failed", "job_timed_out"):
            direction, seq = queued[rec["job_id"]]
            spans[f"{direction} rank 0"] += rec["seq"] - submitted.get(rec["job_id"], seq) + 1
    for track, total in spans.items():
        assert sum(float(b["data-busy"]) for b in busy if b["data-track"] == track) == total


def test_report_refuses_a_folder_it_cannot_write(tmp_path: Path) -> None:
    result = kvflow("report", TRACES / "clean.jsonl", "--html", tmp_path / "no" / "page.html")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"kvflow: error: {tmp_path / 'no' / 'page.html'}: No such file or directory"


# -- export --chrome-trace -------------------------------------------------------------------

REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "i": {"name", "ph", "ts", "pid", "tid", "s"},
            "M": {"name", "ph", "pid", "tid", "args"}}  # fmt: skip


@pytest.mark.parametrize("name", ["two_ranks.jsonl", "timeouts.jsonl", "load_failures.jsonl", "reset_inflight.jsonl"])
def test_export_writes_the_jobs_as_trace_events(tmp_path: Path, name: str) -> None:
    trace = TRACES / name
    out = tmp_path / "trace.json"
    result = kvflow("export", trace, "--chrome-trace", out)
    assert result.exit_code == 0 and result.stderr == "", result.output
    data = json.loads(out.read_text())
    events = data["traceEvents"]
    assert data["displayTimeUnit"] == "ms"
    for event in events:
        assert REQUIRED[event["ph"]] <= set(event), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] in "Xi":
            assert isinstance(event["ts"], float) and event["ts"] >= 0
        if event["ph"] == "X":
            assert isinstance(event["dur"], float) and event["dur"] >= 0
        if event["ph"] == "i":
            assert event["s"] in ("g", "p", "t")
    header, records = trace_lines(trace)
    world = header["config"]["world_size"]

    # a slice per job and rank, starting at the job's submission, on its direction's track
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in events if e["ph"] in "Xi"} <= set(names)
    submitted = {j: r["now_ms"] for r in records if r["type"] == "jobs_submitted" for j in r["job_ids"]}
    directions = {r["job_id"]: r["type"].removesuffix("_queued") for r in records if r["type"].endswith("_queued")}
    ended = {r["job_id"]: r for r in records if r["type"] in ("job_completed", "job_failed", "job_timed_out")}
    assert len(slices) == len(ended) * world
    for s in slices:
        job = s["args"]["job"]
        assert names[s["tid"]].startswith(f"{directions[job]} rank ")
        if job in submitted:
            assert s["ts"] == round(submitted[job] * 1000, 3)
        end = ended[job]
        outcome = {"job_completed": "completed", "job_timed_out": "timed_out"}.get(end["type"])
        assert s["args"]["outcome"] == outcome or (outcome is None and s["args"]["outcome"] in ("failed", "cancelled"))
        assert s["args"]["end_seq"] <= end["seq"] and s["args"]["start_seq"] <= s["args"]["end_seq"]
        if end["type"] == "job_timed_out":
            assert s["ts"] + s["dur"] == pytest.approx(end["now_ms"] * 1000)

    # an instant for each failure and timeout (on the failing rank), fence and fence lift
    for cat, rtype in (("failed", "job_failed"), ("timed_out", "job_timed_out")):
        marked = sorted(e["args"]["job"] for e in events if e["ph"] == "i" and e["cat"] == cat)
        expected = [r["job_id"] for r in records if r["type"] == rtype and (cat != "failed" or r["rank"] >= 0)]
        assert marked == sorted(expected * (world if cat == "timed_out" else 1))
    fenced = sorted(r["job_id"] for r in records if r["type"] in ("job_failed", "job_timed_out") and r.get("fenced"))
    assert sorted(e["args"]["job"] for e in events if e["ph"] == "i" and e["cat"] == "fenced") == sorted(fenced * world)
    assert kvflow("export", trace, "--chrome-trace", out).exit_code == 0
    assert json.loads(out.read_text()) == data  # deterministic
    to_stdout = kvflow("export", trace, "--chrome-trace", "-")
    assert to_stdout.exit_code == 0 and to_stdout.stdout == out.read_text()


def test_export_streams_a_long_trace(tmp_path: Path, big_trace: Path) -> None:
    out = tmp_path / "trace.json"
    assert kvflow("export", big_trace, "--chrome-trace", out).exit_code == 0
    events = json.loads(out.read_text())["traceEvents"]
    _, records = trace_lines(big_trace)
    ended = sum(1 for r in records if r["type"] in ("job_completed", "job_failed", "job_timed_out"))
    assert sum(1 for e in events if e["ph"] == "X") == ended > 2_000


def test_the_tier_of_the_walks_trace_fills_where_the_docs_say() -> None:
    """docs/debugging.md: on traces/clean.jsonl the tier is full from about seq 207 on."""
    from kvflow.inspect.timeline import follow

    timeline, _ = follow(TRACES / "clean.jsonl")
    samples = [b["sample"] for b in timeline.bins.to_list() if b["sample"] is not None]
    first_full = next(s["seq"] for s in samples if s["free"] == 0)
    doc = " ".join((REPO / "docs" / "debugging.md").read_text(encoding="utf-8").split())
    assert f"the tier full from about seq {first_full} on" in doc


def test_the_page_is_the_same_every_time(tmp_path: Path) -> None:
    pages = []
    for n in range(2):
        page = tmp_path / f"page{n}.html"
        assert kvflow("report", TRACES / "two_ranks.jsonl", "--html", page).exit_code == 0
        pages.append(page.read_bytes())
    assert pages[0] == pages[1]
