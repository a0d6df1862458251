"""The ``kvflow report`` verb: a trace as one self-contained HTML page (its CSS, script and
drawings inline; it loads nothing), from one pass over the trace (``kvflow.inspect.timeline``).

The page shows the hit rate and the tier's occupancy per run of seqs, the jobs on a timeline per
direction and rank (failures, timeouts, cancellations and fences marked), and the incidents as
``kvflow incidents`` finds them, each linking to its job's records further down the page.
"""

from __future__ import annotations

import html
import json
import os
from typing import Any

import click

from kvflow.cli.common import output_file, trace_argument, user_errors, warn


@click.command()
@trace_argument
@click.option(
    "--html", "html_path", metavar="FILE", required=True, help="Write the page to FILE (- for standard output)."
)
def report(trace: str, html_path: str) -> None:
    """TRACE as an HTML page that needs no network: hit rate and tier occupancy over the
    trace, the jobs per direction and rank, and the incidents linked to each job's records.

    A long trace is summarised in runs of seqs (at most a few hundred), not drawn event by event.
    """
    from kvflow.inspect.timeline import follow

    with user_errors():
        timeline, found = follow(trace, incidents=True)
    assert found is not None
    for warning in found.warnings:
        warn(warning)
    page = render_page(timeline, found)
    with user_errors():
        with output_file(html_path) as out:
            out.write(page)
    runs = len(timeline.bins.bins)
    if html_path == "-":
        return  # (the page went to standard output)
    click.echo(
        f"{found.path}: wrote {html_path}: {len(found.found())} incidents of {found.jobs} jobs, "
        f"last seq {found.last_seq}, in {runs} run{'' if runs == 1 else 's'} of "
        f"{timeline.bins.width} seq{'' if timeline.bins.width == 1 else 's'}"
    )


