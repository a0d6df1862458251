"""Trace analysis behind ``kvflow incidents`` and ``kvflow inspect`` (DESIGN §1.3, §6).

Everything here reads a trace in one streaming pass through :class:`~kvflow.log.TraceReader`
and folds its events with ``evolve`` alongside, so what it reports about recovery and state
is what the state machine computed, not a re-reading of the event fields. Nothing here
prints: results are dataclasses with ``to_dict()`` (JSON-ready); the CLI renders them.

If a trace stops folding (an illegal event: the trace and the code disagree), the analysis
goes on from the events alone, marks what it could not verify, and says so in ``warnings``;
``kvflow replay`` is the tool that explains such a trace.

The package only re-exports; its modules each do one job:

- :mod:`~kvflow.inspect.walk`: the shared streaming pass (folded state, step, jobs);
- :mod:`~kvflow.inspect.incidents`: the incident finder (``kvflow incidents``);
- :mod:`~kvflow.inspect.history`: the trace queries of ``kvflow inspect``;
- :mod:`~kvflow.inspect.views`: state as JSON-ready data;
- :mod:`~kvflow.inspect.render`: records and incidents as one line of text.
"""

from kvflow.inspect.history import HistoryEntry, InspectError, Inspection, Selector, inspect_trace
from kvflow.inspect.incidents import Incident, IncidentReport, LateResult, find_incidents
from kvflow.inspect.render import describe, few, recovery_summary, to_builtins
from kvflow.inspect.views import focus_dict, state_to_dict
from kvflow.inspect.walk import JobInfo

__all__ = [
    "HistoryEntry",
    "Incident",
    "IncidentReport",
    "InspectError",
    "Inspection",
    "JobInfo",
    "LateResult",
    "Selector",
    "describe",
    "few",
    "find_incidents",
    "focus_dict",
    "inspect_trace",
    "recovery_summary",
    "state_to_dict",
    "to_builtins",
]
