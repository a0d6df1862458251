"""The fixtures every room's tests share, and the Hypothesis settings profiles, one place for
every property test and state machine.

Fixtures: ``restore_structlog`` puts structlog's global configuration back after a test that
captures or configures logs (``capture_logs`` leaves structlog marked configured, and a
configured structlog makes every later engine log each event).

Profiles:

* ``ci``, loaded when the ``CI`` environment variable is set (``.ci/run`` sets it): 2,000
  examples for every Hypothesis test and machine, on top of Hypothesis's own ``ci`` profile
  (derandomized, so a CI failure comes back with the same command; no example database;
  the failing example printed as a ``@reproduce_failure`` blob).
* ``dev``, everywhere else: 50 examples, random, with the local example database (a failure
  found here is replayed first on the next run).
* ``KVFLOW_HYPOTHESIS_PROFILE=ci`` (or ``dev``) picks one explicitly, e.g. to run CI's
  examples locally.

The tests set only what is theirs (step counts, health checks), never ``max_examples``, so
the profile decides how much is run. No deadline in either profile: an example of a machine
is a whole run of up to 60 steps, its time depends on the machine's load, and timing is the
benchmarks' job (tools/); a deadline on a shared VM only adds flaky failures.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import structlog

CI_EXAMPLES = 2_000
DEV_EXAMPLES = 50

try:
    from hypothesis import settings
except ImportError:  # the vLLM venv (.ci/run's second step) has no Hypothesis and no property test
    pass
else:
    settings.register_profile("ci", settings.get_profile("ci"), max_examples=CI_EXAMPLES, deadline=None)
    settings.register_profile("dev", max_examples=DEV_EXAMPLES, deadline=None)
    settings.load_profile(os.environ.get("KVFLOW_HYPOTHESIS_PROFILE") or ("ci" if "CI" in os.environ else "dev"))


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    """structlog's configuration is global (and capture_logs leaves it marked configured)."""
    was_configured = structlog.is_configured()
    saved = structlog.get_config()
    try:
        yield
    finally:
        if was_configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()