def page_data(timeline: Any, found: Any) -> dict[str, Any]:
    """What the page's script draws (embedded in the page as JSON)."""
    config = timeline.walk.reader.config
    bins = []
    for b in timeline.bins.to_list():
        busy = {k.removeprefix("busy:"): v for k, v in b.items() if k.startswith("busy:")}
        row = {k: v for k, v in b.items() if not k.startswith("busy:")}
        row["busy"] = busy
        bins.append(row)
    return {
        "trace": found.path,
        "last_seq": found.last_seq,
        "width": timeline.bins.width,
        "capacity": config.cpu_blocks,
        "world_size": config.world_size,
        "bins": bins,
        "tracks": timeline.ordered_tracks(),
        "spans": None if timeline.too_many_jobs else [s.to_dict() for s in timeline.spans],
        "marks": [m.to_dict() for m in timeline.marks],
        "incident_jobs": sorted({i.job_id for i in found.incidents}),
    }


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def render_page(timeline: Any, found: Any) -> str:
    from kvflow.cli.inspect import incident_cells, refused_cells
    from kvflow.inspect.incidents import RefusedEntry

    esc = html.escape
    data = page_data(timeline, found)
    config = timeline.walk.reader.config
    sums: dict[str, float] = {}
    for b in data["bins"]:
        for key in ("lookups", "tokens", "cpu_hit_tokens", "device_hit_tokens"):
            sums[key] = sums.get(key, 0.0) + b.get(key, 0.0)
    tokens = sums.get("tokens", 0.0)
    hits = sums.get("cpu_hit_tokens", 0.0) + sums.get("device_hit_tokens", 0.0)
    name = os.path.basename(found.path)
    marks = ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in sorted(timeline.mark_counts.items())) or "none"
    summary = [
        ("trace", esc(found.path)),
        (
            "configuration",
            esc(
                f"CPU tier {config.cpu_blocks:,} blocks of {config.block_tokens} tokens, {config.policy}, "
                f"{config.store_mode} stores, {config.world_size} rank{'' if config.world_size == 1 else 's'}"
            ),
        ),
        ("events", f"last seq {found.last_seq:,}"),
        ("jobs", f"{found.jobs:,} ({timeline.jobs_ended:,} ended)"),
        ("lookups", f"{int(sums.get('lookups', 0)):,}"),
        (
            "hit rate",
            f'<span id="hit-rate" data-hit-tokens="{int(hits)}" data-tokens="{int(tokens)}">{_pct(hits, tokens)}</span>'
            f" ({int(hits):,} of {int(tokens):,} looked-up tokens)",
        ),
        ("incidents", f'<span id="incident-count" data-count="{len(found.found())}">{len(found.found()):,}</span>'),
        ("marks", esc(marks)),
    ]
    rows = []
    for item in found.found():
        if isinstance(item, RefusedEntry):
            cells, job = refused_cells(item), item.job_id
        else:
            cells, job = incident_cells(item), item.job_id
        link = f'<a href="#job-{job}">{job}</a>' if job is not None and job in timeline.histories else esc(cells["job"])
        rows.append(
            f'<tr class="incident" data-seq="{esc(cells["seq"])}" data-job="{esc(cells["job"])}">'
            f"<td>{esc(cells['seq'])}</td><td>{esc(cells['step'])}</td><td>{esc(cells['ms'])}</td>"
            f"<td>{link}</td><td>{esc(cells['what'])}</td><td>{esc(cells['request'])}</td>"
            f"<td>{esc(cells['blocks'])}</td><td>{esc(cells['error'])}</td><td>{esc(cells['recovery'])}</td></tr>"
        )
    histories = []
    for job, lines in sorted(timeline.histories.items()):
        text = "\n".join(
            f"{'cmd' if seq is None else seq:>7}  {line:>6}  {esc(what)}" for seq, line, what in lines
        )
        histories.append(
            f'<section class="history" id="job-{job}"><h3>job {job}</h3>'
            f"<pre>{'    seq    line  what'}\n{text}</pre>"
            f"<p>Every record of it: <code>kvflow inspect {esc(found.path)} --job {job}</code></p></section>"
        )
    incidents_html = (
        "<table id=\"incidents\"><thead><tr><th>seq</th><th>step</th><th>ms</th><th>job</th><th>what</th>"
        "<th>request</th><th>blocks</th><th>error</th><th>recovery</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
        if rows
        else '<p id="incidents">No failed, timed-out or cancelled job, and no refused entry.</p>'
    )
    payload = json.dumps(data, separators=(",", ":"), sort_keys=True).replace("</", "<\\/")
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in summary)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>kvflow report: {esc(name)}</title>
<style>{_CSS}</style></head>
<body>
<h1>kvflow report: {esc(name)}</h1>
<dl class="summary">{dl}</dl>
<p class="note">Positions are seqs (the events' numbers: <code>kvflow inspect TRACE --at SEQ</code> shows the
state after one). The trace is cut into <span id="runs">{len(data['bins'])}</span> runs of
{data['width']:,} seq{'' if data['width'] == 1 else 's'}.</p>
<h2>Hit rate per run</h2>
<p class="note">Hit tokens (device and CPU tier) of the run's lookups over their tokens; a request looked up
twice counts twice.</p>
<div id="hit-chart" class="chart"><noscript>The charts need the page's script.</noscript></div>
<h2>CPU tier occupancy</h2>
<p class="note">At each run's last seq: resident entries, entries being stored, fenced slots, free slots
(and the disk and remote tiers' blocks, when the trace has them).</p>
<div id="occupancy-chart" class="chart"></div>
<h2>Jobs per direction and rank</h2>
<p class="note" id="jobs-note"></p>
<div id="jobs-chart" class="chart"></div>
<h2>Incidents</h2>
{incidents_html}
<h2>The incidents' jobs</h2>
{''.join(histories) or '<p>None.</p>'}
<script type="application/json" id="data">{payload}</script>
<script>{_JS}</script>
</body></html>
"""


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;max-width:1200px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}h3{font-size:1em;margin:.8em 0 .2em}
dl.summary{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:600}dd{margin:0}
.note{color:#555;font-size:.9em}.chart svg{display:block;border:1px solid #ddd;background:#fafafa}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ccc;padding:.25em .4em;vertical-align:top}
th{background:#eee}td:nth-child(-n+4){text-align:right;white-space:nowrap}
pre{background:#f4f4f4;padding:.5em;overflow-x:auto;font-size:.85em}
.history:target,tr:target{outline:2px solid #c60}
.legend span{display:inline-block;margin-right:1em}.legend i{display:inline-block;width:.9em;height:.9em;margin-right:.3em;vertical-align:middle}
"""

_JS = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("data").textContent);
  var NS = "http://www.w3.org/2000/svg";
  var W = 1000, LEFT = 130, RIGHT = 10;
  var COLOURS = {resident: "#3a7", in_flight: "#e94", fenced: "#c33", free: "#ddd", disk: "#558", remote: "#a5a",
    completed: "#6a9", failed: "#d22", timed_out: "#e80", cancelled: "#888", fence_lifted: "#36c", fenced_mark: "#c3c"};
  var last = Math.max(data.last_seq, 1);
  function x(seq) { return LEFT + (W - LEFT - RIGHT) * seq / last; }
  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    for (var k in attrs) { node.setAttribute(k, attrs[k]); }
    if (parent) { parent.appendChild(node); }
    return node;
  }
  function title(node, text) { el("title", {}, node).textContent = text; }
  function svg(id, height) {
    var root = el("svg", {width: W, height: height, viewBox: "0 0 " + W + " " + height, role: "img"});
    document.getElementById(id).appendChild(root);
    return root;
  }
  function axis(root, y) {
    el("line", {x1: LEFT, x2: W - RIGHT, y1: y, y2: y, stroke: "#999"}, root);
    for (var i = 0; i <= 5; i++) {
      var seq = Math.round(last * i / 5);
      var anchor = i === 0 ? "start" : i === 5 ? "end" : "middle";
      el("text", {x: x(seq), y: y + 14, "font-size": 11, "text-anchor": anchor}, root).textContent = "seq " + seq;
    }
  }
  function legend(id, names) {
    var div = document.createElement("div");
    div.className = "legend";
    names.forEach(function (n) {
      var s = document.createElement("span");
      s.innerHTML = '<i style="background:' + COLOURS[n] + '"></i>' + n.replace("_mark", "").replace("_", " ");
      div.appendChild(s);
    });
    document.getElementById(id).appendChild(div);
  }
  function runWidth(b) { return Math.max(x(Math.min(b.last_seq + 1, last)) - x(b.first_seq), 0.5); }

  // hit rate: one bar per run
  (function () {
    var H = 160, root = svg("hit-chart", H + 24);
    el("text", {x: 4, y: 14, "font-size": 11}, root).textContent = "hit rate";
    el("text", {x: 4, y: H, "font-size": 11}, root).textContent = "0%";
    el("text", {x: 4, y: 28, "font-size": 11}, root).textContent = "100%";
    data.bins.forEach(function (b) {
      if (!b.tokens) { return; }
      var hits = (b.cpu_hit_tokens || 0) + (b.device_hit_tokens || 0), rate = hits / b.tokens;
      var r = el("rect", {"class": "hit", x: x(b.first_seq), width: runWidth(b), y: H - (H - 20) * rate,
        height: (H - 20) * rate, fill: "#3a7", "data-first": b.first_seq, "data-last": b.last_seq,
        "data-hit-tokens": hits, "data-tokens": b.tokens}, root);
      title(r, "seqs " + b.first_seq + "-" + b.last_seq + ": " + (100 * rate).toFixed(1) + "% of " + b.tokens + " tokens");
    });
    axis(root, H);
  })();

  // occupancy: the CPU tier's slots stacked at each run's last seq
  (function () {
    var H = 200, root = svg("occupancy-chart", H + 24), cap = Math.max(data.capacity, 1);
    el("text", {x: 4, y: 14, "font-size": 11}, root).textContent = data.capacity + " slots";
    var extra = {disk: [], remote: []}, most = {disk: 1, remote: 1};
    data.bins.forEach(function (b) {
      var s = b.sample;
      if (!s) { return; }
      var y = H, g = el("g", {"class": "occupancy", "data-seq": s.seq, "data-resident": s.resident,
        "data-in-flight": s.in_flight, "data-fenced": s.fenced, "data-free": s.free}, root);
      title(g, "after seq " + s.seq + ": " + s.resident + " resident, " + s.in_flight + " being stored, " +
        s.fenced + " fenced, " + s.free + " free");
      ["resident", "in_flight", "fenced", "free"].forEach(function (k) {
        var h = (H - 20) * s[k] / cap;
        y -= h;
        el("rect", {x: x(b.first_seq), width: runWidth(b), y: y, height: h, fill: COLOURS[k]}, g);
      });
      ["disk", "remote"].forEach(function (k) {
        if (s[k] !== undefined) { extra[k].push([x(b.last_seq), s[k]]); most[k] = Math.max(most[k], s[k]); }
      });
    });
    var shown = ["resident", "in_flight", "fenced", "free"];
    ["disk", "remote"].forEach(function (k) {
      if (!extra[k].length) { return; }
      shown.push(k);
      el("polyline", {"class": "tier-" + k, fill: "none", stroke: COLOURS[k], "stroke-width": 2,
        points: extra[k].map(function (p) { return p[0] + "," + (H - (H - 20) * p[1] / most[k]); }).join(" ")}, root);
    });
    axis(root, H);
    legend("occupancy-chart", shown);
  })();

  // jobs: a row per direction and rank
  (function () {
    var ROW = 22, tracks = data.tracks, H = ROW * tracks.length + 10, root = svg("jobs-chart", H + 24);
    var row = {};
    tracks.forEach(function (t, i) {
      row[t] = 5 + i * ROW;
      el("text", {x: 4, y: row[t] + 14, "font-size": 11}, root).textContent = t;
      el("line", {x1: LEFT, x2: W - RIGHT, y1: row[t] + ROW - 2, y2: row[t] + ROW - 2, stroke: "#eee"}, root);
    });
    var note = document.getElementById("jobs-note");
    function track(d, r) { return d + " rank " + r; }
    if (data.spans) {
      note.textContent = "Every job, from its submission to its end on each rank; failed, timed-out and " +
        "cancelled ones link to their records below.";
      data.spans.forEach(function (s) {
        var y = row[track(s.direction, s.rank)], parent = root;
        if (s.outcome !== "completed") {
          parent = el("a", {href: "#job-" + s.job}, root);
        }
        var r = el("rect", {"class": "job " + s.outcome, x: x(s.start_seq), y: y + 3,
          width: Math.max(x(s.end_seq) - x(s.start_seq), 1.5), height: ROW - 8, fill: COLOURS[s.outcome],
          "data-job": s.job, "data-start": s.start_seq, "data-end": s.end_seq}, parent);
        title(r, s.direction + " job " + s.job + " (" + s.blocks + " blocks" + (s.request ? ", " + s.request : "") +
          "): seqs " + s.start_seq + "-" + s.end_seq + ", " + s.outcome.replace("_", " "));
      });
    } else {
      note.textContent = "Too many jobs to draw one by one: the shade of each run is how many jobs were " +
        "running on the track in it, on average; failures, timeouts and fences are marked one by one.";
      var most = 0;
      data.bins.forEach(function (b) { for (var t in b.busy) { most = Math.max(most, b.busy[t] / data.width); } });
      data.bins.forEach(function (b) {
        for (var t in b.busy) {
          var level = b.busy[t] / data.width;
          el("rect", {"class": "busy", x: x(b.first_seq), y: row[t] + 3, width: runWidth(b), height: ROW - 8,
            fill: "#369", "fill-opacity": (0.1 + 0.9 * level / Math.max(most, 1e-9)).toFixed(3),
            "data-track": t, "data-first": b.first_seq, "data-busy": b.busy[t]}, root);
        }
      });
    }
    data.marks.forEach(function (m) {
      var y = row[track(m.direction, m.rank)], cx = x(m.seq), kind = m.kind === "fenced" ? "fenced_mark" : m.kind;
      var a = el("a", {href: "#job-" + m.job}, root);
      var p = el("path", {"class": "mark " + m.kind, d: "M" + cx + "," + (y + 1) + "l-4,-0 l4,7 l4,-7z",
        fill: COLOURS[kind], "data-job": m.job, "data-seq": m.seq}, a);
      title(p, "job " + m.job + " at seq " + m.seq + ": " + m.text);
    });
    axis(root, H);
    legend("jobs-chart", data.spans ? ["completed", "failed", "timed_out", "cancelled", "fenced_mark", "fence_lifted"]
      : ["failed", "timed_out", "cancelled", "fenced_mark", "fence_lifted"]);
  })();
  document.body.setAttribute("data-drawn", "yes");
})();
"""
