"""Eviction policies: ``base`` (the protocol a policy implements), ``lru``, ``arc`` and the
``registry`` that builds a policy by name for ``Config.policy``.

May import: only ``kvflow.core``. Pure: a policy's state is part of the tier's state and evolves
from events, so replay rebuilds it exactly.
"""
