"""The optional C accelerator of the pure core (``kvflow._native``, built from ``csrc/``).

kvflow's decisions and state machine are written in Python (``decide.py``, ``state.py``):
that code is the reference and the fallback. When a C compiler was available at install
time, ``kvflow._native`` mirrors the hot paths (every ``evolve`` and the per-step deciders)
on the very same Python objects, the way CPython pairs ``json`` with ``_json``. Differential
tests run both on the same inputs and require equal events, answers, errors and digests.

Whichever path runs, results are identical; only speed differs. ``kvflow --version`` says
which core is active. This module is pure: it reads no environment.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

# Bumped with csrc/module.c's ABI whenever the contract between the two sides changes: a stale
# build (say, after a pull without a rebuild) is then ignored rather than trusted.
ABI = 1

_ext: ModuleType | None
try:
    import kvflow._native as _ext
except ImportError:  # no compiler at install time: the pure-Python core runs
    _ext = None
if _ext is not None and getattr(_ext, "ABI", None) != ABI:
    _ext = None

_bound = False


def built() -> bool:
    """True when kvflow._native is built for this kvflow (before it is bound to the core)."""
    return _ext is not None


def available() -> bool:
    """True when the C accelerator is built and bound to the core (binding happens when
    kvflow.state is imported; this imports it)."""
    if _ext is not None and not _bound:
        import kvflow.state  # noqa: F401  (binds the accelerator at the end of its import)
    return _ext is not None and _bound


def _namespace() -> dict[str, Any]:
    import kvflow.decide as decide
    import kvflow.errors as errors
    import kvflow.events as events
    import kvflow.state as state

    ns: dict[str, Any] = {}
    for module in (events, errors, state, decide):
        ns.update((k, v) for k, v in vars(module).items() if not k.startswith("__"))
    for job_state in state.JobState:
        ns[f"JobState.{job_state.name}"] = job_state
    for block_state in state.BlockState:
        ns[f"BlockState.{block_state.name}"] = block_state
    return ns


def bind() -> None:
    """Hand the C side kvflow's classes and switch ``evolve`` to it (idempotent)."""
    global _bound
    if _ext is None or _bound:
        return
    import kvflow.state as state

    _ext.setup(_namespace())
    _bound = True
    state._native_evolve = _ext.evolve


def function(name: str) -> Any:
    """A function of the C accelerator by name (``handle``, ``fold_chunk``, ``ints``...), or
    None when the pure-Python core runs."""
    return getattr(_ext, name) if available() else None


def core_name() -> str:
    """"native" or "python": which core runs decisions and folds."""
    return "native" if available() else "python"
