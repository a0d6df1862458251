"""Eviction policies: ``base`` (``Policy``, the base class a policy subclasses: single-block
methods, the bulk forms the state calls derived from them), ``lru``, ``arc``, and the
``registry`` that finds the class ``Config.policy`` names: a built-in by its name, a class of
one's own by ``"module:Class"``.

May import: only ``kvflow.core`` (the registry also imports the module a ``Config.policy``
names). Pure: a policy's state is part of the tier's state and evolves from events, so replay
rebuilds it exactly.
"""
