"""Trace analysis behind ``kvflow incidents``, ``inspect``, ``report`` and ``export``.

Everything here reads a trace in one streaming pass and folds its events alongside, so what it
reports about recovery and state is what the state machine computed, not a re-reading of the
event fields. Nothing here prints: results are dataclasses with ``to_dict()``; the CLI renders.

- ``walk``: the shared streaming pass (folded state, step, jobs);
- ``incidents``: the incident finder; ``history``: the queries of ``kvflow inspect``;
- ``timeline``: the trace over time (runs of seqs, job spans, marks) for the page and the export;
- ``views``: state as JSON-ready data; ``render``: records and incidents as one line of text.

May import: ``kvflow.core`` and ``kvflow.log``.
"""
