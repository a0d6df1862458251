"""Eviction policies and the registry that builds them by name.

The trace header's config names the policy, so replay rebuilds the same one; an unknown or
misconfigured policy fails fast with a one-line message (F11).
"""

from __future__ import annotations

from kvflow.core.errors import ConfigError
from kvflow.core.policies.arc import ARCPolicy
from kvflow.core.policies.base import Policy
from kvflow.core.policies.lru import LRUPolicy
from kvflow.core.values import is_int

# Every policy class is built as ``cls(capacity)``.
POLICIES: dict[str, type[Policy]] = {}


def register_policy(name: str, cls: type[Policy]) -> None:
    """Make ``cls`` available to ``make_policy(name, ...)``.

    Re-registering the same class is a no-op; taking a name already bound to another class
    raises ``ConfigError``, since a trace naming it could then mean two different policies.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"policy name must be a non-empty string, got {name!r}")
    known = POLICIES.get(name)
    if known is not None and known is not cls:
        raise ConfigError(f"policy name {name!r} is already registered to {known.__qualname__}")
    POLICIES[name] = cls


def make_policy(name: str, capacity: int) -> Policy:
    """A fresh, empty policy ``name`` for a tier of ``capacity`` blocks."""
    cls = POLICIES.get(name)
    if cls is None:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown policy {name!r}; known policies: {known}")
    if not is_int(capacity) or capacity < 0:
        raise ConfigError(f"policy capacity must be an int >= 0, got {capacity!r}")
    return cls(capacity)  # type: ignore[call-arg]


register_policy(LRUPolicy.name, LRUPolicy)
register_policy(ARCPolicy.name, ARCPolicy)

__all__ = ["POLICIES", "make_policy", "register_policy"]
